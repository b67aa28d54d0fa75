"""funcshard.step.functional: functional_call with plain dicts, StepParams and GatheredParams.

A plain dict behaves as ``torch.func.functional_call``. ``StepParams`` (ZeRO-0/1) stay in the
model until ``close()``, so that a recomputation in backward sees this step's weights, and
refuse use afterwards. ``GatheredParams`` (ZeRO-2/3) is a read-only mapping whose membership
test gathers nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard.step.functional import GatheredParams, StepParams

import models


def _tied() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    return model


def _others(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _get(model: nn.Module, name: str) -> torch.Tensor:
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


def test_a_plain_dict_is_torch_func_functional_call() -> None:
    model = models.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params, x = _others(model), torch.randn(4, 5)
    out = fs.functional_call(model, params, (x,))
    torch.testing.assert_close(out, torch.func.functional_call(model, params, (x,)), rtol=0, atol=0)
    assert not torch.allclose(out, model(x))  # the given params ran, not the module's
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # One positional argument may come bare.
    torch.testing.assert_close(fs.functional_call(model, params, x), out, rtol=0, atol=0)


def test_a_plain_dict_strict_names_the_missing_keys() -> None:
    model = models.make_model()
    params = _others(model)
    del params["head.bias"]
    with pytest.raises(RuntimeError, match="head.bias"):
        fs.functional_call(model, params, (torch.randn(2, 5),), strict=True)


def test_step_params_stay_in_the_model_until_close() -> None:
    model = models.make_model()
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    params, x = StepParams(_others(model)), torch.randn(4, 5)
    out = fs.functional_call(model, params, (x,))
    torch.testing.assert_close(out, torch.func.functional_call(model, dict(params), (x,)))
    # Until close(), a call of the module itself (a recomputation in backward) sees them.
    assert all(_get(model, n) is params[n] for n in params)
    torch.testing.assert_close(model(x), out, rtol=0, atol=0)
    params.close()
    assert params.closed
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    with pytest.raises(RuntimeError, match="train_step that has finished"):
        fs.functional_call(model, params, (x,))


def test_step_params_swap_tied_weights_under_both_names() -> None:
    model = _tied()
    weight = torch.randn(5, 3)
    params = StepParams({"0.weight": weight})
    tokens = torch.tensor([0, 3])
    out = fs.functional_call(model, params, (tokens,))
    torch.testing.assert_close(out, weight[tokens] @ weight.T)
    assert model[1].weight is weight  # the tied name too
    params.close()
    assert model[1].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)


def test_step_params_strict_names_missing_and_unexpected_keys() -> None:
    model = models.make_model()
    params = _others(model)
    params["nope"] = params.pop("head.bias")
    with pytest.raises(RuntimeError, match=r"missing keys \['head.bias'\].*'nope'"):
        fs.functional_call(model, StepParams(params), (torch.randn(2, 5),), strict=True)


class _Run:
    """A stand-in for units.UnitRun: what GatheredParams asks of it."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.layout = type("L", (), {"names": names})()
        self.closed = False
        self.gathered: list[str] = []
        self.calls = 0

    def param(self, name: str) -> torch.Tensor:
        self.gathered.append(name)
        return torch.full((2,), float(len(name)))

    def call(self, model, args, kwargs):
        self.calls += 1
        return ("ran", model, args, kwargs)


def test_gathered_params_is_a_mapping_whose_membership_gathers_nothing() -> None:
    run = _Run(("b.w", "a.w", "c"))
    params = GatheredParams(run)
    assert list(params) == ["b.w", "a.w", "c"] and len(params) == 3  # layout order
    assert "a.w" in params and "zzz" not in params and run.gathered == []
    torch.testing.assert_close(params["c"], torch.full((2,), 1.0))
    assert run.gathered == ["c"]  # one gather per read by name
    model = nn.Linear(1, 1)
    tag, ran_model, args, kwargs = fs.functional_call(model, params, torch.ones(1), {"k": 1})
    assert tag == "ran" and ran_model is model and kwargs == {"k": 1}
    assert isinstance(args, tuple) and torch.equal(args[0], torch.ones(1))
    assert run.calls == 1  # the unit-by-unit run, not a swap of the module's params
    run.closed = True
    assert params.closed
    with pytest.raises(RuntimeError, match=r"params\['c'\].*finished"):
        params["c"]
    with pytest.raises(RuntimeError, match="finished"):
        fs.functional_call(model, params, (torch.ones(1),))
    assert run.calls == 1


def kinds_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy)
    seen = {}
    base = models.make_loss_fn(model)

    def loss_fn(params, batch):
        seen["type"] = type(params).__name__
        seen["params"] = params
        return base(params, batch)

    state, _ = fs.train_step(state, models.global_batch(0, 4), loss_fn)
    seen["closed_after"] = seen.pop("params").closed
    return seen


@pytest.mark.parametrize(
    "strategy, kind",
    [
        ("no_shard", "StepParams"),
        ("optim", "StepParams"),
        ("optim_grads", "GatheredParams"),
        ("optim_grads_params", "GatheredParams"),
    ],
)
def test_train_step_hands_loss_fn_the_params_of_its_strategy(pool2, strategy, kind) -> None:
    for seen in pool2.run(kinds_worker, strategy):
        assert seen == {"type": kind, "closed_after": True}
