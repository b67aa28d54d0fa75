"""Filling a target layout's flat buffers from any ``Source``, in two phases.

``plan`` settles what is read where (with the scalars, read at once) and writes nothing;
``Plan.check`` has the source read and verify every byte the rank will read, keeping none
(``Source.check``). Only then, once every rank has checked (``restore``'s agreement),
``Plan.fill`` reads into the target's buffers: ``like``'s own, donated, so a restore needs
about one leaf of scratch instead of a second state. A ``like`` from a meta-device model has
no buffers: those are made here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from typing import Any

import torch

from funcshard.checkpoint.coords import Coords, row_blocks, scale_widths
from funcshard.checkpoint.format import Keys
from funcshard.checkpoint.matching import conversions, source_blocks
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.checkpoint.tree import (
    map_opt,
    spec_in,
)
from funcshard.layout import sharding as shard_lib
from funcshard.layout.buckets import BlockScales, PerBucket
from funcshard.layout.layout import Bucket, Layout
from funcshard.optim.moments import MomentFormat
from funcshard.parallel.tensor import chunk_sizes
from funcshard.state.state import Donation, LossScale, TrainState, derive_compute

__all__ = ["Plan", "plan"]


def _target(
    old: torch.Tensor, bucket: Bucket, layout: Layout, *, pin: bool = False
) -> torch.Tensor:
    """``old`` (``like``'s buffer, read into in place once donated), or where it is on the
    meta device (an unfilled ``like``), a fresh flat where ``fs.init`` puts it. ``pin``: an
    offloaded master on a CUDA layout is page-locked, as ``fs.init`` makes it."""
    if not old.is_meta:
        return old
    device = torch.device("cpu") if bucket.offload else layout.device
    flat = torch.empty(old.numel(), dtype=old.dtype, device=device)
    if pin and bucket.offload and layout.device.type == "cuda":
        flat = flat.pin_memory()
    return flat


def _requests(
    flats: Sequence[torch.Tensor | None],
    layout: Layout,
    prefix: Keys,
    keymap: dict[Keys, Keys],
    skip: Container[Keys] = (),
) -> list[ReadRequest]:
    """This rank's real rows of every leaf of the bucket flats (leaves in ``skip`` are
    converted, not read), each into its rows of the flat."""
    coords = Coords(layout.tensor)
    blocks = getattr(flats, "blocks", None)
    requests = []
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
        r = layout.over(bucket).shard_rank
        for spec in layout.bucket_leaves(bucket):
            spec = spec_in(spec, blocks, bucket.index)
            start, stop = spec.row_range(r)
            keys = (*prefix, spec.name)
            if stop > start and keys not in skip:
                out = shard_lib.rows_view(flat, spec, r)
                if blocks is None:  # this tensor rank's part of the global array
                    start, stop, box = coords.rows(spec.name, start, stop)
                else:
                    start, stop, box = coords.scale_rows(spec.name, start, stop, spec.row_numel)
                requests.append(ReadRequest(keymap.get(keys, keys), start, stop, out, box))
    return requests


def _zero_padding(flats: Sequence[torch.Tensor | None], layout: Layout) -> None:
    """Zeroes the padding rows of every leaf of the bucket flats."""
    blocks = getattr(flats, "blocks", None)
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
        r = layout.over(bucket).shard_rank
        for spec in layout.bucket_leaves(bucket):
            spec = spec_in(spec, blocks, bucket.index)
            start, stop = spec.row_range(r)
            real = (stop - start) * spec.row_numel
            flat[spec.offset + real : spec.offset + spec.shard_numel].zero_()


@dataclasses.dataclass
class Plan:
    """What a restore reads where: the target buffers (``like``'s own where it has them),
    the requests into them, the moments to convert and the scalars, already read."""

    source: Source
    model_only: bool
    master: tuple[torch.Tensor, ...]
    opt_state: Any  # None with model_only: the optimizer's init makes it from the masters
    flats: list[Sequence[torch.Tensor | None]]  # every target part, for its padding
    requests: list[ReadRequest]
    conversions: list[_Conversion]
    step: int
    loss_scale: LossScale | None

    def check(self) -> None:
        """Has the source read (and verify) every byte ``fill`` reads, keeping none; writes
        no target buffer."""
        self.source.check(self.requests + _conversion_requests(self))

    def fill(self, donated: Donation) -> None:
        """Reads every leaf into the target buffers (``donated``'s: ``like``'s, consumed);
        with ``model_only`` the optimizer state is ``init(master)``, made once ``like``'s is
        released."""
        layout = donated.layout
        for flats in self.flats:
            _zero_padding(flats, layout)
        self.source.read_into(self.requests)
        if self.model_only:
            self.opt_state = donated.optimizer.init(layout.per_bucket(self.master))
        elif self.conversions:
            _convert_moments(layout, self.source, self.opt_state, self.conversions)

    def state(self, donated: Donation, compute: tuple[torch.Tensor | None, ...]) -> TrainState:
        """The restored state, from ``fill``'s buffers and ``compute`` (``derive_compute``
        into ``donated.compute``)."""
        return donated.state(
            master=self.master,
            compute=compute,
            opt_state=self.opt_state,
            step=self.step,
            loss_scale=self.loss_scale,
        )


def derive(donated: Donation, master: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """The compute copies of the restored masters, written into ``like``'s (a collective
    under ZeRO 1-2)."""
    return derive_compute(donated.layout, master, into=donated.compute)


def plan(
    like: TrainState, source: Source, *, model_only: bool, keymap: dict[Keys, Keys] | None = None
) -> Plan:
    """What restoring ``like``'s layout from ``source`` reads where; reads only scalars,
    writes nothing, runs no collective.

    Masters are read (cast to the master dtype); with ``model_only`` the optimizer state is
    ``like.optimizer.init(master)`` and the step 0, otherwise both are read too.
    """
    layout = like.layout
    keymap = keymap or {}
    n = len(layout.buckets)
    master = tuple(
        _target(m, b, layout, pin=True) for m, b in zip(like.master, layout.buckets, strict=True)
    )
    requests = _requests(master, layout, ("params",), keymap)
    flats: list[Sequence[torch.Tensor | None]] = [master]
    opt_state, jobs, step = None, [], 0
    if not model_only:
        convert = conversions(layout, like.opt_state, source.arrays(), source.info)

        def buckets(path: Keys, olds: PerBucket) -> PerBucket:
            targets = olds.with_entries(
                None if o is None else _target(o, b, layout)
                for o, b in zip(olds, layout.buckets, strict=True)
            )
            requests.extend(_requests(targets, layout, ("opt_state", *path), keymap, convert))
            flats.append(targets)
            return targets

        opt_state = map_opt(
            like.opt_state,
            n,
            buckets,
            lambda p, x: type(x)(source.read_scalar(("opt_state", *p))),
        )
        step = int(source.read_scalar(("step",)))
        if convert:
            jobs = _conversions(layout, source, opt_state, convert)
    loss_scale = like.loss_scale
    if loss_scale is not None:
        loss_scale = LossScale(float(layout.policy.loss_scale_init), 0)
        if not model_only and ("loss_scale", "scale") in source.scalars():
            loss_scale = LossScale(
                float(source.read_scalar(("loss_scale", "scale"))),
                int(source.read_scalar(("loss_scale", "good_steps"))),
            )
    return Plan(source, model_only, master, opt_state, flats, requests, jobs, step, loss_scale)


@dataclasses.dataclass(frozen=True)
class _Conversion:
    """A moment stored 8-bit on one side only, or with other blocks: this rank's rows as stored
    (``rows``: its ``out`` on the meta device, for its shape and dtype; whole global rows when
    the source is 8-bit, since its blocks may cross this rank's ``box``) and the source's
    scales of them (``scales``, None when the source is not 8-bit)."""

    keys: Keys
    rows: ReadRequest
    scales: ReadRequest | None
    full: tuple[int, ...]  # the leaf's global shape
    box: tuple[int, int, int] | None  # this rank's part of a whole row: (dim, start, stop)


def _conversions(
    layout: Layout, source: Source, opt_state: Any, convert: dict[Keys, Keys | None]
) -> list[_Conversion]:
    """What converting each moment of ``convert`` reads (nothing is read here)."""
    n = len(layout.buckets)
    coords = Coords(layout.tensor)
    parts: dict[Keys, PerBucket] = {}
    map_opt(opt_state, n, lambda p, x: parts.__setitem__(("opt_state", *p), x), lambda p, x: x)
    found = source.arrays()
    out = []
    for keys, scale_src in convert.items():
        if isinstance(parts[keys[:-1]], BlockScales):
            continue  # computed with its moment
        spec = layout.leaf(keys[-1])
        start, stop = spec.row_range(layout.spec_rank(spec))
        if stop == start:
            continue
        full = coords.shape(spec.name, spec.shape)
        g_start, g_stop, box = coords.rows(spec.name, start, stop)
        if scale_src is None:
            rows = torch.empty((stop - start, *spec.shape[1:]), dtype=torch.float32, device="meta")
            request = ReadRequest(keys, g_start, g_stop, rows, box)
            out.append(_Conversion(keys, request, None, full, None))
            continue
        dtype = _TORCH_8BIT[found[keys][1]]
        rows = torch.empty((stop - start, *full[1:]), dtype=dtype, device="meta")
        cols = found[scale_src][0][1]
        src = torch.empty(stop - start, cols, dtype=torch.float32, device="meta")
        scales = ReadRequest(scale_src, g_start, g_stop, src)
        request = ReadRequest(keys, g_start, g_stop, rows)
        out.append(_Conversion(keys, request, scales, full, box))
    return out


def _conversion_requests(plan: Plan) -> list[ReadRequest]:
    return [r for c in plan.conversions for r in (c.rows, c.scales) if r is not None]


def _real(request: ReadRequest) -> ReadRequest:
    """``request`` with a fresh CPU ``out`` of its meta one's shape and dtype."""
    out = torch.empty(request.out.shape, dtype=request.out.dtype)
    return request._replace(out=out)


def _convert_moments(
    layout: Layout, source: Source, opt_state: Any, jobs: list[_Conversion]
) -> None:
    """Fills the moments stored 8-bit on one side only, one leaf at a time (so one leaf's
    rows are in scratch): this rank's rows are read as stored, dequantized to fp32 (with the
    source's scales) and cast, or quantized (scales computed)."""
    n = len(layout.buckets)
    parts: dict[Keys, PerBucket] = {}
    map_opt(opt_state, n, lambda p, x: parts.__setitem__(("opt_state", *p), x), lambda p, x: x)
    for job in jobs:
        keys, spec = job.keys, layout.leaf(job.keys[-1])
        r = layout.spec_rank(spec)
        rows = _real(job.rows)
        scales = None if job.scales is None else _real(job.scales)
        source.read_into([rows] if scales is None else [rows, scales])
        src = rows.out
        wide = src.float()
        if scales is not None:
            wide = _dequantized(source.info, job.scales.keys, spec.name, job.full, src, scales.out)
            if job.box is not None:
                wide = wide.narrow(job.box[0], job.box[1], job.box[2] - job.box[1])
        wide = wide.contiguous().reshape(-1)
        del src, rows
        flat = parts[keys[:-1]][spec.bucket]
        values = shard_lib.rows_view(flat, spec, r)
        scale_part = parts.get((*keys[:-2], keys[-2] + "_scale"))
        wide = wide.to(flat.device)
        if isinstance(scale_part, BlockScales) and scale_part.blocks[spec.bucket] is not None:
            block = scale_part.blocks[spec.bucket]
            out_scales = shard_lib.rows_view(scale_part[spec.bucket], spec.scales(block), r)
            MomentFormat(flat.dtype, block).encode(wide, values.view(-1), out_scales.view(-1))
        else:
            values.copy_(wide.view(values.shape).to(values.device))


def _dequantized(
    info: dict | None,
    scale_key: Keys,
    name: str,
    full: tuple[int, ...],
    values: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """Whole global rows of an 8-bit moment as fp32, each source tensor rank's piece of a row
    decoded with its blocks and its scales (side by side in ``scales``' rows)."""
    dim, size = source_blocks(info, name, full)
    blocks, widths = row_blocks(full, dim, size), scale_widths(full, dim, size)
    if None in blocks or scales.shape[1] != sum(widths):
        raise ValueError(
            f"checkpoint: {'/'.join(scale_key)} has {scales.shape[1]} scales a row for "
            f"{name!r} of shape {full}; expected {sum(widths)}, the blocks of "
            f"funcshard.optim.moments.block_of over {size} tensor rank(s): {blocks}"
        )
    out = torch.empty(values.shape, dtype=torch.float32)
    d = 1 if dim is None or dim == 0 else dim
    pieces = [full[d]] if len(blocks) == 1 else chunk_sizes(full[d], size)
    lo = at = 0
    for block, width, cols in zip(blocks, widths, pieces, strict=True):
        piece = values.narrow(d, lo, cols).contiguous()
        got = torch.empty(piece.shape, dtype=torch.float32)
        own = scales[:, at : at + width].contiguous()
        MomentFormat(values.dtype, block).decode(piece.reshape(-1), own.reshape(-1), got.view(-1))
        out.narrow(d, lo, cols).copy_(got)
        lo, at = lo + cols, at + width
    return out


_TORCH_8BIT = {"int8": torch.int8, "uint8": torch.uint8}


def materialized(like: TrainState) -> TrainState:
    """``like`` (from a meta-device model, unfilled) with fresh buffers where ``fs.init`` puts
    them for its masters and optimizer state, and its model's persistent buffers made on the
    layout's device, for values copied in whole (the local tier's); ``like`` itself when
    filled. Nothing is read, no collective."""
    if like.filled:
        return like
    layout = like.layout
    for name in like.buffers.names:
        buf = like.buffers.get(name)
        if buf.device.type == "meta":  # made in every tree holding it (a pipeline's stages)
            made = torch.empty(buf.shape, dtype=buf.dtype, device=layout.device)
            like.buffers.load(name, made, layout.device)
    pairs = zip(like.master, layout.buckets, strict=True)
    master = tuple(_target(m, b, layout, pin=True) for m, b in pairs)

    def buckets(path: Keys, olds: PerBucket) -> PerBucket:
        targets = zip(olds, layout.buckets, strict=True)
        return olds.with_entries(None if o is None else _target(o, b, layout) for o, b in targets)

    opt_state = map_opt(like.opt_state, len(layout.buckets), buckets, lambda p, x: x)
    return like.replace(master=master, opt_state=opt_state)
