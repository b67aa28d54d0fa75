"""Muon on stacked experts: a 3-D parameter ``(num_experts, m, n)`` has each expert's matrix
orthogonalized as its own, on a plain model as on an expert-parallel one.

Exact checks, as ``test_muon.py``'s: one process on a 3-D tensor equals ``torch.optim.Muon`` on
its experts as separate matrices, bit for bit; and given the same gradients, the sharded step
(every strategy, experts on ``mesh["expert"]`` or not) gives the one-process step's matrices
bit for bit (each expert's matrix is orthogonalized whole, from the bits one process uses).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs

import helpers_experts as moe

LR, WD = 0.02, 0.1


def test_each_expert_is_orthogonalized_as_torch_muon_does_a_matrix() -> None:
    g = torch.Generator().manual_seed(2)
    params = {"experts": torch.randn(3, 8, 5, generator=g), "w": torch.randn(6, 4, generator=g)}
    ref = [nn.Parameter(x.clone()) for x in params["experts"]] + [nn.Parameter(params["w"].clone())]
    topt = torch.optim.Muon(ref, lr=LR, weight_decay=WD)
    opt = fs.optim.muon(LR, weight_decay=WD)
    state = opt.init(params)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        for p, x in zip(ref, [*grads["experts"], grads["w"]], strict=True):
            p.grad = x.clone()
        topt.step()
        params, state = opt.update(grads, state, params)
    assert torch.equal(params["experts"], torch.stack([p.detach() for p in ref[:3]]))
    assert torch.equal(params["w"], ref[3].detach())


def test_other_non_matrices_are_still_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'conv' has shape \\(2, 3, 4, 5\\).*2-D"):
        fs.optim.muon(0.1).init({"w": torch.zeros(2, 2), "conv": torch.zeros(2, 3, 4, 5)})


def _optimizer() -> fs.optim.Optimizer:
    """Muon for the matrices and the stacked experts, SGD with momentum for the rest."""
    return fs.optim.multi_transform(
        {"muon": fs.optim.muon(LR, weight_decay=WD), "sgd": fs.optim.sgd(0.1, momentum=0.9)},
        lambda name, shape: "muon" if len(shape) >= 2 else "sgd",
    )


def _local(state: fs.TrainState, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's rows of every full gradient, as the state holds them (an expert leaf's of
    this expert rank's experts)."""
    layout = state.layout
    out = {}
    for spec in layout.leaves:
        g = full[spec.name]
        if layout.tensor.on_experts(spec.name):
            g = layout.tensor.part_of(spec.name, g)
        rank = layout.spec_rank(spec)
        start, stop = spec.row_range(rank)
        out[spec.name] = g.reshape(spec.rows, -1)[start:stop].reshape(spec.shard_shape(rank))
    return out


def exact_worker(shard: int, replicate: int, expert: int, strategy: str) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, expert=expert, device_type="cpu")
    model = moe.make_model(5)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if expert > 1:
        moe.place_experts(model, mesh["expert"])
    opt = _optimizer()
    state = fs.init(model, opt, mesh=mesh, strategy=strategy)
    ref_state = opt.init(params)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
        state = fs.offload_step(state, _local(state, grads))
        params, ref_state = opt.update(grads, ref_state, params)
    full = fs.full_params(state)
    return {
        n: torch.equal(full[n], params[n])
        if params[n].dim() >= 2
        else bool(torch.allclose(full[n], params[n], rtol=1e-6, atol=1e-7))
        for n in params
    }


CASES = (
    [(4, 1, 1, s) for s in ("no_shard", "optim_grads_params")]
    + [(4, 1, 2, s) for s in fs.STRATEGIES]
    + [(2, 2, 2, "optim"), (4, 1, 4, "optim_grads")]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sharded_step_on_experts_equals_one_process_bitwise(pool4, case) -> None:
    for same in pool4.run(exact_worker, *case):
        assert all(same.values()), same
