"""Small models and reference training loops shared by the tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
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


# (shard, replicate) of the meshes the optimizer parity tests run on
MESHES = {"2": (2, 1), "3": (3, 1), "2x2": (2, 2)}


# SGD momentum and AdamW: ours beside torch's, for the parity tests (test_parity, test_hfsdp).
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


def parity_errors(state: fs.TrainState, history: list[dict], ref: dict) -> dict:
    """The largest relative errors of a run against one process's ``ref`` (``params``,
    ``losses``, ``norms``): params (from ``fs.full_params``, plain global tensors of the
    reference's shapes), every step's loss and grad norm."""
    from torch.distributed.tensor import DTensor

    full = fs.full_params(state)
    assert not any(isinstance(t, DTensor) for t in full.values()), "full_params: plain tensors"
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    assert shapes == {n: tuple(t.shape) for n, t in ref["params"].items()}, shapes
    rel = lambda a, b: float((a - b).norm() / (b.norm() + 1e-12))  # noqa: E731
    return {
        "params": max(rel(full[n], ref["params"][n]) for n in ref["params"]),
        "loss": max(abs(m["loss"] - r) / r for m, r in zip(history, ref["losses"], strict=True)),
        "norm": max(
            abs(m["grad_norm"] - r) / r for m, r in zip(history, ref["norms"], strict=True)
        ),
    }


def make_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        return nn.functional.cross_entropy(logits, batch["y"])

    return loss_fn


def train(
    state: fs.TrainState,
    model: nn.Module,
    steps,
    *,
    rows: int,
    microbatches: int = 1,
    d_in: int = 5,
) -> tuple[fs.TrainState, list[dict]]:
    """``fs.train_step`` on this rank's part of the global batch of each step in ``steps``.

    Returns the last state and every step's metrics.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = make_loss_fn(model)
    history = []
    for step in steps:
        batch = local_batch(global_batch(step, rows, d_in=d_in), rank, world)
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=microbatches)
        history.append(metrics)
    return state, history


def reference_run(
    model: nn.Module,
    make_opts: Callable[[nn.Module], torch.optim.Optimizer | list[torch.optim.Optimizer]],
    steps: int,
    rows: int,
    *,
    clip: float | None = None,
    lr_lambda: Callable[[int], float] | None = None,
    d_in: int = 5,
) -> dict:
    """Single-process plain torch on the concatenated global batch.

    ``make_opts(model)`` gives the torch optimizer(s) of a copy of ``model``; ``lr_lambda`` a
    ``LambdaLR`` on each; ``clip`` a ``clip_grad_norm_`` before each step, whose norms are
    returned. Returns ``{"params", "losses", "norms"}``.
    """
    model = copy.deepcopy(model)
    opts = make_opts(model)
    opts = opts if isinstance(opts, list) else [opts]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts] if lr_lambda else []
    losses, norms = [], []
    for step in range(steps):
        batch = global_batch(step, rows, d_in=d_in)
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        for o in opts:
            o.zero_grad()
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        losses.append(loss.item())
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "losses": losses,
        "norms": norms,
    }


# --- rank functions shared by the optimizer tests (importable: RankPool pickles them) ---------


def offload_runs(
    make_opt: Callable[[], fs.optim.Optimizer],
    strategy: str,
    *,
    seed: int,
    steps: int,
    rows: int,
    d_in: int = 5,
) -> dict[float, dict]:
    """Full params after ``steps`` (2 microbatches) at offload fractions 0, 0.5 and 1."""
    mesh = fs.make_mesh(device_type="cpu")
    out = {}
    for fraction in (0.0, 0.5, 1.0):
        model = make_model(seed=seed, d_in=d_in)
        state = fs.init(model, make_opt(), mesh=mesh, strategy=strategy, offload_fraction=fraction)
        assert fraction == 0.0 or any(b.offload for b in state.layout.buckets)
        state, _ = train(state, model, range(steps), rows=rows, microbatches=2, d_in=d_in)
        out[fraction] = fs.full_params(state)
    return out


def save_trained(
    directory: str,
    make_opt: Callable[[], fs.optim.Optimizer],
    *,
    seed: int,
    steps: int,
    rows: int,
    d_in: int = 5,
) -> None:
    """Trains ``steps`` steps under ZeRO-3 with half the optimizer offloaded, then saves."""
    mesh = fs.make_mesh(device_type="cpu")
    model = make_model(seed=seed, d_in=d_in)
    state = fs.init(
        model, make_opt(), mesh=mesh, strategy="optim_grads_params", offload_fraction=0.5
    )
    state, _ = train(state, model, range(steps), rows=rows, d_in=d_in)
    fs.save(directory, state)


def resume_trained(
    directory: str,
    make_opt: Callable[[], fs.optim.Optimizer],
    strategy: str,
    fraction: float,
    *,
    start: int,
    stop: int,
    rows: int,
    d_in: int = 5,
) -> dict:
    """Restores ``directory`` (saved at step ``start``) onto this layout, from a model with
    other weights (none may survive the restore), and trains up to ``stop``: full params."""
    mesh = fs.make_mesh(device_type="cpu")
    model = make_model(seed=12, d_in=d_in)
    like = fs.init(model, make_opt(), mesh=mesh, strategy=strategy, offload_fraction=fraction)
    state = fs.restore(directory, like=like)
    assert state.step == start, state.step
    state, _ = train(state, model, range(start, stop), rows=rows, d_in=d_in)
    return fs.full_params(state)


def max_rel_err(a: dict, b: dict) -> float:
    worst = 0.0
    for n in a:
        diff = (a[n].double() - b[n].double()).norm()
        worst = max(worst, float(diff / (b[n].double().norm() + 1e-12)))
    return worst
