"""Rank workers of ``tests/test_pipeline_plan.py``: pipelined runs of the pipeline tests'
model (``helpers_pipeline``) whose measured bytes and state the test holds to ``fs.plan``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint as activation

import funcshard as fs
from funcshard.testing import state_bytes

import helpers_pipeline as hp
import models

STEPS, ROWS = 2, 8  # ROWS per data-parallel rank: 2 a microbatch


def per_rank(schedule: str) -> int:
    return 1 if schedule in ("GPipe", "1F1B") else 2


def measure(schedule: str, strategy: str, replicate: int, init: dict | None = None) -> dict:
    """STEPS steps at P=2 over 4 ranks (S=2, or R=2 with ``replicate=2``; ``init``: more of
    fs.init's arguments): what this rank moved per axis, kind and calls, and its state's
    bytes."""
    mesh = fs.make_mesh(pipeline=2, replicate=replicate, device_type="cpu")
    dp = dist.get_world_size() // 2
    stages = fs.pipeline.split(hp.make_net(), hp.split_points(2 * per_rank(schedule)))
    pipe = fs.Pipeline(schedule, microbatches=hp.MICROBATCHES)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    state = fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe, **(init or {}))
    with fs.comm_stats() as stats:
        for step in range(STEPS):
            batch = hp.dp_parts(step, ROWS, dp)[dist.get_rank() % dp]
            state, _ = fs.train_step(state, batch, hp.loss_fn)
    return {
        "pipeline_rank": mesh["pipeline"].get_local_rank(),
        "by_axis": {k: v for k, v in stats.bytes_by_axis.items() if v},
        "bytes": {k: v for k, v in stats.bytes.items() if v},
        "calls": {k: v for k, v in stats.calls.items() if v},
        "state": state_bytes(state),
    }


def measure_cases(cases: list[tuple]) -> list[dict]:
    return [measure(*case) for case in cases]


class ValueCheck(models.Block):
    """A block that reads its input's values (a check): the meta device cannot run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            raise ValueError("ValueCheck: a nonfinite input")
        return super().forward(x)


class Checkpointed(models.Block):
    """A block under activation checkpointing (recomputed in backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation.checkpoint(super().forward, x, use_reentrant=False)
