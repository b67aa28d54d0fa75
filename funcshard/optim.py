"""Pure optimizers in the optax style, running torch's fused kernels underneath.

An :class:`Optimizer` is a pair of functions. ``init(params)`` builds a state that is
numerically inert (zeros, count 0: no synthetic step, no weight decay). ``update(grads, state,
params)`` returns ``(new_params, new_state)`` with exactly the update rules of
``torch.optim.SGD`` (dampening 0, nesterov False) and ``torch.optim.AdamW`` (decoupled weight
decay, bias correction, eps after the square root).

Leaves are grouped by (device, dtype) and each group is stepped by ONE fused kernel call over
lists of tensors, so the cost does not grow with Python work per leaf. With ``donate=True`` the
input buffers are updated in place and returned (the caller must treat the inputs as consumed);
otherwise the inputs are left untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

__all__ = ["Optimizer", "SgdState", "AdamWState", "sgd", "adamw", "Schedule"]

Schedule = Callable[[int], float]
PyTree = Any


class Optimizer(NamedTuple):
    """A pure optimizer: ``init(params) -> state``; ``update(grads, state, params)``."""

    init: Callable[..., Any]
    update: Callable[..., tuple[PyTree, Any]]


class SgdState(NamedTuple):
    count: int
    momentum: PyTree  # None when momentum == 0, as torch keeps no buffer then


class AdamWState(NamedTuple):
    count: int
    mu: PyTree
    nu: PyTree


def _lr_at(lr: float | Schedule, count: int) -> float:
    return float(lr(count)) if callable(lr) else float(lr)


def _leaves(tree: PyTree) -> list[torch.Tensor]:
    return optree.tree_leaves(tree, none_is_leaf=False)


def _groups(*columns: list[torch.Tensor]) -> dict[tuple, list[list[torch.Tensor]]]:
    """Splits parallel leaf lists into per-(device, dtype) lists for the fused kernels."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for row in zip(*columns, strict=True):
        key = (row[0].device, row[0].dtype)
        cols = groups.setdefault(key, [[] for _ in columns])
        for col, t in zip(cols, row, strict=True):
            col.append(t)
    return groups


def _prepare(grads: PyTree, params: PyTree, donate: bool, *states: PyTree):
    """Leaf lists for a step; copies the state when the caller keeps its inputs."""
    treedef = optree.tree_structure(params)
    p = _leaves(params)
    g = _leaves(grads)
    if len(g) != len(p):
        raise ValueError(f"optimizer update: {len(g)} gradient leaves for {len(p)} params")
    g = [gi if gi.dtype == pi.dtype else gi.to(pi.dtype) for gi, pi in zip(g, p, strict=True)]
    if not donate:
        p = [t.clone() for t in p]
    out_states = []
    for s in states:
        leaves = _leaves(s)
        out_states.append(leaves if donate else [t.clone() for t in leaves])
    return treedef, p, g, out_states


def _not_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def sgd(lr: float | Schedule, momentum: float = 0.0, weight_decay: float = 0.0) -> Optimizer:
    """torch.optim.SGD's rule (dampening 0, nesterov False) as a pure optimizer.

    >>> opt = sgd(0.1, momentum=0.9)
    >>> p = {"w": torch.ones(2)}
    >>> p, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> p["w"].tolist()
    [0.8999999761581421, 0.8999999761581421]
    """
    _not_negative("momentum", momentum)
    _not_negative("weight_decay", weight_decay)

    def init(params: PyTree) -> SgdState:
        buf = optree.tree_map(torch.zeros_like, params) if momentum else None
        return SgdState(count=0, momentum=buf)

    def update(grads: PyTree, state: SgdState, params: PyTree, *, donate: bool = False):
        bufs = (state.momentum,) if momentum else ()
        treedef, p, g, out = _prepare(grads, params, donate, *bufs)
        m = out[0] if momentum else [None] * len(p)
        lr_now = _lr_at(lr, state.count)
        cols = (p, g, m) if momentum else (p, g)
        for lists in _groups(*cols).values():
            torch._fused_sgd_(
                lists[0],
                lists[1],
                lists[2] if momentum else [],
                weight_decay=weight_decay,
                momentum=momentum,
                lr=lr_now,
                dampening=0.0,
                nesterov=False,
                maximize=False,
                # zero-initialised buffers make step 1 (buf = g) and later steps one formula
                is_first_step=False,
            )
        new_m = optree.tree_unflatten(treedef, m) if momentum else None
        return optree.tree_unflatten(treedef, p), SgdState(state.count + 1, new_m)

    return Optimizer(init, update)


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Optimizer:
    """torch.optim.AdamW's rule as a pure optimizer (fused kernel on CPU and CUDA).

    >>> opt = adamw(0.1)
    >>> p = {"w": torch.zeros(2)}
    >>> p, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> [round(x, 4) for x in p["w"].tolist()], s.count
    ([-0.1, -0.1], 1)
    """
    beta1, beta2 = betas
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"adamw: betas must lie in [0, 1), got {betas}")
    _not_negative("eps", eps)
    _not_negative("weight_decay", weight_decay)

    def init(params: PyTree) -> AdamWState:
        zeros = lambda: optree.tree_map(torch.zeros_like, params)
        return AdamWState(count=0, mu=zeros(), nu=zeros())

    def update(grads: PyTree, state: AdamWState, params: PyTree, *, donate: bool = False):
        treedef, p, g, (mu, nu) = _prepare(grads, params, donate, state.mu, state.nu)
        lr_now = _lr_at(lr, state.count)
        for (device, _), (gp, gg, gm, gv) in _groups(p, g, mu, nu).items():
            step = torch.tensor(float(state.count + 1), device=device)
            torch._fused_adamw_(
                gp,
                gg,
                gm,
                gv,
                [],
                [step] * len(gp),
                amsgrad=False,
                lr=lr_now,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                maximize=False,
            )
        unflat = lambda leaves: optree.tree_unflatten(treedef, leaves)
        return unflat(p), AdamWState(state.count + 1, unflat(mu), unflat(nu))

    return Optimizer(init, update)
