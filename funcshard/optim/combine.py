"""Composition: ``chain``, ``clip_by_global_norm``, ``multi_transform`` and ``decay_mask``."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import optree
import torch

from funcshard.layout.buckets import NAMESPACE, is_per_bucket
from funcshard.optim.base import GradientTransformation, Optimizer, PyTree, leaves
from funcshard.optim.spec import per_leaf_rule

if TYPE_CHECKING:
    from funcshard.layout.layout import Placement

__all__ = [
    "ChainState",
    "ClipState",
    "MultiTransformState",
    "chain",
    "clip_by_global_norm",
    "multi_transform",
    "decay_mask",
]


def decay_mask(name: str, shape: tuple) -> bool:
    """nanoGPT's weight-decay rule: decay matrices and embeddings, not biases or norm weights.

    >>> decay_mask("h.0.attn.weight", (64, 64)), decay_mask("h.0.ln.weight", (64,))
    (True, False)
    """
    del name
    return len(shape) >= 2


class ChainState(NamedTuple):
    states: tuple


class ClipState(NamedTuple):
    pass


class MultiTransformState(NamedTuple):
    inner: dict  # label -> that optimizer's state over its own parameters (None elsewhere)


def _combined_partition(parts: list[Callable | None]) -> Callable | None:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return lambda name, shape: tuple(p(name, shape) for p in parts)


def chain(*transforms: GradientTransformation | Optimizer) -> Optimizer | GradientTransformation:
    """Gradient transformations applied in order, then (optionally) one optimizer.

    ``chain(clip_by_global_norm(1.0), adamw(...))`` is an Optimizer; a chain of gradient
    transformations only is a GradientTransformation. Scaling transforms (the clip) fold their
    factor into the optimizer's fused kernel: no extra pass over the gradients.

    >>> from funcshard.optim import sgd
    >>> opt = chain(clip_by_global_norm(1.0), sgd(1.0))
    >>> p = {"w": torch.zeros(2)}
    >>> p, s = opt.update({"w": torch.full((2,), 3.0)}, opt.init(p), p)
    >>> [round(x, 4) for x in p["w"].tolist()]
    [-0.7071, -0.7071]
    """
    if not transforms:
        raise ValueError("chain: give at least one transformation")
    *front, last = transforms
    for i, t in enumerate(front):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: element {i} is a {type(t).__name__}; only the last element "
                "may be an optimizer (the rest transform gradients, e.g. "
                "clip_by_global_norm)"
            )
    if not isinstance(last, (GradientTransformation, Optimizer)):
        raise TypeError(
            f"chain: the last element is a {type(last).__name__}; expected an "
            "fs.optim optimizer or gradient transformation"
        )
    partition = _combined_partition([t.partition for t in transforms])

    def init(params: PyTree) -> ChainState:
        return ChainState(tuple(t.init(params) for t in transforms))

    def transform(grads, state: ChainState, params, grad_norm, grad_scale):
        new_states = []
        for t, s in zip(front, state.states, strict=False):
            grads, s, grad_scale = t.update(
                grads, s, params, grad_norm=grad_norm, grad_scale=grad_scale
            )
            new_states.append(s)
        return grads, new_states, grad_scale

    if isinstance(last, GradientTransformation):

        def update_grads(grads, state: ChainState, params, *, grad_norm=None, grad_scale=1.0):
            grads, new_states, grad_scale = transform(grads, state, params, grad_norm, grad_scale)
            grads, s, grad_scale = last.update(
                grads, state.states[-1], params, grad_norm=grad_norm, grad_scale=grad_scale
            )
            return grads, ChainState((*new_states, s)), grad_scale

        return GradientTransformation(init, update_grads, partition)

    def update(
        grads,
        state: ChainState,
        params,
        *,
        donate: bool = False,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
        placement: Placement | None = None,
    ):
        grads, new_states, grad_scale = transform(grads, state, params, grad_norm, grad_scale)
        new_params, s = last.update(
            grads,
            state.states[-1],
            params,
            donate=donate,
            grad_norm=grad_norm,
            grad_scale=grad_scale,
            placement=placement,
        )
        return new_params, ChainState((*new_states, s))

    return Optimizer(init, update, partition, last.elementwise)


def _local_norm(grads: PyTree) -> float:
    ts = leaves(grads)
    if not ts:
        return 0.0
    norms = torch._foreach_norm(ts, 2)
    return float(torch.stack([n.double() for n in norms]).square().sum().sqrt())


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales the gradients by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_``.

    ``norm`` is the global L2 norm that ``train_step`` computes once (every shard and replica,
    padding excluded); on a plain pytree it is the norm of its leaves. ``metrics["grad_norm"]``
    stays the norm before clipping.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")

    def init(params: PyTree) -> ClipState:
        del params
        return ClipState()

    def update(grads, state: ClipState, params, *, grad_norm=None, grad_scale=1.0):
        del params
        if grad_norm is None:
            if any(
                is_per_bucket(x)
                for x in optree.tree_leaves(
                    grads, is_leaf=is_per_bucket, none_is_leaf=False, namespace=NAMESPACE
                )
            ):
                raise ValueError(
                    "clip_by_global_norm: these gradients are shards of a TrainState and no "
                    "global norm was given; use the clip as the first element of the "
                    "state's outermost chain (train_step passes it the global norm)"
                )
            grad_norm = _local_norm(grads)
        norm = grad_scale * float(grad_norm)
        coef = max_norm / (norm + 1e-6) if math.isfinite(norm) else 1.0
        return grads, state, grad_scale * min(coef, 1.0)

    return GradientTransformation(init, update)


def _label_fn(labels: Callable | Mapping) -> Callable[[str, tuple], Hashable]:
    if isinstance(labels, Mapping):
        table = dict(labels)

        def lookup(name: str, shape: tuple) -> Hashable:
            if name not in table:
                raise KeyError(f"multi_transform: labels has no entry for parameter {name!r}")
            return table[name]

        return lookup
    if not callable(labels):
        raise TypeError(
            "multi_transform: labels must be a callable (name, shape) -> label or a "
            f"dict {{name: label}}; got {type(labels).__name__}"
        )
    return lambda name, shape: labels(name, tuple(shape))


def multi_transform(
    optimizers_by_label: Mapping[str, Optimizer],
    labels: Callable[[str, tuple], str] | Mapping[str, str],
) -> Optimizer:
    """A different optimizer per parameter label, e.g. Muon for matrices and AdamW elsewhere.

    Each optimizer sees only its own parameters (the others are None in its tree); its state
    covers them alone. A clip belongs before the multi_transform, in an outer ``chain``.

    Args:
      optimizers_by_label: ``{label: optimizer}`` (string labels: they name checkpoint paths).
      labels: ``(name, shape) -> label`` or ``{name: label}``.
    """
    inner = dict(optimizers_by_label)
    if not inner:
        raise ValueError("multi_transform: give at least one labelled optimizer")
    for label, opt in inner.items():
        if not isinstance(label, str):
            raise TypeError(f"multi_transform: label {label!r} must be a str")
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"multi_transform: {label!r} maps to a {type(opt).__name__}; "
                "expected an optimizer (put gradient transformations in a chain "
                "around the multi_transform)"
            )
    label_fn = _label_fn(labels)

    def checked(name: str, shape: tuple) -> str:
        label = label_fn(name, shape)
        if label not in inner:
            raise KeyError(
                f"multi_transform: parameter {name!r} has label {label!r}; expected "
                f"one of {sorted(inner)}"
            )
        return label

    label_of = per_leaf_rule(checked, "multi_transform labels")

    def partition(name: str, shape: tuple) -> Hashable:
        label = checked(name, shape)
        sub = inner[label].partition
        return (label, sub(name, shape) if sub is not None else None)

    def split(tree: PyTree, params: PyTree):
        """Per label, ``tree`` with the other labels' leaves replaced by None."""
        flat, treedef = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
        tags = iter(label_of(params))
        owner = [None if x is None else next(tags) for x in flat]
        return (
            {
                label: treedef.unflatten(
                    [x if o == label else None for x, o in zip(flat, owner, strict=True)]
                )
                for label in inner
            },
            owner,
            treedef,
        )

    def init(params: PyTree) -> MultiTransformState:
        parts, _, _ = split(params, params)
        return MultiTransformState({label: inner[label].init(parts[label]) for label in inner})

    def update(
        grads,
        state: MultiTransformState,
        params,
        *,
        donate: bool = False,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
        placement: Placement | None = None,
    ):
        del grad_norm  # the global norm is the whole tree's; inner clips see their own part
        g_parts, _, _ = split(grads, params)
        p_parts, owner, treedef = split(params, params)
        new_params, new_state = {}, {}
        for label, opt in inner.items():
            new_p, new_state[label] = opt.update(
                g_parts[label],
                state.inner[label],
                p_parts[label],
                donate=donate,
                grad_scale=grad_scale,
                placement=placement,
            )
            new_params[label] = optree.tree_flatten(new_p, none_is_leaf=True, namespace=NAMESPACE)[
                0
            ]
        merged = [None if o is None else new_params[o][i] for i, o in enumerate(owner)]
        return treedef.unflatten(merged), MultiTransformState(new_state)

    return Optimizer(init, update, partition, all(o.elementwise for o in inner.values()))
