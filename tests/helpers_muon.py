"""The Muon recipe the Muon tests share: Muon on the hidden matrices, AdamW on the rest.

Used by ``test_muon.py`` (against torch), ``test_tp_muon.py`` (tensor parallel) and
``test_comm.py`` (Muon's exchange bytes against ``fs.plan``). The model has ``D_IN`` = 40 inputs
so that every matrix's gradient has full rank (``test_muon.py``'s docstring says why).
``fp32_iterations`` makes torch's Muon and ours orthogonalize with ``ns_fp32_iterations``, so
that end-to-end tolerances hold on every CPU (``test_muon.py``'s docstring).
"""

from __future__ import annotations

import contextlib

import torch

import funcshard as fs
from funcshard.optim import matrices as muon_lib

STEPS = 4
LOCAL_ROWS = 24
D_IN = 40
CLIP = 0.5
LR, ADAM_LR, WD = 0.02, 1e-2, 0.1


def is_muon(name: str, shape: tuple) -> bool:
    return len(shape) == 2 and not name.startswith("head")


def schedule(step: int) -> float:
    return fs.optim.warmup_cosine(1.0, warmup=2, total=STEPS, final=0.1)(step)


def ours() -> fs.optim.Optimizer:
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(CLIP),
        fs.optim.multi_transform(
            {
                "muon": fs.optim.muon(lambda s: LR * schedule(s), weight_decay=WD),
                "adamw": fs.optim.adamw(
                    lambda s: ADAM_LR * schedule(s), weight_decay=WD, mask=fs.optim.decay_mask
                ),
            },
            lambda name, shape: "muon" if is_muon(name, shape) else "adamw",
        ),
    )


def plain() -> fs.optim.Optimizer:
    """Muon for the hidden matrices, AdamW for the rest: no clip, no schedule (the exact
    comparisons)."""
    return fs.optim.multi_transform(
        {
            "muon": fs.optim.muon(LR, weight_decay=WD),
            "adamw": fs.optim.adamw(ADAM_LR, weight_decay=WD),
        },
        lambda name, shape: "muon" if is_muon(name, shape) else "adamw",
    )


def same_as(full: dict, params: dict) -> dict[str, bool]:
    """Per parameter, whether the sharded step's ``full`` equals the one-process ``params``:
    Muon's matrices bit for bit; AdamW's leaves to 1e-6 only: its fused kernel treats an
    element in the vector body and in the scalar tail of a buffer slightly differently, and a
    flat bucket puts the tails elsewhere than per-tensor buffers do."""
    return {
        n: torch.equal(full[n], params[n])
        if is_muon(n, tuple(params[n].shape))
        else bool(torch.allclose(full[n], params[n], rtol=1e-6, atol=1e-7))
        for n in params
    }


def movement_err(ours: dict, ref: dict, init: dict) -> float:
    """The largest ``|ours - ref| / |ref - init|`` over the parameters (the movement's error)."""
    return max(
        float(
            (ours[n].double() - ref[n].double()).norm()
            / ((ref[n].double() - init[n].double()).norm() + 1e-12)
        )
        for n in ref
    )


def ns_fp32_iterations(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization with its bf16 input and output, iterating in fp32."""
    a, b, c = coefficients
    x = update.bfloat16().float()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).contiguous().bfloat16()


@contextlib.contextmanager
def fp32_iterations():
    """torch's Muon and ours both orthogonalize with ``ns_fp32_iterations``."""
    theirs = torch.optim._muon._zeropower_via_newtonschulz
    mine = muon_lib.newton_schulz
    torch.optim._muon._zeropower_via_newtonschulz = ns_fp32_iterations
    muon_lib.newton_schulz = ns_fp32_iterations
    try:
        yield
    finally:
        torch.optim._muon._zeropower_via_newtonschulz = theirs
        muon_lib.newton_schulz = mine
