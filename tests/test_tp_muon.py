"""Muon under tensor parallelism: every FULL matrix orthogonalized, as torch.optim.Muon does on
the unsharded model.

The Llama-like model of ``helpers_tp`` parallelized with torchtitan's plan (q / k / v / w1 / w3
Shard(0), o / w2 Shard(1), the head colwise) on (shard 2 x tensor 2) and (tensor 4). Muon takes
the 2-D matrices but the head (``helpers_muon.is_muon``): the split ones and the embedding,
which is replicated over "tensor" (each tensor rank orthogonalizes it whole); AdamW the rest.
The same two kinds of checks as ``test_muon.py`` (whose docstring says why):

* Exact: given the same gradients, the TP sharded step gives the one-process step's matrices
  bit for bit (``fs.optim.muon`` in one process equals ``torch.optim.Muon`` bit for bit:
  ``test_muon.py``). A matrix orthogonalized from its local shard, or from a full matrix put
  together in another order, or stepped with the learning rate of its local shape, is off.
* End to end against torch (clip + Muon + AdamW + LambdaLR on the plain model, the global batch),
  both orthogonalizing with ``ns_fp32_iterations``, within ``TOL`` of the movement; and every
  matrix orthogonalized whole, with its full shape, by exactly T ranks per step (one owner per
  tensor rank).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import funcshard as fs
from funcshard.optim import matrices as muon_lib

import helpers_tp as H
from helpers_muon import (
    ADAM_LR,
    CLIP,
    LR,
    WD,
    fp32_iterations,
    is_muon,
    movement_err,
    ours,
    plain,
    same_as,
    schedule,
)

TOL = 2e-2  # test_muon.py's bound on the movement error (its docstring derives it)
STEPS, ROWS, SEED = 4, 16, 12
MESHES = {"2x2": (2, 2), "1x4": (1, 4)}  # (shard, tensor)


def local_grads(model: nn.Module, grads: dict, tensor_mesh) -> dict:
    """This tensor rank's shard of every full gradient, as torch places the parameter."""
    params = dict(model.named_parameters())
    return {
        n: distribute_tensor(g, tensor_mesh, params[n].placements).to_local()
        if isinstance(params[n], DTensor)
        else g
        for n, g in grads.items()
    }


MODELS = {
    "llama": (H.make_model, H.parallelize),
    # split 5 / 4 over "tensor": each tensor rank's local sizes differ, its buckets must not
    "uneven": (H.make_uneven, H.parallelize_uneven),
}


def exact_worker(strategy: str, shard: int, tensor: int, fraction: float, name: str) -> dict:
    mesh = H.world_mesh(shard, 1, tensor)
    make, parallelize = MODELS[name]
    model = make(SEED)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize(model, mesh)
    opt = plain()
    state = fs.init(model, opt, mesh=mesh, strategy=strategy, offload_fraction=fraction)
    ref_state = opt.init(params)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
        local = local_grads(model, grads, mesh["tensor"])
        state = fs.offload_step(state, fs.shard(local, mesh, strategy=strategy))
        params, ref_state = opt.update(grads, ref_state, params)
    return same_as(fs.full_params(state), params)


@pytest.mark.parametrize(
    "mesh,strategy,fraction,model",
    # the owner exchange runs as under ZeRO-1 for every sharded strategy: one of them, the
    # replicated one, an offloaded one, tensor 4 (the suite's time) and an offloaded one whose
    # tensor split is uneven (the offloaded leaves must be the same on every tensor rank)
    [
        ("2x2", "no_shard", 0.0, "llama"),
        ("2x2", "optim", 0.0, "llama"),
        ("2x2", "optim_grads_params", 0.5, "llama"),
        ("1x4", "optim_grads_params", 0.0, "llama"),
        ("2x2", "optim_grads_params", 0.5, "uneven"),
    ],
)
def test_tp_step_equals_one_process_bitwise(pool4, mesh, strategy, fraction, model) -> None:
    shard, tensor = MESHES[mesh]
    for same in pool4.run(exact_worker, strategy, shard, tensor, fraction, model):
        assert all(same.values()), [n for n, ok in same.items() if not ok]


def reference(model: nn.Module) -> dict:
    """clip + torch.optim.Muon + AdamW + LambdaLR on the plain model, the global batch."""
    model = copy.deepcopy(model)
    named = list(model.named_parameters())
    mats = [p for n, p in named if is_muon(n, tuple(p.shape))]
    decay = [p for n, p in named if not is_muon(n, tuple(p.shape)) and p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    opts = [
        torch.optim.Muon(mats, lr=LR, weight_decay=WD),
        torch.optim.AdamW(
            [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
            lr=ADAM_LR,
        ),
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in opts]
    for step in range(STEPS):
        batch = H.global_batch(step, ROWS)
        logits = model(batch["x"])
        loss = nn.functional.cross_entropy(logits.reshape(-1, H.VOCAB), batch["y"].reshape(-1))
        for o in opts:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for o in opts + scheds:
            o.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def parity_worker(strategy: str, shard: int, tensor: int) -> dict:
    with fp32_iterations():
        mesh = H.world_mesh(shard, 1, tensor)
        model = H.make_model(SEED)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        ref = reference(model)
        H.parallelize(model, mesh)
        shapes = []
        real = muon_lib.newton_schulz

        def spy(update, *args):
            shapes.append(tuple(update.shape))
            return real(update, *args)

        muon_lib.newton_schulz = spy
        try:
            state = fs.init(model, ours(), mesh=mesh, strategy=strategy)
            state, _ = H.train(state, model, mesh, range(STEPS), rows=ROWS)
        finally:
            muon_lib.newton_schulz = real
        return {"err": movement_err(fs.full_params(state), ref, init), "shapes": shapes}


@pytest.mark.parametrize(
    "mesh,strategy", [("2x2", "optim_grads_params"), ("1x4", "optim_grads_params")]
)
def test_tp_muon_parity_with_torch(pool4, mesh, strategy) -> None:
    shard, tensor = MESHES[mesh]
    results = pool4.run(parity_worker, strategy, shard, tensor)
    model = H.make_model(SEED)
    whole = [tuple(p.shape) for n, p in model.named_parameters() if is_muon(n, tuple(p.shape))]
    for r in results:
        assert r["err"] < TOL, r["err"]
    # every matrix whole, with its full shape, once per step in each tensor rank's data-parallel
    # group: a split one by its T owners (one per tensor rank), the embedding (replicated over
    # "tensor") by each tensor rank for itself
    seen = sorted(s for r in results for s in r["shapes"])
    assert seen == sorted(whole * STEPS * tensor)
