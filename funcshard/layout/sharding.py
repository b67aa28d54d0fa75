"""Moving between full tensors, per-rank flat shards and the collectives' rank-section layout
(pure layout transforms: the gathers are :mod:`funcshard.comm.params`').

Three layouts of one bucket (local numel ``L``, shard count ``S``):

* local flat (``L``): this rank's padded rows of every leaf, leaf after leaf. Masters, grads
  and optimizer state live like this.
* rank sections (``S * L``): the local flats of ranks 0..S-1 back to back: the output of an
  all-gather and the input of a reduce-scatter.
* full (``S * L``): each leaf's padded full tensor, leaf after leaf, so a leaf is a contiguous
  view. Gathered params and per-bucket full compute params live like this.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import ops
from funcshard.layout.build import build_layout
from funcshard.layout.layout import LeafSpec
from funcshard.layout.policy import MixedPrecisionPolicy

__all__ = ["shard"]


def full_view(full: torch.Tensor, spec: LeafSpec, shard_size: int) -> torch.Tensor:
    """Leaf ``spec`` (real rows only, its own shape) inside a bucket's full buffer."""
    start = shard_size * spec.offset
    return full[start : start + spec.numel].view(spec.shape)


def local_view(flat: torch.Tensor, spec: LeafSpec, shard_rank: int) -> torch.Tensor:
    """This rank's real rows of leaf ``spec`` inside a bucket's local flat buffer (a 0-d leaf:
    shape ``()`` on the rank that holds it, ``(0,)`` elsewhere)."""
    return rows_view(flat, spec, shard_rank).view(spec.shard_shape(shard_rank))


def rows_view(flat: torch.Tensor, spec: LeafSpec, shard_rank: int) -> torch.Tensor:
    """``local_view`` with a leading row dimension even for a 0-d leaf (one row)."""
    start, stop = spec.row_range(shard_rank)
    n = (stop - start) * spec.row_numel
    return flat[spec.offset : spec.offset + n].view(stop - start, *spec.shape[1:])


def pack_local(
    tensors: list[torch.Tensor],
    specs: list[LeafSpec],
    shard_rank: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Cuts this rank's rows out of full tensors into one zero-padded local flat buffer."""
    numel = sum(s.shard_numel for s in specs)
    if any(t.is_meta for t in tensors) or torch.device(device).type == "meta":
        return torch.empty(numel, dtype=dtype, device="meta")
    flat = torch.zeros(numel, dtype=dtype, device=device)
    for t, spec in zip(tensors, specs, strict=True):
        start, stop = spec.row_range(shard_rank)
        rows = t.detach().reshape(spec.rows, spec.row_numel)[start:stop]
        flat[spec.offset : spec.offset + rows.numel()].copy_(rows.reshape(-1))
    return flat


def to_rank_sections(
    grads: list[torch.Tensor | None],
    specs: list[LeafSpec],
    shard_size: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Full per-leaf tensors (None = zero) into the reduce-scatter input layout, cast to dtype,
    on ``device`` (default: the gradients'; it matters when every one is None)."""
    ref = next((g for g in grads if g is not None), None)
    device = device if device is not None else ref.device if ref is not None else "cpu"
    numel = shard_size * sum(s.shard_numel for s in specs)
    if ref is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    if all(s.numel > 0 and s.rows_per_shard == -(-s.rows // shard_size) for s in specs):
        # One kernel pads every leaf's rows to a multiple of shard_size, cuts them into
        # shard_size chunks and writes chunk r of every leaf into section r, casting on the way.
        parts = [
            g.reshape(s.rows, s.row_numel) if g is not None else ref.new_zeros(s.rows, s.row_numel)
            for g, s in zip(grads, specs, strict=True)
        ]
        out = torch.empty(numel, dtype=dtype, device=device)
        torch._chunk_cat(parts, dim=0, num_chunks=shard_size, out=out.view(shard_size, -1))
        return out
    parts = []
    for g, spec in zip(grads, specs, strict=True):
        if g is None:
            parts.append(torch.zeros(shard_size, spec.shard_numel, dtype=dtype, device=device))
            continue
        rows = g.reshape(spec.rows, spec.row_numel)
        pad = shard_size * spec.rows_per_shard - spec.rows
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, spec.row_numel)])
        parts.append(rows.view(shard_size, spec.shard_numel).to(dtype))
    return torch.cat(parts, dim=1).reshape(-1)


def add_to_rank_sections(
    acc: torch.Tensor, grads: list[torch.Tensor | None], specs: list[LeafSpec], shard_size: int
) -> None:
    """``acc += to_rank_sections(grads, specs, shard_size, acc.dtype)`` in one pass: each
    leaf's gradient is added straight into its place in every section of ``acc`` (a leaf whose
    rows do not split evenly goes through a padded copy). The same bits as the two-pass form:
    a gradient widened to ``acc.dtype`` is exact, and each element gets one addition."""
    sections = acc.view(shard_size, -1)
    dst, src = [], []
    for g, spec in zip(grads, specs, strict=True):
        if g is None or spec.numel == 0:
            continue
        rows = g.reshape(spec.rows, spec.row_numel)
        pad = shard_size * spec.rows_per_shard - spec.rows
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, spec.row_numel)])
        dst.append(sections[:, spec.offset : spec.offset + spec.shard_numel])
        src.append(rows.reshape(shard_size, spec.shard_numel))  # a transposed grad copies
    if dst:
        torch._foreach_add_(dst, src)


def from_rank_sections(
    sections: torch.Tensor, specs: list[LeafSpec], shard_size: int
) -> torch.Tensor:
    """All-gather output layout into the full layout (a leaf becomes one contiguous range)."""
    if shard_size == 1:
        return sections
    return ops.place_rank_sections(sections, [s.shard_numel for s in specs], shard_size)


def to_sections(
    full: torch.Tensor, specs: list[LeafSpec], shard_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of :func:`from_rank_sections`, cast to ``dtype`` on the way (a new tensor):
    a full-layout flat into the rank sections a reduce-scatter takes."""
    out = torch.empty(full.numel(), dtype=dtype, device=full.device)
    if shard_size == 1:
        return out.copy_(full)
    sections = out.view(shard_size, -1)
    dst = [sections[:, s.offset : s.offset + s.shard_numel] for s in specs]
    src = [
        full[shard_size * s.offset : shard_size * (s.offset + s.shard_numel)].view(shard_size, -1)
        for s in specs
    ]
    torch._foreach_copy_(dst, src)
    return out


def shard(
    params: dict[str, torch.Tensor], mesh: DeviceMesh, /, *, strategy: str = "optim_grads_params"
) -> dict[str, torch.Tensor]:
    """This rank's part of each full parameter, as the strategy places master weights.

    Sharded strategies keep rows ``[r * ceil(n / S), (r + 1) * ceil(n / S))`` of dim 0 (fewer,
    possibly none, on the last ranks; padding is internal and never shown); ``no_shard`` keeps
    everything. On a mesh of 2 shard ranks, ``shard({"w": torch.arange(5.)}, mesh)["w"]`` is
    ``tensor([0., 1., 2.])`` on shard rank 0 and ``tensor([3., 4.])`` on shard rank 1.
    """
    layout = build_layout(
        {n: (tuple(p.shape), p.dtype) for n, p in params.items()},
        model=None,
        mesh=mesh,
        policy=MixedPrecisionPolicy(main_params_dtype=None, main_grads_dtype=None),
        strategy=strategy,
    )
    out = {}
    for bucket in layout.buckets:
        specs = layout.bucket_leaves(bucket)
        flat = pack_local(
            [params[s.name] for s in specs],
            specs,
            layout.shard_rank,
            dtype=bucket.dtypes.master,
            device=params[specs[0].name].device,
        )
        out.update({s.name: local_view(flat, s, layout.shard_rank) for s in specs})
    return {n: out[n] for n in params}
