"""A TrainState as keyed arrays and back.

Keys are tuples of strings: ``("params", name)``, ``("opt_state", *path, name)`` for every
per-bucket buffer of the optimizer state (``path``: NamedTuple fields and tuple indices down to
it), and scalars ``("opt_state", *path)``, ``("step",)``, ``("loss_scale", "scale")``.
Writing maps a state to the rows each rank writes; reading fills a target layout's flat
buffers from any ``Source`` (the rows each rank needs) and rebuilds the state.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch

from funcshard import mesh as mesh_lib
from funcshard import sharding as shard_lib
from funcshard.buckets import BlockScales, PerBucket, map_parts, scale_index
from funcshard.checkpoint.format import (
    EIGHT_BIT_NAMES,
    FLOAT_NAMES,
    FORMAT_VERSION,
    Keys,
    chunk_rows,
    param_dir,
)
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.layout import Bucket, Layout, LeafSpec
from funcshard.optim.moments import MomentFormat, block_of
from funcshard.state import LossScale, TrainState, derive_compute

__all__ = ["CheckpointMismatchError", "is_per_bucket", "plan_writes", "match", "read"]


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state; the message lists every mismatch."""


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
    (the walk is :func:`funcshard.buckets.map_parts`)."""

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


def _scale_path(path: Keys) -> Keys:
    return (*path[:-1], path[-1] + "_scale")


def _spec_in(spec: LeafSpec, blocks: tuple[int | None, ...] | None, bucket: int) -> LeafSpec:
    """``spec``, or the spec of its 8-bit scales when the part is a ``BlockScales``."""
    return spec if blocks is None else spec.scales(blocks[bucket])


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
        "step": int(state.step),
    }


# --- writing: the rows of each array this rank writes ---------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Writers:
    """How the rows of every array split among the writing ranks."""

    parts: int  # writers per array
    index: int  # this rank's writer index
    active: bool  # False on replicas that write nothing
    split: bool = False  # no_shard: every rank holds every row, so split them evenly

    @classmethod
    def of(cls, layout: Layout) -> Writers:
        mesh = layout.mesh
        if not layout.strategy.shards_optim:  # every rank holds everything: split the rows
            shard = mesh_lib.axis_size(mesh, "shard")
            index = mesh_lib.axis_rank(mesh, "replicate") * shard + mesh_lib.axis_rank(
                mesh, "shard"
            )
            return cls(layout.dp_size, index, True, split=True)
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
    data: torch.Tensor | None  # rows [start, stop); None when this rank writes none


def plan_writes(
    state: TrainState, *, stage: bool, chunk_bytes: int
) -> tuple[list[ArrayWrite], dict[Keys, Any]]:
    """What this rank writes: its rows of every array, and (all ranks know them) the scalars.

    ``stage`` copies the rows to fresh host memory (an asynchronous save must not see later
    in-place updates of the state's buffers).
    """
    layout = state.layout
    writers = Writers.of(layout)
    r = layout.shard_rank
    n = len(layout.buckets)

    def rows_of(flats: tuple[torch.Tensor | None, ...], prefix: Keys) -> list[ArrayWrite]:
        out = []
        blocks = getattr(flats, "blocks", None)  # 8-bit scales: (rows, row_numel // block)
        for bucket, flat in zip(layout.buckets, flats, strict=True):
            if flat is None:  # this bucket has no value here
                continue
            for spec in layout.bucket_leaves(bucket):
                spec = _spec_in(spec, blocks, bucket.index)
                start, stop, piece = writers.rows(spec)
                data = None
                if stop > start:
                    view = writers.local_rows(flat, spec, r, start, stop).detach()
                    data = view.to("cpu", copy=True) if stage else view
                chunk = chunk_rows(piece, spec.row_numel * flat.element_size(), chunk_bytes)
                out.append(
                    ArrayWrite(
                        (*prefix, spec.name), spec.shape, flat.dtype, chunk, start, stop, data
                    )
                )
        return out

    arrays = rows_of(state.master, ("params",))
    map_opt(
        state.opt_state,
        n,
        lambda p, x: arrays.extend(rows_of(x, ("opt_state", *p))),
        lambda p, x: x,
    )
    scalars = {("opt_state", *p): v for p, v in opt_layout(state.opt_state, n)[1].items()}
    scalars[("step",)] = int(state.step)
    if state.loss_scale is not None:
        scalars[("loss_scale", "scale")] = float(state.loss_scale.scale)
        scalars[("loss_scale", "good_steps")] = int(state.loss_scale.good_steps)
    order = {name: i for i, name in enumerate(layout.names)}
    arrays.sort(key=lambda a: (a.keys[:-1], order[a.keys[-1]]))
    return arrays, scalars


# --- reading: does the checkpoint fit, and which key feeds which leaf ------------------------


def _closest(
    name: str,
    shape: tuple[int, ...],
    candidates: dict[str, tuple[int, ...]],
    unpaired: set[str],
    n: int = 3,
) -> str:
    """Up to ``n`` candidates most like ``name``: unpaired ones first, then those of the same
    shape, then by ``difflib``'s similarity of the names."""

    def rank(c: str) -> tuple:
        return (
            c in unpaired,
            tuple(candidates[c]) == tuple(shape),
            difflib.SequenceMatcher(None, name, c).ratio(),
        )

    near = sorted(candidates, key=rank, reverse=True)[:n]
    return ", ".join(f"{c} {tuple(candidates[c])}" for c in near)


def expected_arrays(like: TrainState, model_only: bool) -> dict[Keys, tuple[int, ...]]:
    """Every array ``like``'s layout reads, by key, with its full shape."""
    layout = like.layout
    out: dict[Keys, tuple[int, ...]] = {("params", s.name): s.shape for s in layout.leaves}
    if not model_only:
        paths, _ = opt_layout(like.opt_state, len(layout.buckets))
        blocks = opt_blocks(like.opt_state, len(layout.buckets))
        for p, present in paths.items():
            for s in layout.leaves:
                if present[s.bucket]:
                    out[("opt_state", *p, s.name)] = _spec_in(s, blocks.get(p), s.bucket).shape
    return out


def _is_8bit(dtype_name: str) -> bool:
    return dtype_name in EIGHT_BIT_NAMES


def conversions(
    layout: Layout, opt_state: Any, found: dict[Keys, tuple]
) -> dict[Keys, Keys | None]:
    """Optimizer moments stored 8-bit on one side and not on the other: per target moment key,
    the source scale key it must be dequantized with (None: the source is not 8-bit and the
    target quantizes it); the target's scale keys of a moment it quantizes map to None."""
    n = len(layout.buckets)
    paths, _ = opt_layout(opt_state, n)
    blocks = opt_blocks(opt_state, n)
    out: dict[Keys, Keys | None] = {}
    for p, present in paths.items():
        if p in blocks:
            continue
        scale_blocks = blocks.get(_scale_path(p))
        for s in layout.leaves:
            keys = ("opt_state", *p, s.name)
            if not present[s.bucket] or keys not in found:
                continue
            target_8bit = scale_blocks is not None and scale_blocks[s.bucket] is not None
            source_8bit = _is_8bit(found[keys][1])
            if target_8bit and not source_8bit:
                out[keys] = None
                out[("opt_state", *_scale_path(p), s.name)] = None
            elif source_8bit and not target_8bit:
                out[keys] = ("opt_state", *_scale_path(p), s.name)
    return out


def _optimizer_problems(like: TrainState, source: Source) -> tuple[list[str], dict]:
    """What keeps ``source``'s optimizer state from ``like``'s, and the paths of its
    per-bucket parts."""
    paths, scalars = opt_layout(like.opt_state, len(like.layout.buckets))
    kind = opt_kind(like.opt_state)
    problems: list[str] = []
    if source.info is None:
        problems.append(
            "optimizer: the checkpoint was not written by funcshard (no "
            "optimizer state it can map); restore it with model_only=True"
        )
    elif source.info.get("optimizer") is None:
        problems.append(
            "optimizer: the checkpoint holds params only (converted); restore it with "
            "model_only=True"
        )
    elif source.info.get("optimizer") != kind:
        problems.append(
            f"optimizer: the checkpoint holds {source.info.get('optimizer')}, "
            f"the target state has {kind}"
        )
    have_scalars = source.scalars()
    for p in [("opt_state", *p) for p in scalars] + [("step",)]:
        if p not in have_scalars:
            problems.append(f"{param_dir(p)}: missing from the checkpoint")
    return problems, paths


def _unpaired_problems(
    expected: dict[Keys, tuple[int, ...]],
    found: dict,
    missing: list[Keys],
    extra: list[Keys],
) -> list[str]:
    """Expected arrays the checkpoint lacks and arrays it holds that nothing expects, each
    with the closest name on the other side."""
    held = {param_dir(k): s for k, (s, _) in found.items()}
    wanted = {param_dir(k): s for k, s in expected.items()}
    unpaired_held = {param_dir(k) for k in extra}
    unpaired_wanted = {param_dir(k) for k in missing}
    problems = []
    for keys in missing:
        near = _closest(param_dir(keys), expected[keys], held, unpaired_held)
        problems.append(
            f"{param_dir(keys)}: missing from the checkpoint (expected shape "
            f"{expected[keys]})" + (f"; closest there: {near}" if near else "")
        )
    for keys in extra:
        near = _closest(param_dir(keys), found[keys][0], wanted, unpaired_wanted)
        problems.append(
            f"{param_dir(keys)}: in the checkpoint but not in the target state "
            f"(shape {found[keys][0]})" + (f"; closest expected: {near}" if near else "")
        )
    return problems


def match(like: TrainState, source: Source, model_only: bool) -> tuple[list[str], dict[Keys, Keys]]:
    """Every way ``source`` does not fit ``like`` (empty when it fits), and for each expected
    key the source key that feeds it (itself, or a tied alias under which the source holds
    the weight)."""
    layout = like.layout
    found = source.arrays()
    expected = expected_arrays(like, model_only)
    keymap: dict[Keys, Keys] = {}
    problems, paths = ([], {}) if model_only else _optimizer_problems(like, source)
    missing: list[Keys] = []
    convert = {} if model_only else conversions(layout, like.opt_state, found)
    for keys, shape in expected.items():
        if keys in convert and convert[keys] is None and keys not in found:
            continue  # the scales of a moment the target quantizes from a wider one
        src = keys
        if keys not in found and keys[0] == "params":
            alias = next(
                (("params", a) for a in layout.aliases_of(keys[1]) if ("params", a) in found), None
            )
            src = alias or keys
        if src not in found:
            missing.append(keys)
            continue
        keymap[keys] = src
        got_shape, got_dtype = found[src]
        if got_shape != shape:
            problems.append(
                f"{param_dir(src)}: shape {got_shape} in the checkpoint, expected {shape}"
            )
        if got_dtype not in FLOAT_NAMES and not (keys[0] == "opt_state" and _is_8bit(got_dtype)):
            problems.append(
                f"{param_dir(src)}: dtype {got_dtype} in the checkpoint, expected a floating dtype"
            )
    prefixes = {("params",)} | {("opt_state", *p) for p in paths}
    used = set(keymap.values()) | {("params", a) for a, _ in layout.aliases}
    used |= {k for k in convert.values() if k is not None and k in found}
    extra = [k for k in found if k not in used and k[:-1] in prefixes]
    problems += _unpaired_problems(expected, found, missing, extra)
    if not model_only:
        problems += [
            f"{param_dir(k)}: optimizer state the target optimizer lacks"
            for k in found
            if k[:1] == ("opt_state",) and k not in used and k[:-1] not in prefixes
        ]
    return problems, keymap


def mismatch_error(where: str, problems: list[str], source: Source) -> CheckpointMismatchError:
    """One error listing every problem, and what the checkpoint's params are."""
    held = sorted((k, s) for k, (s, _) in source.arrays().items() if k[0] == "params")
    listing = ", ".join(f"{param_dir(k[1:])} {s}" for k, s in held[:40])
    more = f", ... ({len(held) - 40} more)" if len(held) > 40 else ""
    return CheckpointMismatchError(
        f"{where} does not fit the target state:\n  "
        + "\n  ".join(problems)
        + f"\n  the checkpoint's params ({len(held)}): {listing}{more}"
    )


# --- reading: filling the flat buffers ---------------------------------------------------------


def _new_flat(
    bucket: Bucket, layout: Layout, numel: int, dtype: torch.dtype, *, pin: bool = False
) -> torch.Tensor:
    """A fresh, unfilled flat for ``bucket``, where ``fs.init`` puts it. ``like``'s own
    buffers are never written: a restore that fails leaves ``like`` as it was. ``pin``: an
    offloaded master on a CUDA layout is page-locked, as ``fs.init`` makes it (it crosses to
    the device every step; the optimizer state stays on the host)."""
    device = torch.device("cpu") if bucket.offload else layout.device
    flat = torch.empty(numel, dtype=dtype, device=device)
    if pin and bucket.offload and layout.device.type == "cuda":
        flat = flat.pin_memory()
    return flat


def _fill(
    flats: Sequence[torch.Tensor | None],
    layout: Layout,
    source: Source,
    prefix: Keys,
    keymap: dict[Keys, Keys],
    skip: Container[Keys] = (),
) -> None:
    """Copies this rank's real rows of every leaf from ``source`` into the bucket flats and
    zeroes their padding rows (leaves in ``skip``: padding only; they are converted)."""
    r = layout.shard_rank
    blocks = getattr(flats, "blocks", None)
    requests = []
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
        for spec in layout.bucket_leaves(bucket):
            spec = _spec_in(spec, blocks, bucket.index)
            start, stop = spec.row_range(r)
            real = (stop - start) * spec.row_numel
            flat[spec.offset + real : spec.offset + spec.shard_numel].zero_()
            if stop > start and (*prefix, spec.name) not in skip:
                keys = (*prefix, spec.name)
                requests.append(
                    ReadRequest(
                        keymap.get(keys, keys), start, stop, shard_lib.rows_view(flat, spec, r)
                    )
                )
    source.read_into(requests)


@dataclasses.dataclass
class Read:
    """What ``read`` produced: every leaf of the new state but the derived compute copies."""

    master: tuple[torch.Tensor, ...]
    opt_state: Any
    step: int
    loss_scale: LossScale | None

    def derive_compute(self, like: TrainState) -> tuple[torch.Tensor | None, ...]:
        """The compute copies of the new masters (a collective under ZeRO 1-2)."""
        return derive_compute(like.layout, self.master)

    def assemble(
        self, like: TrainState, compute: tuple[torch.Tensor | None, ...] | None = None
    ) -> TrainState:
        """The new state; consumes ``like``, only now: a read that failed leaves it usable.
        ``compute``: from ``derive_compute`` (derived here when None; every rank calls it)."""
        if compute is None:
            compute = self.derive_compute(like)
        return like.donate("restore").state(
            master=self.master,
            compute=compute,
            opt_state=self.opt_state,
            step=self.step,
            loss_scale=self.loss_scale,
        )


def read(
    like: TrainState, source: Source, *, model_only: bool, keymap: dict[Keys, Keys] | None = None
) -> Read:
    """Reads every leaf for ``like``'s layout from ``source`` into new buffers, with no
    collectives; ``like`` is neither written nor consumed (``Read.assemble`` consumes it).

    Masters are read (cast to the master dtype); with ``model_only`` the optimizer state is
    ``like.optimizer.init(master)`` and the step 0, otherwise both are read too.
    """
    layout = like.layout
    keymap = keymap or {}
    n = len(layout.buckets)
    old_opt = like.opt_state  # checks that ``like`` is live
    master = tuple(_new_flat(b, layout, b.numel, b.dtypes.master, pin=True) for b in layout.buckets)
    _fill(master, layout, source, ("params",), keymap)
    if model_only:
        opt_state = like.optimizer.init(layout.per_bucket(master))
        step = 0
    else:
        convert = conversions(layout, old_opt, source.arrays())

        def buckets(path: Keys, olds: PerBucket) -> tuple:
            flats = olds.with_entries(
                None if o is None else _new_flat(b, layout, o.numel(), o.dtype)
                for o, b in zip(olds, layout.buckets, strict=True)
            )
            _fill(flats, layout, source, ("opt_state", *path), keymap, convert)
            return flats

        opt_state = map_opt(
            old_opt, n, buckets, lambda p, x: type(x)(source.read_scalar(("opt_state", *p)))
        )
        if convert:
            _convert_moments(layout, source, opt_state, convert)
        step = int(source.read_scalar(("step",)))
    loss_scale = like.loss_scale
    if loss_scale is not None:
        loss_scale = LossScale(float(layout.policy.loss_scale_init), 0)
        if not model_only and ("loss_scale", "scale") in source.scalars():
            loss_scale = LossScale(
                float(source.read_scalar(("loss_scale", "scale"))),
                int(source.read_scalar(("loss_scale", "good_steps"))),
            )
    return Read(master, opt_state, step, loss_scale)


def _convert_moments(
    layout: Layout, source: Source, opt_state: Any, convert: dict[Keys, Keys | None]
) -> None:
    """Fills the moments stored 8-bit on one side only: this rank's rows are read as stored,
    dequantized to fp32 (with the source's scales) and cast, or quantized (scales computed)."""
    n, r = len(layout.buckets), layout.shard_rank
    parts: dict[Keys, PerBucket] = {}
    map_opt(opt_state, n, lambda p, x: parts.__setitem__(("opt_state", *p), x), lambda p, x: x)
    found = source.arrays()
    requests, jobs = [], []
    for keys, scale_src in convert.items():
        part = parts[keys[:-1]]
        if isinstance(part, BlockScales):
            continue  # computed with its moment
        spec = layout.leaf(keys[-1])
        start, stop = spec.row_range(r)
        if stop == start:
            continue
        shape = (stop - start, *spec.shape[1:])
        dtype_name = found[keys][1]
        src = torch.empty(shape, dtype=_TORCH_8BIT.get(dtype_name, torch.float32))
        requests.append(ReadRequest(keys, start, stop, src))
        src_scales = None
        if scale_src is not None:
            cols = found[scale_src][0][1]
            src_scales = torch.empty(stop - start, cols, dtype=torch.float32)
            requests.append(ReadRequest(scale_src, start, stop, src_scales))
        jobs.append((keys, spec, src, src_scales))
    source.read_into(requests)
    for keys, spec, src, src_scales in jobs:
        wide = src.float().reshape(-1)
        if src_scales is not None:
            block = block_of(spec.shape)
            if block is None or src_scales.shape[1] != scale_index(block, spec.row_numel):
                raise ValueError(
                    f"checkpoint: {'/'.join(scale_src)} has {src_scales.shape[1]} scales a row "
                    f"for {spec.name!r} of shape {spec.shape}; expected the blocks of "
                    f"funcshard.optim.moments.block_of: {block}"
                )
            fmt = MomentFormat(src.dtype, block)
            wide = torch.empty(src.numel(), dtype=torch.float32)
            fmt.decode(src.reshape(-1), src_scales.reshape(-1), wide)
        flat = parts[keys[:-1]][spec.bucket]
        values = shard_lib.rows_view(flat, spec, r)
        scale_part = parts.get((*keys[:-2], keys[-2] + "_scale"))
        wide = wide.to(flat.device)
        if src_scales is None and isinstance(scale_part, BlockScales):
            block = scale_part.blocks[spec.bucket]
            scales = shard_lib.rows_view(scale_part[spec.bucket], spec.scales(block), r)
            MomentFormat(flat.dtype, block).encode(wide, values.view(-1), scales.view(-1))
        else:
            values.copy_(wide.view(values.shape).to(values.device))


_TORCH_8BIT = {"int8": torch.int8, "uint8": torch.uint8}
