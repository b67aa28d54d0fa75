"""train_step: nonfinite skip, fp16 dynamic loss scaling, consumed state, unfilled state."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import funcshard as fs

import models


def _tensors(state) -> list[torch.Tensor]:
    return [t.clone() for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]


def nonfinite_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy=strategy)
    base = models.make_loss_fn(model)
    rank = dist.get_rank()
    batch = models.local_batch(models.global_batch(0, 8), rank, 2)
    state, _ = fs.train_step(state, batch, base)  # a real optimizer state to protect
    before = _tensors(state)

    def poisoned(params, b):
        loss = base(params, b)
        # NaN gradient for head.bias on rank 1 only; every rank takes the param (a collective)
        poison = float("nan") if rank == 1 else 1.0
        return loss + (params["head.bias"] * poison).sum() * 0

    state, metrics = fs.train_step(state, batch, poisoned)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _tensors(state), strict=True))
    return {
        "nonfinite": metrics["nonfinite"],
        "names": metrics["nonfinite_params"],
        "unchanged": unchanged,
        "step": state.step,
    }


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_nonfinite_step_changes_nothing_and_names_the_leaves(pool2, strategy: str) -> None:
    for r in pool2.run(nonfinite_worker, strategy):
        assert r["nonfinite"] == 1 and r["unchanged"] and r["step"] == 1
        assert r["names"] == ["head.bias"]


def fp16_worker(strategy: str) -> list:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    policy = fs.MixedPrecisionPolicy(
        param_dtype=torch.float16, loss_scale_init=2.0**10, loss_scale_growth_interval=2
    )
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, strategy=strategy)
    base = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    trace = [state.loss_scale.scale]
    for factor in (1e6, 1.0, 1.0, 1.0):  # 1e6 * 2**10 overflows fp16 in backward
        before = fs.full_params(state)
        state, metrics = fs.train_step(state, batch, lambda p, b, f=factor: base(p, b) * f)
        moved = any(not torch.equal(before[n], v) for n, v in fs.full_params(state).items())
        trace.append((metrics["nonfinite"], metrics["loss_scale"], moved))
    return trace


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_fp16_overflow_halves_the_scale_and_skips_then_growth(pool2, strategy: str) -> None:
    trace = pool2.run(fp16_worker, strategy)[0]
    assert trace == [
        1024.0,
        (1, 512.0, False),
        (0, 512.0, True),
        (0, 1024.0, True),
        (0, 1024.0, True),
    ]


def consumed_worker() -> list[str]:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    loss_fn = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    new, _ = fs.train_step(state, batch, loss_fn)
    errors = []
    for use in (
        lambda: fs.train_step(state, batch, loss_fn),
        lambda: state.params,
        lambda: fs.tree.leaves(state),
        lambda: fs.full_params(state),
    ):
        try:
            use()
            errors.append("no error")
        except fs.ConsumedStateError as e:
            errors.append(str(e))
    fs.train_step(new, batch, loss_fn)  # the returned state works
    return errors


def test_consumed_state_refuses_reuse(pool2) -> None:
    for msg in pool2.run(consumed_worker)[0]:
        assert "consumed by train_step" in msg


def _donate(via: str, state, batch, loss_fn, directory: str):
    if via == "train_step":
        return fs.train_step(state, batch, loss_fn)[0]
    if via == "offload_step":
        grads = tuple(torch.full((b.numel,), 0.5) for b in state.layout.buckets)
        return fs.offload_step(state, grads)
    return fs.restore(directory, like=state)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def donation_worker(via: str, strategy: str, directory: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)
    loss_fn = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, loss_fn)  # a momentum buffer to share
    if via == "restore":
        fs.save(directory, state)
    leaves, treedef = fs.tree.flatten(state)
    aliases = {
        "replace": state.replace(step=0),
        "tree_map": fs.tree.map(lambda x: x, state),
        "unflatten": fs.tree.unflatten(treedef, leaves),
        "detach": fs.tree.map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, state),
    }
    copy = fs.tree.map(_clone, state)
    before = {n: p.clone() for n, p in state.params.items()}
    new = _donate(via, state, batch, loss_fn, directory)
    errors = {}
    for name, alias in aliases.items():
        try:
            fs.train_step(alias, batch, loss_fn)
            errors[name] = None
        except fs.ConsumedStateError as e:
            errors[name] = str(e)
    untouched = all(torch.equal(copy.params[n], p) for n, p in before.items())
    # the copy trains on its own buffers: the donated result does not move when it steps
    after_new = {n: p.clone() for n, p in new.params.items()}
    copy, _ = fs.train_step(copy, batch, loss_fn)
    independent = all(torch.equal(new.params[n], p) for n, p in after_new.items())
    new, _ = fs.train_step(new, batch, loss_fn)  # and the returned state works
    return {
        "errors": errors,
        "untouched": untouched,
        "independent": independent,
        "copy_step": copy.step,
    }


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.parametrize("via", ["train_step", "offload_step", "restore"])
def test_donation_refuses_every_state_sharing_a_buffer(pool2, tmp_path, via, strategy) -> None:
    """Aliases made by replace, tree maps and unflatten die with the donated state; a copy
    whose tensors are clones stays valid, keeps its values and trains independently."""
    for r in pool2.run(donation_worker, via, strategy, str(tmp_path / "ckpt")):
        for name, e in r["errors"].items():
            assert e is not None and f"consumed by {via}" in e, (name, e)
        assert r["untouched"] and r["independent"] and r["copy_step"] == 2, r


def test_offload_step_has_no_private_keywords() -> None:
    params = inspect.signature(fs.offload_step).parameters
    assert not [n for n in params if n.startswith("_")], list(params)


def meta_worker() -> str:
    mesh = fs.make_mesh(device_type="cpu")
    with torch.device("meta"):
        model = models.MLP()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    assert not state.filled
    try:
        fs.train_step(
            state, {"x": torch.randn(2, 5), "y": torch.zeros(2).long()}, models.make_loss_fn(model)
        )
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_meta_model_gives_unfilled_state_that_refuses_to_step(pool2) -> None:
    assert "holds no values" in pool2.run(meta_worker)[0]


def test_microbatch_split_errors_name_the_leaf() -> None:
    from funcshard.step.train import split_microbatches

    with pytest.raises(ValueError, match=r"'x'.*3 rows"):
        split_microbatches({"x": torch.zeros(3, 2)}, 4)
    parts = split_microbatches({"x": torch.arange(6)}, 3)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]


def ragged_worker(strategy: str, compile: str | None) -> dict:
    """Steps 0 and 2 of 4 rows a rank, 2 microbatches; between them a ragged batch: 2 rows on
    rank 0, 1 on rank 1. Beside it the same run without the ragged step."""
    rank, out = dist.get_rank(), {}
    for ragged in (True, False):
        torch.manual_seed(0)
        model = models.make_model()
        mesh = fs.make_mesh(device_type="cpu")
        opt = fs.optim.sgd(0.1, momentum=0.9)
        state = fs.init(model, opt, mesh=mesh, strategy=strategy, compile=compile)
        loss_fn = models.make_loss_fn(model)
        state, _ = fs.train_step(
            state, models.local_batch(models.global_batch(0, 8), rank, 2), loss_fn, 2
        )
        if ragged:
            small = models.global_batch(1, 3)
            mine = {k: v[:2] if rank == 0 else v[2:] for k, v in small.items()}
            try:
                fs.train_step(state, mine, loss_fn, 2)
                out["error"] = None
            except ValueError as e:
                out["error"] = str(e)
        state, _ = fs.train_step(
            state, models.local_batch(models.global_batch(2, 8), rank, 2), loss_fn, 2
        )
        out[ragged] = fs.full_params(state)
    return out


@pytest.mark.parametrize(
    ("strategy", "compile"), [("optim_grads_params", None), ("optim_grads", "aot_eager")]
)
def test_a_batch_one_rank_cannot_split_raises_on_every_rank(pool2, strategy, compile) -> None:
    """A ragged last batch: rank 1's single row cannot make 2 microbatches. Raised on that
    rank alone, its peer waited in the step's first collective for ever (ZeRO-3: the gather;
    captured: the reduce by sends). Now both raise, naming rank 1, and the state goes on as
    if the step had not been asked for (bitwise)."""
    for out in pool2.run(ragged_worker, strategy, compile):
        assert out["error"] is not None and "rank 1: batch leaf" in out["error"], out["error"]
        assert "1 rows cannot split into 2" in out["error"] and "rank 0" not in out["error"]
        for name, want in out[False].items():
            assert torch.equal(out[True][name], want), name


def huge_gradient_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    base = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    norms = {}
    for factor in (1.0, 1e22):  # 1e22: finite gradients whose squares overflow fp32
        state = fs.init(model, fs.optim.sgd(0.0), mesh=mesh, strategy=strategy)
        _, metrics = fs.train_step(state, batch, lambda p, b, f=factor: base(p, b) * f)
        norms[factor] = (metrics["grad_norm"], metrics["nonfinite"])
    return norms


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_huge_finite_gradient_is_not_an_overflow(pool2, strategy: str) -> None:
    for r in pool2.run(huge_gradient_worker, strategy):
        (small, bad_small), (huge, bad_huge) = r[1.0], r[1e22]
        assert bad_small == 0 and bad_huge == 0
        assert huge == pytest.approx(small * 1e22, rel=1e-5)


def penalty_worker(strategy: str) -> dict:
    """A loss that uses params by name beside the model call: an L2 penalty on two leaves."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    base = models.make_loss_fn(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)

    def loss_fn(params, b):
        assert "head.weight" in params and "nope" not in params and len(params) == 17
        return base(params, b) + 0.3 * (
            params["head.weight"].square().sum() + params["scale"].square()
        )

    ref = models.make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        glob = models.global_batch(step, 4 * world)
        state, _ = fs.train_step(state, models.local_batch(glob, rank, world), loss_fn, 2)
        opt.zero_grad()
        out = ref(glob["x"])
        loss = torch.nn.functional.cross_entropy(out, glob["y"]) + 0.3 * (
            ref.head.weight.square().sum() + ref.scale.square()
        )
        loss.backward()
        opt.step()
    got = fs.full_params(state)
    return {
        n: float((got[n] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-12))
        for n, p in ref.named_parameters()
    }


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_params_by_name_in_the_loss_get_exact_gradients(pool2, strategy: str) -> None:
    for errors in pool2.run(penalty_worker, strategy):
        assert max(errors.values()) < 1e-5, errors


class Routed(models.MLP):
    """MLP whose second block runs only on rows routed to it: none on rank 1's data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != 1 or bool(x[:, 0].mean() > 0):  # data-dependent: the block may not run
                h = block(h)
        return (self.head(h) * self.scale).float()


def routed_worker(strategy: str) -> float:
    mesh = fs.make_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Routed()
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)
    glob = models.global_batch(0, 8)
    glob["x"][:, 0] = torch.tensor([1.0] * 4 + [-1.0] * 4)  # rank 0 routes to block 1, rank 1 not
    batch = models.local_batch(glob, rank, world)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    ref = Routed()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    for r in range(world):  # the mean of the ranks' gradients, each with its own routing
        part = models.local_batch(glob, r, world)
        loss = torch.nn.functional.cross_entropy(ref(part["x"]), part["y"]) / world
        loss.backward()
    opt.step()
    got = fs.full_params(state)
    return max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_a_unit_that_only_some_ranks_run(pool2, strategy: str) -> None:
    """ZeRO-0/1 reduce after backward in a fixed order: data-dependent routing is fine."""
    assert max(pool2.run(routed_worker, strategy)) < 1e-6


class SharedBlocks(nn.Module):
    """One Linear used twice: the same module is both children of the ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([block, block])
        self.out = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


class TiedAcrossUnits(nn.Module):
    """The last unit's output projection is the root's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 11, bias=False)])
        self.blocks[1].weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.tanh(self.blocks[0](self.emb(x))))


class TiedPair(nn.Module):
    """Two Linears of one unit sharing their weight (an alias inside the unit's module)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class TiedWithinUnits(SharedBlocks):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TiedPair(), TiedPair()])


def sharing_worker(kind: str, strategy: str) -> float:
    torch.manual_seed(0)
    model = {"shared": SharedBlocks, "tied": TiedAcrossUnits, "within": TiedWithinUnits}[kind]()
    ref = copy.deepcopy(model)
    state = fs.init(
        model,
        fs.optim.sgd(0.1, momentum=0.9),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy=strategy,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = (
            torch.randn(6 * world, 8, generator=g)
            if kind != "tied"
            else torch.randint(0, 11, (6 * world, 3), generator=g)
        )
        y = torch.randint(0, 11, x.shape[:1] if kind != "tied" else x.shape, generator=g)

        def loss_fn(params, b, m=model):
            logits = fs.functional_call(m, params, (b[0],))
            return nn.functional.cross_entropy(logits.reshape(-1, 11), b[1].reshape(-1))

        state, _ = fs.train_step(state, (x.chunk(world)[rank], y.chunk(world)[rank]), loss_fn, 2)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x).reshape(-1, 11), y.reshape(-1)).backward()
        opt.step()
    got = fs.full_params(state)
    return max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("kind", ["shared", "tied", "within"])
@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_shared_modules_and_weights_tied_across_units(pool2, kind: str, strategy: str) -> None:
    assert max(pool2.run(sharing_worker, kind, strategy)) < 1e-6


class CheckpointedInside(models.Block):
    """Activation checkpointing inside a unit: the recompute bypasses the unit's entry."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class Checkpointing(models.MLP):
    """``inside``: each block checkpoints its own body; else the model checkpoints blocks."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        self.inside = inside
        if inside:
            self.blocks = nn.ModuleList(CheckpointedInside(37) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if self.inside else checkpoint(block, h, use_reentrant=False)
        return (self.head(h) * self.scale).float()


def checkpointing_worker(inside: bool, strategy: str):
    torch.manual_seed(0)
    model = Checkpointing(inside)
    ref = copy.deepcopy(model)
    state = fs.init(
        model,
        fs.optim.sgd(0.1, momentum=0.9),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy=strategy,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    try:
        for step in range(3):  # from the second step on, stale weights would show
            glob = models.global_batch(step, 4 * world)
            state, _ = fs.train_step(
                state, models.local_batch(glob, rank, world), models.make_loss_fn(model), 2
            )
            opt.zero_grad()
            nn.functional.cross_entropy(ref(glob["x"]), glob["y"]).backward()
            opt.step()
    except RuntimeError as e:
        return str(e)
    got = fs.full_params(state)
    return max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_activation_checkpointing_recomputes_with_this_steps_weights(pool2, inside, strategy):
    """Around a unit or inside its own forward (the recompute then bypasses the unit's hooks:
    under ZeRO-3 it runs on the unit's re-gathered params), exact under every strategy."""
    for r in pool2.run(checkpointing_worker, inside, strategy):
        assert isinstance(r, float) and r < 1e-6, r


def kept_params_worker(strategy: str) -> str:
    model = models.make_model()
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy
    )
    kept = []
    base = models.make_loss_fn(model)

    def loss_fn(params, b):
        kept.append(params)
        return base(params, b)

    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, loss_fn)
    errors = []
    for use in (lambda p: fs.functional_call(model, p, (batch["x"],)), lambda p: p["head.bias"]):
        try:
            use(kept[0])
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return errors[0] if strategy in ("no_shard", "optim") else " / ".join(map(str, errors))


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_params_kept_past_their_step_refuse_use(pool2, strategy: str) -> None:
    for e in pool2.run(kept_params_worker, strategy):
        assert "None" not in e and "train_step that has finished" in e, e
