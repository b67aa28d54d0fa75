"""SGD-with-momentum and AdamW parity against a single-process plain-torch run (fp32).

Every strategy x mesh {1, 2, 3, 4, 1x2, 2x2} x microbatches {1, 3}; 37-row leaves split unevenly.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import funcshard as fs

import models

STEPS = 4
LOCAL_ROWS = 6  # divisible by 1 and 3 microbatches


def parity_worker(strategy: str, shard: int, replicate: int) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    rows = LOCAL_ROWS * dist.get_world_size()
    errors = {}
    for opt_name, (ours, theirs) in models.OPTIMIZERS.items():
        for microbatches in (1, 3):
            model = models.make_model(seed=7)
            state = fs.init(model, ours(), mesh=mesh, strategy=strategy)
            state, history = models.train(
                state, model, range(STEPS), rows=rows, microbatches=microbatches
            )
            losses = [m["loss"] for m in history]
            ref = models.reference_run(model, theirs, STEPS, rows)
            key = f"{opt_name}/mb{microbatches}"
            errors[key + "/params"] = models.max_rel_err(fs.full_params(state), ref["params"])
            pairs = zip(losses, ref["losses"], strict=True)
            errors[key + "/loss"] = max(abs(a - b) / abs(b) for a, b in pairs)
    return errors


# (shard, replicate): "1x2" is two replicas of one shard (pure replication under any strategy).
MESHES = {"1": (1, 1), "2": (2, 1), "3": (3, 1), "4": (4, 1), "1x2": (1, 2), "2x2": (2, 2)}


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_parity_with_single_process_torch(pool_of, mesh: str, strategy: str) -> None:
    shard, replicate = MESHES[mesh]
    pool = pool_of(shard * replicate)
    for rank_errors in pool.run(parity_worker, strategy, shard, replicate):
        bad = {k: v for k, v in rank_errors.items() if not v < 1e-4}
        assert not bad, f"relative error >= 1e-4: {bad}"
