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

from funcshard import sharding as shard_lib
from funcshard.buckets import BlockScales, PerBucket, scale_index
from funcshard.checkpoint.coords import Coords
from funcshard.checkpoint.format import Keys
from funcshard.checkpoint.matching import conversions
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.checkpoint.tree import (
    map_opt,
    spec_in,
)
from funcshard.layout import Bucket, Layout
from funcshard.optim.moments import MomentFormat, block_of
from funcshard.state import Donation, LossScale, TrainState, derive_compute

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
    r = layout.shard_rank
    coords = Coords(layout.tensor)
    blocks = getattr(flats, "blocks", None)
    requests = []
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
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
    r = layout.shard_rank
    blocks = getattr(flats, "blocks", None)
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
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
        convert = conversions(layout, like.opt_state, source.arrays())

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
    """A moment stored 8-bit on one side only: this rank's rows as stored (``rows``: its
    ``out`` on the meta device, for its shape and dtype) and the source's scales of them
    (``scales``, None when the target quantizes), dequantized in blocks of ``block``."""

    keys: Keys
    rows: ReadRequest
    scales: ReadRequest | None
    block: int | None


def _conversions(
    layout: Layout, source: Source, opt_state: Any, convert: dict[Keys, Keys | None]
) -> list[_Conversion]:
    """What converting each moment of ``convert`` reads (nothing is read here).

    Raises:
      NotImplementedError: an 8-bit moment split along a dim >= 1 by the tensor axis.
      ValueError: the source holds another number of scales a row than the blocks need.
    """
    n, r = len(layout.buckets), layout.shard_rank
    coords = Coords(layout.tensor)
    parts: dict[Keys, PerBucket] = {}
    map_opt(opt_state, n, lambda p, x: parts.__setitem__(("opt_state", *p), x), lambda p, x: x)
    found = source.arrays()
    out = []
    for keys, scale_src in convert.items():
        if isinstance(parts[keys[:-1]], BlockScales):
            continue  # computed with its moment
        spec = layout.leaf(keys[-1])
        start, stop = spec.row_range(r)
        if stop == start:
            continue
        dtype = _TORCH_8BIT.get(found[keys][1], torch.float32)
        rows = torch.empty((stop - start, *spec.shape[1:]), dtype=dtype, device="meta")
        g_start, g_stop, box = coords.rows(spec.name, start, stop)
        scales, block = None, None
        if scale_src is not None:
            where = "/".join(scale_src)
            if box is not None:
                raise NotImplementedError(
                    f"checkpoint: {where}: converting the 8-bit moment of "
                    f"{spec.name!r}, split over the tensor axis along a dim >= 1, to another "
                    "moment dtype; restore it with the moment dtypes it was saved with"
                )
            cols = found[scale_src][0][1]
            block = block_of(spec.shape)
            if block is None or cols != scale_index(block, spec.row_numel):
                raise ValueError(
                    f"checkpoint: {where} has {cols} scales a row for {spec.name!r} of shape "
                    f"{spec.shape}; expected the blocks of "
                    f"funcshard.optim.moments.block_of: {block}"
                )
            src = torch.empty(stop - start, cols, dtype=torch.float32, device="meta")
            scales = ReadRequest(scale_src, g_start, g_stop, src)
        out.append(_Conversion(keys, ReadRequest(keys, g_start, g_stop, rows, box), scales, block))
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
    n, r = len(layout.buckets), layout.shard_rank
    parts: dict[Keys, PerBucket] = {}
    map_opt(opt_state, n, lambda p, x: parts.__setitem__(("opt_state", *p), x), lambda p, x: x)
    for job in jobs:
        keys, spec = job.keys, layout.leaf(job.keys[-1])
        rows = _real(job.rows)
        scales = None if job.scales is None else _real(job.scales)
        source.read_into([rows] if scales is None else [rows, scales])
        src = rows.out
        wide = src.float().reshape(-1)
        if scales is not None:
            wide = torch.empty(src.numel(), dtype=torch.float32)
            MomentFormat(src.dtype, job.block).decode(src.reshape(-1), scales.out.reshape(-1), wide)
        del src, rows
        flat = parts[keys[:-1]][spec.bucket]
        values = shard_lib.rows_view(flat, spec, r)
        scale_part = parts.get((*keys[:-2], keys[-2] + "_scale"))
        wide = wide.to(flat.device)
        if scales is None and isinstance(scale_part, BlockScales):
            block = scale_part.blocks[spec.bucket]
            out_scales = shard_lib.rows_view(scale_part[spec.bucket], spec.scales(block), r)
            MomentFormat(flat.dtype, block).encode(wide, values.view(-1), out_scales.view(-1))
        else:
            values.copy_(wide.view(values.shape).to(values.device))


_TORCH_8BIT = {"int8": torch.int8, "uint8": torch.uint8}
