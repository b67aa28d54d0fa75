"""ZeRO-2/3 units: Hugging Face activation checkpointing, placeholders, errors of loss_fn."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models
from helpers_units import ce, hf_model, token_batch

ROWS, STEPS, MICRO = 4, 3, 2  # equal microbatches: mean of means


def hf_checkpointing_worker(kind: str, strategy: str, checkpointing: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = hf_model(kind)
    ref = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    state = fs.init(
        model,
        fs.optim.sgd(0.1, momentum=0.9),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy=strategy,
    )
    layout = state.layout
    after_forward = []
    attention_calls = []  # forward, and again in backward where a layer is recomputed
    for name, module in model.named_modules():
        if name.split(".")[-1] in ("attn", "self_attn"):
            module.register_forward_hook(lambda *_: attention_calls.append(1))

    def loss_fn(params, tokens):
        out = fs.functional_call(
            model, params, (), {"input_ids": tokens[:, :-1], "use_cache": False}
        )
        after_forward.append(stats.gathered_live)
        return ce(model, out.logits, tokens)

    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    calls = []
    for step in range(STEPS):
        tokens = token_batch(step, ROWS * world)
        with fs.comm_stats() as stats:
            state, _ = fs.train_step(state, tokens.chunk(world)[rank], loss_fn, MICRO)
        calls.append(stats.calls["all_gather"])
        opt.zero_grad()
        ce(ref, ref(input_ids=tokens[:, :-1], use_cache=False).logits, tokens).backward()
        opt.step()
    got = fs.full_params(state)
    ref_params = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    full_unit = max(b.numel for b in layout.buckets if b.unit != 0) * layout.shard_size * 4
    root = sum(b.numel for b in layout.buckets if b.unit == 0) * layout.shard_size * 4
    return {
        "err": models.max_rel_err(got, ref_params),
        "gathers": calls,
        "buckets": len(layout.buckets),
        "units": len(layout.units),
        "after_forward": after_forward,
        "peak": stats.gathered_peak,
        "bound": 2 * full_unit + root,
        "attention_calls": len(attention_calls),
    }


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_gradient_checkpointing_is_exact(pool2, kind: str, strategy: str) -> None:
    """``gradient_checkpointing_enable()`` checkpoints inside each decoder layer's forward:
    exact against plain torch under every strategy, and under ZeRO-3 the recomputation runs on
    the unit's backward re-gather: one gather per bucket in forward and one in backward, no
    more than without checkpointing, and nothing gathered stays alive past forward."""
    for r in pool2.run(hf_checkpointing_worker, kind, strategy, True):
        assert r["units"] == 3 and r["attention_calls"] == 2 * 2 * MICRO * STEPS, r
        assert r["err"] < 1e-4, r
        if strategy == "optim_grads_params":
            assert r["gathers"] == [2 * r["buckets"] * MICRO] * STEPS, r
            assert r["after_forward"] == [0] * (STEPS * MICRO), r
            assert r["peak"] <= r["bound"], r


def test_hf_checkpointing_gathers_as_much_as_no_checkpointing(pool2) -> None:
    plain = pool2.run(hf_checkpointing_worker, "llama", "optim_grads_params", False)[0]
    assert plain["attention_calls"] == 2 * MICRO * STEPS and plain["err"] < 1e-4, plain
    assert plain["gathers"] == [2 * plain["buckets"] * MICRO] * STEPS, plain


# --- errors ----------------------------------------------------------------------------------


class Raising(models.MLP):
    """Raises ``RuntimeError(message)`` from inside its first block's forward when ``inside``."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.blocks[0].register_forward_hook(self._maybe_raise)

    def _maybe_raise(self, module, args, output):
        if self.inside:
            raise RuntimeError("tokenizer metadata missing (inside a unit)")


def user_error_worker(strategy: str) -> list[str]:
    model = Raising()
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy
    )
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    base = models.make_loss_fn(model)

    def after_forward(params, b):
        base(params, b)
        raise RuntimeError("tokenizer metadata missing")

    def inside(params, b):
        model.inside = True
        return base(params, b)

    seen = []
    for loss_fn in (after_forward, inside):
        try:
            fs.train_step(state, batch, loss_fn)
            seen.append("no error")
        except RuntimeError as e:
            seen.append(f"{type(e).__name__}: {e}")
    return seen


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_an_error_of_the_loss_fn_comes_back_unchanged(pool2, strategy: str) -> None:
    for seen in pool2.run(user_error_worker, strategy):
        assert seen == [
            "RuntimeError: tokenizer metadata missing",
            "RuntimeError: tokenizer metadata missing (inside a unit)",
        ], seen


class Peeking(models.MLP):
    """Reads a unit's weight in root code, before that unit runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peek = self.blocks[1].fc.weight.sum() * 0
        return super().forward(x) + peek


def outside_worker(strategy: str) -> str:
    torch.manual_seed(0)
    model = Peeking()
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy
    )
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    try:
        fs.train_step(state, batch, models.make_loss_fn(model))
    except fs.UnitParamsError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_unit_param_used_outside_its_unit_is_named(pool2, strategy: str) -> None:
    for e in pool2.run(outside_worker, strategy):
        assert "'blocks.1.fc.weight'" in e and "'blocks.1'" in e and "params[name]" in e, e


class SharedLinear(torch.nn.Module):
    """Three residual blocks, the first and the last running one Linear; with ``on_root`` the
    Linear is also registered on the model itself, before the blocks (the root unit's)."""

    def __init__(self, on_root: bool) -> None:
        super().__init__()
        shared = torch.nn.Linear(8, 8)
        if on_root:
            self.shared = shared
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(fc, torch.nn.Tanh())
                for fc in (shared, torch.nn.Linear(8, 8), shared)
            ]
        )
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def shared_worker(on_root: bool) -> dict:
    out = {}
    for strategy in ("no_shard", "optim_grads_params"):
        torch.manual_seed(0)
        model = SharedLinear(on_root)
        mesh = fs.make_mesh(device_type="cpu")
        state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)

        def loss_fn(params, b, model=model):
            return fs.functional_call(model, params, (b,)).square().mean()

        try:
            for step in range(2):
                batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
                state, _ = fs.train_step(state, batch[dist.get_rank() :: 2], loss_fn)
            out[strategy] = fs.full_params(state)
        except fs.UnitParamsError as e:
            out[strategy] = str(e)
    return out


def test_a_param_tied_into_two_units_is_named_with_its_other_name(pool2) -> None:
    """One Linear in blocks 0 and 2: ZeRO-3 gathers it with blocks.0 only, so block 2's use
    is refused, naming the tied name and the two ways out (before, the error said to read
    params[name] in loss_fn, which the user's code never did). Registered on the model
    first (the root), it trains as no_shard does."""
    for out in pool2.run(shared_worker, False):
        e = out["optim_grads_params"]
        assert "'blocks.0.0.weight'" in e and "'blocks.2.0.weight'" in e, e
        assert "one unit" in e and "root" in e and "params[name]" not in e, e
    for out in pool2.run(shared_worker, True):
        for name, want in out["no_shard"].items():
            torch.testing.assert_close(out["optim_grads_params"][name], want, rtol=1e-6, atol=1e-6)


def backward_inside_worker(strategy: str) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy
    )
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    base = models.make_loss_fn(model)

    def backward_inside(params, b):
        loss = base(params, b)
        loss.backward()  # the step takes the one backward itself
        return loss

    try:
        fs.train_step(state, batch, backward_inside)
    except RuntimeError as e:
        error = str(e)
    else:
        error = "no error"
    # the failed step consumed nothing: the state still steps
    state, metrics = fs.train_step(state, batch, base)
    return {"error": error, "step": state.step}


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_backward_inside_loss_fn_is_refused(pool2, strategy: str) -> None:
    for r in pool2.run(backward_inside_worker, strategy):
        assert "inside loss_fn" in r["error"] and strategy in r["error"], r
        assert r["step"] == 1


class Checkpointed(models.MLP):
    """Each block under non-reentrant activation checkpointing (recomputed in backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h) * self.scale


def phases_worker(strategy: str) -> list[str]:
    """The run's stored phase as each unit's pre-forward hook sees it."""
    from funcshard.step.units import UnitRun

    torch.manual_seed(0)
    model = Checkpointed()
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy
    )
    seen: list[str] = []
    original = UnitRun.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for unit in self.units[1:]:

            def wrapped(module, args, _pre=unit.pre_forward, _unit=unit, _run=self):
                seen.append(f"{_unit.prefix}:{_run.phase.value}")
                return _pre(module, args)

            unit.pre_forward = wrapped

    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    UnitRun.__init__ = spy
    try:
        fs.train_step(state, batch, models.make_loss_fn(model))
    finally:
        UnitRun.__init__ = original
    return seen


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_recomputation_runs_in_the_stored_backward_phase(pool2, strategy: str) -> None:
    """A forward inside backward (activation checkpointing) is told apart by the run's stored
    phase: each block runs once in forward, then once more in backward (its recomputation)."""
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    for seen in pool2.run(phases_worker, strategy):
        assert seen == [f"{b}:forward" for b in blocks] + [
            f"{b}:backward" for b in reversed(blocks)
        ], seen


def test_saved_params_unpack_through_the_bucket_holder_alone() -> None:
    """The saved-tensor codec needs only "which holder re-gathers bucket b" (no UnitRun: the
    units package has no run <-> saved import cycle): a registered gathered param is packed
    to a token, and unpacking it asks that holder for the buffer, then lets it release."""
    from funcshard.step.units.saved import SavedParams

    calls = []
    full = torch.arange(12.0)

    class Holder:
        def backward_full(self, bucket: int) -> torch.Tensor:
            calls.append(("full", bucket, saved.refs[bucket]))
            return full

        def maybe_release(self, bucket: int) -> None:
            calls.append(("release", bucket, saved.refs[bucket]))

    saved = SavedParams(lambda bucket: Holder())
    saved.register(3, full)
    view = full[4:10].view(2, 3)
    token = saved.pack(view)
    assert not isinstance(token, torch.Tensor) and saved.refs[3] == 1
    other = torch.ones(2)
    assert saved.pack(other) is other  # not a gathered param: saved as it is
    got = saved.unpack(token)
    torch.testing.assert_close(got, view, rtol=0, atol=0)
    # the buffer is asked for while the token counts, released once it no longer does
    assert calls == [("full", 3, 1), ("release", 3, 0)]
