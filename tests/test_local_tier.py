"""The local checkpoint tier: every save on each rank's node and replicated on the next node;
a restart restores the newest step the live nodes hold for every rank, bitwise, else the
persistent one. Four gloo ranks as two nodes of two (``ranks_per_node=2``)."""

from __future__ import annotations

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
