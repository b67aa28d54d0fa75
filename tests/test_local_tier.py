"""The local checkpoint tier: every save on each rank's node and replicated on the next node;
a restart restores the newest step the live nodes hold for every rank, bitwise, else the
persistent one. Four gloo ranks as two nodes of two (``ranks_per_node=2``)."""

from __future__ import annotations

import errno
import os
import shutil

import torch
import torch.distributed as dist

import funcshard as fs

import models

ROWS = 37


def _setup():
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=4)

    def fresh(strategy: str = "optim_grads_params") -> fs.TrainState:
        opt = fs.optim.adamw(1e-2)  # moments and a count: every kind of leaf
        return fs.init(model, opt, mesh=mesh, strategy=strategy)

    return model, fresh


def _values(state: fs.TrainState) -> list[torch.Tensor]:
    leaves = fs.tree.leaves(state.opt_state_by_name())
    return [t.clone() for t in (*state.master, *leaves) if isinstance(t, torch.Tensor)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def tier_worker(root: str, lose: list[int], strategy: str = "optim_grads_params") -> dict:
    """Trains 3 steps saving each (root every 2nd), loses the tiers of nodes ``lose``,
    restores into a fresh state; what it restored and what each step had saved."""
    model, fresh = _setup()
    local = os.path.join(root, "local-{node}")
    kw = dict(local_dir=local, local_replicas=1, persistent_every=2, ranks_per_node=2)
    saved = {}
    state = fresh()
    with fs.CheckpointManager(os.path.join(root, "persistent"), async_save=False, **kw) as mgr:
        for step in range(3):
            state, _ = models.train(state, model, [step], rows=ROWS)
            mgr.save(state.step, state)
            saved[state.step] = _values(state)
    dist.barrier()
    kept = sorted(os.listdir(local.format(node=1)))  # what retention left, before the losses
    dist.barrier()
    if dist.get_rank() == 0:
        for node in lose:
            shutil.rmtree(local.format(node=node))
        for node in {0, 1} - set(lose):  # step 9: every rank's file of step 2, never committed
            shutil.copytree(local.format(node=node) + "/2", local.format(node=node) + "/9")
            os.remove(local.format(node=node) + "/9/COMMIT")
    dist.barrier()
    with fs.CheckpointManager(os.path.join(root, "persistent"), **kw) as mgr:
        restored = mgr.restore(like=fresh(strategy))
    return {
        "step": restored.step,
        "bitwise": strategy != "optim_grads_params"
        or _equal(_values(restored), saved[restored.step]),
        "kept": kept,
    }


def test_a_lost_node_restores_bitwise_from_its_replicas(pool4, tmp_path) -> None:
    for result in pool4.run(tier_worker, str(tmp_path), [1]):
        assert result["step"] == 3 and result["bitwise"], result


def test_both_tiers_lost_restores_the_persistent_step(pool4, tmp_path) -> None:
    for result in pool4.run(tier_worker, str(tmp_path), [0, 1]):
        assert result["step"] == 2 and result["bitwise"], result


def test_the_tier_keeps_its_newest_two_steps(pool4, tmp_path) -> None:
    for result in pool4.run(tier_worker, str(tmp_path), []):
        assert result["step"] == 3 and result["bitwise"], result
        assert result["kept"] == ["2", "3"], result


def test_another_layout_restores_the_persistent_step(pool4, tmp_path) -> None:
    """The tier serves the layout that saved it; another one reads root's newest step."""
    for result in pool4.run(tier_worker, str(tmp_path), [], "optim"):
        assert result["step"] == 2, result


# --- runs and timelines (#52) ------------------------------------------------------------


def _manager(root: str, name: str, **kw) -> fs.CheckpointManager:
    local = os.path.join(root, "local-{node}")  # one local_dir for every run below
    kw = dict(local_dir=local, ranks_per_node=2, async_save=False) | kw
    return fs.CheckpointManager(os.path.join(root, name), **kw)


def _run(mgr, state, model, steps) -> tuple[fs.TrainState, dict]:
    saved = {}
    for step in steps:
        state, _ = models.train(state, model, [step], rows=ROWS)
        mgr.save(state.step, state)
        saved[state.step] = _values(state)
    return state, saved


def runs_worker(root: str) -> dict:
    """Run A saves steps 1-3; run B (another root and seed, the same local_dir) saves step 1
    and restarts: B's step 1, never A's step 3."""
    model, fresh = _setup()
    with _manager(root, "A") as mgr:
        _run(mgr, fresh(), model, range(3))
    other = models.make_model(seed=5)
    with _manager(root, "B") as mgr:
        _, saved = _run(mgr, fresh(), other, [0])
    with _manager(root, "B") as mgr:
        restored = mgr.restore(like=fresh())
    return {"step": restored.step, "bitwise": _equal(_values(restored), saved[1])}


def test_another_run_sharing_local_dir_is_never_restored(pool4, tmp_path) -> None:
    for result in pool4.run(runs_worker, str(tmp_path)):
        assert result == {"step": 1, "bitwise": True}, result


def timeline_worker(root: str) -> dict:
    """Steps 1-4 (root every 2nd), restore(2) from root, a new step 3 saved, then a restart:
    the new step 3, never the abandoned step 4; a new run of the root then restores root's."""
    model, fresh = _setup()
    with _manager(root, "C", persistent_every=2) as mgr:
        _run(mgr, fresh(), model, range(4))
        state = mgr.restore(2, like=fresh())
        _, saved = _run(mgr, state, model, [9])
    kept = sorted(os.listdir(os.path.join(root, f"local-{dist.get_rank() // 2}")))
    dist.barrier()  # listed before a peer's next manager writes its probe there
    with _manager(root, "C", persistent_every=2) as mgr:
        restored = mgr.restore(like=fresh())
    return {"step": restored.step, "bitwise": _equal(_values(restored), saved[3]), "kept": kept}


def test_a_restore_of_an_earlier_step_abandons_the_later_ones(pool4, tmp_path) -> None:
    for result in pool4.run(timeline_worker, str(tmp_path)):
        assert result["step"] == 3 and result["bitwise"], result
        assert result["kept"] == ["3"], result  # the abandoned step 4 removed, no leftovers


def mismatch_worker(root: str) -> dict:
    """Root holds step 1 of an SGD state; the tier a newer step 2 of an AdamW one: a restore
    into an SGD state falls back to root's step 1 instead of raising."""
    model, fresh = _setup()
    mesh = fs.make_mesh(device_type="cpu")
    opt = fs.optim.sgd(0.1, momentum=0.9)
    sgd = lambda: fs.init(model, opt, mesh=mesh, strategy="optim_grads_params")
    with _manager(root, "D") as mgr:
        _, saved = _run(mgr, sgd(), model, [0])
    with _manager(root, "D", persistent_every=10) as mgr:
        _run(mgr, fresh(), model, [1, 2])
    like = sgd()
    with _manager(root, "D") as mgr:
        restored = mgr.restore(like=like)
    return {"step": restored.step, "bitwise": _equal(_values(restored), saved[1])}


def test_a_tier_step_that_does_not_fit_falls_back_to_root(pool4, tmp_path) -> None:
    for result in pool4.run(mismatch_worker, str(tmp_path)):
        assert result == {"step": 1, "bitwise": True}, result


# --- failures (#52) ----------------------------------------------------------------------


def enospc_worker(root: str) -> dict:
    """Rank 1's disk full in a tier save: every rank raises naming rank 1's error, and what the
    save wrote is gone; a killed save's leftovers go when the next manager is made."""
    from funcshard.checkpoint import storage

    model, fresh = _setup()
    state = fresh()
    real = storage.write_bytes

    def full(path: str, data: bytes) -> None:
        if dist.get_rank() == 1 and os.path.basename(path).startswith("rank"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, data)

    node_dir = os.path.join(root, f"local-{dist.get_rank() // 2}")
    with _manager(root, "E") as mgr:
        storage.write_bytes = full
        try:
            mgr.save(1, state)
            error = None
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        finally:
            storage.write_bytes = real
        dist.barrier()
        left = sorted(os.listdir(node_dir))
        mgr.save(2, state)  # the tier still works
        # node 1's leader fails to rename step 3 into place after node 0's has: the step is
        # whole on no node, so node 0 removes it again (and step 2, the resume point, stays)
        real_rename = storage.rename

        def refused(src: str, dst: str) -> None:
            if dist.get_rank() == 2 and os.path.basename(dst) == "3":
                raise OSError(errno.EIO, "Input/output error", dst)
            real_rename(src, dst)

        storage.rename = refused
        try:
            mgr.save(3, state)
            commit_error = None
        except Exception as e:  # noqa: BLE001
            commit_error = f"{type(e).__name__}: {e}"
        finally:
            storage.rename = real_rename
        dist.barrier()
        after_commit = sorted(os.listdir(node_dir))
    dist.barrier()
    if dist.get_rank() % 2 == 0:  # a killed save's: uncommitted, temporary, being removed
        for name in ("3", "4.orbax-checkpoint-tmp-1", "2.orbax-checkpoint-deleting-1"):
            os.makedirs(os.path.join(node_dir, name, "x"))
    dist.barrier()
    with _manager(root, "E"):
        swept = sorted(os.listdir(node_dir))
    return {
        "error": error,
        "left": left,
        "swept": swept,
        "commit_error": commit_error,
        "after_commit": after_commit,
    }


def test_a_tier_save_failing_on_one_rank_raises_on_every_rank(pool4, tmp_path) -> None:
    for rank, result in enumerate(pool4.run(enospc_worker, str(tmp_path))):
        assert "No space left on device" in result["error"], result
        if rank != 1:
            assert "failed on rank(s) [1]" in result["error"], result
        assert result["left"] == [] and result["swept"] == ["2"], result
        assert "Input/output error" in result["commit_error"], result
        assert result["after_commit"] == ["2"], result


def shared_worker(root: str, name: str = "shared") -> str:
    try:
        fs.CheckpointManager(root, local_dir=os.path.join(root, name), ranks_per_node=2)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_local_dir_with_another_field_is_refused(pool4, tmp_path) -> None:
    for result in pool4.run(shared_worker, str(tmp_path), "run-{user}"):
        assert "may hold '{node}' and no other field (KeyError: 'user')" in result, result


def test_local_dir_that_nodes_share_is_refused(pool4, tmp_path) -> None:
    """4 ranks on one host as 2 nodes: a local_dir without {node} is one directory for both."""
    for result in pool4.run(shared_worker, str(tmp_path)):
        assert "is one directory for nodes [0, 1]" in result and "{node}" in result, result


def test_the_newest_timeline_is_chosen_unless_root_went_on_without_it() -> None:
    """``choose`` on two ranks (one a node): the newest timeline's newest complete step."""
    from funcshard.checkpoint.local_records import Timeline, choose

    old, new = Timeline("old", 1, None), Timeline("new", 2, 4)  # new began at restore(2)
    views = [
        {("old", 4): (old, [0, 1]), ("new", 3): (new, [0, 1]), ("new", 5): (new, [0])},
        {("old", 4): (old, [0, 1]), ("new", 3): (new, [0, 1])},
    ]
    got = choose(views, 2, 4)  # root's 4 is the abandoned one the timeline saw begin
    assert got is not None and (got.step, got.timeline, got.continues) == (3, new, False)
    views[1][("new", 5)] = (new, [1])
    assert choose(views, 2, 4) == (5, new, True)
    assert choose(views, 2, 6) is None  # root went on past step 5 without this tier
    assert choose([{("old", 4): (old, [0])}, {}], 2, None) is None  # rank 1's copy lost


# --- review (#52): one rank failing alone, a token cut short, local_dir over root --------


def alone_worker(root: str, where: str) -> list:
    """One rank's reads fail alone: while the tier sweeps (rank 2), rank 0 lists root at a
    restore or after one, rank 1 lists its tier at a restore. Never a hang: the sweep is
    skipped, a node whose tier cannot be read counts as lost, root's error raises everywhere."""
    from funcshard.checkpoint import local_tier

    model, fresh = _setup()
    _, saved = _run(_manager(root, "F"), fresh(), model, [0])
    real = local_tier.storage.listdir
    failing = {"sweep": 2, "restore": 0, "begin": 0, "view": 1}[where]

    def eio(path: str) -> list[str]:
        if "local-" not in path or not path.endswith(("-1", "/1")):
            return real(path)  # what breaks: node 1's directory (the sweep), a step's (view)
        local_tier.storage.listdir = real  # once
        raise OSError(errno.EIO, "Input/output error", path)

    out = []
    try:
        if dist.get_rank() == failing and where == "sweep":
            local_tier.storage.listdir = eio
        mgr = _manager(root, "F")
        if dist.get_rank() == failing and where in ("restore", "begin"):
            mgr.local.root_latest = lambda: real(os.path.join(root, "gone"))
        if dist.get_rank() == failing and where == "view":
            local_tier.storage.listdir = eio
        restored = mgr.restore(1 if where == "begin" else None, like=fresh())
        out += [restored.step, _equal(_values(restored), saved[1])]
    except OSError as e:
        out.append(str(e))
    finally:
        local_tier.storage.listdir = real
    return out


def test_a_rank_failing_alone_never_leaves_the_others_waiting(pool4, tmp_path) -> None:
    for where in ("sweep", "view"):
        for result in pool4.run(alone_worker, str(tmp_path / where), where):
            assert result == [1, True], (where, result)
    for where in ("restore", "begin"):
        for result in pool4.run(alone_worker, str(tmp_path / where), where):
            assert len(result) == 1 and "could not read" in result[0], (where, result)
            assert "No such file or directory" in result[0], (where, result)


def token_worker(root: str) -> list:
    """A token cut short by a kill (empty) begins a new run (restores root's step) instead of
    refusing every manager; local_dir that is root is refused before its sweep touches root."""
    model, fresh = _setup()
    _run(_manager(root, "G"), fresh(), model, [0])
    dist.barrier()
    if dist.get_rank() == 0:
        open(os.path.join(root, "G", "funcshard_run.json"), "wb").close()
    dist.barrier()
    restored = _manager(root, "G").restore(like=fresh())
    refused = []
    for local_dir in ("G", "G/{node}"):  # root itself; steps' names in root
        try:
            _manager(root, "G", local_dir=os.path.join(root, local_dir))
        except ValueError as e:
            refused.append("a directory of its own" in str(e))
    return [restored.step, refused == [True, True], os.listdir(root + "/G/1")]


def test_a_token_cut_short_and_local_dir_over_root(pool4, tmp_path) -> None:
    for result in pool4.run(token_worker, str(tmp_path)):
        assert result[:2] == [1, True] and "commit_success.txt" in result[2], result
