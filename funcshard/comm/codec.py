"""The 8-bit blockwise wire formats: encode and decode (pure tensors, no groups).

A wire format (the ``dtype`` argument) is either a floating dtype (bf16, fp16, ...: the values
cast to it) or ``torch.int8`` / ``torch.float8_e4m3fn``: blockwise scaled. A row of a parameter
(the product of its dims after the first) is cut into blocks of :data:`BLOCK` consecutive
elements, the last one shorter, so a block never crosses a row (:class:`Blocks`). Each block
travels as its fp32 scale ``s`` (the block's absmax) and one byte per element: int8
``round(x * 127 / s)``, fp8 ``fp8(x * 448 / s)``; it comes back as ``q * (s / 127)`` (or
``/ 448``). A row of one element (a 1-D or 0-d parameter) is a block of one whose value is its
own scale: it travels exactly, as 4 bytes, and no value byte. Everything an element's bits
depend on is in its own row, so a row quantizes to the same bits on every layout (what
``deterministic=True`` needs of ``param_comm_dtype``). A section travels as one byte buffer:
its scales (fp32), then its values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

__all__ = [
    "BLOCK",
    "EIGHT_BIT",
    "Blocks",
    "blocks",
    "encode",
    "decode",
    "roundtrip",
    "pack",
    "unpack",
    "check",
]

BLOCK = 256  # elements per scale at most (ZeRO++ qwZ, bitsandbytes, torchao)
EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)
_TOP = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest value a byte holds
_SCALE = 4  # bytes of one fp32 scale
_TINY, _UNTINY = 2.0**-64, 2.0**64  # blocks with an absmax below _TINY are coded times _UNTINY


# --- the blocks of a flat section ------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """Blocks of one shape in a section: ``uniform`` (``count`` contiguous blocks of ``width``),
    ``ragged`` (``count`` rows of ``width`` > BLOCK elements, not a multiple of BLOCK: full
    blocks, then a shorter tail) or ``exact`` (``count`` rows of one element)."""

    kind: str
    count: int
    width: int
    offset: int  # first element
    value: int  # first value byte
    scale: int  # first scale

    @property
    def scales(self) -> int:
        return self.count * (self.width // BLOCK + 1) if self.kind == "ragged" else self.count


class Blocks:
    """The row-local blocks of a flat section: segments of ``(rows, row_numel)`` back to back.

    >>> b = Blocks([(3, 600), (5, 1)])  # 3 rows of 256 + 256 + 88, then 5 one-element rows
    >>> b.numel, b.count, b.nbytes  # 1805 elements, 9 + 5 scales, 9 * 4 + 1800 + 5 * 4 bytes
    (1805, 14, 1856)
    """

    def __init__(self, segments: Sequence[tuple[int, int]]) -> None:
        self.segments = tuple((int(r), int(w)) for r, w in segments if r and w)
        runs: list[_Run] = []
        offset = value = scale = 0
        for rows, width in self.segments:
            if width == 1:
                run = _Run("exact", rows, 1, offset, value, scale)
            elif width <= BLOCK or width % BLOCK == 0:
                size = min(width, BLOCK)
                count = rows * width // size
                last = runs[-1] if runs else None
                if last is not None and last.kind == "uniform" and last.width == size:
                    runs[-1] = dataclasses.replace(last, count=last.count + count)
                    run = None
                else:
                    run = _Run("uniform", count, size, offset, value, scale)
            else:
                run = _Run("ragged", rows, width, offset, value, scale)
            if run is not None:
                runs.append(run)
            n = rows * width
            offset += n
            value += 0 if width == 1 else n
            scale += rows if width <= BLOCK else rows * -(-width // BLOCK)
        self.runs = tuple(runs)
        self.numel, self.values, self.count = offset, value, scale

    @property
    def nbytes(self) -> int:
        """Bytes of the section on an 8-bit wire: its scales and its value bytes."""
        return _SCALE * self.count + self.values

    def split(self, parts: int) -> list[tuple[int, Blocks]]:
        """``parts`` consecutive pieces ``(first element, blocks)`` covering the section, of
        about equal bytes on the wire: cut at the first block boundary at or after each
        ``k * nbytes / parts`` bytes (a piece may be empty). Cutting inside a row keeps its
        blocks, since the cut falls on a block boundary."""
        cuts = [self._boundary(-(-k * self.nbytes // parts)) for k in range(1, parts)]
        bounds = [0, *cuts, self.numel]
        return [(a, blocks(self._piece(a, b))) for a, b in zip(bounds, bounds[1:], strict=False)]

    def _boundary(self, target: int) -> int:
        """The element at the first block boundary at or after ``target`` wire bytes."""
        offset = at_bytes = 0
        for rows, width in self.segments:
            per_block = _SCALE + min(width, BLOCK) if width > 1 else _SCALE
            row_bytes = _SCALE if width == 1 else width + _SCALE * -(-width // BLOCK)
            if target < at_bytes + rows * row_bytes:
                row, rest = divmod(target - at_bytes, row_bytes)
                block = -(-rest // per_block)  # full blocks before the cut
                at = min(block * BLOCK, width)
                return offset + row * width + at
            offset += rows * width
            at_bytes += rows * row_bytes
        return self.numel

    def _piece(self, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """The segments of elements ``[a, b)`` (both block boundaries)."""
        out, offset = [], 0
        for rows, width in self.segments:
            lo, hi = max(a, offset) - offset, min(b, offset + rows * width) - offset
            offset += rows * width
            if lo >= hi:
                continue
            (r0, p0), (r1, p1) = divmod(lo, width), divmod(hi, width)
            if r0 == r1:  # inside one row
                out.append((1, p1 - p0))
                continue
            if p0:
                out.append((1, width - p0))
                r0 += 1
            out.append((r1 - r0, width))
            if p1:
                out.append((1, p1))
        return tuple(out)


@functools.lru_cache(maxsize=4096)
def blocks(segments: tuple[tuple[int, int], ...]) -> Blocks:
    """:class:`Blocks` of ``segments`` (cached: layouts are static)."""
    return Blocks(segments)


def _block_views(run: _Run, chunk: torch.Tensor, scales: torch.Tensor):
    """``(elements, scales)`` of the blocks of a uniform or ragged ``run``: views of ``chunk``
    (the run's own elements, shape ``(..., n)``) as ``(..., blocks, width)`` and of the
    section's ``scales`` as ``(..., blocks)``."""
    s = scales[..., run.scale : run.scale + run.scales]
    if run.kind == "uniform":
        yield chunk.unflatten(-1, (run.count, run.width)), s
        return
    full = run.width // BLOCK
    rows = chunk.unflatten(-1, (run.count, run.width))
    s = s.unflatten(-1, (run.count, full + 1))
    yield rows[..., : full * BLOCK].unflatten(-1, (full, BLOCK)), s[..., :full]
    yield rows[..., full * BLOCK :], s[..., full]


def encode(x: torch.Tensor, dtype: torch.dtype, layout: Blocks, out: torch.Tensor) -> None:
    """Quantizes ``x`` (shape ``(..., layout.numel)``, floating) into ``out`` (uint8, shape
    ``(..., layout.nbytes)``): per section its fp32 scales, then its values in ``dtype``."""
    top = _TOP[dtype]
    scales = torch.empty(*x.shape[:-1], layout.count, dtype=torch.float32, device=x.device)
    values = out[..., _SCALE * layout.count :]  # one byte a value, written as bytes
    for run in layout.runs:
        n = run.count * run.width
        xs = x[..., run.offset : run.offset + n]
        if run.kind == "exact":  # one-element rows: the scale is the value
            scales[..., run.scale : run.scale + n].copy_(xs)
            continue
        q = torch.empty(xs.shape, dtype=torch.float32, device=x.device).copy_(xs)
        for qv, sv in _block_views(run, q, scales):
            absmax = qv.abs().amax(-1)
            sv.copy_(absmax)
            shift = _shift(absmax)
            inv = torch.where(absmax > 0, top / (absmax * shift), torch.zeros_like(absmax))
            qv.mul_(shift.unsqueeze(-1)).mul_(inv.unsqueeze(-1))  # inf or NaN absmax: decode
        if dtype == torch.int8:
            q.round_()
        # cast, then bytes: inductor's CPU code cannot write an fp8 view of a uint8 buffer
        # (a masked store promotes its bool mask with fp8: "Promotion for Float8 Types")
        values[..., run.value : run.value + n].copy_(
            q.clamp_(-top, top).to(dtype).view(torch.uint8)
        )
    out[..., : _SCALE * layout.count].copy_(scales.view(torch.uint8))


def decode(
    packed: torch.Tensor, dtype: torch.dtype, layout: Blocks, out: torch.Tensor
) -> torch.Tensor:
    """``encode``'s inverse: ``packed`` (uint8 ``(..., nbytes)``) into ``out`` (any floating
    dtype, ``(..., numel)``); returns ``out``. A block whose scale is not finite (a NaN or an
    infinity in the block) comes back not finite."""
    top = _TOP[dtype]
    raw = packed[..., : _SCALE * layout.count]
    scales = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device).copy_(raw)
    scales = scales.view(torch.float32)  # a fresh buffer: aligned for the fp32 view
    values = packed[..., _SCALE * layout.count :]
    for run in layout.runs:
        n = run.count * run.width
        if run.kind == "exact":
            out[..., run.offset : run.offset + n].copy_(scales[..., run.scale : run.scale + n])
            continue
        q, unit = _to_float(values[..., run.value : run.value + n], dtype)
        for qv, sv in _block_views(run, q, scales):
            shift = _shift(sv)
            qv.mul_((sv * shift / top * unit).unsqueeze(-1)).mul_((1.0 / shift).unsqueeze(-1))
        out[..., run.offset : run.offset + n].copy_(q)
    return out


def _shift(absmax: torch.Tensor) -> torch.Tensor:
    """Per block a power of two the codec scales a tiny block's values by (1 elsewhere).

    ``top / absmax`` overflows fp32 below absmax ~1e-36, and ``absmax / top`` loses bits to
    the subnormals: a block whose absmax is below 2^-64 is coded as its values times 2^64
    (exact: a power of two, and the block's values are below 1 after it), then scaled back.
    Elsewhere the factor is 1, so the bits are what the plain formula gives; everywhere they
    are the formula's in fp32 with an unbounded exponent.
    """
    return torch.where(absmax < _TINY, _UNTINY, 1.0).to(absmax.dtype)


def _to_float(raw: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The bytes ``raw`` (uint8) as ``dtype`` values in a new fp32 tensor, times ``1 / unit``.

    On the CPU, fp8 converts element by element (several times slower than the rest of the
    decode); shifted into fp16's bit positions an e4m3 byte is the same value times 2^-8 (the
    subnormals too), which converts vectorized. The factor ``unit = 2^8`` goes into the
    block's scale, a power of two: the products are the same bits.
    """
    if dtype == torch.float8_e4m3fn and raw.device.type == "cpu":
        bits = raw.to(torch.int16)
        half = (bits & 0x80).bitwise_left_shift_(8).bitwise_or_((bits & 0x7F) << 7)
        return half.view(torch.float16).to(torch.float32), 256.0
    return raw.view(dtype).to(torch.float32), 1.0


def roundtrip(x: torch.Tensor, dtype: torch.dtype, layout: Blocks | None) -> torch.Tensor:
    """What ``x`` (1-D) becomes through the wire ``dtype``, in ``x``'s dtype (a new tensor)."""
    if dtype not in EIGHT_BIT:
        return x.to(dtype).to(x.dtype)
    layout = check(layout, x.numel())
    packed = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    encode(x, dtype, layout, packed)
    return decode(packed, dtype, layout, torch.empty_like(x))


def check(layout: Blocks | None, numel: int) -> Blocks:
    if layout is None or layout.numel != numel:
        raise ValueError(
            f"an 8-bit wire needs the blocks of its {numel}-element sections; got "
            f"{None if layout is None else f'blocks of {layout.numel} elements'}"
        )
    return layout


def pack(local: torch.Tensor, dtype: torch.dtype, layout: Blocks | None = None) -> torch.Tensor:
    """1-D ``local`` as it travels on the ``dtype`` wire: 8-bit, one byte buffer of
    ``layout.nbytes`` (its scales, then its values); otherwise the cast (``local`` itself
    when it has that dtype already).

    >>> pack(torch.tensor([1.0, -0.5]), torch.int8, blocks(((1, 2),))).tolist()  # scale 1.0
    [0, 0, 128, 63, 127, 192]
    """
    if dtype not in EIGHT_BIT:
        return local.to(dtype)
    layout = check(layout, local.numel())
    packed = torch.empty(layout.nbytes, dtype=torch.uint8, device=local.device)
    encode(local, dtype, layout, packed)
    return packed


def unpack(
    packed: torch.Tensor,
    dtype: torch.dtype,
    layout: Blocks | None,
    count: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`pack`'s inverse over ``count`` packed sections back to back: their values, one
    section after the other, in a new 1-D ``out_dtype`` tensor (``layout``: the blocks of one
    section, for an 8-bit wire)."""
    if dtype not in EIGHT_BIT:
        return packed.to(out_dtype)
    assert layout is not None and packed.numel() == count * layout.nbytes, "packed sections"
    out = torch.empty(count, layout.numel, dtype=out_dtype, device=packed.device)
    return decode(packed.view(count, layout.nbytes), dtype, layout, out).view(-1)
