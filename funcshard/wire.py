"""Low-precision wires summed in fp32, and the 8-bit blockwise formats they may carry.

``grad_comm_dtype`` is the wire only (API v3): each rank's contribution is rounded to the wire
dtype once, on the sending side, and the sum over ranks runs in fp32 (or ``main_grads_dtype``
when wider), with any backend's plain collectives:

* reduce-scatter (:func:`start_reduce_scatter`): an all-to-all of the rank sections in the
  wire format, then each rank sums the sections it received in fp32. Per rank that moves the
  bytes of a ring reduce-scatter of the same wire (all sections but its own out, as many in)
  and is counted as one: the full wire buffer.
* all-reduce (:func:`all_reduce`): that reduce-scatter over the group's parts of the tensor,
  then an all-gather of the reduced parts in the wire format. Every rank, a part's owner too,
  takes each part from the wire, so the replicas hold the same bits. Counted as an all-reduce
  of the wire tensor.

A ring collective in bf16 rounds every partial sum, so its error grows with the group; here a
contribution is rounded once going out (and the sum once coming back, for an all-reduce),
whatever the group size (``experiments/bench_wire.py`` measures both).

Wire formats (the ``dtype`` argument):

* a floating dtype (bf16, fp16, ...): the values cast to it.
* ``torch.int8`` / ``torch.float8_e4m3fn``: blockwise scaled. A row of a parameter (the
  product of its dims after the first) is cut into blocks of :data:`BLOCK` consecutive
  elements, the last one shorter, so a block never crosses a row (:class:`Blocks`). Each block
  travels as its fp32 scale ``s`` (the block's absmax) and one byte per element: int8
  ``round(x * 127 / s)``, fp8 ``fp8(x * 448 / s)``; it comes back as ``q * (s / 127)`` (or
  ``/ 448``). A row of one element (a 1-D or 0-d parameter) is a block of one whose value is
  its own scale: it travels exactly, as 4 bytes, and no value byte. Everything an element's
  bits depend on is in its own row, so a row quantizes to the same bits on every layout (what
  ``deterministic=True`` needs of ``param_comm_dtype``). A section travels as one byte buffer:
  its scales (fp32), then its values.

The layout glue at the bottom is what :mod:`funcshard.reduce`, the ZeRO-3 gather, the ZeRO 0-2
compute copies, HFSDP's gather of the masters over "replicate" and :func:`funcshard.plan.plan`
call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from funcshard import collectives
from funcshard import sharding as shard_lib

if TYPE_CHECKING:
    from funcshard.layout import Bucket, Layout, LeafSpec
    from funcshard.policy import LeafDtypes

__all__ = [
    "BLOCK",
    "EIGHT_BIT",
    "Blocks",
    "blocks",
    "encode",
    "decode",
    "roundtrip",
    "start_reduce_scatter",
    "all_reduce",
    "start_all_reduce",
    "pack",
    "unpack",
    "start_all_gather",
    "reduces_in_fp32",
    "sections_dtype",
    "param_wire",
    "blocks_of",
    "start_reduce_shard_axis",
    "start_reduce_replicate_axis",
    "section_leaves",
    "section_blocks",
    "packs_shard",
    "packed_nbytes",
    "empty_packed",
    "pack_params",
    "gather_replicas",
    "all_gather_params",
    "gather_full",
    "reduce_scatter_nbytes",
    "all_reduce_nbytes",
    "all_gather_nbytes",
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
    values = out[..., _SCALE * layout.count :].view(dtype)
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
        values[..., run.value : run.value + n].copy_(q.clamp_(-top, top))
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
    layout = _check(layout, x.numel())
    packed = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    encode(x, dtype, layout, packed)
    return decode(packed, dtype, layout, torch.empty_like(x))


def _check(layout: Blocks | None, numel: int) -> Blocks:
    if layout is None or layout.numel != numel:
        raise ValueError(
            f"an 8-bit wire needs the blocks of its {numel}-element sections; got "
            f"{None if layout is None else f'blocks of {layout.numel} elements'}"
        )
    return layout


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a sum of ``dtype`` values runs in: fp32, or ``dtype`` when wider."""
    return torch.promote_types(dtype, torch.float32)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


# --- collectives -------------------------------------------------------------------------------
def start_reduce_scatter(
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    axis: str,
    dtype: torch.dtype,
    layout: Blocks | None = None,
    kind: str | None = "reduce_scatter",
) -> collectives.Pending:
    """The group's sum of 1-D ``full``, this rank's contiguous 1/size of it, summed in fp32
    (or ``full``'s dtype when wider) from contributions on the ``dtype`` wire.

    Args:
      full: this rank's contribution, as ``size`` equal sections (consumed: its buffer may
        hold the decoded sections).
      group: the ranks to reduce over (None: this rank alone, nothing moves or rounds).
      axis: the mesh axis of ``group``, for the accounting.
      dtype: the wire: a floating dtype (a cast) or an 8-bit format of :data:`EIGHT_BIT`.
      layout: the blocks of one section (8-bit wires; every section has the same).
      kind: what ``fs.comm_stats`` counts the full wire buffer under (None: nothing).

    Returns:
      A pending result whose ``wait()`` gives this rank's section of the sum.
    """
    size = _size(group)
    acc = _acc_dtype(full.dtype)
    if size == 1:
        return collectives.Pending(None, full.to(acc))
    section = full.numel() // size
    if dtype in EIGHT_BIT:
        layout = _check(layout, section)
        send = torch.empty(size, layout.nbytes, dtype=torch.uint8, device=full.device)
        encode(full.view(size, section), dtype, layout, send)
        scratch = full.view(size, section) if full.dtype == acc else None

        def finish(recv: torch.Tensor) -> torch.Tensor:
            out = scratch
            if out is None:
                out = torch.empty(size, section, dtype=acc, device=recv.device)
            return decode(recv.view(size, -1), dtype, layout, out).sum(0)

        return _all_to_all(send, group, axis, kind, finish)
    wire = full.to(dtype)
    return _all_to_all(
        wire.view(size, section), group, axis, kind, lambda r: r.view(size, -1).sum(0, dtype=acc)
    )


def _all_to_all(send: torch.Tensor, group, axis: str, kind: str | None, finish):
    """All-to-all of the rows of ``send`` (row r to rank r); ``finish`` of what came back."""
    size, width = send.shape
    recv = torch.empty_like(send)
    pending = collectives.all_to_all(
        recv.view(-1), send.view(-1), [width] * size, [width] * size, group, axis=axis, kind=kind
    )
    return collectives.Pending.then(pending, finish)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    axis: str,
    dtype: torch.dtype,
    layout: Blocks | None = None,
) -> torch.Tensor:
    """The group's sum of ``tensor`` (1-D on an 8-bit wire) in fp32 (or its own dtype when
    wider), a new tensor the same on every rank: :func:`start_reduce_scatter` of the group's
    parts, then an all-gather of the reduced parts on the same wire. Counted as one all-reduce
    of the wire tensor (8-bit: every part padded to the largest, in bytes).

    Args:
      tensor: this rank's contribution (not modified).
      group: the ranks to reduce over (None: this rank alone; returned as it is, in fp32).
      axis: the mesh axis of ``group``, for the accounting.
      dtype: the wire, as for :func:`start_reduce_scatter`.
      layout: the blocks of ``tensor`` (8-bit wires); the parts are cut on block boundaries.
    """
    return start_all_reduce(tensor, group, axis=axis, dtype=dtype, layout=layout).wait()


def start_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    axis: str,
    dtype: torch.dtype,
    layout: Blocks | None = None,
) -> collectives.Pending:
    """:func:`all_reduce` as a chain: the reduce-scatter (an all-to-all) starts now, reading
    ``tensor`` before this returns; ``wait()`` sums the parts and all-gathers the sum. So the
    all-gather is issued where the caller waits: every rank waits for a group's chains in the
    same order."""
    size = _size(group)
    acc = _acc_dtype(tensor.dtype)
    if size == 1:
        return collectives.Pending(None, tensor.to(acc))
    flat, shape = tensor.reshape(-1), tensor.shape
    n = flat.numel()
    if dtype not in EIGHT_BIT:
        wire = torch.nn.functional.pad(flat.to(dtype), (0, -n % size))
        collectives.record("all_reduce", wire[:n], axis)
        part = start_reduce_scatter(wire, group, axis=axis, dtype=dtype, kind=None)

        def gather(summed: torch.Tensor) -> torch.Tensor:
            back = collectives.all_gather(summed.to(dtype), group, axis=axis, kind=None)
            return back[:n].to(acc).view(shape)

        return collectives.Pending.then(part, gather)
    layout = _check(layout, n)
    parts = layout.split(size)
    width = max(p.nbytes for _, p in parts)
    send = torch.zeros(size, width, dtype=torch.uint8, device=flat.device)
    for r, (start, p) in enumerate(parts):
        encode(flat[start : start + p.numel], dtype, p, send[r, : p.nbytes])
    collectives.record("all_reduce", send, axis)
    start, mine = parts[dist.get_rank(group)]

    def finish(recv: torch.Tensor) -> torch.Tensor:
        out = torch.empty(size, mine.numel, dtype=acc, device=flat.device)
        reduced = decode(recv.view(size, width)[:, : mine.nbytes], dtype, mine, out).sum(0)
        packed = torch.zeros(width, dtype=torch.uint8, device=flat.device)
        encode(reduced, dtype, mine, packed[: mine.nbytes])
        gathered = collectives.all_gather(packed, group, axis=axis, kind=None).view(size, width)
        full = torch.empty(n, dtype=acc, device=flat.device)
        for r, (begin, p) in enumerate(parts):
            decode(gathered[r, : p.nbytes], dtype, p, full[begin : begin + p.numel])
        return full.view(shape)

    return _all_to_all(send, group, axis, None, finish)


def pack(local: torch.Tensor, dtype: torch.dtype, layout: Blocks | None = None) -> torch.Tensor:
    """1-D ``local`` as it travels on the ``dtype`` wire: 8-bit, one byte buffer of
    ``layout.nbytes`` (its scales, then its values); otherwise the cast (``local`` itself
    when it has that dtype already).

    >>> pack(torch.tensor([1.0, -0.5]), torch.int8, blocks(((1, 2),))).tolist()  # scale 1.0
    [0, 0, 128, 63, 127, 192]
    """
    if dtype not in EIGHT_BIT:
        return local.to(dtype)
    layout = _check(layout, local.numel())
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


def start_all_gather(
    local: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    axis: str,
    dtype: torch.dtype,
    layout: Blocks | None = None,
    out_dtype: torch.dtype,
    kind: str | None = "all_gather",
) -> collectives.Pending:
    """Every rank's 1-D ``local`` in group rank order, sent on the ``dtype`` wire (quantized
    once, here) and decoded to ``out_dtype`` on arrival. With a group of one nothing moves,
    but ``local`` still goes through the wire's rounding, so the result depends on the values
    alone, not on the group size. Counted as an all-gather of the wire buffers.

    Args:
      local: this rank's part (not modified).
      group: the ranks (None: this rank alone).
      axis: the mesh axis of ``group``, for the accounting.
      dtype: the wire, as for :func:`start_reduce_scatter`.
      layout: the blocks of ``local`` (8-bit wires; the same on every rank).
      out_dtype: the dtype of the result.
      kind: what ``fs.comm_stats`` counts the gathered wire under.
    """
    size = _size(group)
    packed = pack(local, dtype, layout)
    unpack_all = lambda r: unpack(r, dtype, layout, size, out_dtype)  # noqa: E731
    if size == 1:
        return collectives.Pending(None, unpack_all(packed))
    pending = collectives.all_gather(packed, group, axis=axis, async_op=True, kind=kind)
    return collectives.Pending.then(pending, unpack_all)


# --- the layout's wires ------------------------------------------------------------------------
def reduces_in_fp32(dtypes: LeafDtypes) -> bool:
    """Whether a bucket's gradients take the wire of this module (rounded once, summed in
    fp32): an 8-bit ``grad_comm_dtype``, or one narrower than (or as narrow as, but other
    than) ``main_grads_dtype``. Otherwise the ring collectives run in the wire dtype as ever
    (``grad_comm_dtype`` equal to ``main_grads_dtype``, or wider)."""
    comm, grad = dtypes.comm, dtypes.grad
    return comm in EIGHT_BIT or (comm != grad and comm.itemsize <= grad.itemsize)


def sections_dtype(dtypes: LeafDtypes) -> torch.dtype:
    """The dtype a bucket's unreduced rank sections are built in before the wire: the wire
    dtype for the ring collectives, the main-grads dtype when this module rounds them."""
    return dtypes.grad if reduces_in_fp32(dtypes) else dtypes.comm


def param_wire(layout: Layout, bucket: Bucket) -> torch.dtype | None:
    """The dtype a bucket's compute params travel in, None when it is the compute dtype."""
    wire = layout.policy.param_comm_dtype
    return None if wire is None or wire == bucket.dtypes.compute else wire


def blocks_of(layout: Layout, bucket: Bucket) -> Blocks:
    """The blocks of a bucket's local flat (one padded shard of every leaf, leaf after leaf);
    rows are never split between shards, so every section of the full buffer has them too."""
    return blocks(tuple((s.rows_per_shard, s.row_numel) for s in layout.bucket_leaves(bucket)))


def _blocks_for(layout: Layout, bucket: Bucket, dtype: torch.dtype) -> Blocks | None:
    return blocks_of(layout, bucket) if dtype in EIGHT_BIT else None


def start_reduce_shard_axis(
    layout: Layout, bucket: Bucket, sections: torch.Tensor
) -> collectives.Pending:
    """Rank sections (main-grads dtype, consumed) -> this rank's shard of their mean over
    "shard" (``wait()``: fp32 or wider), each rank's sections rounded to the wire once after
    the division by the data-parallel size."""
    x = sections.to(_acc_dtype(bucket.dtypes.grad))
    if layout.dp_size > 1:
        x.div_(layout.dp_size)
    group = layout.shard_group if layout.shard_size > 1 else None
    comm = bucket.dtypes.comm
    return start_reduce_scatter(
        x, group, axis="shard", dtype=comm, layout=_blocks_for(layout, bucket, comm)
    )


def start_reduce_replicate_axis(
    layout: Layout, bucket: Bucket, local: torch.Tensor
) -> collectives.Pending:
    """A gradient shard summed over the replicas (the world under ``no_shard``) on the wire,
    in the main-grads dtype (``local`` is read before this returns; :func:`start_all_reduce`
    says in which order to wait)."""
    comm = bucket.dtypes.comm
    pending = start_all_reduce(
        local,
        layout.replicate_group,
        axis=layout.replicate_axis,
        dtype=comm,
        layout=_blocks_for(layout, bucket, comm),
    )
    return collectives.Pending.then(pending, lambda out: out.to(bucket.dtypes.grad))


# The params' wire. A rank encodes (packs) its compute shard once, on the sending side; the
# gathers move the packed bytes and decode exactly once, into the full compute params, by the
# blocks of the master sections. HFSDP packs each master where it is updated: the outer gather
# over "replicate" moves the packed masters into the inner shard, which stays packed (ZeRO-3
# keeps it so between steps, ``Layout.packed_sections``), and the gather over "shard" moves
# those bytes again, unchanged. Blocks never cross a row and rows are never split, so the
# decoded params are a function of the masters alone, the same bits on every layout.
def _sections(layout: Layout) -> int:
    """Master sections per shard of ``layout`` (R for HFSDP's inner layout, else 1)."""
    return max(1, layout.packed_sections)


def section_leaves(layout: Layout, bucket: Bucket) -> list[LeafSpec]:
    """The leaves of one master section of a bucket's shard, as a master flat packs them (the
    bucket's own specs; 1/R of the rows and offsets of each under HFSDP's inner layout)."""
    specs, k = layout.bucket_leaves(bucket), _sections(layout)
    if k == 1:
        return specs
    return [
        dataclasses.replace(s, rows_per_shard=s.rows_per_shard // k, offset=s.offset // k)
        for s in specs
    ]


def section_blocks(layout: Layout, bucket: Bucket) -> Blocks:
    """The blocks of one master section of a bucket's shard (what a param wire packs)."""
    return blocks(tuple((s.rows_per_shard, s.row_numel) for s in section_leaves(layout, bucket)))


def packs_shard(layout: Layout, bucket: Bucket) -> bool:
    """Whether a bucket's compute shard is kept packed: HFSDP's inner layout with a param
    wire (its ``packed_sections`` master sections, as they crossed "replicate")."""
    return layout.packed_sections > 0 and param_wire(layout, bucket) is not None


def packed_nbytes(layout: Layout, bucket: Bucket) -> int:
    """Bytes of one master section of a bucket's shard on its param wire (the compute dtype
    when there is none)."""
    wire = param_wire(layout, bucket) or bucket.dtypes.compute
    if wire in EIGHT_BIT:
        return section_blocks(layout, bucket).nbytes
    return bucket.numel // _sections(layout) * wire.itemsize


def empty_packed(layout: Layout, bucket: Bucket, device: torch.device | str) -> torch.Tensor:
    """An uninitialized packed shard of a bucket (its ``packed_sections`` sections)."""
    wire = param_wire(layout, bucket)
    dtype = torch.uint8 if wire in EIGHT_BIT else wire
    numel = _sections(layout) * packed_nbytes(layout, bucket) // dtype.itemsize
    return torch.empty(numel, dtype=dtype, device=device)


def pack_params(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """A bucket's compute shard (one master section) packed on its param wire."""
    wire = param_wire(layout, bucket)
    assert wire is not None, "a param wire"
    return pack(local, wire, section_blocks(layout, bucket) if wire in EIGHT_BIT else None)


def gather_replicas(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """HFSDP: this rank's inner shard of a bucket from every replica's updated master
    (``local``: this rank's, in the compute dtype). With a param wire each master is packed
    once, here, and the inner shard is the ``R`` packed sections in replica order: they
    cross "replicate" and stay packed (:func:`packs_shard`); else the compute-dtype shard
    of :func:`funcshard.sharding.gather_replicas`."""
    if param_wire(layout, bucket) is None:
        return shard_lib.gather_replicas(layout, bucket, local)
    packed = pack_params(layout, bucket, local)
    if layout.replicas == 1:
        return packed
    return collectives.all_gather(packed, layout.replicate_group, axis="replicate")


def all_gather_params(layout: Layout, bucket: Bucket, local: torch.Tensor) -> collectives.Pending:
    """A bucket's full compute params (the full layout, compute dtype) gathered over the
    layout's shard group from this rank's compute shard (asynchronous; ZeRO-3's gathers,
    ZeRO 0-2's compute copies).

    Without a param wire the compute-dtype shards move. With one, the packed shards do
    (``local`` packed here, or already packed under :func:`packs_shard`), and the result is
    decoded once, section by section, on arrival."""
    specs, S = layout.bucket_leaves(bucket), layout.shard_size
    wire = param_wire(layout, bucket)
    if wire is None:
        count, sections, packed = S, specs, local
        finish = lambda r: r  # noqa: E731
    else:
        count, sections = S * _sections(layout), section_leaves(layout, bucket)
        eight_bit = section_blocks(layout, bucket) if wire in EIGHT_BIT else None
        packed = local if packs_shard(layout, bucket) else pack_params(layout, bucket, local)
        compute = bucket.dtypes.compute
        finish = lambda r: unpack(r, wire, eight_bit, count, compute)  # noqa: E731
    if S == 1:
        pending = collectives.Pending(None, packed)
    else:
        pending = collectives.all_gather(
            packed, layout.shard_group, axis=layout.shard_axis, async_op=True
        )
    return collectives.Pending.then(
        pending, lambda r: shard_lib.from_rank_sections(finish(r), sections, count)
    )


def gather_full(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """ZeRO 0-2's full compute params of a bucket from this rank's compute shard, through
    ``param_comm_dtype`` when it differs from the compute dtype (also with one shard, so the
    compute params are the same function of the masters on every layout)."""
    if param_wire(layout, bucket) is None:
        return shard_lib.gather_full(layout, bucket, local)
    return all_gather_params(layout, bucket, local).wait()


# --- bytes, for fs.plan --------------------------------------------------------------------------
def reduce_scatter_nbytes(layout: Layout, bucket: Bucket) -> int:
    """Bytes counted for one shard-axis reduce-scatter of a bucket's gradient."""
    comm, S = bucket.dtypes.comm, layout.shard_size
    if comm in EIGHT_BIT:
        return S * blocks_of(layout, bucket).nbytes
    return S * bucket.numel * comm.itemsize


def all_reduce_nbytes(layout: Layout, bucket: Bucket, size: int) -> int:
    """Bytes counted for one all-reduce of a bucket's local gradient over ``size`` ranks."""
    comm = bucket.dtypes.comm
    if comm in EIGHT_BIT:
        return size * max(p.nbytes for _, p in blocks_of(layout, bucket).split(size))
    return bucket.numel * comm.itemsize


def all_gather_nbytes(layout: Layout, bucket: Bucket) -> int:
    """Bytes counted for one shard-axis all-gather of a bucket's compute params."""
    return layout.shard_size * _sections(layout) * packed_nbytes(layout, bucket)
