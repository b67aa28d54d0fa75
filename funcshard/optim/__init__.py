"""Pure optimizers in the optax style, running torch's fused kernels underneath.

An :class:`Optimizer` is a pair of pure functions (``init``, ``update``); ``chain`` puts
gradient transformations (``clip_by_global_norm``) before one; ``multi_transform`` gives
parameter labels their own optimizers (``muon`` for matrices beside ``adamw``); ``mask=`` on
``sgd``/``adamw`` says where weight decay applies. Rules are per parameter, and parameters
with one rule share one fused kernel call.
"""

from funcshard.optim.base import GradientTransformation, Optimizer, Schedule
from funcshard.optim.combine import (
    ChainState,
    ClipState,
    MultiTransformState,
    chain,
    clip_by_global_norm,
    decay_mask,
    multi_transform,
)
from funcshard.optim.matrices import MuonState, muon
from funcshard.optim.rules import AdamWState, SgdState, adamw, sgd
from funcshard.optim.schedules import constant, warmup_cosine, warmup_linear

__all__ = [
    "AdamWState",
    "ChainState",
    "ClipState",
    "GradientTransformation",
    "MultiTransformState",
    "MuonState",
    "Optimizer",
    "Schedule",
    "SgdState",
    "adamw",
    "chain",
    "clip_by_global_norm",
    "constant",
    "decay_mask",
    "multi_transform",
    "muon",
    "sgd",
    "warmup_cosine",
    "warmup_linear",
]
