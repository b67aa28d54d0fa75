"""What the ``deterministic=True`` tests share: the recipe, the run and the bitwise comparison.

Used by ``test_determinism.py`` and by ``test_wire.py`` (a param wire under
``deterministic=True``). The global batch (36 rows) is split into ``CHUNKS`` = 4 gradient chunks
by every layout; ``snapshot`` gathers every parameter and optimizer-state tensor by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import funcshard as fs

import models

STEPS = 4
CHUNKS = 4
ROWS = 36  # 9 rows per chunk
CLIP = 0.3  # below the gradient norm on most steps: the clip is active


def recipe() -> fs.optim.Optimizer:
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(CLIP),
        fs.optim.adamw(
            fs.optim.warmup_cosine(2e-2, warmup=2, total=STEPS, final=2e-3),
            weight_decay=0.1,
            mask=fs.optim.decay_mask,
        ),
    )


def muon_recipe() -> fs.optim.Optimizer:
    """Muon on the blocks' matrices (whole-matrix owners), AdamW on the rest."""
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(CLIP),
        fs.optim.multi_transform(
            {"muon": fs.optim.muon(0.02), "adamw": fs.optim.adamw(3e-3, weight_decay=0.1)},
            lambda name, shape: (
                "muon" if len(shape) == 2 and name.startswith("blocks") else "adamw"
            ),
        ),
    )


RECIPES = {"adamw": recipe, "muon": muon_recipe}


def full_rows(layout, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's rows (one holder of each master shard, in shard order:
    under HFSDP the master index is not the global rank)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (layout.shard_rank, local))
    parts: dict = {}
    for shard_rank, rows in gathered:
        parts.setdefault(shard_rank, rows)
    size = layout.shard_size
    out = {}
    for name in local:
        spec = layout.leaf(name)
        if size == 1 or spec.shape == ():
            out[name] = parts[0][name]
        else:
            out[name] = torch.cat([parts[r][name] for r in range(size)])
    return out


def snapshot(state) -> dict:
    """Every parameter and every optimizer-state tensor, full, by name."""
    names = set(state.layout.names)
    by_name = lambda x: isinstance(x, dict) and bool(x) and set(x) <= names  # noqa: E731
    opt = fs.tree.leaves(state.opt_state_by_name(), is_leaf=by_name)
    tensors = {f"params/{n}": t for n, t in full_rows(state.layout, state.params).items()}
    for i, part in enumerate(x for x in opt if by_name(x)):
        tensors.update({f"opt{i}/{n}": t for n, t in full_rows(state.layout, part).items()})
    return {"tensors": {k: v.clone() for k, v in tensors.items()}, "step": state.step}


def penalized(model, twice: bool = False):
    """The loss plus a penalty that reads a unit's weight by name, outside the unit; ``twice``
    also runs the model a second time (on the chunk's rows reversed): three uses of a bucket."""
    base = models.make_loss_fn(model)

    def loss_fn(params, batch):
        loss = base(params, batch)
        if twice:
            loss = loss + 0.5 * base(params, {k: v.flip(0) for k, v in batch.items()})
        return loss + 1e-2 * params["blocks.1.fc.weight"].square().sum()

    return loss_fn


def run(state, steps, microbatches: int, penalty: bool = False, twice: bool = False):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_model(seed=3)
    loss_fn = penalized(model, twice) if penalty else models.make_loss_fn(model)
    metrics = []
    for step in steps:
        batch = models.local_batch(models.global_batch(step, ROWS), rank, world)
        state, m = fs.train_step(state, batch, loss_fn, microbatches=microbatches)
        metrics.append((m["loss"], m["grad_norm"], m["nonfinite"]))
    return state, metrics


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got["metrics"] == want["metrics"], (what, got["metrics"], want["metrics"])
    assert got["tensors"].keys() == want["tensors"].keys(), what
    differ = [k for k, v in got["tensors"].items() if not torch.equal(v, want["tensors"][k])]
    assert not differ, (what, differ)
