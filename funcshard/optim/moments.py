"""Optimizer moments stored narrow: bf16 / fp16 casts and 8-bit blockwise quantization.

The update always computes in fp32 (optax's ``mu_dtype`` rule): a step decodes a chunk of the
stored moments into fp32 scratch, runs torch's fused fp32 kernel on it, and encodes the chunk
back, so every byte of a moment is read and written once per step and the chunk stays in cache
(one memory-bound pass; torch's fused kernels take no mixed dtypes).

Formats (``dtype`` of the stored moment):

* ``torch.bfloat16`` / ``torch.float16``: the fp32 moment rounded to nearest even; for bf16
  optionally stochastically (``stochastic=True``): 16 bits of dither are added below the bf16
  mantissa before truncation. The dither is the low 16 bits of ``updated param XOR grad``
  (fp32 bits): no RNG state, the same for an element wherever it is stored, so
  ``deterministic=True`` holds.
* ``torch.int8`` (signed, for a first moment) and ``torch.uint8`` (unsigned, for a second
  moment): blockwise, one fp32 scale (the block's absmax) per block of consecutive elements
  that never crosses a row of its parameter: ``block`` divides the row, or the row is cut into
  blocks of 256 and a shorter last one (a :class:`~funcshard.layout.buckets.Ragged` block).
  Values are companded, like bitsandbytes' dynamic map, so small elements of a block keep
  resolution:
  int8 stores ``round(127 * sign(x) * sqrt(|x| / absmax))``, uint8 stores
  ``round(255 * (x / absmax) ** (1/4))`` (a second moment spans the square of a first
  moment's range). The rule for which parameters are 8-bit, and their blocks: :func:`block_of`;
  the others keep the master dtype (bitsandbytes' ``min_8bit_size``).

A block sits inside one row, and every operation here is elementwise or a max over one block,
so an element's stored bits depend only on its own row's values: the same on every layout
(on every data-parallel layout of one tensor degree for a rowwise tensor-parallel weight, whose
blocks cut the row of its tensor rank's shard: :func:`block_of`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from funcshard.layout.buckets import Block, Ragged, granule, scale_index

__all__ = [
    "MIN_8BIT_NUMEL",
    "MAX_BLOCK",
    "MomentFormat",
    "block_of",
    "check_dtype",
    "CHUNK",
]

MIN_8BIT_NUMEL = 4096  # smaller parameters keep fp32 moments (bitsandbytes' min_8bit_size)
MAX_BLOCK = 256  # elements per scale at most (bitsandbytes / torchao)
MIN_BLOCK = 32  # a row whose largest power-of-two divisor <= 256 is smaller: ragged blocks
# Elements per chunk of the decode / step / encode loop: p, g, two fp32 scratch moments of one
# chunk (4 MiB) stay in cache; a multiple of 256 (blocks) and of 64 (the fused kernels'
# vector body).
CHUNK = 1 << 18
EIGHT_BIT = (torch.int8, torch.uint8)
NARROW = (torch.bfloat16, torch.float16)


def check_dtype(dtype: torch.dtype | None, what: str, *, signed: bool) -> None:
    """Raises unless ``dtype`` may store a moment (``signed``: a first moment, int8 allowed;
    else a second moment, uint8 allowed)."""
    ok = (None, torch.float32, torch.float64, *NARROW, torch.int8 if signed else torch.uint8)
    if dtype not in ok:
        raise ValueError(f"{what}: expected one of {[str(d) for d in ok]}, got {dtype}")


def block_of(shape: tuple[int, ...]) -> Block | None:
    """The blocks of an 8-bit moment of a parameter of ``shape``, or None when it keeps fp32
    moments (< 2 dims or < 4096 elements). A row (``prod(shape[1:])``) is cut by the largest
    power of two <= 256 that divides it, if that is >= 32; else a row of at most 256 elements
    is one block, and a longer one is cut into blocks of 256 and a shorter last one.

    A tensor-parallel parameter (a :class:`~funcshard.parallel.axis.GlobalShape`) is 8-bit by its
    global shape, whatever the tensor degree, and its blocks cut the row of the shard this
    rank holds: a rowwise (``Shard(1)``) weight's local row is a piece of the global row, and
    a block never crosses it, so an element's bits depend only on its own row's values of its
    own tensor rank (the blocks follow the tensor degree; a checkpoint records them).

    >>> block_of((1024, 768)), block_of((64, 64)), block_of((4096,)), block_of((100, 100))
    (256, 64, None, 100)
    >>> block_of((256, 769))
    Ragged(size=256, row=769)
    >>> from funcshard.parallel.axis import GlobalShape
    >>> block_of(GlobalShape((4096, 11008), (4096, 5504))), block_of((4096, 11008))
    (128, 256)
    """
    numel = math.prod(shape)
    if len(shape) < 2 or numel < MIN_8BIT_NUMEL:
        return None
    row = math.prod(getattr(shape, "local", shape)[1:])
    if row == 0:  # an empty shard (torch's chunking leaves the last tensor ranks none)
        return MAX_BLOCK
    block = MAX_BLOCK
    while block >= MIN_BLOCK and row % block:
        block //= 2
    if block >= MIN_BLOCK:
        return block
    return row if row <= MAX_BLOCK else Ragged(MAX_BLOCK, row)


@dataclasses.dataclass(frozen=True, slots=True)
class MomentFormat:
    """How one moment of one buffer is stored: its dtype and, for 8-bit, the block size."""

    dtype: torch.dtype
    block: Block | None = None  # set for int8 / uint8
    stochastic: bool = False

    @property
    def quantized(self) -> bool:
        return self.dtype in EIGHT_BIT

    def zeros(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero moment storage for a flat (or any) tensor ``like``: values, scales or None."""
        values = torch.zeros_like(like, dtype=self.dtype)
        if not self.quantized:
            return values, None
        n = like.numel()
        if n % granule(self.block):
            what = "rows" if isinstance(self.block, Ragged) else "blocks"
            raise ValueError(
                f"8-bit moment: {n} elements is not a whole number of {what} of {self.block}"
            )
        count = scale_index(self.block, n)
        return values, torch.zeros(count, dtype=torch.float32, device=like.device)

    def decode(
        self, values: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor
    ) -> torch.Tensor:
        """``values`` (a flat chunk; ``scales`` its blocks' scales) as fp32 into ``out``."""
        out.copy_(values)
        if not self.quantized:
            return out
        if self.dtype == torch.int8:  # x = absmax * sign(q) * (q / 127)^2
            out.mul_(out.abs())
            top = 1.0 / _I8_TOP**2
        else:  # x = absmax * (q / 255)^4
            out.square_().square_()
            top = 1.0 / _U8_TOP**4
        for blocks, s in _views(self.block, out, scales):
            shift = _shift(s)
            blocks.mul_(_per_element((s * shift) * top, blocks))
            blocks.mul_(_per_element(1.0 / shift, blocks))
        return out

    def encode(
        self,
        x: torch.Tensor,
        values: torch.Tensor,
        scales: torch.Tensor | None,
        dither: torch.Tensor | None = None,
    ) -> None:
        """Stores the fp32 chunk ``x`` (consumed as scratch) into ``values`` / ``scales``."""
        if not self.quantized:
            if dither is not None and self.dtype == torch.bfloat16:
                x.view(torch.int32).add_(dither).bitwise_and_(-65536)
            values.copy_(x)
            return
        signed = self.dtype == torch.int8
        magnitude = torch.abs(x) if signed else x
        top = _I8_TOP**2 if signed else _U8_TOP**4  # companding folded into one factor
        for blocks, s in _views(self.block, magnitude, scales):
            if s.is_contiguous():
                torch.amax(blocks, dim=-1, out=s)
            else:
                s.copy_(torch.amax(blocks, dim=-1))
            shift = _shift(s)
            safe = torch.where(s > 0, s * shift, torch.ones_like(s))
            blocks.mul_(_per_element(shift, blocks))
            blocks.mul_(_per_element(top / safe, blocks))
        magnitude.sqrt_()
        if not signed:
            magnitude.sqrt_()
        magnitude.round_()
        if signed:
            torch.copysign(magnitude, x, out=magnitude)
        values.copy_(magnitude)


_I8_TOP, _U8_TOP = 127.0, 255.0
_TINY, _UNTINY = 2.0**-64, 2.0**64


def _shift(scales: torch.Tensor) -> torch.Tensor:
    """Per block the power of two its values are coded at: 2^64 where the absmax is below
    2^-64, else 1. ``top / absmax`` overflows fp32 below absmax ~1e-29 (uint8's top is 255^4)
    and ``absmax / top`` loses bits to the subnormals; scaled by 2^64 (exact) neither happens.
    Where the factor is 1 the bits are the plain formula's; everywhere they are the formula's
    in fp32 with an unbounded exponent. The kernel (``_kernels.c``) does the same."""
    return torch.where(scales < _TINY, _UNTINY, 1.0).to(scales.dtype)


def _views(block: Block, x: torch.Tensor, scales: torch.Tensor):
    """``(blocks, scales)`` views of a flat chunk of whole blocks (whole rows when ragged):
    elements ``(..., blocks, width)`` and their scales ``(..., blocks)``; a ragged block gives
    its rows' full blocks, then their shorter last blocks."""
    if not isinstance(block, Ragged):
        return [(x.view(-1, block), scales)]
    full = block.row // block.size
    rows, s = x.view(-1, block.row), scales.view(-1, full + 1)
    return [
        (rows[:, : full * block.size].unflatten(1, (full, block.size)), s[:, :full]),
        (rows[:, full * block.size :].unsqueeze(1), s[:, full:]),
    ]


def _per_element(per_block: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """A per-block factor broadcast over its block's elements (explicitly expanded: torch's
    CPU loop is many times faster on it than on a plain ``unsqueeze(1)`` broadcast)."""
    return per_block.unsqueeze(-1).expand(blocks.shape)


def dither_of(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """16 bits of dither per element for stochastic rounding to bf16: ``(p ^ g) & 0xFFFF`` of
    the fp32 bits of the updated param and the gradient."""
    p = param if param.dtype == torch.float32 else param.float()
    g = grad if grad.dtype == torch.float32 else grad.float()
    return torch.bitwise_xor(p.view(torch.int32), g.view(torch.int32)).bitwise_and_(0xFFFF)


def decode_flat(fmt: MomentFormat, values: torch.Tensor, scales: torch.Tensor | None):
    """A whole stored moment as a fresh fp32 tensor of ``values``' shape."""
    out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    fmt.decode(values.reshape(-1), scales, out.view(-1))
    return out


def encode_flat(
    fmt: MomentFormat, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None
) -> None:
    """Stores a whole fp32 moment ``x`` (not modified) into ``values`` / ``scales``."""
    fmt.encode(x.reshape(-1).clone(), values.view(-1), scales)
