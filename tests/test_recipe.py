"""The LLM recipe: clipping on the global norm, decay masks, schedules, per-label optimizers.

Every case is checked against plain torch on the concatenated global batch:
``clip_grad_norm_`` + ``torch.optim.AdamW`` / ``SGD`` with two param groups + ``LambdaLR``.
Each rule also has a check that the reference WITHOUT it ends far from ours, so a test would
fail if funcshard ignored the rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

import models

STEPS = 4
LOCAL_ROWS = 6
CLIP = 0.3  # below the model's gradient norm on most steps: the clip is active
PEAK, FINAL, WARMUP, TOTAL = 2e-2, 2e-3, 2, 4
WD = 0.1


def schedule(step: int) -> float:
    return fs.optim.warmup_cosine(PEAK, warmup=WARMUP, total=TOTAL, final=FINAL)(step)


# --- the recipes: ours and torch's, with a switch to drop one rule from torch's ---------------
def ours(recipe: str, clip: float = CLIP) -> fs.optim.Optimizer:
    if recipe == "adamw":
        inner = fs.optim.adamw(schedule, weight_decay=WD, mask=fs.optim.decay_mask)
    elif recipe == "sgd_nesterov":
        inner = fs.optim.sgd(
            schedule, momentum=0.9, nesterov=True, weight_decay=WD, mask=fs.optim.decay_mask
        )
    else:  # matrices by AdamW, the rest by SGD with momentum (each its own state)
        inner = fs.optim.multi_transform(
            {
                "matrix": fs.optim.adamw(schedule, weight_decay=WD),
                "other": fs.optim.sgd(schedule, momentum=0.9),
            },
            lambda name, shape: "matrix" if len(shape) >= 2 else "other",
        )
    return fs.optim.chain(fs.optim.clip_by_global_norm(clip), inner)


def multi() -> fs.optim.Optimizer:
    return ours("multi")


def torch_opts(recipe: str, model: nn.Module, drop: str | None = None) -> list:
    """Plain torch's optimizers for ``recipe``; ``drop="mask"`` decays every parameter."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    wd = WD if drop == "mask" else 0.0  # the no-decay group; decays when the mask is dropped
    if recipe == "adamw":
        groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": wd}]
        return [torch.optim.AdamW(groups, lr=PEAK)]
    if recipe == "sgd_nesterov":
        groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": wd}]
        return [torch.optim.SGD(groups, lr=PEAK, momentum=0.9, nesterov=True)]
    return [
        torch.optim.AdamW(decay, lr=PEAK, weight_decay=WD),
        torch.optim.SGD(rest, lr=PEAK, momentum=0.9),
    ]


def reference(
    model: nn.Module, recipe: str, rows: int, steps: int = STEPS, drop: str | None = None
) -> dict:
    """Plain torch's run of ``recipe``; ``drop`` ignores one rule (mask, clip or schedule)."""
    return models.reference_run(
        model,
        lambda m: torch_opts(recipe, m, drop),
        steps,
        rows,
        clip=None if drop == "clip" else CLIP,
        lr_lambda=(lambda s: 1.0) if drop == "schedule" else (lambda s: schedule(s) / PEAK),
    )


def _train(state, model, steps, microbatches: int = 1, rows: int | None = None):
    rows = rows or LOCAL_ROWS * dist.get_world_size()
    state, history = models.train(state, model, steps, rows=rows, microbatches=microbatches)
    return state, [m["grad_norm"] for m in history]


# --- single process: the optimizers on plain pytrees ------------------------------------------
@pytest.mark.parametrize("recipe", ["adamw", "sgd_nesterov", "multi"])
def test_recipe_on_a_plain_pytree_matches_torch(recipe: str) -> None:
    model = models.make_model(seed=5)
    rows = 12
    opt = ours(recipe)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.init(params)
    loss_fn = models.make_loss_fn(model)
    for step in range(STEPS):
        batch = models.global_batch(step, rows)
        p = {n: t.requires_grad_() for n, t in params.items()}
        grads = dict(zip(p, torch.autograd.grad(loss_fn(p, batch), list(p.values())), strict=True))
        params, state = opt.update(grads, state, {n: t.detach() for n, t in p.items()})
    ref = reference(model, recipe, rows)
    assert models.max_rel_err(params, ref["params"]) < 1e-5
    assert sum(n > CLIP for n in ref["norms"]) >= STEPS - 1, ref["norms"]


def test_update_without_donation_leaves_inputs_untouched() -> None:
    opt = ours("adamw", clip=1e-3)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    before = copy.deepcopy((params, grads))
    state = opt.init(params)
    opt.update(grads, state, params)
    for a, b in zip(fs.tree.leaves((params, grads)), fs.tree.leaves(before), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "recipe,drop",
    [("adamw", "mask"), ("adamw", "clip"), ("adamw", "schedule"), ("sgd_nesterov", "mask")],
)
def test_each_rule_moves_the_result(recipe: str, drop: str) -> None:
    """The references the parity tests use differ when one rule is left out: a funcshard
    that ignored the rule would fail them."""
    model = models.make_model(seed=5)
    full = reference(model, recipe, 12)["params"]
    without = reference(model, recipe, 12, drop=drop)["params"]
    assert models.max_rel_err(without, full) > 1e-3


def test_bad_rules_name_the_parameter() -> None:
    p = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    with pytest.raises(KeyError, match="'b'"):
        fs.optim.adamw(mask={"w": True}).init(p)
    with pytest.raises(KeyError, match="'b'.*label 'x'"):
        fs.optim.multi_transform(
            {"m": fs.optim.sgd(0.1)}, lambda n, s: "m" if n == "w" else "x"
        ).init(p)
    with pytest.raises(TypeError, match="only the last element"):
        fs.optim.chain(fs.optim.sgd(0.1), fs.optim.clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match="nesterov"):
        fs.optim.sgd(0.1, nesterov=True)


def test_schedules_follow_the_contract() -> None:
    import math

    s = fs.optim.warmup_cosine(1.0, warmup=10, total=110, final=0.1)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    lin = fs.optim.warmup_linear(1.0, warmup=10, total=110, final=0.0)
    assert lin(35) == pytest.approx(0.75) and lin(1000) == 0.0
    assert fs.optim.constant(3e-4)(123) == 3e-4


# --- many ranks: every strategy and mesh, microbatches {1, 3} ----------------------------------
# AdamW and SGD-nesterov recipes on every mesh; the multi_transform recipe on 2 ranks (its
# sharded path is the same code per label, and the offload and resume tests run it too).
def parity_worker(strategy: str, shard: int, replicate: int) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    world = dist.get_world_size()
    errors = {}
    recipes = ("adamw", "sgd_nesterov", "multi") if world == 2 else ("adamw", "sgd_nesterov")
    for recipe in recipes:
        model = models.make_model(seed=7)
        ref = reference(model, recipe, LOCAL_ROWS * world)
        for microbatches in (1, 3):
            state = fs.init(model, ours(recipe), mesh=mesh, strategy=strategy)
            state, norms = _train(state, model, range(STEPS), microbatches)
            key = f"{recipe}/mb{microbatches}"
            errors[key] = models.max_rel_err(fs.full_params(state), ref["params"])
            errors[key + "/norm"] = max(
                abs(a - b) / b for a, b in zip(norms, ref["norms"], strict=True)
            )
            errors[key + "/clipped_steps"] = sum(n > CLIP for n in norms)
    return errors


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
@pytest.mark.parametrize("mesh", list(models.MESHES))
def test_recipe_parity_with_torch(pool_of, mesh: str, strategy: str) -> None:
    shard, replicate = models.MESHES[mesh]
    pool = pool_of(shard * replicate)
    for errors in pool.run(parity_worker, strategy, shard, replicate):
        clipped = {k: v for k, v in errors.items() if k.endswith("clipped_steps")}
        assert all(v >= STEPS - 1 for v in clipped.values()), clipped
        bad = {k: v for k, v in errors.items() if k not in clipped and not v < 1e-4}
        assert not bad, f"relative error >= 1e-4: {bad}"


def offload_worker(strategy: str) -> dict:
    rows = LOCAL_ROWS * dist.get_world_size()
    out = models.offload_runs(multi, strategy, seed=9, steps=STEPS, rows=rows)
    return {
        f: max(float((out[f][n] - out[0.0][n]).abs().max()) for n in out[f]) for f in (0.5, 1.0)
    }


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_offloaded_recipe_is_identical_to_offload_zero(pool2, strategy: str) -> None:
    for diffs in pool2.run(offload_worker, strategy):
        assert all(v == 0.0 for v in diffs.values()), diffs


RESUME_ROWS = 12  # one global batch for 2 and 3 ranks


def test_chained_multi_transform_state_restores_across_layouts(pool2, pool3, tmp_path) -> None:
    """Saved on 2 ranks (ZeRO-3, half offloaded), resumed on 3 ranks under ZeRO-1 and ZeRO-2
    with other offload fractions: the run continues exactly (AdamW moments and SGD momentum
    of each label come back, so the last steps match torch's uninterrupted run)."""
    directory = str(tmp_path / "ckpt")
    pool2.run(models.save_trained, directory, multi, seed=11, steps=2, rows=RESUME_ROWS)
    ref = reference(models.make_model(seed=11), "multi", RESUME_ROWS)["params"]
    for strategy, fraction in (("optim", 0.0), ("optim_grads", 1.0)):
        resumed = pool3.run(
            models.resume_trained,
            directory,
            multi,
            strategy,
            fraction,
            start=2,
            stop=STEPS,
            rows=RESUME_ROWS,
        )
        for params in resumed:
            assert models.max_rel_err(params, ref) < 1e-4, (strategy, fraction)
