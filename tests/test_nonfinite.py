"""Nonfinite steps: an inf gradient on one rank skips the step on every rank (state unchanged,
the leaf named in the metrics) and training goes on as if the step had not happened.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models
from helpers_errors import cpu_params


def inf_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    base = models.make_loss_fn(model)
    rank = dist.get_rank()

    def poisoned(params, b):  # +Inf in head.bias's gradient, on rank 1 only
        loss = base(params, b)
        return loss + params["head.bias"].sum() * (float("inf") if rank == 1 else 0.0)

    runs = {}
    for name, losses in (("skip", (base, poisoned, base, base)), ("clean", (base, base, base))):
        state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy=strategy)
        good, trace = 0, []
        for loss_fn in losses:
            batch = models.local_batch(models.global_batch(good, 8), rank, 2)
            before = [t.clone() for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]
            state, metrics = fs.train_step(state, batch, loss_fn)
            after = [t for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]
            same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            trace.append((metrics["nonfinite"], metrics.get("nonfinite_params"), same))
            good += loss_fn is base
        runs[name] = (trace, cpu_params(fs.full_params(state)), state.step)
    return runs


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_inf_gradient_skips_the_step_and_training_recovers(pool2, strategy):
    for r in pool2.run(inf_worker, strategy):
        trace, params, step = r["skip"]
        assert trace[1] == (1, ["head.bias"], True)
        assert [t[0] for t in trace] == [0, 1, 0, 0] and not any(t[2] for t in trace[2:])
        _, clean, clean_step = r["clean"]
        assert step == clean_step == 3
        assert all(torch.equal(params[n], clean[n]) for n in clean), "the skip left a trace"
