"""``sgd`` and ``adamw``: torch.optim's exact rules as pure optimizers on torch's fused kernels.

``init(params)`` is numerically inert (zeros, count 0: no synthetic step, no weight decay).
Leaves are grouped by (device, dtype, rule) and each group is stepped by ONE fused kernel call
over lists of tensors, so the cost does not grow with Python work per leaf or per label. With
``donate=True`` the input params, state and gradient buffers are updated in place and returned
(the caller must treat them as consumed); otherwise the inputs are left untouched.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch

from funcshard.buckets import NAMESPACE, Block, BlockScales, is_per_bucket, scale_index
from funcshard.optim import kernels
from funcshard.optim.base import (
    Mask,
    Optimizer,
    PyTree,
    Schedule,
    as_predicate,
    leaf_params,
    leaves,
    lr_at,
    not_negative,
    uniform,
)
from funcshard.optim.moments import (
    CHUNK,
    EIGHT_BIT,
    MomentFormat,
    block_of,
    check_dtype,
    dither_of,
    granule,
)

if TYPE_CHECKING:
    from funcshard.layout import Placement

__all__ = ["SgdState", "AdamWState", "sgd", "adamw", "per_leaf_rule", "tree_zeros"]


class SgdState(NamedTuple):
    count: int
    momentum: PyTree  # None when momentum == 0, as torch keeps no buffer then
    momentum_scale: PyTree = None  # mu_dtype=torch.int8: the blocks' fp32 scales


class AdamWState(NamedTuple):
    count: int
    mu: PyTree
    nu: PyTree
    mu_scale: PyTree = None  # mu_dtype=torch.int8: the blocks' fp32 scales (BlockScales)
    nu_scale: PyTree = None  # nu_dtype=torch.uint8: likewise


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


def _prepare(grads: PyTree, params: PyTree, donate: bool, grad_scale: float, *states: PyTree):
    """Leaf lists for a step; copies what the kernels write when the caller keeps its inputs."""
    treedef = optree.tree_structure(params, none_is_leaf=False, namespace=NAMESPACE)
    p, g = leaves(params), leaves(grads)
    if len(g) != len(p):
        raise ValueError(f"optimizer update: {len(g)} gradient leaves for {len(p)} params")
    for gi, pi in zip(g, p, strict=True):
        if gi.shape != pi.shape:
            raise ValueError(
                f"optimizer update: a gradient of shape {tuple(gi.shape)} for a "
                f"param of shape {tuple(pi.shape)}"
            )
    cast = [gi if gi.dtype == pi.dtype else gi.to(pi.dtype) for gi, pi in zip(g, p, strict=True)]
    if grad_scale != 1.0 and not donate:  # the scaled kernels write the scaled grads back
        cast = [c.clone() if c is gi else c for c, gi in zip(cast, g, strict=True)]
    if not donate:
        p = [t.clone() for t in p]
    out_states = [leaves(s) if donate else [t.clone() for t in leaves(s)] for s in states]
    return treedef, p, cast, out_states


def _groups(keys: list[Hashable], *columns: list[torch.Tensor]) -> dict[tuple, list[list]]:
    """Splits parallel leaf lists into per-(device, dtype, rule) lists for the fused kernels."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for key, *row in zip(keys, *columns, strict=True):
        cols = groups.setdefault((row[0].device, row[0].dtype, key), [[] for _ in columns])
        for col, t in zip(cols, row, strict=True):
            col.append(t)
    return groups


# The fused CPU kernels run a vector loop over the largest multiple of the vector width and a
# scalar loop over the rest, and the two round differently (measured on torch 2.13, AVX2: an
# AdamW ``exp_avg_sq`` or an SGD momentum element differs by an ulp). Where an element falls
# would then depend on how parameters are packed and sharded. Every tensor handed to a kernel is
# therefore a multiple of VECTOR_BODY elements; a tensor's tail runs in a zero-padded scratch
# of that size, in the same call, and is copied back.
VECTOR_BODY = 64


def _vector_body_only(columns: list[list[torch.Tensor]]):
    """``columns`` (parallel lists: params, grads, states) recut so that every entry's numel is
    a multiple of VECTOR_BODY: a tensor's body as a view, its tail in a zero-padded scratch.
    Returns the kernel's columns and a function that copies the stepped tails back. Zeros step
    to zeros under every rule here (no NaN), so the padding changes nothing."""
    tails = [
        (i, col0.numel() % VECTOR_BODY)
        for i, col0 in enumerate(columns[0])
        if col0.numel() % VECTOR_BODY and all(col[i].is_contiguous() for col in columns)
    ]
    if not tails:
        return columns, lambda: None
    cut = dict(tails)
    out, scratch = [], []
    for col in columns:
        flat = [t.view(-1) if i in cut else t for i, t in enumerate(col)]
        body = [
            t[: t.numel() - cut[i]] if i in cut else t
            for i, t in enumerate(flat)
            if i not in cut or t.numel() > cut[i]
        ]
        pads = []
        for i, n in tails:
            pad = flat[i].new_zeros(VECTOR_BODY)
            pad[:n].copy_(flat[i][-n:])
            pads.append(pad)
        scratch.append((flat, pads))
        out.append(body + pads)

    def write_back() -> None:
        for flat, pads in scratch:
            for (i, n), pad in zip(tails, pads, strict=True):
                flat[i][-n:].copy_(pad[:n])

    return out, write_back


def _kernel_groups(keys: list[Hashable], *columns: list[torch.Tensor]):
    """``_groups`` for one fused call each; on the CPU every element runs in the vector body
    (``_vector_body_only``): the tails are written back once the caller's kernel has run, when
    the loop asks for the next group."""
    for key, cols in _groups(keys, *columns).items():
        write_back = None
        if key[0].type == "cpu":
            cols, write_back = _vector_body_only(cols)
        yield key, cols
        if write_back is not None:
            write_back()


def _in_fp32(columns: list[list[torch.Tensor]]):
    """fp32 copies of reduced-precision CPU columns, and a function that rounds them back.

    torch 2.13's fused CPU SGD leaves bfloat16 / float16 params unchanged in its vector loop
    (its scalar loop, computing in fp32 and rounding once, is right): stepping fp32 copies and
    rounding gives exactly the scalar loop's bits, for every element.
    """
    wide = [[t.float() for t in col] for col in columns]

    def write_back() -> None:
        for col, col32 in zip(columns, wide, strict=True):
            torch._foreach_copy_(col, col32)

    return wide, write_back


def _scale_arg(grad_scale: float, device: torch.device) -> torch.Tensor | None:
    """The fused kernels' ``grad_scale`` (they divide by it), or None for no scaling."""
    if grad_scale == 1.0:
        return None
    # torch.full is a fill kernel; torch.tensor(x, device=cuda) would copy from pageable host
    # memory and wait for the stream.
    return torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)


def _check_stochastic(on: bool, what: str, *dtypes: torch.dtype | None) -> None:
    if on and torch.bfloat16 not in dtypes:
        raise ValueError(
            f"{what}: stochastic_rounding=True rounds bf16 moments; no moment is bf16 "
            f"(got {[str(d) for d in dtypes]})"
        )


def _block_rule(quantized: bool, what: str):
    """``(rule, blocks_of)``: the 8-bit block of a parameter (None when it keeps its master
    dtype, or when nothing is 8-bit), as a partition rule and per leaf of a tree."""
    if not quantized:
        return None, lambda params: [None] * len(leaves(params))
    rule = lambda name, shape: block_of(tuple(shape))
    return rule, per_leaf_rule(rule, f"{what} 8-bit blocks")


def _partition(*rules: Callable[[str, tuple], Hashable] | None):
    """The key of an optimizer's rules: one rule, a tuple of several, or None."""
    rules = tuple(r for r in rules if r is not None)
    if not rules:
        return None
    if len(rules) == 1:
        return rules[0]
    return lambda name, shape: tuple(r(name, shape) for r in rules)


def _decay_rule(weight_decay: float, mask: Mask, what: str):
    decays = as_predicate(mask, what)
    return (lambda name, shape: weight_decay if decays(name, shape) else 0.0), decays


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    mask: Mask = None,
    *,
    mu_dtype: torch.dtype | None = None,
    stochastic_rounding: bool = False,
) -> Optimizer:
    """torch.optim.SGD's rule (dampening 0) as a pure optimizer.

    Args:
      lr: a float or a schedule ``step -> float`` (step = updates done before this one).
      momentum: torch's momentum (a buffer is kept only when > 0).
      weight_decay: L2 penalty added to the gradient, where ``mask`` says so.
      nesterov: Nesterov momentum, as ``torch.optim.SGD(nesterov=True)``.
      mask: which parameters decay: None (all), ``(name, shape) -> bool`` or ``{name: bool}``.
      mu_dtype: the dtype the momentum buffer is stored in (as ``adamw``'s ``mu_dtype``).
      stochastic_rounding: a bf16 momentum buffer is rounded stochastically.

    >>> opt = sgd(0.1, momentum=0.9)
    >>> p = {"w": torch.ones(2)}
    >>> p, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> p["w"].tolist()
    [0.8999999761581421, 0.8999999761581421]
    """
    not_negative("momentum", momentum)
    not_negative("weight_decay", weight_decay)
    if nesterov and momentum <= 0:
        raise ValueError("sgd: nesterov=True needs momentum > 0 (as torch.optim.SGD)")
    decay, decays = _decay_rule(weight_decay, mask, "sgd")
    decay_of = per_leaf_rule(decay, "sgd mask")
    mu_rule = Moments(mu_dtype, "sgd mu_dtype", signed=True, stochastic=stochastic_rounding)
    _check_stochastic(stochastic_rounding, "sgd", mu_dtype)
    narrow_moments = mu_dtype is not None and momentum > 0
    block_rule, blocks_of = _block_rule(narrow_moments and mu_rule.quantized, "sgd")

    def init(params: PyTree) -> SgdState:
        decay_of(params)  # a mask that does not fit the params fails here, not at step 1
        if not narrow_moments:
            return SgdState(count=0, momentum=tree_zeros(params) if momentum else None)
        return SgdState(0, *mu_rule.zeros(params, blocks_of(params)))

    def fused(lr_now: float, grad_scale: float, wd, device, gp, gg, gm) -> None:
        """torch's fused SGD on one group of same-device buffers (gm: [] without momentum)."""
        torch._fused_sgd_(
            gp,
            gg,
            gm,
            weight_decay=wd,
            momentum=momentum,
            lr=lr_now,
            dampening=0.0,
            nesterov=nesterov,
            maximize=False,
            # zero-initialised buffers make step 1 (buf = g) and later steps one formula
            is_first_step=False,
            grad_scale=_scale_arg(grad_scale, device),
            found_inf=None,
        )

    def narrow_update(grads, state: SgdState, params, donate: bool, grad_scale: float):
        lr_now = lr_at(lr, state.count)
        kernel = functools.partial(fused, lr_now, grad_scale)
        native = lambda wd: kernels.sgd_args(lr_now, momentum, wd, nesterov, grad_scale)
        new_p, ((m, m_s),) = _narrow_step(
            params,
            grads,
            [(mu_rule, state.momentum, state.momentum_scale)],
            blocks_of(params),
            decay_of(params),
            donate,
            kernel,
            native,
        )
        return new_p, SgdState(state.count + 1, m, m_s)

    def update(
        grads: PyTree,
        state: SgdState,
        params: PyTree,
        *,
        donate: bool = False,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
        placement: Placement | None = None,
    ):
        if narrow_moments:
            return narrow_update(grads, state, params, donate, grad_scale)
        bufs = (state.momentum,) if momentum else ()
        treedef, p, g, out = _prepare(grads, params, donate, grad_scale, *bufs)
        m = out[0] if momentum else None
        lr_now = lr_at(lr, state.count)
        columns = (p, g, m) if momentum else (p, g)
        for (device, dtype, wd), cols in _kernel_groups(decay_of(params), *columns):
            narrow = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            if narrow:
                cols, write_back = _in_fp32(cols)
            gp, gg, *gm = cols
            fused(lr_now, grad_scale, wd, device, gp, gg, gm[0] if momentum else [])
            if narrow:
                write_back()
        new_m = optree.tree_unflatten(treedef, m) if momentum else None
        return optree.tree_unflatten(treedef, p), SgdState(state.count + 1, new_m)

    return Optimizer(
        init, update, partition=_partition(decays if mask is not None else None, block_rule)
    )


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask = None,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    stochastic_rounding: bool = False,
) -> Optimizer:
    """torch.optim.AdamW's rule as a pure optimizer (fused kernel on CPU and CUDA).

    Args:
      lr: a float or a schedule ``step -> float`` (step = updates done before this one).
      betas, eps: as torch (eps added after the square root, bias correction).
      weight_decay: decoupled weight decay, where ``mask`` says so.
      mask: which parameters decay: None (all), ``(name, shape) -> bool`` or ``{name: bool}``;
        ``fs.optim.decay_mask`` is nanoGPT's rule (matrices and embeddings only).
      mu_dtype, nu_dtype: the dtype the first / second moment is STORED in; None the master
        dtype (torch's bits). ``torch.bfloat16`` / ``torch.float16``: computed in fp32, stored
        narrow. ``torch.int8`` (mu) / ``torch.uint8`` (nu): 8-bit blockwise with fp32 scales
        (:mod:`funcshard.optim.moments`; parameters :func:`~funcshard.optim.moments.block_of`
        gives no block keep the master dtype). An fp16 second moment flushes values below
        6e-8 (squared gradients under 2.4e-4) to zero: prefer bf16.
      stochastic_rounding: bf16 moments are rounded stochastically (dithered) instead of to
        nearest.

    >>> opt = adamw(0.1)
    >>> p = {"w": torch.zeros(2)}
    >>> p, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> [round(x, 4) for x in p["w"].tolist()], s.count
    ([-0.1, -0.1], 1)
    """
    beta1, beta2 = betas
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"adamw: betas must lie in [0, 1), got {betas}")
    not_negative("eps", eps)
    not_negative("weight_decay", weight_decay)
    decay, decays = _decay_rule(weight_decay, mask, "adamw")
    decay_of = per_leaf_rule(decay, "adamw mask")
    mu_rule = Moments(mu_dtype, "adamw mu_dtype", signed=True, stochastic=stochastic_rounding)
    nu_rule = Moments(nu_dtype, "adamw nu_dtype", signed=False, stochastic=stochastic_rounding)
    _check_stochastic(stochastic_rounding, "adamw", mu_dtype, nu_dtype)
    narrow = mu_dtype is not None or nu_dtype is not None
    block_rule, blocks_of = _block_rule(mu_rule.quantized or nu_rule.quantized, "adamw")

    def init(params: PyTree) -> AdamWState:
        decay_of(params)  # a mask that does not fit the params fails here, not at step 1
        if not narrow:
            return AdamWState(count=0, mu=tree_zeros(params), nu=tree_zeros(params))
        blocks = blocks_of(params)
        mu, mu_scale = mu_rule.zeros(params, blocks)
        nu, nu_scale = nu_rule.zeros(params, blocks)
        return AdamWState(0, mu, nu, mu_scale, nu_scale)

    def fused(count: int, lr_now: float, steps: dict, grad_scale: float, wd, device, *bufs):
        """torch's fused AdamW on one group of same-device buffers (p, g, mu, nu lists)."""
        if device not in steps:
            steps[device] = torch.full((), float(count + 1), dtype=torch.float32, device=device)
        gp, gg, gm, gv = bufs
        torch._fused_adamw_(
            gp,
            gg,
            gm,
            gv,
            [],
            [steps[device]] * len(gp),
            amsgrad=False,
            lr=lr_now,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            maximize=False,
            grad_scale=_scale_arg(grad_scale, device),
            found_inf=None,
        )

    def narrow_update(grads, state: AdamWState, params, donate: bool, grad_scale: float):
        lr_now = lr_at(lr, state.count)
        kernel = functools.partial(fused, state.count, lr_now, {}, grad_scale)
        native = lambda wd: kernels.adamw_args(
            state.count, lr_now, beta1, beta2, eps, wd, grad_scale
        )
        new_p, ((mu, mu_s), (nu, nu_s)) = _narrow_step(
            params,
            grads,
            [(mu_rule, state.mu, state.mu_scale), (nu_rule, state.nu, state.nu_scale)],
            blocks_of(params),
            decay_of(params),
            donate,
            kernel,
            native,
        )
        return new_p, AdamWState(state.count + 1, mu, nu, mu_s, nu_s)

    def update(
        grads: PyTree,
        state: AdamWState,
        params: PyTree,
        *,
        donate: bool = False,
        grad_norm: float | None = None,
        grad_scale: float = 1.0,
        placement: Placement | None = None,
    ):
        if narrow:
            return narrow_update(grads, state, params, donate, grad_scale)
        treedef, p, g, (mu, nu) = _prepare(grads, params, donate, grad_scale, state.mu, state.nu)
        lr_now, steps = lr_at(lr, state.count), {}
        for (device, _, wd), bufs in _kernel_groups(decay_of(params), p, g, mu, nu):
            fused(state.count, lr_now, steps, grad_scale, wd, device, *bufs)
        unflat = lambda xs: optree.tree_unflatten(treedef, xs)
        return unflat(p), AdamWState(state.count + 1, unflat(mu), unflat(nu))

    return Optimizer(
        init, update, partition=_partition(decays if mask is not None else None, block_rule)
    )


# --- moments stored narrow (mu_dtype / nu_dtype) ---------------------------------------------
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

    def zeros(self, params: PyTree, blocks: list[Block | None]) -> tuple[PyTree, PyTree]:
        """``(values, scales)`` trees of a zero moment (``scales`` None unless 8-bit)."""
        if self.dtype is None:
            return tree_zeros(params), None
        fmts = iter(blocks)

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
            _scales_of,
            built,
            is_leaf=_is_built,
            none_is_leaf=False,
            namespace=NAMESPACE,
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


def _narrow_step(
    params: PyTree,
    grads: PyTree,
    moments: list[tuple[Moments, PyTree, PyTree]],
    blocks: list[int | None],
    keys: list[Hashable],
    donate: bool,
    kernel: Callable[..., None],
    native: Callable[[Hashable], kernels.Args] | None = None,
) -> tuple[PyTree, list[tuple[PyTree, PyTree]]]:
    """One step with moments stored narrow. Per buffer, the one-pass CPU kernel
    (:mod:`funcshard.optim.kernels`, given its scalars ``native(key)``) where it applies; else
    chunks of ``CHUNK`` elements are decoded into fp32 scratch, stepped by
    ``kernel(key, device, params, grads, *moments)`` (lists of one tensor each, fp32) and
    encoded back: the same bits. Returns the new params and, per moment, its new
    ``(values, scales)``."""
    flat_p, treedef = _flat(params)
    flat_g = _flat(grads)[0]
    keep = [i for i, x in enumerate(flat_p) if x is not None]
    if len(flat_g) != len(flat_p):
        raise ValueError(f"optimizer update: {len(flat_g)} gradient leaves for {len(flat_p)}")
    cols = []
    for rule, values, scales in moments:
        vals, vdef = _flat(values)
        scs, sdef = _flat(scales) if scales is not None else ([None] * len(vals), None)
        if not donate:
            vals = [None if t is None else t.clone() for t in vals]
            scs = [None if t is None else t.clone() for t in scs]
        cols.append((rule, vals, vdef, scs, sdef, scales is not None))
    out_p = list(flat_p)
    for j, i in enumerate(keep):
        p, g = flat_p[i], flat_g[i]
        if g.shape != p.shape:
            raise ValueError(
                f"optimizer update: a gradient of shape {tuple(g.shape)} for a "
                f"param of shape {tuple(p.shape)}"
            )
        if g.dtype != p.dtype:
            g = g.to(p.dtype)
        elif not donate:  # the scaled kernels write the scaled grads back
            g = g.clone()
        if not donate:
            p = p.clone()
        out_p[i] = p
        states = [
            (rule.format(blocks[j], p.dtype), vals[i], scs[i]) for rule, vals, _, scs, _, _ in cols
        ]
        if native is None or not kernels.step(native(keys[j]), p, g, states):
            _chunked(p, g, states, lambda *c, k=keys[j], d=p.device: kernel(k, d, *c))
    new_moments = [
        (vdef.unflatten(vals), sdef.unflatten(scs) if has else None)
        for _, vals, vdef, scs, sdef, has in cols
    ]
    return treedef.unflatten(out_p), new_moments


def _scale_range(fmt: MomentFormat, scales: torch.Tensor | None, start: int, stop: int):
    """The scales of elements ``[start, stop)`` (block boundaries) of a moment."""
    if scales is None:
        return None
    return scales[scale_index(fmt.block, start) : scale_index(fmt.block, stop)]


def _chunked(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[tuple[MomentFormat, torch.Tensor, torch.Tensor | None]],
    kernel: Callable[..., None],
) -> None:
    """Steps one buffer in place, chunk by chunk (decode, fused fp32 kernel, encode)."""
    n = param.numel()
    p, g = param.view(-1), grad.reshape(-1)
    wide = p.dtype != torch.float32
    unit = math.lcm(*[granule(fmt.block) for fmt, _, _ in states])
    chunk = max(1, CHUNK // unit) * unit  # whole blocks (whole rows of ragged blocks)
    width = min(chunk, n)
    scratch = [torch.empty(width, dtype=torch.float32, device=p.device) for _ in states]
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        xs = []
        for (fmt, values, scales), buf in zip(states, scratch, strict=True):
            sc = _scale_range(fmt, scales, start, stop)
            xs.append(fmt.decode(values.view(-1)[start:stop], sc, buf[: stop - start]))
        pc, gc = p[start:stop], g[start:stop]
        p32 = pc.float() if wide else pc
        g32 = gc.float() if gc.dtype != torch.float32 else gc
        columns = [[p32], [g32], *[[x] for x in xs]]
        write_back = None
        if p.device.type == "cpu":
            columns, write_back = _vector_body_only(columns)
        kernel(*columns)
        if write_back is not None:
            write_back()
        if wide:
            pc.copy_(p32)
        dither = dither_of(p32, g32) if any(f.stochastic for f, _, _ in states) else None
        for (fmt, values, scales), x in zip(states, xs, strict=True):
            sc = _scale_range(fmt, scales, start, stop)
            fmt.encode(x, values.view(-1)[start:stop], sc, dither if fmt.stochastic else None)
