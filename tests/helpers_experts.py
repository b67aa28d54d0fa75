"""A tiny mixture-of-experts model for the expert axis's tests, standing alone (no
``fs.ExpertParallel``): experts stacked on dim 0 (``(num_experts, ...)``), top-1 routing that
leaves the experts uneven loads, and, once its experts are ``Shard(0)`` DTensors on
``mesh["expert"]`` (:func:`place_experts`), a forward that sends each token to the rank holding
its expert and back by ``all_to_all_rows`` (counted on "expert"). The reference is the same
model, plain, in one process on the concatenated global batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import funcshard as fs
from funcshard.distributed import ops

import models

D_IN, DIM, HIDDEN, EXPERTS, CLASSES = 6, 8, 12, 4, 5


def _expert_mlp(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor):
    """Rows of ``x`` grouped by expert (``counts[j]`` rows for expert ``j``) through each one."""
    outs = [
        nn.functional.silu(xj @ w1[j]) @ w2[j]
        for j, xj in enumerate(torch.split(x, counts))
        if xj.shape[0]
    ]
    # no rows: x's empty rows, still in the graph, so that every rank runs the backward
    # all-to-all its peers wait for
    return torch.cat(outs) if outs else x[:0]


class Experts(nn.Module):
    """``experts(x, idx)``: token ``i`` through expert ``idx[i]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.4)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(idx, stable=True)
        counts = torch.bincount(idx, minlength=EXPERTS)
        if isinstance(self.w1, DTensor):
            ys = _dispatched(x[order], counts, self.w1, self.w2)
        else:
            ys = _expert_mlp(x[order], counts.tolist(), self.w1, self.w2)
        return ys[torch.argsort(order)]


def _dispatched(xs: torch.Tensor, counts: torch.Tensor, w1: DTensor, w2: DTensor):
    """Sorted tokens to the expert ranks holding their experts, through them, and back."""
    mesh = w1.device_mesh
    group, size = mesh.get_group(), mesh.size()
    local = EXPERTS // size
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # (source rank, local expert) counts
    send_rows = counts.view(size, local).sum(1).tolist()
    recv = recv.view(size, local)
    got = ops.all_to_all_rows(xs, recv.sum(1).tolist(), send_rows, group)
    # received rows by (source, expert); the experts run them by (expert, source)
    starts = torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)
    segments = [(j, r) for j in range(local) for r in range(size)]
    perm = torch.cat(
        [
            torch.arange(int(starts[r * local + j]), int(starts[r * local + j] + recv[r, j]))
            for j, r in segments
        ]
        or [torch.zeros(0, dtype=torch.long)]
    )
    ys = _expert_mlp(got[perm], recv.sum(0).tolist(), w1.to_local(), w2.to_local())
    back = ys[torch.argsort(perm)]
    return ops.all_to_all_rows(back, send_rows, recv.sum(1).tolist(), group)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        probs = torch.softmax(self.router(h), -1)
        idx = probs.argmax(-1)
        gate = probs.gather(1, idx[:, None])
        return self.head(h + gate * self.experts(h, idx))


def make_model(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE()


def place_experts(model: MoE, mesh) -> MoE:
    """The experts ``Shard(0)`` DTensors on ``mesh`` (``mesh["expert"]``), in place."""
    for name in ("w1", "w2"):
        p = getattr(model.experts, name)
        setattr(model.experts, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
    return model


def global_batch(step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(3000 + step)
    return {
        "x": torch.randn(rows, D_IN, generator=g),
        "y": torch.randint(0, CLASSES, (rows,), generator=g),
    }


def local_batch(batch: dict) -> dict:
    """Every rank its own data-parallel rank (no tensor axis here)."""
    return models.local_batch(batch, dist.get_rank(), dist.get_world_size())


make_loss_fn = models.make_loss_fn  # logits of batch["x"] against batch["y"]


def train(state, model, steps, *, rows: int, microbatches: int = 2):
    loss_fn = make_loss_fn(model)
    history = []
    for step in steps:
        batch = local_batch(global_batch(step, rows))
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=microbatches)
        history.append(metrics)
    return state, history


def reference_run(model: nn.Module, steps: int, rows: int, *, lr=0.1, momentum=0.9) -> dict:
    """The plain model in one process on the concatenated global batch (SGD with momentum)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses, norms = [], []
    for step in range(steps):
        batch = global_batch(step, rows)
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "losses": losses, "norms": norms}
