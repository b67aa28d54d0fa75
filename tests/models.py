"""Small models and reference training loops shared by the tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

import funcshard as fs


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class MLP(nn.Module):
    """Uneven shapes on purpose: 37 rows split over 2, 3 and 4 ranks."""

    def __init__(self, d_in: int = 5, dim: int = 37, n_blocks: int = 3, n_out: int = 11) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, n_out)
        self.scale = nn.Parameter(torch.tensor(1.5))  # a 0-d parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.to(self.inp.weight.dtype))
        for block in self.blocks:
            h = block(h)
        return (self.head(h) * self.scale).float()


def make_model(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


def global_batch(step: int, rows: int, d_in: int = 5, n_out: int = 11) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "x": torch.randn(rows, d_in, generator=g),
        "y": torch.randint(0, n_out, (rows,), generator=g),
    }


def local_batch(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def make_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        return nn.functional.cross_entropy(logits, batch["y"])

    return loss_fn


def reference_run(model: nn.Module, torch_opt_fn, steps: int, rows: int) -> dict:
    """Single-process plain torch on the concatenated global batch."""
    model = copy.deepcopy(model)
    opt = torch_opt_fn(model.parameters())
    losses = []
    for step in range(steps):
        batch = global_batch(step, rows)
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "losses": losses,
    }


def max_rel_err(a: dict, b: dict) -> float:
    worst = 0.0
    for n in a:
        diff = (a[n].double() - b[n].double()).norm()
        worst = max(worst, float(diff / (b[n].double().norm() + 1e-12)))
    return worst
