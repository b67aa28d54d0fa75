"""What the side-by-side benchmarks of a GPT on several meshes share (``bench_tp.py``,
``bench_moe.py``): the loss, the step's global batch, a funcshard runner and an FSDP2 runner
with the same ``step(x) -> loss``, and the loop that steps every runner in turn (so that all
see the same machine load) and times each step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import funcshard as fs

__all__ = [
    "loss",
    "global_batch",
    "FunShard",
    "Fsdp2",
    "in_turns",
    "print_table",
    "largest_loss_difference",
]


def loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def global_batch(step: int, vocab: int, seq_len: int, rows: int) -> torch.Tensor:
    """The step's global batch of ``rows`` token sequences (the same on every rank)."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, vocab, (rows, seq_len + 1), generator=g)


class FunShard:
    """A funcshard state of ``model`` (already parallelized) stepping ``x`` in
    ``microbatches``; ``bytes``: the last step's bytes by mesh axis."""

    def __init__(self, model, state: fs.TrainState, microbatches: int) -> None:
        self.model, self.state, self.microbatches = model, state, microbatches
        self.bytes: dict[str, int] = {}

    def step(self, x: torch.Tensor) -> float:
        def loss_fn(params, batch):
            return loss(fs.functional_call(self.model, params, (batch[:, :-1],)), batch)

        with fs.comm_stats() as stats:
            self.state, metrics = fs.train_step(
                self.state, x, loss_fn, microbatches=self.microbatches
            )
        self.bytes = dict(stats.bytes_by_axis)
        return metrics["loss"]

    def state_bytes(self) -> int:
        leaves = [t for t in fs.tree.leaves(self.state) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in leaves)


class Fsdp2:
    """An FSDP2 model (``fully_shard`` already applied) with fused AdamW stepping ``x`` in
    ``microbatches``; ``after_backward()`` runs before the optimizer step. No gradient norm:
    torch's ``clip_grad_norm_`` refuses a mix of meshes (funcshard computes its norm every
    step, a small advantage to FSDP2 here)."""

    def __init__(
        self, model, lr: float, microbatches: int, after_backward: Callable[[], None] = None
    ) -> None:
        self.model, self.microbatches = model, microbatches
        self.after_backward = after_backward or (lambda: None)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

    def step(self, x: torch.Tensor) -> float:
        total = 0.0
        parts = x.chunk(self.microbatches)
        for part in parts:
            value = loss(self.model(part[:, :-1]), part) / len(parts)
            value.backward()
            total += float(value.detach())
        self.after_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mean = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(mean)  # the global mean, as funcshard's metrics
        return float(mean) / dist.get_world_size()  # a tensor group's ranks: the same loss

    def state_bytes(self) -> int:
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        params = [local(p) for p in self.model.parameters()]
        moments = [
            local(v)
            for s in self.opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return sum(t.numel() * t.element_size() for t in params + moments)


def in_turns(
    runners: dict, batch_of: Callable[[str, int], torch.Tensor], steps: int, warmup: int
) -> dict:
    """Every runner steps in turn on ``batch_of(name, step)``, each step behind a barrier;
    the median wall and CPU time of the steps after ``warmup``, the state bytes, funcshard's
    bytes by axis and the loss curves."""
    wall = {n: [] for n in runners}
    cpu = {n: [] for n in runners}
    losses = {n: [] for n in runners}
    for step in range(warmup + steps):
        for name, runner in runners.items():
            x = batch_of(name, step)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(runner.step(x))
            if step >= warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return {
        "wall": {n: statistics.median(v) for n, v in wall.items()},
        "cpu": {n: statistics.median(v) for n, v in cpu.items()},
        "state_bytes": {n: r.state_bytes() for n, r in runners.items()},
        "bytes_by_axis": {n: r.bytes for n, r in runners.items() if isinstance(r, FunShard)},
        "losses": losses,
    }


def print_table(out: list[dict], width: int = 22) -> None:
    """The runners' rows (median step, state per rank, funcshard's bytes by axis) and the
    loss curves' largest difference from the first runner's."""
    r0 = out[0]
    print(f"{'runner':<{width}}{'wall s':>9}{'cpu s':>9}{'state MB/rank':>15}  bytes/step by axis")
    for name in r0["wall"]:
        axes = r0["bytes_by_axis"].get(name, {})
        shown = ", ".join(f"{a} {b / 1e6:.2f} MB" for a, b in sorted(axes.items()) if b)
        print(
            f"{name:<{width}}{r0['wall'][name]:>9.3f}{r0['cpu'][name]:>9.3f}"
            f"{max(o['state_bytes'][name] for o in out) / 1e6:>15.2f}  {shown or '-'}"
        )


def largest_loss_difference(r0: dict, reference: str) -> float:
    curves = r0["losses"]
    return max(
        abs(a - b) for n in curves for a, b in zip(curves[n], curves[reference], strict=True)
    )
