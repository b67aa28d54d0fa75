"""One description of an optimizer rule (:class:`Spec`) and the one builder of them (:func:`build`).

``sgd``, ``adamw`` and ``muon`` say only what differs: their state's moment fields and how each
is stored (:class:`Moments`), where weight decay applies, and the ``step`` that updates one
step's buffers in place. The builder does the rest, the same way for every rule:

* ``init``: a zero moment per field (narrow or 8-bit storage as :class:`Moments` says), count 0;
* ``update``: the step's leaves (:class:`Buffers`: checked against the params, cast to their
  dtypes, copied unless donated), its scalars (:class:`Scalars`), the rule's step, and the new
  state rebuilt around the stepped buffers;
* ``partition``: the mask (where it was given) and the 8-bit block of every parameter, so a
  buffer never packs two rules.

The state is ``state(count=, <field>=, <field>_scale=)`` for every moment field (``mu``, ``nu``,
``momentum``); ``<field>_scale`` holds the 8-bit blocks' scales (None otherwise), and a field whose
rule is None (SGD without momentum) stays None.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch

from funcshard.layout.buckets import NAMESPACE, Block, BlockScales, is_per_bucket
from funcshard.optim.base import (
    Mask,
    Optimizer,
    PyTree,
    Schedule,
    as_predicate,
    leaf_params,
    leaves,
    lr_at,
    uniform,
)
from funcshard.optim.moments import EIGHT_BIT, MomentFormat, block_of, check_dtype

if TYPE_CHECKING:
    from funcshard.layout.layout import Placement

__all__ = ["Spec", "build", "Buffers", "Scalars", "Moments", "per_leaf_rule", "tree_zeros"]


def tree_zeros(params: PyTree) -> PyTree:
    return optree.tree_map(torch.zeros_like, params, none_is_leaf=False, namespace=NAMESPACE)


def per_leaf_rule(rule: Callable[[str, tuple], Hashable], what: str):
    """``params -> [rule value per leaf]``, computed once per tree structure and shapes.

    The rule's answer depends only on static metadata (names and shapes), so a step looks it up
    instead of calling the rule once per parameter.
    """
    cache: dict[Any, list[Hashable]] = {}

    def values(params: PyTree) -> list[Hashable]:
        flat, treedef = optree.tree_flatten(params, none_is_leaf=False, namespace=NAMESPACE)
        key = (treedef, tuple(tuple(t.shape) for t in flat))
        if key not in cache:
            cache[key] = [uniform(rule, pairs, what) for pairs in leaf_params(params)]
        return cache[key]

    return values


def check_stochastic(on: bool, what: str, *dtypes: torch.dtype | None) -> None:
    if on and torch.bfloat16 not in dtypes:
        raise ValueError(
            f"{what}: stochastic_rounding=True rounds bf16 moments; no moment is bf16 "
            f"(got {[str(d) for d in dtypes]})"
        )


class Scalars:
    """What one step's kernels read besides the buffers: the count of updates done before it,
    the learning rate at that count and the factor the applied gradients are the grads times."""

    __slots__ = ("count", "lr", "grad_scale", "_steps")

    def __init__(self, count: int, lr: float, grad_scale: float) -> None:
        self.count, self.lr, self.grad_scale = count, lr, grad_scale
        self._steps: dict[torch.device, torch.Tensor] = {}

    def step_tensor(self, device: torch.device) -> torch.Tensor:
        """``count + 1`` as an fp32 scalar on ``device`` (made once per step and device)."""
        if device not in self._steps:
            self._steps[device] = torch.full(
                (), float(self.count + 1), dtype=torch.float32, device=device
            )
        return self._steps[device]

    def grad_scale_arg(self, device: torch.device) -> torch.Tensor | None:
        """The fused kernels' ``grad_scale`` (they divide by it), or None for no scaling."""
        if self.grad_scale == 1.0:
            return None
        # torch.full is a fill kernel; torch.tensor(x, device=cuda) would copy from pageable
        # host memory and wait for the stream.
        return torch.full((), 1.0 / self.grad_scale, dtype=torch.float32, device=device)


class Moments:
    """The storage rule of one moment of an optimizer (``mu_dtype=`` / ``nu_dtype=``).

    ``dtype`` None keeps the master dtype (the plain path, torch's bits). Under an 8-bit dtype a
    parameter that :func:`funcshard.optim.moments.block_of` gives no block keeps the master
    dtype; the others get int8 / uint8 values and a :class:`BlockScales` part.
    """

    def __init__(self, dtype: torch.dtype | None, what: str, *, signed: bool, stochastic: bool):
        check_dtype(dtype, what, signed=signed)
        self.dtype, self.stochastic = dtype, stochastic and dtype == torch.bfloat16

    @property
    def quantized(self) -> bool:
        return self.dtype in EIGHT_BIT

    def format(self, block: Block | None, master: torch.dtype) -> MomentFormat:
        if self.dtype is None or (self.quantized and block is None):
            return MomentFormat(master)
        return MomentFormat(self.dtype, block if self.quantized else None, self.stochastic)

    def zeros(self, params: PyTree, blocks: list[Block | None] | None) -> tuple[PyTree, PyTree]:
        """``(values, scales)`` trees of a zero moment (``scales`` None unless 8-bit); ``blocks``
        per leaf, None when nothing is 8-bit."""
        if self.dtype is None:
            return tree_zeros(params), None
        fmts = iter(blocks) if blocks is not None else itertools.repeat(None)

        def make(t: torch.Tensor) -> _Built:
            fmt = self.format(next(fmts), t.dtype)
            return _Built(*fmt.zeros(t), fmt.block)

        def part(x: Any) -> Any:
            if is_per_bucket(x):
                pairs = [None if t is None else make(t) for t in x]
                return (x.with_entries(None if q is None else q[0] for q in pairs), pairs)
            return make(x)

        built = optree.tree_map(
            part, params, is_leaf=is_per_bucket, none_is_leaf=False, namespace=NAMESPACE
        )
        values = optree.tree_map(
            lambda x: x[0], built, is_leaf=_is_built, none_is_leaf=False, namespace=NAMESPACE
        )
        if not self.quantized:
            return values, None
        scales = optree.tree_map(
            _scales_of, built, is_leaf=_is_built, none_is_leaf=False, namespace=NAMESPACE
        )
        return values, scales


class _Built(NamedTuple):
    """A zero moment of one tensor: values, scales (8-bit) and the block they were cut by."""

    values: torch.Tensor
    scales: torch.Tensor | None
    block: Block | None


def _is_built(x: Any) -> bool:
    return isinstance(x, _Built) or (type(x) is tuple and len(x) == 2 and not is_per_bucket(x))


def _scales_of(x: Any) -> Any:
    if isinstance(x, _Built):
        return x.scales
    values, built = x  # a PerBucket part: (values part, [_Built | None])
    blocks = [None if q is None or q.scales is None else q.block for q in built]
    return BlockScales([None if q is None else q.scales for q in built], values.members, blocks)


def _flat(tree: PyTree) -> tuple[list, Any]:
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


@dataclasses.dataclass(frozen=True, slots=True)
class Buffers:
    """One step's leaves (the params' non-None leaves, in order), stepped in place.

    ``params`` and every moment's ``values`` / ``scales`` are the state's own tensors under
    ``donate=True``, copies otherwise; ``grads`` are in the params' dtypes, and a step may write
    the scaled gradients into them (copies when ``grad_scale != 1`` and not donated). ``decay``
    is the weight decay of each leaf.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    decay: list[float]
    rules: tuple[Moments, ...]  # per kept moment field
    values: list[list[torch.Tensor]]  # per kept moment field, per leaf
    scales: list[list[torch.Tensor | None]]
    blocks: list[Block | None] | None  # per leaf (None: nothing is 8-bit)

    @property
    def narrow(self) -> bool:
        """Whether a moment is stored in another dtype than the params' (bf16, 8-bit...)."""
        return any(rule.dtype is not None for rule in self.rules)

    def states(self, j: int) -> list[tuple[MomentFormat, torch.Tensor, torch.Tensor | None]]:
        """Leaf ``j``'s moments: per field its format, stored values and (8-bit) scales."""
        block = None if self.blocks is None else self.blocks[j]
        master = self.params[j].dtype
        return [
            (rule.format(block, master), values[j], scales[j])
            for rule, values, scales in zip(self.rules, self.values, self.scales, strict=True)
        ]


def _copies(xs: list, donate: bool) -> list:
    return xs if donate else [None if t is None else t.clone() for t in xs]


def _leaves_of(what: str, grads: PyTree, params: PyTree, donate: bool, grad_scale: float):
    """``(flat params, treedef, kept indices, params, grads)`` of a step, checked and copied."""
    flat_p, treedef = _flat(params)
    keep = [i for i, x in enumerate(flat_p) if x is not None]
    g = leaves(grads)
    if len(g) != len(keep):
        raise ValueError(f"{what} update: {len(g)} gradient leaves for {len(keep)} params")
    p = [flat_p[i] for i in keep]
    for j, (gi, pi) in enumerate(zip(g, p, strict=True)):
        if gi.shape != pi.shape:
            names = [n for n, _ in leaf_params(params)[j]]
            raise ValueError(
                f"{what} update: a gradient of shape {tuple(gi.shape)} for {names} of shape "
                f"{tuple(pi.shape)}"
            )
    cast = [gi if gi.dtype == pi.dtype else gi.to(pi.dtype) for gi, pi in zip(g, p, strict=True)]
    if grad_scale != 1.0 and not donate:  # the scaled kernels write the scaled grads back
        cast = [c.clone() if c is gi else c for c, gi in zip(cast, g, strict=True)]
    return flat_p, treedef, keep, _copies(p, donate), cast


@dataclasses.dataclass(frozen=True)
class Spec:
    """An optimizer rule, by what differs from the others.

    ``moments`` maps each moment field of ``state`` to its storage rule (None: the field is
    kept None); ``step(buffers, scalars, params, placement)`` updates the buffers in place;
    ``check(params)`` rejects params the rule cannot step (at init and every update).
    """

    what: str
    lr: float | Schedule
    state: Callable[..., Any]
    moments: dict[str, Moments | None]
    step: Callable[[Buffers, Scalars, PyTree, Placement | None], None]
    weight_decay: float = 0.0
    mask: Mask = None
    check: Callable[[PyTree], None] | None = None
    elementwise: bool = True


def _block_rule(quantized: bool, what: str):
    """``(rule, blocks_of)``: the 8-bit block of a parameter (None when it keeps its master
    dtype, or when nothing is 8-bit), as a partition rule and per leaf of a tree."""
    if not quantized:
        return None, lambda params: None
    rule = lambda name, shape: block_of(shape if isinstance(shape, tuple) else tuple(shape))
    return rule, per_leaf_rule(rule, f"{what} 8-bit blocks")


def _partition(*rules: Callable[[str, tuple], Hashable] | None):
    """The key of an optimizer's rules: one rule, a tuple of several, or None."""
    rules = tuple(r for r in rules if r is not None)
    if not rules:
        return None
    if len(rules) == 1:
        return rules[0]
    return lambda name, shape: tuple(r(name, shape) for r in rules)


def build(spec: Spec) -> Optimizer:
    """The optimizer ``spec`` describes (see the module docstring)."""
    decays = as_predicate(spec.mask, spec.what)
    wd = spec.weight_decay
    decay_of = per_leaf_rule(lambda n, s: wd if decays(n, s) else 0.0, f"{spec.what} mask")
    kept = {f: rule for f, rule in spec.moments.items() if rule is not None}
    block_rule, blocks_of = _block_rule(any(r.quantized for r in kept.values()), spec.what)

    def init(params: PyTree) -> Any:
        if spec.check is not None:
            spec.check(params)
        decay_of(params)  # a mask that does not fit the params fails here, not at step 1
        blocks = blocks_of(params)
        return _state(spec, 0, {f: rule.zeros(params, blocks) for f, rule in kept.items()})

    def update(
        grads: PyTree,
        state: Any,
        params: PyTree,
        *,
        donate: bool = False,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
        placement: Placement | None = None,
    ):
        if spec.check is not None:
            spec.check(params)
        flat_p, treedef, keep, p, g = _leaves_of(spec.what, grads, params, donate, grad_scale)
        fields = [_Field.of(spec.what, state, f, flat_p, keep, donate) for f in kept]
        bufs = Buffers(
            p,
            g,
            decay_of(params),
            tuple(kept.values()),
            [f.values for f in fields],
            [f.scales for f in fields],
            blocks_of(params),
        )
        scalars = Scalars(state.count, lr_at(spec.lr, state.count), grad_scale)
        spec.step(bufs, scalars, params, placement)
        new = {name: f.tree(flat_p) for name, f in zip(kept, fields, strict=True)}
        return _rebuild(treedef, p, flat_p), _state(spec, state.count + 1, new)

    partition = _partition(decays if spec.mask is not None else None, block_rule)
    return Optimizer(init, update, partition=partition, elementwise=spec.elementwise)


def _state(spec: Spec, count: int, moments: dict[str, tuple[PyTree, PyTree]]) -> Any:
    """``spec.state`` of ``count`` and every moment field's ``(values, scales)`` trees; a field
    missing from ``moments`` (its rule keeps none) and its scales are None."""
    absent = (None, None)
    return spec.state(
        count=count,
        **{f: moments.get(f, absent)[0] for f in spec.moments},
        **{f"{f}_scale": moments.get(f, absent)[1] for f in spec.moments},
    )


class _Field(NamedTuple):
    """One moment field of a state as a step's leaves (copies unless donated) and the tree
    definitions that rebuild it."""

    values: list[torch.Tensor]
    values_def: Any
    scales: list[torch.Tensor | None]
    scales_def: Any  # None: the field has no scales

    @staticmethod
    def of(what: str, state: Any, field: str, flat_p: list, keep: list[int], donate: bool):
        vals, vdef = optree.tree_flatten(
            getattr(state, field), none_is_leaf=False, namespace=NAMESPACE
        )
        if len(vals) != len(keep):
            raise ValueError(f"{what} update: {len(vals)} {field} leaves for {len(keep)} params")
        tree = getattr(state, f"{field}_scale")
        flat_s, sdef = _flat(tree) if tree is not None else ([None] * len(flat_p), None)
        if len(flat_s) != len(flat_p):
            raise ValueError(
                f"{what} update: {field}_scale has {len(flat_s)} leaves for {len(flat_p)} params"
            )
        scales = _copies([flat_s[i] for i in keep], donate)
        return _Field(_copies(vals, donate), vdef, scales, sdef)

    def tree(self, flat_p: list) -> tuple[PyTree, PyTree]:
        """The stepped ``(values, scales)`` trees."""
        return self.values_def.unflatten(self.values), _rebuild(
            self.scales_def, self.scales, flat_p
        )


def _rebuild(treedef: Any, kept: list, flat: list) -> PyTree:
    """The tree of ``treedef`` (flattened with None leaves) with ``kept`` at the non-None
    leaves of ``flat`` (the params), None elsewhere; None without a treedef."""
    if treedef is None:
        return None
    it = iter(kept)
    return treedef.unflatten([None if x is None else next(it) for x in flat])
