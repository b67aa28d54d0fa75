"""Every rank of a layout's mesh built the same model: checked once, at ``fs.init``.

A rank whose model differs (a config read per rank, a sequence length taken from that rank's
data) may pack other shapes into buckets of the same sizes: the step's gathers and
reduce-scatters would then pair one rank's rows of a weight with another rank's rows of
another weight, with no error. Where a size differs, gloo aborted a rank in the first step
("collective mismatch"; a GPT whose position table was sized per rank); NCCL may hang.
:func:`check_same_model` compares one hash of the parameters' names, shapes and dtypes (and
the settings that shape the step's collectives: strategy, outer strategy, units, policy,
offload fraction, deterministic) across the mesh, two int64 in one all-reduce; only where they
differ does every rank send its lists, so that every rank raises the same :class:`ValueError`
naming the first setting or parameter that differs and the rank. A rank given other units,
another policy or offload fraction packs other buckets: gloo aborted in ``fs.init``'s first
collectives or the first step ("collective mismatch")."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from funcshard.distributed import mesh as mesh_lib
from funcshard.layout.layout import Layout

__all__ = ["check_same_model"]

Spec = list[tuple[str, tuple[int, ...], str]]
Settings = tuple[tuple[str, str], ...]


def spec_of(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Spec:
    """The parameters as compared: name, global shape and dtype, in name order."""
    return [(n, tuple(s), str(d).removeprefix("torch.")) for n, (s, d) in sorted(shapes.items())]


def settings_of(layout: Layout) -> Settings:
    """The layout's settings every rank must share, shown as compared: each decides the
    buckets or the collectives (a rank's own device, mesh and rows are not among them)."""
    return (
        ("strategy", repr(layout.strategy.value)),
        ("outer_strategy", repr(layout.outer.value)),
        ("units", repr(layout.units)),
        ("policy", repr(layout.policy)),
        ("offload_fraction", repr(layout.offload_fraction)),
        ("deterministic", repr(layout.deterministic)),
    )


def _digest(spec: Spec, settings: Settings) -> int:
    blob = repr((settings, spec)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2  # -h fits int64


def check_same_model(layout: Layout, named: dict[str, torch.Tensor]) -> None:
    """Raises ValueError on every rank of ``layout``'s mesh where their ``named`` params'
    names, shapes or dtypes, or their settings (:func:`settings_of`), differ (module
    docstring); a mesh of one rank checks nothing. A tensor-parallel param's shape is its
    global one."""
    if layout.mesh.size() == 1:
        return
    group = mesh_lib.world_group(layout.mesh)
    spec = spec_of({n: (tuple(p.shape), p.dtype) for n, p in named.items()})
    settings = settings_of(layout)
    h = _digest(spec, settings)
    both = torch.tensor([h, -h], dtype=torch.int64, device=layout.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) == -int(both[1]):  # max == min: one hash on every rank
        return
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (settings, spec), group=group)  # only where they differ
    raise ValueError(f"init: {difference(every)}")


def difference(every: list[tuple[Settings, Spec]]) -> str:
    """What the first rank that differs from group rank 0 has otherwise: a setting first
    (in :func:`settings_of`'s order), then a parameter (names in order)."""
    settings0, spec0 = every[0]
    for r, (settings, spec) in enumerate(every[1:], start=1):
        for (key, value), (_, value0) in zip(settings, settings0, strict=True):
            if value != value0:
                return f"rank {r} of the mesh asked for {key} {value}, rank 0 for {value0}"
        mine, theirs = ({n: (s, d) for n, s, d in x} for x in (spec0, spec))
        for name in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(name), theirs.get(name)
            if a != b:
                return (
                    f"the ranks' models differ: parameter {name!r} is {_shown(b)} on rank {r} "
                    f"of the mesh and {_shown(a)} on rank 0 (every rank must build the same "
                    "model: names, shapes and dtypes)"
                )
    return "the ranks' models differ"


def _shown(entry: tuple | None) -> str:
    return "absent" if entry is None else f"{tuple(entry[0])} {entry[1]}"
