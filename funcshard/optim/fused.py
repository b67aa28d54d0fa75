"""The step of an elementwise rule on fused kernels: :class:`Fused`, the description, and
:func:`fused_step`, the step :func:`funcshard.optim.spec.build` runs for it.

A rule is described by torch's fused kernel over lists of tensors (``kernel``) and the scalars
of the one-pass CPU kernel (``native``, :mod:`funcshard.optim.kernels`). Moments kept in the
params' dtype: leaves are grouped by (device, dtype, weight decay) and each group is stepped by
ONE fused kernel call, so the cost does not grow with Python work per leaf or per label.
Moments stored narrow (bf16, fp16, 8-bit): per buffer, the one-pass CPU kernel where it applies;
else chunks of ``CHUNK`` elements are decoded into fp32 scratch, stepped by the fused kernel
and encoded back: the same bits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch

from funcshard.layout.buckets import scale_index
from funcshard.optim import kernels
from funcshard.optim.moments import CHUNK, MomentFormat, dither_of, granule

if TYPE_CHECKING:
    from funcshard.optim.spec import Buffers, Scalars

__all__ = ["Fused", "fused_step", "VECTOR_BODY"]

# (scalars, weight decay, device, params, grads, *moments): lists of tensors, stepped in place
Kernel = Callable[..., None]


@dataclasses.dataclass(frozen=True, slots=True)
class Fused:
    """An elementwise rule: ``kernel(scalars, wd, device, params, grads, *moments)`` (torch's
    fused kernel on lists of same-device tensors, in place) and ``native(scalars, wd)``, the
    one-pass CPU kernel's arguments (:mod:`funcshard.optim.kernels`)."""

    kernel: Kernel
    native: Callable[[Scalars, float], kernels.Args]


def fused_step(rule: Fused):
    """The ``step`` of :class:`funcshard.optim.spec.Spec` for a fused rule."""

    def step(bufs: Buffers, scalars: Scalars, params, placement) -> None:
        if bufs.narrow:
            for j, (p, g, wd) in enumerate(zip(bufs.params, bufs.grads, bufs.decay, strict=True)):
                states = bufs.states(j)
                if not kernels.step(rule.native(scalars, wd), p, g, states):
                    _chunked(
                        p, g, states, lambda *c, k=wd, d=p.device: rule.kernel(scalars, k, d, *c)
                    )
            return
        columns = (bufs.params, bufs.grads, *bufs.values)
        for (device, _, wd), cols in _kernel_groups(bufs.decay, *columns):
            rule.kernel(scalars, wd, device, *cols)

    return step


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


def in_fp32(columns: list[list[torch.Tensor]]):
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
