"""The optimizer protocol and what every rule shares: per-parameter rules on flat buffers.

An :class:`Optimizer` is a pure ``init``/``update`` pair (:class:`InitFn`, :class:`UpdateFn`).
UNLIKE OPTAX, ``update`` returns the NEW PARAMS, not updates to add: ``update(grads, state,
params, *, donate=False, grad_norm=None, grad_scale=1.0, placement=None) -> (new_params,
new_state)``. The fused kernels underneath (torch's ``_fused_adamw_``, ``_fused_sgd_``) write
the parameters in place, and returning updates would cost a pass over memory of its own.
The gradients it applies are ``grad_scale * grads``, the factor folded into the fused kernel
(so a clip costs no pass of its own). ``grad_norm`` is the global L2 norm of ``grads`` when the
caller knows it (``train_step`` does: the norm over every shard and replica); a clip uses it
instead of the local leaves' norm. ``placement`` (a :class:`funcshard.layout.layout.Placement`,
given with the buffers of a TrainState) says where every row of the parameters lives; elementwise
rules ignore it, a matrix rule (``muon``) uses it to assemble whole matrices. An optimizer
whose update is not elementwise says so (``elementwise=False``): the offloaded step then never
splits its buffers into blocks.

A :class:`GradientTransformation` maps gradients to gradients; ``chain`` puts any number of them
before one optimizer. Its ``update`` (:class:`TransformFn`) returns ``(grads, new_state,
grad_scale)``: a transform that only scales (a clip) returns the grads untouched and the new
factor.

Rules are per parameter: ``mask(name, shape)`` and ``labels(name, shape)``. On a plain pytree a
leaf's name is its path joined with "."; inside a TrainState the leaves are per-bucket flat
buffers (:class:`funcshard.layout.buckets.PerBucket`) and a rule is asked about every parameter a
buffer packs. ``partition(name, shape)`` is the key of an optimizer's rules: funcshard never
packs parameters with different keys into one bucket, so one buffer always has one rule, and
buffers with the same rule share one fused kernel call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import optree
import torch

from funcshard.layout.buckets import NAMESPACE, Members

if TYPE_CHECKING:
    from funcshard.layout.layout import Placement

__all__ = [
    "Optimizer",
    "GradientTransformation",
    "InitFn",
    "UpdateFn",
    "TransformFn",
    "Schedule",
    "Mask",
    "Partition",
    "leaf_params",
    "as_predicate",
    "uniform",
]

PyTree = Any
Schedule = Callable[[int], float]
Mask = Callable[[str, tuple], bool] | Mapping[str, bool] | None
Partition = Callable[[str, tuple], Hashable]
ParamPairs = tuple[tuple[str, tuple[int, ...]], ...]


class InitFn(Protocol):
    """``init(params) -> state``: numerically inert (zeros, count 0; no synthetic step)."""

    def __call__(self, params: PyTree, /) -> Any: ...


class UpdateFn(Protocol):
    """``update(grads, state, params, *, ...) -> (new_params, new_state)``.

    Returns the NEW PARAMS (not optax's updates): the fused kernels write them in place.

    Args:
      grads: gradients, the structure of ``params``.
      state: what ``init`` (or the last ``update``) returned.
      params: the current params.
      donate: True lets the update write ``params``, ``state`` and ``grads`` in place (the
        caller treats them as consumed); False leaves every input untouched.
      grad_norm: the global L2 norm of ``grads`` when the caller knows it (for a clip).
      grad_scale: the factor the applied gradients are ``grads`` times (folded into the kernel).
      placement: where the rows of a TrainState's flat buffers live (for matrix rules).
    """

    def __call__(
        self,
        grads: PyTree,
        state: Any,
        params: PyTree,
        /,
        *,
        donate: bool = False,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
        placement: Placement | None = None,
    ) -> tuple[PyTree, Any]: ...


class TransformFn(Protocol):
    """A gradient transformation's ``update(grads, state, params, *, grad_norm, grad_scale) ->
    (grads, new_state, grad_scale)``."""

    def __call__(
        self,
        grads: PyTree,
        state: Any,
        params: PyTree,
        /,
        *,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
    ) -> tuple[PyTree, Any, float]: ...


class Optimizer(NamedTuple):
    """A pure optimizer: ``init`` (:class:`InitFn`), ``update`` (:class:`UpdateFn`, which
    returns new params, unlike optax); ``partition(name, shape)`` the key of its
    per-parameter rules (None: one rule for every parameter); ``elementwise`` False when an
    element's update reads other elements (a matrix orthogonalization)."""

    init: InitFn
    update: UpdateFn
    partition: Partition | None = None
    elementwise: bool = True


class GradientTransformation(NamedTuple):
    """Gradients to gradients: ``init`` (:class:`InitFn`) and ``update``
    (:class:`TransformFn`). Put before an optimizer with ``chain``."""

    init: InitFn
    update: TransformFn
    partition: Partition | None = None


def leaves(tree: PyTree) -> list[torch.Tensor]:
    return optree.tree_leaves(tree, none_is_leaf=False, namespace=NAMESPACE)


def leaf_params(tree: PyTree) -> list[ParamPairs]:
    """Per leaf of ``tree``, the ``(name, shape)`` of every parameter it holds.

    A leaf under a ``PerBucket`` holds its bucket's members; any other leaf is one parameter
    named by its path.
    """
    paths, values, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False, namespace=NAMESPACE)
    out = []
    for path, value in zip(paths, values, strict=True):
        if path and isinstance(path[-1], Members):
            out.append(path[-1].pairs())
        else:
            out.append(((".".join(map(str, path)), tuple(value.shape)),))
    return out


def as_predicate(mask: Mask, what: str) -> Callable[[str, tuple], bool]:
    """``mask`` as a ``(name, shape) -> bool``; a dict must name every parameter it is asked."""
    if mask is None:
        return lambda name, shape: True
    if isinstance(mask, Mapping):
        table = dict(mask)

        def lookup(name: str, shape: tuple) -> bool:
            if name not in table:
                raise KeyError(
                    f"{what}: the mask has no entry for parameter {name!r} "
                    f"(it names {sorted(table)[:8]}{'...' if len(table) > 8 else ''})"
                )
            return bool(table[name])

        return lookup
    if not callable(mask):
        raise TypeError(
            f"{what}: mask must be None, a callable (name, shape) -> bool or a "
            f"dict {{name: bool}}; got {type(mask).__name__}"
        )
    return lambda name, shape: bool(mask(name, tuple(shape)))


def uniform(rule: Callable[[str, tuple], Any], params: ParamPairs, what: str) -> Any:
    """The one value ``rule`` gives every parameter of a buffer (they must agree)."""
    values = {name: rule(name, shape) for name, shape in params}
    distinct = set(values.values())
    if len(distinct) > 1:
        raise ValueError(
            f"{what}: parameters {sorted(values)} share one flat buffer but get "
            f"different rules {values}; build the state with fs.init(model, opt, "
            "...) for this optimizer, which keeps rules in separate buckets"
        )
    return distinct.pop()


def lr_at(lr: float | Schedule, count: int) -> float:
    return float(lr(count)) if callable(lr) else float(lr)


def not_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
