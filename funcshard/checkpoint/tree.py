"""A TrainState as keyed arrays: the optimizer state's tree, and the rows each rank writes.

Keys are tuples of strings: ``("params", name)``, ``("opt_state", *path, name)`` for every
per-bucket buffer of the optimizer state (``path``: NamedTuple fields and tuple indices down to
it), and scalars ``("opt_state", *path)``, ``("step",)``, ``("loss_scale", "scale")``.
Writing maps a state to the rows each rank writes (here); reading checks that a checkpoint
fits a target state (``matching``) and fills the target layout's flat buffers from any
``Source`` (``reading``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from funcshard.checkpoint import coords as coords_lib
from funcshard.checkpoint.format import (
    EIGHT_BIT_NAMES,
    FORMAT_VERSION,
    Keys,
    chunk_rows,
)
from funcshard.distributed import mesh as mesh_lib
from funcshard.layout import sharding as shard_lib
from funcshard.layout.buckets import BlockScales, PerBucket, map_parts
from funcshard.layout.layout import Layout, LeafSpec
from funcshard.state.state import TrainState

__all__ = [
    "is_per_bucket",
    "map_opt",
    "opt_layout",
    "opt_blocks",
    "info",
    "Writers",
    "ArrayWrite",
    "plan_writes",
    "align_chunks",
    "buffer_writes",
]


# --- the optimizer state's tree -------------------------------------------------------------


def is_per_bucket(x: Any, n_buckets: int) -> bool:
    """Whether ``x`` is a per-bucket part of an optimizer state (a ``PerBucket``: one entry per
    bucket, None where the bucket has no value in this subtree). The one place that
    recognizes it."""
    return isinstance(x, PerBucket) and len(x) == n_buckets


def map_opt(
    x: Any,
    n_buckets: int,
    on_buckets: Callable[[Keys, tuple], Any],
    on_scalar: Callable[[Keys, Any], Any],
    path: Keys = (),
) -> Any:
    """Rebuilds an optimizer state, calling back on each per-bucket tuple and each scalar
    (the walk is :func:`funcshard.layout.buckets.map_parts`)."""

    def part(p: Keys, v: PerBucket) -> Any:
        if not is_per_bucket(v, n_buckets):
            where = ".".join(("opt_state", *p))
            raise TypeError(f"{where}: {len(v)} per-bucket entries, expected {n_buckets}")
        return on_buckets(p, v)

    def leaf(p: Keys, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, (bool, int, float)):
            return on_scalar(p, v)
        where = ".".join(("opt_state", *p))
        raise TypeError(f"{where}: cannot checkpoint a {type(v).__name__}")

    return map_parts(x, part, leaf, path)


def opt_layout(
    opt_state: Any, n_buckets: int
) -> tuple[dict[Keys, tuple[bool, ...]], dict[Keys, Any]]:
    """The per-bucket paths (with which buckets hold a value) and the scalars of a state."""
    arrays: dict[Keys, tuple[bool, ...]] = {}
    scalars: dict[Keys, Any] = {}
    map_opt(
        opt_state,
        n_buckets,
        lambda p, x: arrays.__setitem__(p, tuple(t is not None for t in x)),
        lambda p, x: scalars.__setitem__(p, x),
    )
    return arrays, scalars


def opt_blocks(opt_state: Any, n_buckets: int) -> dict[Keys, tuple[int | None, ...]]:
    """The 8-bit scale parts of a state (``BlockScales``): per path, the block per bucket. A
    scale part at ``(..., f + "_scale")`` belongs to the moment at ``(..., f)``."""
    out: dict[Keys, tuple[int | None, ...]] = {}
    map_opt(
        opt_state,
        n_buckets,
        lambda p, x: out.__setitem__(p, x.blocks) if isinstance(x, BlockScales) else None,
        lambda p, x: x,
    )
    return out


def scale_path(path: Keys) -> Keys:
    return (*path[:-1], path[-1] + "_scale")


def spec_in(spec: LeafSpec, blocks: tuple[int | None, ...] | None, bucket: int) -> LeafSpec:
    """``spec``, or the spec of its 8-bit scales when the part is a ``BlockScales``."""
    return spec if blocks is None else spec.scales(blocks[bucket])


def is_8bit(dtype_name: str) -> bool:
    return dtype_name in EIGHT_BIT_NAMES


def opt_kind(opt_state: Any) -> str:
    return type(opt_state).__name__


def info(state: TrainState) -> dict:
    """funcshard's record of a checkpoint (in ``_CHECKPOINT_METADATA``)."""
    layout = state.layout
    return {
        "version": FORMAT_VERSION,
        "optimizer": opt_kind(state.opt_state),
        "opt_arrays": [list(p) for p in opt_layout(state.opt_state, len(layout.buckets))[0]],
        "strategy": str(layout.strategy),
        "outer_strategy": str(layout.outer),
        "mesh": list(layout.mesh.shape),
        "tensor": layout.tensor.size,
        "split_dims": split_dims(layout),
        "step": int(state.step),
    } | _pipeline_info(state)


def _pipeline_info(state: TrainState) -> dict:
    """A pipelined state's record: its pipeline's size, schedule and stage count (its
    ``mesh`` and ``strategy`` are then those of the first pipeline rank's sub-world)."""
    run = state.pipeline
    if run is None:
        return {}
    size = dist.get_world_size(run.group)
    return {"pipeline": {"size": size, "schedule": run.pipe.schedule, "stages": len(run.stages)}}


def split_dims(layout: Layout) -> dict[str, int]:
    """The dim each parameter split over "tensor" is split along (what a restore onto another
    tensor degree needs to know the blocks of its 8-bit scales: ``coords.row_blocks``)."""
    leaves = layout.tensor.leaves
    return {n: leaf.dim for n, leaf in leaves.items() if leaf.dim is not None}


# --- writing: the rows of each array this rank writes ---------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Writers:
    """How the rows of every array split among the writing ranks."""

    parts: int  # writers per array
    index: int  # this rank's writer index
    active: bool  # False on replicas that write nothing
    split: bool = False  # no_shard: every rank holds every row, so split them evenly

    @classmethod
    def of(cls, layout: Layout, spec: LeafSpec) -> Writers:
        """The writers of leaf ``spec`` (the ranks of its bucket's groups)."""
        layout = layout.over(layout.buckets[spec.bucket])
        mesh = layout.group_mesh
        if not layout.strategy.shards_optim:  # every rank holds everything: split the rows
            shard = mesh_lib.axis_size(mesh, "shard")
            index = mesh_lib.axis_rank(mesh, "replicate") * shard + mesh_lib.axis_rank(
                mesh, "shard"
            )
            return cls(mesh.size(), index, True, split=True)
        # the first replica writes (under HFSDP every rank holds rows no other rank holds)
        return cls(layout.shard_size, layout.shard_rank, layout.placement.replica_rank == 0)

    def rows(self, spec: LeafSpec) -> tuple[int, int, int]:
        """``(start, stop, piece)``: ``spec``'s rows this writer writes, and the rows each
        writer owns (so a chunk or file region aligned to ``piece`` has one writer)."""
        # a sharded rank writes the rows it owns (a deterministic layout may own more than
        # an even split: its shards are aligned)
        piece = -(-spec.rows // self.parts) if self.split else spec.rows_per_shard
        start = min(self.index * piece, spec.rows) if self.active else spec.rows
        return start, min(start + piece, spec.rows), piece

    def local_rows(
        self, flat: torch.Tensor, spec: LeafSpec, shard_rank: int, start: int, stop: int
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``spec`` out of this rank's flat buffer (a view)."""
        lo = spec.row_range(shard_rank)[0]
        return shard_lib.rows_view(flat, spec, shard_rank)[start - lo : stop - lo]


@dataclasses.dataclass(slots=True)
class ArrayWrite:
    keys: Keys
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk_rows: int
    start: int
    stop: int
    data: torch.Tensor | None  # rows [start, stop) (and ``box``); None when it writes none
    box: coords_lib.Box | None = None  # a tensor rank's block along a dim >= 1
    split: tuple[int, int] | None = None  # (dim, chunk width) of chunks split along a dim >= 1


def plan_writes(
    state: TrainState,
    *,
    stage: Callable[[Keys, torch.Tensor], torch.Tensor] | None,
    chunk_bytes: int,
) -> tuple[list[ArrayWrite], dict[Keys, Any]]:
    """What this rank writes: its rows of every array, and (all ranks know them) the scalars.

    ``stage(keys, rows)``, if given, copies the rows of an array to host memory (an
    asynchronous save must not see later in-place updates of the state's buffers).
    """
    layout = state.layout
    n = len(layout.buckets)

    coords = coords_lib.Coords(layout.tensor)
    gathered: list[tuple[ArrayWrite, torch.Tensor, bool]] = []

    def rows_of(flats: tuple[torch.Tensor | None, ...], prefix: Keys) -> list[ArrayWrite]:
        out = []
        blocks = getattr(flats, "blocks", None)  # 8-bit scales: (rows, row_numel // block)
        for bucket, flat in zip(layout.buckets, flats, strict=True):
            if flat is None:  # this bucket has no value here
                continue
            for leaf in layout.bucket_leaves(bucket):
                spec = spec_in(leaf, blocks, bucket.index)
                out.append(_write_of(spec, blocks is not None, flat, prefix))
        return out

    def _write_of(spec: LeafSpec, scales: bool, flat: torch.Tensor, prefix: Keys) -> ArrayWrite:
        writers, r = Writers.of(layout, spec), layout.spec_rank(spec)
        start, stop, piece = writers.rows(spec)
        if not coords.writes(spec.name):  # replicated over "tensor": tensor rank 0 writes
            start = stop = spec.rows
        data = view = None
        keys = (*prefix, spec.name)
        if stop > start:
            view = writers.local_rows(flat, spec, r, start, stop).detach()
            gathered_later = coords.gathers(spec.name)  # staged once gathered, below
            data = stage(keys, view) if stage is not None and not gathered_later else view
        split = coords.split(spec.name, scales)
        if scales:
            start, stop, box = coords.scale_rows(spec.name, start, stop, spec.row_numel)
        else:
            start, stop, box = coords.rows(spec.name, start, stop)
        shape = coords.shape(spec.name, spec.shape, scales)
        row = math.prod(shape[1:]) if coords.gathers(spec.name) else spec.row_numel
        chunk = chunk_rows(piece, row * flat.element_size(), chunk_bytes)
        write = ArrayWrite(keys, shape, flat.dtype, chunk, start, stop, data, None, split)
        if not coords.gathers(spec.name):
            write.box = box
        elif view is not None:  # whole rows: gathered over "tensor" below, in one order
            gathered.append((write, view, scales))
        return write

    arrays = rows_of(state.master, ("params",))
    map_opt(
        state.opt_state,
        n,
        lambda p, x: arrays.extend(rows_of(x, ("opt_state", *p))),
        lambda p, x: x,
    )
    for write, view, scales in sorted(gathered, key=lambda g: g[0].keys):
        # on the state's device (the tensor group's backend); every tensor rank gets the rows
        # and tensor rank 0 writes them
        rows = coords.gather(write.keys[-1], view, scales)
        write.data = rows
        if not coords.writes_gathered():
            write.start = write.stop = write.shape[0]
            write.data = None
        elif stage is not None:
            write.data = stage(write.keys, rows)
    scalars = {("opt_state", *p): v for p, v in opt_layout(state.opt_state, n)[1].items()}
    scalars[("step",)] = int(state.step)
    if state.loss_scale is not None:
        scalars[("loss_scale", "scale")] = float(state.loss_scale.scale)
        scalars[("loss_scale", "good_steps")] = int(state.loss_scale.good_steps)
    order = {name: i for i, name in enumerate(layout.names)}
    arrays.sort(key=lambda a: (a.keys[:-1], order[a.keys[-1]]))
    return arrays + buffer_writes(state, stage=stage, chunk_bytes=chunk_bytes), scalars


def buffer_writes(
    state: TrainState,
    *,
    stage: Callable[[Keys, torch.Tensor], torch.Tensor] | None,
    chunk_bytes: int,
) -> list[ArrayWrite]:
    """The model's persistent buffers (:mod:`funcshard.state.buffers`) as ``("buffers", name)``
    arrays, whole: every rank holds the same values, so the first rank of the data-parallel
    world of tensor rank 0 writes them (staged: the loop may update them during the write)."""
    layout = state.layout
    world = mesh_lib.world_group(layout.mesh)
    writes = dist.get_rank(world) == 0 and layout.tensor.rank == 0
    out = []
    for name, tensor in state.buffers.values().items():
        keys = ("buffers", name)
        rows = tensor.shape[0] if tensor.dim() else 1
        data = None
        if writes:
            data = tensor.detach().reshape(rows, *tensor.shape[1:])
            data = stage(keys, data) if stage is not None else data
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        chunk = chunk_rows(rows, row_bytes, chunk_bytes)
        start = 0 if writes else rows
        out.append(ArrayWrite(keys, tuple(tensor.shape), tensor.dtype, chunk, start, rows, data))
    return out


def align_chunks(arrays: list[ArrayWrite], group, chunk_bytes: int) -> None:
    """Rows per chunk of every array of a tensor-parallel state, such that no chunk has two
    writers: a divisor of every writer's boundary, the writers of all tensor ranks (a small
    collective of metadata on ``group``; every rank computes the same)."""
    mine = {a.keys: (a.start, a.stop) for a in arrays if a.data is not None}
    bounds = coords_lib.gather_bounds(group, mine)
    for a in arrays:
        if not a.shape:
            continue
        piece = coords_lib.chunk_gcd(bounds.get(a.keys, ()), a.shape[0])
        dims = list(a.shape[1:])
        if a.split is not None:
            dims[a.split[0] - 1] = a.split[1]
        row_bytes = math.prod(dims) * a.dtype.itemsize
        a.chunk_rows = chunk_rows(piece, row_bytes, chunk_bytes)
