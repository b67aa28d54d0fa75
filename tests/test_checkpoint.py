"""Checkpoints: Orbax layout, resharding restore, model-only loads, the manager.

A save on (world a, strategy s) restored on (world b, strategy t, offload f) and trained on
must match one uninterrupted single-process run; plain Orbax in a JAX process reads our files
and we read Orbax's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard import checkpoint as ckpt_lib

import models

ROWS = 12  # global batch rows: divisible by 1, 2, 3 and 4 ranks
LR, WD = 1e-2, 0.1


def _adamw() -> fs.optim.Optimizer:
    return fs.optim.adamw(LR, weight_decay=WD)


def _torch_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def _train(state: fs.TrainState, model: nn.Module, steps: range) -> fs.TrainState:
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = models.make_loss_fn(model)
    for step in steps:
        batch = models.local_batch(models.global_batch(step, ROWS), rank, world)
        state, _ = fs.train_step(state, batch, loss_fn)
    return state


def _poison(state: fs.TrainState) -> None:
    for t in fs.tree.leaves(state):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(float("nan"))


def _cpu(params: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in params.items()}


# --- rank functions (importable: RankPool pickles them by name) -------------------------------


def save_worker(directory: str, strategy: str, replicate: int, steps: int, **kw) -> dict:
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    model = models.make_model(seed=0, **kw)
    state = fs.init(model, _adamw(), mesh=mesh, strategy=strategy)
    state = _train(state, model, range(steps))
    with ckpt_lib.io_stats() as io:
        fs.save(directory, state)
    return {
        "written": io.bytes_written,
        "full": _cpu(fs.full_params(state)),
        "mu": _cpu(state.opt_state_by_name().mu),
    }


def restore_worker(
    directory: str, strategy: str, replicate: int, offload: float, start: int, stop: int, **kw
) -> dict:
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    model = models.make_model(seed=1, **kw)  # other weights: none of them may survive
    like = fs.init(model, _adamw(), mesh=mesh, strategy=strategy, offload_fraction=offload)
    _poison(like)
    with ckpt_lib.io_stats() as io:
        state = fs.restore(directory, like=like)
    consumed = like.consumed
    restored_step = state.step
    state = _train(state, model, range(start, stop))
    return {
        "full": _cpu(fs.full_params(state)),
        "step": restored_step,
        "read": io.bytes_read,
        "checked": io.bytes_checked,
        "extra": io.bytes_verified_extra,
        "consumed": consumed,
        "offloaded": any(b.offload for b in state.layout.buckets),
    }


# --- resharding: save, restore elsewhere, train on ----------------------------------------------

CASES = {
    # name: (save world, save strategy, save replicate, restore world, strategy, replicate, offload)
    "2->3": (2, "optim_grads_params", 1, 3, "optim", 1, 0.5),
    "3->2": (3, "optim_grads", 1, 2, "optim_grads_params", 1, 0.3),
    "2->1": (2, "optim", 1, 1, "no_shard", 1, 0.0),
    "2x2->2": (4, "optim_grads_params", 2, 2, "optim_grads", 1, 0.0),
    "zero3->no_shard": (2, "optim_grads_params", 1, 3, "no_shard", 1, 0.5),
    "no_shard->2x2": (2, "no_shard", 1, 4, "optim_grads_params", 2, 0.5),
}
SAVE_STEPS, TOTAL_STEPS = 2, 4


@pytest.fixture(scope="module")
def reference():
    return models.reference_run(models.make_model(seed=0), _torch_adamw, TOTAL_STEPS, ROWS)


@pytest.mark.parametrize("case", list(CASES))
def test_restore_on_another_layout_continues_training(request, tmp_path, reference, case):
    world_a, strat_a, rep_a, world_b, strat_b, rep_b, offload = CASES[case]
    directory = str(tmp_path / "ckpt")
    saved = request.getfixturevalue(f"pool{world_a}").run(
        save_worker, directory, strat_a, rep_a, SAVE_STEPS
    )
    if rep_a > 1:  # HSDP: the second replica holds the same shards and writes nothing
        assert [s["written"] > 0 for s in saved] == [True, True, False, False]
    if strat_a == "no_shard":  # every rank holds everything: they split the writing
        assert all(s["written"] > 0 for s in saved)
    results = request.getfixturevalue(f"pool{world_b}").run(
        restore_worker, directory, strat_b, rep_b, offload, SAVE_STEPS, TOTAL_STEPS
    )
    for r in results:
        assert r["step"] == SAVE_STEPS and r["consumed"]
        assert r["offloaded"] == (offload > 0)
        err = models.max_rel_err(r["full"], reference["params"])
        assert err < 1e-5, f"{case}: continuation differs from the uninterrupted run ({err:.2e})"


def test_each_rank_reads_its_share(pool2, pool3, tmp_path):
    directory = str(tmp_path / "ckpt")
    kw = {"dim": 256, "n_blocks": 2}
    pool2.run(save_worker, directory, "optim_grads_params", 1, 1, **kw)
    results = pool3.run(restore_worker, directory, "optim_grads_params", 1, 0.0, 1, 1, **kw)
    reads = [r["read"] for r in results]
    n = sum(p.numel() for p in models.make_model(**kw).parameters())
    total = 3 * 4 * n  # master, mu and nu in fp32
    assert sum(reads) == total, "rows must be read exactly once over all ranks"
    for b in reads:
        assert abs(b - total / 3) < 0.05 * total, f"per-rank reads {reads} of {total} bytes"
    for r in results:  # verified once before the read, in the same whole checksum blocks
        assert r["checked"] == r["read"] + r["extra"], r


# --- Orbax interoperability ---------------------------------------------------------------------

JAX_RESTORE = textwrap.dedent("""
    import sys, numpy as np, orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore(sys.argv[1])
    flat = {"step": np.asarray(tree["step"]), "count": np.asarray(tree["opt_state"]["count"])}
    for group in ("params", "mu"):
        src = tree["params"] if group == "params" else tree["opt_state"]["mu"]
        for name, a in src.items():
            flat[group + "/" + name] = np.asarray(a).astype(np.float32)
            flat["dtype/" + group + "/" + name] = np.array(str(a.dtype))
    np.savez(sys.argv[2], **flat)
""")


def _run_python(code: str, *args: str) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_plain_orbax_restores_our_checkpoint(pool3, tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = pool3.run(save_worker, directory, "optim_grads_params", 1, 2)
    assert os.path.exists(os.path.join(directory, "commit_success.txt"))
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]
    zarray = json.load(open(os.path.join(directory, "params.blocks.0.fc.weight", ".zarray")))
    assert zarray["shape"] == [37, 37] and zarray["chunks"] == [13, 37]  # a chunk per rank
    out = str(tmp_path / "out.npz")
    _run_python(JAX_RESTORE, directory, out)
    got = np.load(out)
    assert int(got["step"]) == 2 and int(got["count"]) == 2
    for name, full in saved[0]["full"].items():
        np.testing.assert_array_equal(got["params/" + name], full.numpy(), err_msg=name)
        assert str(got["dtype/params/" + name]) == "float32"
    mu = {n: torch.tensor(got["mu/" + n]) for n in saved[0]["full"]}
    for name in mu:  # each rank returned its own rows of mu
        rows = torch.cat([s["mu"][name].reshape(-1) for s in saved])
        torch.testing.assert_close(mu[name].reshape(-1), rows, rtol=0, atol=0)


def bf16_save_worker(directory: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0).to(torch.bfloat16)
    policy = fs.MixedPrecisionPolicy(main_params_dtype=None, main_grads_dtype=None)
    state = fs.init(model, _adamw(), mesh=mesh, strategy="optim", policy=policy)
    fs.save(directory, state)
    return _cpu(fs.full_params(state))


def test_bf16_masters_are_stored_as_bfloat16(pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    full = pool2.run(bf16_save_worker, directory)[0]
    zarray = json.load(open(os.path.join(directory, "opt_state.nu.inp.weight", ".zarray")))
    assert zarray["dtype"] == "bfloat16"
    out = str(tmp_path / "out.npz")
    _run_python(JAX_RESTORE, directory, out)
    got = np.load(out)
    for name, t in full.items():
        assert str(got["dtype/params/" + name]) == "bfloat16"
        np.testing.assert_array_equal(got["params/" + name], t.float().numpy(), err_msg=name)


JAX_SAVE = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp, orbax.checkpoint as ocp
    src = dict(np.load(sys.argv[1]))
    for kind in sys.argv[3:]:
        dtype, fmt = kind.split("-")
        cast = (lambda a: jnp.asarray(a, jnp.bfloat16)) if dtype == "bf16" else np.asarray
        tree = {"params": {n: cast(a) for n, a in src.items()}, "step": 5}
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=(fmt == "ocdbt"))
        ocp.Checkpointer(handler).save(sys.argv[2] + "/" + kind, tree)
""")
ORBAX_KINDS = ("fp32-zarr", "bf16-zarr", "fp32-ocdbt", "bf16-ocdbt")


def model_only_worker(directory: str, strategy: str, offload: float) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=1)
    like = fs.init(model, _adamw(), mesh=mesh, strategy=strategy, offload_fraction=offload)
    _poison(like)
    state = fs.restore(directory, like=like, model_only=True)
    opt_zero = all(
        bool((t == 0).all()) for t in fs.tree.leaves(state.opt_state) if isinstance(t, torch.Tensor)
    )
    out = {
        "full": _cpu(fs.full_params(state)),
        "step": state.step,
        "count": state.opt_state.count,
        "opt_zero": opt_zero,
    }
    state = _train(state, model, range(1))
    return out


def test_model_only_restore_of_checkpoints_orbax_wrote(pool2, tmp_path):
    weights = {n: p.detach().numpy() for n, p in models.make_model(seed=0).named_parameters()}
    np.savez(tmp_path / "w.npz", **weights)
    _run_python(JAX_SAVE, str(tmp_path / "w.npz"), str(tmp_path), *ORBAX_KINDS)
    for kind in ORBAX_KINDS:
        results = pool2.run(model_only_worker, str(tmp_path / kind), "optim_grads_params", 0.5)
        for r in results:
            assert r["step"] == 0 and r["count"] == 0 and r["opt_zero"], kind
            for name, a in weights.items():
                want = torch.tensor(a)
                if kind.startswith("bf16"):
                    want = want.bfloat16().float()
                torch.testing.assert_close(
                    r["full"][name], want, rtol=0, atol=0, msg=f"{kind}: {name}"
                )


JAX_MANAGER_SAVE = textwrap.dedent("""
    import sys, numpy as np, orbax.checkpoint as ocp
    src, root = dict(np.load(sys.argv[1])), sys.argv[2]

    def nested(flat):
        out = {}
        for name, a in flat.items():
            *path, leaf = name.split(".")
            node = out
            for k in path:
                node = node.setdefault(k, {})
            node[leaf] = a
        return out

    renamed = {n.replace("head.weight", "head.kernel"): a for n, a in src.items()}
    with ocp.CheckpointManager(root + "/single") as m:  # root/1/default
        m.save(1, args=ocp.args.StandardSave({"params": nested(src), "step": 1}))
    with ocp.CheckpointManager(root + "/composite") as m:  # root/1/params beside root/1/meta
        m.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(nested(src)),
                                          meta=ocp.args.JsonSave({"lr": 0.1})))
    with ocp.CheckpointManager(root + "/renamed") as m:
        m.save(1, args=ocp.args.StandardSave({"params": nested(renamed)}))
""")


def orbax_step_worker(root: str) -> dict:
    out = {}
    for kind in ("single", "composite"):
        r = model_only_worker(os.path.join(root, kind, "1"), "optim_grads_params", 0.0)
        out[kind] = r["full"]
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(models.make_model(seed=1), _adamw(), mesh=mesh)
    try:
        fs.restore(os.path.join(root, "renamed", "1"), like=like, model_only=True)
        out["error"] = None
    except ckpt_lib.CheckpointMismatchError as e:
        out["error"] = str(e)
    return out


def test_orbax_manager_steps_composites_and_nested_trees(pool2, tmp_path):
    weights = {n: p.detach().numpy() for n, p in models.make_model(seed=0).named_parameters()}
    np.savez(tmp_path / "w.npz", **weights)
    _run_python(JAX_MANAGER_SAVE, str(tmp_path / "w.npz"), str(tmp_path))
    for r in pool2.run(orbax_step_worker, str(tmp_path)):
        for kind in ("single", "composite"):
            for name, a in weights.items():
                torch.testing.assert_close(
                    r[kind][name], torch.tensor(a), rtol=0, atol=0, msg=f"{kind}: {name}"
                )
        msg = r["error"]
        assert msg is not None
        # one line per mismatch, with what the checkpoint holds closest to the expected name
        assert (
            "params.head.weight: missing from the checkpoint (expected shape (11, 37)); "
            "closest there: params.head.kernel (11, 37)"
        ) in msg, msg
        assert (
            "params.head.kernel: in the checkpoint but not in the target state (shape "
            "(11, 37)); closest expected: params.head.weight (11, 37)"
        ) in msg, msg
        assert "the checkpoint's params (17): " in msg, msg


JAX_MANAGER_RESTORE = textwrap.dedent("""
    import sys, numpy as np, orbax.checkpoint as ocp
    with ocp.CheckpointManager(sys.argv[1]) as m:
        steps = m.all_steps()
        tree = m.restore(int(sys.argv[2]))
    flat = {"steps": np.array(steps), "step": np.asarray(tree["step"])}
    flat.update({"params/" + n: np.asarray(a) for n, a in tree["params"].items()})
    np.savez(sys.argv[3], **flat)
""")


def manager_save_worker(root: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, _adamw(), mesh=mesh, strategy="optim_grads_params")
    with fs.CheckpointManager(root) as mgr:
        for step in (1, 2):
            state = _train(state, model, range(step - 1, step))
            mgr.save(step, state)
    return _cpu(fs.full_params(state))


def test_jax_checkpoint_manager_restores_our_manager_root(pool2, tmp_path):
    root = str(tmp_path / "run")
    full = pool2.run(manager_save_worker, root)[0]
    out = str(tmp_path / "out.npz")
    _run_python(JAX_MANAGER_RESTORE, root, "2", out)
    got = np.load(out)
    assert got["steps"].tolist() == [1, 2] and int(got["step"]) == 2
    for name, t in full.items():
        np.testing.assert_array_equal(got["params/" + name], t.numpy(), err_msg=name)


def _without_first_bucket(state: fs.TrainState) -> fs.TrainState:
    """mu's first bucket as an inner optimizer of multi_transform that does not own it: None."""
    opt = state.opt_state
    return state.replace(
        opt_state=opt._replace(mu=type(opt.mu)((None, *opt.mu[1:]), opt.mu.members))
    )


def none_bucket_worker(directory: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = _train(fs.init(model, _adamw(), mesh=mesh, strategy="optim"), model, range(1))
    state = _without_first_bucket(state)
    fs.save(directory, state)
    like = fs.init(models.make_model(seed=1), _adamw(), mesh=mesh, strategy="optim")
    restored = fs.restore(directory, like=_without_first_bucket(like))
    layout = state.layout
    first = [layout.leaves[i].name for i in layout.buckets[0].leaves]
    return {
        "first": first,
        "rest": [n for n in layout.names if n not in first],
        "none_kept": restored.opt_state.mu[0] is None,
        "mu_equal": all(
            torch.equal(a, b)
            for a, b in zip(restored.opt_state.mu[1:], state.opt_state.mu[1:], strict=True)
        ),
    }


def test_per_bucket_entries_may_be_none(pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    for r in pool2.run(none_bucket_worker, directory):
        assert r["none_kept"] and r["mu_equal"]
        held = set(os.listdir(directory))
        assert all(f"opt_state.mu.{n}" not in held for n in r["first"]), "nothing saved for None"
        assert all(f"opt_state.mu.{n}" in held for n in r["rest"])
        assert all(f"opt_state.nu.{n}" in held for n in r["first"] + r["rest"])


# --- mismatches, meta-device models ---------------------------------------------------------------


def mismatch_worker(directory: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0, n_blocks=2, n_out=12)
    model.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    like = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy="optim")
    try:
        fs.restore(directory, like=like)
    except ckpt_lib.CheckpointMismatchError as e:
        return {"message": str(e), "like_usable": like.step == 0}
    return {"message": None}


def test_mismatches_are_listed_in_one_error(pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    pool2.run(save_worker, directory, "optim", 1, 1)
    for r in pool2.run(mismatch_worker, directory):
        msg = r["message"]
        assert msg is not None and r["like_usable"]
        for needle in (
            "optimizer: the checkpoint holds AdamWState",
            "params.extra: missing",
            "params.head.weight: shape (11, 37) in the checkpoint, expected (12, 37)",
            "params.blocks.2.fc.weight: in the checkpoint but not in the target",
            "opt_state.mu.inp.weight: optimizer state the target optimizer lacks",
        ):
            assert needle in msg, f"{needle!r} not in:\n{msg}"


def meta_worker(directory: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    with torch.device("meta"):
        model = models.make_model(seed=0)
    state = fs.init(model, _adamw(), mesh=mesh, strategy="optim_grads_params", offload_fraction=0.5)
    errors = []
    for fn in (
        lambda: fs.save(directory + "-unfilled", state),
        lambda: _train(state, model, range(1)),
    ):
        try:
            fn()
        except RuntimeError as e:
            errors.append(str(e))
    state = fs.restore(directory, like=state, model_only=True)
    filled = state.filled
    full = _cpu(fs.full_params(state))
    state = _train(state, model, range(2))
    return {
        "errors": errors,
        "filled": filled,
        "full": full,
        "trained": _cpu(fs.full_params(state)),
    }


def test_meta_device_model_is_filled_by_restore(pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = pool2.run(save_worker, directory, "optim", 1, 0)[0]["full"]
    ref = models.reference_run(models.make_model(seed=0), _torch_adamw, 2, ROWS)
    for r in pool2.run(meta_worker, directory):
        assert len(r["errors"]) == 2 and all("no values" in e for e in r["errors"])
        assert r["filled"]
        assert models.max_rel_err(r["full"], saved) == 0
        assert models.max_rel_err(r["trained"], ref["params"]) < 1e-5
    assert not os.path.exists(directory + "-unfilled")


def test_rebuild_from_params_in_memory(pool2):
    results = pool2.run(rebuild_worker)
    for r in results:
        assert (
            models.max_rel_err(
                r, {n: p.detach() for n, p in models.make_model(seed=0).named_parameters()}
            )
            == 0
        )


def rebuild_worker() -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(
        models.make_model(seed=1), _adamw(), mesh=mesh, strategy="optim", offload_fraction=0.5
    )
    params = dict(models.make_model(seed=0).named_parameters())
    return _cpu(fs.full_params(ckpt_lib.rebuild_from_params(like, params)))


# --- the manager ----------------------------------------------------------------------------------


def manager_worker(root: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, _adamw(), mesh=mesh, strategy="optim_grads_params")
    mgr = fs.CheckpointManager(root, max_to_keep=2)  # asynchronous by default
    real = mgr.saver.write_arrays
    gate = threading.Event()

    def gated(*args, **kwargs):  # holds the background write until the next step has run
        gate.wait(60)
        return real(*args, **kwargs)

    at = {}
    for step in range(1, 5):
        state = _train(state, model, range(step - 1, step))
        if step == 4:
            gate.set()
        at[step] = _cpu(fs.full_params(state))
        if step == 3:  # the save in flight (step 2's) looks write_arrays up as it writes:
            mgr.wait()  # swapped before it has, it took the gate and waited out its 60 s
        mgr.saver.write_arrays = gated if step == 3 else real
        mgr.save(step, state)  # step 3 is written after step 4 updated the buffers in place
    mgr.wait()
    mgr.saver.write_arrays = real
    if dist.get_rank() == 0:  # leftovers of interrupted saves are never listed
        os.makedirs(os.path.join(root, "5" + ckpt_lib.TMP_MARK + "1"))
        os.makedirs(os.path.join(root, "6"))
    dist.barrier()
    steps, latest = mgr.all_steps(), mgr.latest_step()
    like = fs.init(
        models.make_model(seed=1), _adamw(), mesh=mesh, strategy="optim", offload_fraction=0.5
    )
    restored = mgr.restore(like=like)
    err = models.max_rel_err(fs.full_params(restored), at[4])
    err3 = models.max_rel_err(
        fs.full_params(mgr.restore(3, like=fs.init(model, _adamw(), mesh=mesh))), at[3]
    )

    # a failure in the background is raised by the next wait, on every rank
    def broken(*args, **kwargs):
        raise OSError("disk full (injected)")

    if dist.get_rank() == 1:
        mgr.saver.write_arrays = broken
    try:
        mgr.save(7, restored)
        try:
            mgr.wait()
            failure = None
        except RuntimeError as e:
            failure = f"{e} <- {e.__cause__}"
    finally:
        mgr.saver.write_arrays = real
    mgr.close()
    return {
        "steps": steps,
        "latest": latest,
        "err": err,
        "err3": err3,
        "failure": failure,
        "after": mgr.all_steps(),
    }


def test_manager_retention_async_and_failures(pool2, tmp_path):
    for r in pool2.run(manager_worker, str(tmp_path / "run")):
        assert r["steps"] == [3, 4] and r["latest"] == 4
        assert r["err"] == 0 and r["err3"] == 0, "async save must stage the state it was given"
        assert r["failure"] is not None and "save to" in r["failure"]
        assert r["after"] == [3, 4]
    assert not [p for p in os.listdir(tmp_path / "run") if p.startswith("7")]
