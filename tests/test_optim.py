"""Pure optimizers: exactly torch.optim's rules, inert init, purity unless donated."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(37, 5, generator=g),
        "b": torch.randn(3, generator=g),
        "c": torch.randn((), generator=g),
    }


CASES = {
    "sgd": (lambda: fs.optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum_wd": (
        lambda: fs.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adamw": (
        lambda: fs.optim.adamw(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    "adamw_schedule": (
        lambda: fs.optim.adamw(lambda step: 1e-2 / (1 + step)),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optim(case: str) -> None:
    ours, theirs = CASES[case]
    opt = ours()
    params = _params()
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = theirs(list(ref.values()))
    sched = (
        torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 1 / (1 + step))
        if case == "adamw_schedule"
        else None
    )
    state = opt.init(params)
    for step in range(5):
        grads = _params(seed=100 + step)
        params, state = opt.update(grads, state, params)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        if sched:
            sched.step()
    assert state.count == 5
    for k in params:
        torch.testing.assert_close(params[k], ref[k].detach(), rtol=1e-6, atol=1e-7)


def test_init_is_numerically_inert() -> None:
    params = _params()
    for make in (
        lambda: fs.optim.adamw(1e-2, weight_decay=0.5),
        lambda: fs.optim.sgd(0.1, momentum=0.9, weight_decay=0.5),
    ):
        state = make().init(params)
        assert state.count == 0
        tensors = [t for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]
        assert tensors and all(not t.any() for t in tensors)


def test_update_is_pure_unless_donated() -> None:
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    params = _params()
    kept = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    new, new_state = opt.update(_params(1), state, params)
    assert all(torch.equal(params[k], kept[k]) for k in params)
    assert all(not t.any() for t in state.mu.values())
    donated, _ = opt.update(_params(1), opt.init(params), params, donate=True)
    assert donated["a"] is params["a"] and torch.equal(donated["a"], new["a"])


def test_mixed_devices_and_dtypes_group_per_kernel() -> None:
    opt = fs.optim.sgd(0.5, momentum=0.5)
    params = {"f32": torch.ones(3), "bf16": torch.ones(3, dtype=torch.bfloat16)}
    grads = {"f32": torch.ones(3), "bf16": torch.ones(3, dtype=torch.float32)}
    new, _ = opt.update(grads, opt.init(params), params)
    assert new["bf16"].dtype == torch.bfloat16
    assert new["f32"].tolist() == [0.5] * 3 and new["bf16"].float().tolist() == [0.5] * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sgd_steps_every_element_of_low_precision_params(dtype: torch.dtype) -> None:
    """torch's fused CPU SGD skips reduced-precision params in its vector loop; ours is the
    fp32 step rounded once, on every element (long tensors have a vector body)."""
    torch.manual_seed(0)
    opt = fs.optim.sgd(0.37, momentum=0.9, nesterov=True, weight_decay=0.1)
    p32, g32 = torch.randn(1000), torch.randn(1000)
    params = {"w": p32.to(dtype)}
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.update({"w": g32.to(dtype)}, state, params)
    ref = {"w": p32.to(dtype).float()}
    ref_state = opt.init(ref)
    for _ in range(2):
        ref, ref_state = opt.update({"w": g32.to(dtype).float()}, ref_state, ref)
        ref = {"w": ref["w"].to(dtype).float()}
        ref_state = ref_state._replace(momentum={"w": ref_state.momentum["w"].to(dtype).float()})
    assert torch.equal(params["w"], ref["w"].to(dtype))
    assert torch.equal(state.momentum["w"], ref_state.momentum["w"].to(dtype))


def test_bad_hyperparameters_are_named() -> None:
    with pytest.raises(ValueError, match="betas"):
        fs.optim.adamw(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="momentum"):
        fs.optim.sgd(0.1, momentum=-1)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: fs.optim.sgd(0.1, momentum=0.9), "momentum"),
        (fs.optim.adamw, "mu"),
        (fs.optim.muon, "momentum"),
    ],
    ids=["sgd", "adamw", "muon"],
)
def test_a_state_or_gradient_that_does_not_fit_is_named(make, field: str) -> None:
    """Every optimizer checks its inputs the same way (one builder): a gradient of the wrong
    shape names the parameter, a state built for other params names the moment field."""
    opt = make()
    params = {"v": torch.zeros(3, 4), "w": torch.zeros(2, 2)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"a gradient of shape \(4, 3\) for \['v'\]"):
        opt.update({"v": torch.zeros(4, 3), "w": torch.zeros(2, 2)}, state, params)
    with pytest.raises(ValueError, match=f"1 {field} leaves for 2 params"):
        opt.update(params, opt.init({"w": torch.zeros(2, 2)}), params)
