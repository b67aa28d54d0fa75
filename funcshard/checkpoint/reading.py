"""Filling a target layout's flat buffers from any ``Source``: the rows each rank needs, into
new buffers (a failed read leaves the target state as it was), then the new state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from typing import Any

import torch

from funcshard import sharding as shard_lib
from funcshard.buckets import BlockScales, PerBucket
from funcshard.checkpoint.coords import Coords, row_blocks, scale_widths
from funcshard.checkpoint.format import Keys
from funcshard.checkpoint.matching import conversions, source_blocks
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.checkpoint.tree import (
    map_opt,
    spec_in,
)
from funcshard.layout import Bucket, Layout
from funcshard.optim.moments import MomentFormat
from funcshard.state import LossScale, TrainState, derive_compute
from funcshard.tensor_parallel import chunk_sizes

__all__ = ["Read", "read"]


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
    coords = Coords(layout.tensor)
    blocks = getattr(flats, "blocks", None)
    requests = []
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
        for spec in layout.bucket_leaves(bucket):
            spec = spec_in(spec, blocks, bucket.index)
            start, stop = spec.row_range(r)
            real = (stop - start) * spec.row_numel
            flat[spec.offset + real : spec.offset + spec.shard_numel].zero_()
            if stop > start and (*prefix, spec.name) not in skip:
                keys = (*prefix, spec.name)
                out = shard_lib.rows_view(flat, spec, r)
                if blocks is None:  # this tensor rank's part of the global array
                    start, stop, box = coords.rows(spec.name, start, stop)
                else:
                    start, stop, box = coords.scale_rows(spec.name, start, stop, spec.row_numel)
                requests.append(ReadRequest(keymap.get(keys, keys), start, stop, out, box))
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
        convert = conversions(layout, old_opt, source.arrays(), source.info)

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
    """Fills the moments stored 8-bit on one side only, or with other blocks: this rank's rows
    are read as stored (whole global rows when 8-bit: its scales are the source's tensor ranks'
    side by side), dequantized to fp32 with the source's blocks, this rank's part taken, and
    cast, or quantized (scales computed with this layout's blocks)."""
    n, r = len(layout.buckets), layout.shard_rank
    coords = Coords(layout.tensor)
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
        full = coords.shape(spec.name, spec.shape)
        dtype_name = found[keys][1]
        g_start, g_stop, box = coords.rows(spec.name, start, stop)
        src_scales = None
        if scale_src is None:
            src = torch.empty((stop - start, *spec.shape[1:]), dtype=torch.float32)
            requests.append(ReadRequest(keys, g_start, g_stop, src, box))
        else:  # whole rows: the source's blocks may cross this rank's box
            src = torch.empty((stop - start, *full[1:]), dtype=_TORCH_8BIT[dtype_name])
            requests.append(ReadRequest(keys, g_start, g_stop, src))
            cols = found[scale_src][0][1]
            src_scales = torch.empty(stop - start, cols, dtype=torch.float32)
            requests.append(ReadRequest(scale_src, g_start, g_stop, src_scales))
        jobs.append((keys, scale_src, spec, full, src, src_scales, box))
    source.read_into(requests)
    for keys, scale_src, spec, full, src, src_scales, box in jobs:
        wide = src.float()
        if src_scales is not None:
            wide = _dequantized(source.info, scale_src, spec.name, full, src, src_scales)
            if box is not None:
                wide = wide.narrow(box[0], box[1], box[2] - box[1])
        wide = wide.contiguous().reshape(-1)
        flat = parts[keys[:-1]][spec.bucket]
        values = shard_lib.rows_view(flat, spec, r)
        scale_part = parts.get((*keys[:-2], keys[-2] + "_scale"))
        wide = wide.to(flat.device)
        if isinstance(scale_part, BlockScales) and scale_part.blocks[spec.bucket] is not None:
            block = scale_part.blocks[spec.bucket]
            scales = shard_lib.rows_view(scale_part[spec.bucket], spec.scales(block), r)
            MomentFormat(flat.dtype, block).encode(wide, values.view(-1), scales.view(-1))
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
