"""Global coordinates of a tensor-parallel state's leaves: checkpoints hold FULL arrays.

A layout's leaves are the LOCAL tensor-parallel shards of the model's DTensor parameters
(:mod:`funcshard.parallel.tensor`); a checkpoint holds each one at its global shape, every
rank writing and reading only its own part:

* ``Shard(0)`` (colwise weights): the local rows are a contiguous range of global rows;
  rows ``[a, b)`` of the local leaf are global rows ``[off + a, off + b)``.
* ``Shard(d)``, ``d >= 1`` (rowwise weights): the local leaf is a block of the global one
  along ``d``; rows ``[a, b)`` of it are the *box* ``rows [a, b) x dim d [off, off + n)``.
  Such an array is stored with zarr chunks split along ``d`` too, one chunk column per tensor
  rank (``(rows per chunk, ..., cols / T, ...)``), so each tensor rank writes whole chunks of
  its own and a restore onto the same tensor degree reads exactly its chunks. A zarr grid is
  regular, so an uneven split (``D % T != 0``: torch gives the last ranks fewer) is stored in
  whole rows instead: the tensor ranks' boxes are gathered over "tensor" at save and tensor
  rank 0 writes them (:meth:`Coords.gathers`); any box of them reads back.
* ``Replicate`` and plain parameters: the same on every tensor rank; tensor rank 0 writes.

8-bit scales ``(rows, blocks per row)`` follow their moment: a ``Shard(0)`` leaf's rows are
offset, a ``Shard(d >= 1)`` leaf's blocks are the tensor ranks' blocks side by side (each
tensor rank's blocks cut its own local row: :func:`row_blocks`). A checkpoint records the
split dims (``split_dims`` of its record), so a restore onto another tensor degree knows the
blocks the scales were cut by and re-blocks the moment (``reading``).

A box is ``(dim, lo, hi)``: the range ``[lo, hi)`` along ``dim >= 1``; None: whole rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from funcshard.checkpoint.format import NUMPY_DTYPE, chunk_file
from funcshard.distributed import ops
from funcshard.layout.buckets import Block, Ragged, scale_index
from funcshard.optim.moments import block_of
from funcshard.parallel.axis import GlobalShape, ModelAxis
from funcshard.parallel.tensor import chunk_sizes, local_shape

__all__ = [
    "Box",
    "Coords",
    "segments",
    "box_slices",
    "split_of",
    "read_box",
    "row_blocks",
    "scale_widths",
    "block_spans",
]


def row_blocks(shape: Sequence[int], dim: int | None, size: int) -> tuple[Block | None, ...]:
    """Per tensor rank, the 8-bit block of the shard of a parameter of global ``shape`` split
    along ``dim`` over ``size`` ranks (:func:`funcshard.optim.moments.block_of` of its
    :class:`GlobalShape`); one entry, the plain block, when ``dim`` is None or 0."""
    shape = tuple(shape)
    if dim is None or dim == 0:
        return (block_of(shape),)
    return tuple(
        block_of(GlobalShape(shape, local_shape(shape, dim, size, t))) for t in range(size)
    )


def scale_widths(shape: Sequence[int], dim: int | None, size: int) -> tuple[int, ...]:
    """Per tensor rank, the 8-bit scales a row of its shard has (see :func:`row_blocks`):
    side by side they are a row of the global scales array."""
    shape = tuple(shape)
    blocks = row_blocks(shape, dim, size)
    if len(blocks) == 1:
        return (scale_index(blocks[0], math.prod(shape[1:])) if blocks[0] else 0,)
    rows = [math.prod(local_shape(shape, dim, size, t)[1:]) for t in range(size)]
    return tuple(scale_index(b, n) if b else 0 for b, n in zip(blocks, rows, strict=True))


Box = tuple[int, int, int]


def block_spans(shape: Sequence[int], dim: int | None, size: int) -> tuple:
    """How the 8-bit blocks of a parameter of global ``shape`` split along ``dim`` over
    ``size`` tensor ranks cut a global row: the lengths of its blocks in row order (a split
    along dim 0 or 1 keeps each shard's row contiguous in the global row), or the shards and
    their blocks for a split along a later dim. Two layouts with equal spans store the same
    scales: a checkpoint of one reads into the other as stored."""
    shape = tuple(shape)
    blocks = row_blocks(shape, dim, size)
    if dim is not None and dim >= 2:
        return ("dim", dim, size, blocks)
    if dim is None or dim == 0:
        rows = [math.prod(shape[1:])]
    else:
        inner = math.prod(shape[2:])
        rows = [n * inner for n in chunk_sizes(shape[1], size)]
    spans: list[int] = []
    for block, row in zip(blocks, rows, strict=True):
        if block is None:
            return ()
        size_of = block.size if isinstance(block, Ragged) else block
        spans += [min(size_of, row - i) for i in range(0, row, size_of)]
    return tuple(spans)


class Coords:
    """Where this rank's local leaves sit in the global arrays along the model-parallel
    axis (a state without one, :data:`~funcshard.parallel.axis.NO_AXIS`, maps every leaf to
    itself)."""

    def __init__(self, tensor: ModelAxis) -> None:
        self.tensor = tensor

    def _leaf(self, name: str):
        return self.tensor.leaves.get(name)

    def dim(self, name: str) -> int | None:
        leaf = self._leaf(name)
        return None if leaf is None else leaf.dim

    def writes_gathered(self) -> bool:
        """Whether this rank writes the rows gathered whole over the axis (its rank 0 does)."""
        return self.tensor.rank == 0

    def writes(self, name: str) -> bool:
        """Whether this tensor rank writes ``name`` (replicated ones: tensor rank 0 only)."""
        return self.tensor.counts(name)

    def shape(self, name: str, local: tuple[int, ...], scales: bool = False) -> tuple[int, ...]:
        """The global shape of ``name``'s array (``scales``: of its 8-bit scales, ``local``
        then being the local scales' shape)."""
        d = self.dim(name)
        if d is None:
            return tuple(local)
        full = self._leaf(name).shape
        if not scales:
            return tuple(full)
        if d == 0:
            return (full[0], *local[1:])
        return (local[0], sum(scale_widths(full, d, self.tensor.size)))

    def rows(self, name: str, start: int, stop: int) -> tuple[int, int, Box | None]:
        """Local rows ``[start, stop)`` of ``name`` as global rows and box."""
        d = self.dim(name)
        if d is None:
            return start, stop, None
        _, lo, hi = self.tensor.span(name)
        if d == 0:
            return start + lo, stop + lo, None
        return start, stop, (d, lo, hi)

    def scale_rows(
        self, name: str, start: int, stop: int, per_row: int
    ) -> tuple[int, int, Box | None]:
        """Local rows of ``name``'s 8-bit scales (``per_row`` blocks a local row)."""
        d = self.dim(name)
        if d is None:
            return start, stop, None
        if d == 0:
            return self.rows(name, start, stop)
        widths = scale_widths(self._leaf(name).shape, d, self.tensor.size)
        t = self.tensor.rank
        lo = sum(widths[:t])
        assert widths[t] == per_row, (name, widths, per_row)
        return start, stop, (1, lo, lo + per_row)

    def gathers(self, name: str) -> bool:
        """Whether ``name`` is split along a dim >= 1 unevenly: stored in whole rows, which
        tensor rank 0 writes after a gather over "tensor" (see the module docstring)."""
        d = self.dim(name)
        if d is None or d == 0:
            return False
        return self._leaf(name).shape[d] % self.tensor.size != 0

    def split(self, name: str, scales: bool = False) -> tuple[int, int] | None:
        """``(dim, chunk width)`` of an array split along ``dim >= 1`` among the tensor ranks
        (None: chunked along dim 0 only); ``scales``: of its 8-bit scales."""
        d = self.dim(name)
        if d is None or d == 0 or self.gathers(name):
            return None
        full = self._leaf(name).shape
        if scales:
            return 1, scale_widths(full, d, self.tensor.size)[0]
        return d, full[d] // self.tensor.size

    def widths(self, name: str, local: Sequence[int], scales: bool) -> list[tuple[int, ...]]:
        """Every tensor rank's shape of ``local`` (rows of ``name``, or of its scales)."""
        leaf = self._leaf(name)
        size = self.tensor.size
        if scales:
            return [(local[0], w) for w in scale_widths(leaf.shape, leaf.dim, size)]
        return [(local[0], *local_shape(leaf.shape, leaf.dim, size, t)[1:]) for t in range(size)]

    def gather(self, name: str, local: torch.Tensor, scales: bool) -> torch.Tensor:
        """The tensor ranks' ``local`` rows of ``name`` (or of its scales) side by side: whole
        global rows, on every tensor rank (one all-gather over "tensor", pieces padded)."""
        shapes = self.widths(name, tuple(local.shape), scales)
        width = max(math.prod(s) for s in shapes)
        buffer = torch.zeros(width, dtype=local.dtype, device=local.device)
        buffer[: local.numel()].copy_(local.reshape(-1))
        out = ops.all_gather(buffer, self.tensor.group, axis=ops.Axis.TENSOR, kind="checkpoint")
        out = out.view(self.tensor.size, width)
        parts = [out[t, : math.prod(s)].view(s) for t, s in enumerate(shapes)]
        return torch.cat(parts, dim=1 if scales else self._leaf(name).dim)


def box_slices(ndim: int, start: int, stop: int, box: Box | None) -> tuple[slice, ...]:
    """The index of rows ``[start, stop)`` (and ``box``) of an array of ``ndim`` dims."""
    index = [slice(start, stop)] + [slice(None)] * (ndim - 1)
    if box is not None:
        index[box[0]] = slice(box[1], box[2])
    return tuple(index)


def segments(
    shape: Sequence[int], itemsize: int, start: int, stop: int, box: Box | None
) -> list[tuple[int, int]]:
    """``(byte offset, length)`` in a C-order array of ``shape`` of rows ``[start, stop)``
    and ``box``, in the order of the box's own C-order bytes (contiguous runs merged)."""
    row = math.prod(shape[1:]) * itemsize
    if box is None:
        return [(start * row, (stop - start) * row)] if stop > start else []
    d, lo, hi = box
    outer = math.prod(shape[1:d])
    tail = math.prod(shape[d + 1 :]) * itemsize
    width = shape[d] * tail
    out: list[tuple[int, int]] = []
    for r in range(start, stop):
        for o in range(outer):
            at = r * row + o * width + lo * tail
            n = (hi - lo) * tail
            if out and out[-1][0] + out[-1][1] == at:
                out[-1] = (out[-1][0], out[-1][1] + n)
            elif n:
                out.append((at, n))
    return out


def chunk_gcd(bounds: Sequence[int], rows: int) -> int:
    """The largest row count dividing every writer's boundary (``rows`` when none)."""
    g = 0
    for b in bounds:
        if 0 < b < rows:
            g = math.gcd(g, b)
    return g or rows


def gather_bounds(group: dist.ProcessGroup, mine: dict) -> dict:
    """Every rank's write boundaries per array (a small collective of metadata)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    out: dict = {}
    for part in everyone:
        for keys, bounds in part.items():
            out.setdefault(keys, []).extend(bounds)
    return out


def split_of(shape: list, chunks: list) -> tuple[int, int] | None | bool:
    """``(dim, width)`` of zarr chunks split along one dim >= 1 evenly (a tensor-parallel
    leaf's blocks), None when only dim 0 is chunked, False for any other grid."""
    if len(chunks) != len(shape):
        return False
    split = [i for i in range(1, len(shape)) if chunks[i] != max(shape[i], 1)]
    if not split:
        return None
    d = split[0]
    if len(split) > 1 or not isinstance(chunks[d], int) or chunks[d] <= 0 or shape[d] % chunks[d]:
        return False
    return d, chunks[d]


ReadChunk = Callable[[str, int, tuple[int, int, int], memoryview], bool]


def read_box(
    md: dict, start: int, stop: int, buf: memoryview, box: Box | None, read_chunk: ReadChunk
) -> bool:
    """Rows ``[start, stop)`` (and ``box``) of a plain zarr v2 array chunked along dim 0 and
    perhaps one dim ``d >= 1`` (``md["_split"]``) into ``buf``: each chunk's rows read whole
    by ``read_chunk(file name, row chunk, (lo, hi, size), out)`` (verified there), the box's
    columns copied out. False when ``read_chunk`` finds a chunk absent."""
    shape, item = md["shape"], NUMPY_DTYPE[md["dtype"]].itemsize
    d, w = md["_split"] or (box[0], shape[box[0]])  # type: ignore[index]
    if box is not None and box[0] != d:  # read whole rows, then take the box
        full = np.empty((stop - start) * math.prod(shape[1:]) * item, dtype=np.uint8)
        if not read_box(md, start, stop, memoryview(full), None, read_chunk):
            return False
        got = full.reshape(stop - start, *shape[1:], item)[
            box_slices(len(shape), 0, stop - start, box)
        ]
        np.frombuffer(buf, dtype=np.uint8)[:] = got.reshape(-1)
        return True
    lo, hi = (box[1], box[2]) if box is not None else (0, shape[d])
    outer, tail = math.prod(shape[1:d]), math.prod(shape[d + 1 :]) * item
    crow, chunk = outer * w * tail, md["chunks"][0]
    if crow == 0 or stop <= start or hi <= lo:
        return True
    dst = np.frombuffer(buf, dtype=np.uint8).reshape(stop - start, outer, (hi - lo) * tail)
    sep = md.get("dimension_separator", ".")
    for k in range(start // chunk, (stop - 1) // chunk + 1):
        r0, r1 = max(start, k * chunk), min(stop, (k + 1) * chunk)
        size = (min(shape[0], (k + 1) * chunk) - k * chunk) * crow
        span = ((r0 - k * chunk) * crow, (r1 - k * chunk) * crow, size)
        for j in range(lo // w, (hi - 1) // w + 1):
            c0, c1 = max(lo, j * w) - j * w, min(hi, (j + 1) * w) - j * w
            slab = np.empty(span[1] - span[0], dtype=np.uint8)
            if not read_chunk(chunk_file(k, len(shape), sep, at=(d, j)), k, span, memoryview(slab)):
                return False
            a = (j * w + c0 - lo) * tail
            rows = slab.reshape(r1 - r0, outer, w * tail)[:, :, c0 * tail : c1 * tail]
            dst[r0 - start : r1 - start, :, a : a + (c1 - c0) * tail] = rows
    return True
