"""Replicas that agree: ranks that hold the same rows must hold the same bits.

Silent data corruption at scale is a device that computes wrong bits without an error. Under
data parallelism it shows as replicas that drift apart: two ranks that hold the same rows of a
master (HSDP's replicas over "replicate", every rank under ``no_shard``) or of the optimizer
state, or the ranks of a tensor group that all hold a replicated leaf, stop agreeing after a
step. :func:`check_replicas` compares one crc32c per leaf across each such group of ranks:
the bytes on the wire are one 8-byte hash per leaf per rank of the group, whatever the model's
size; only when some group disagrees does each rank send its findings to the others, so that
every rank raises the same :class:`ReplicaMismatchError`.

It covers the model's persistent buffers too (``buffers/<name>``, across every
data-parallel rank) when ``fs.init``'s ``buffers="broadcast"`` says they must agree (a
checkpoint holds one rank's: :mod:`funcshard.state.buffers`).

What it does not cover: the ranks of a fault-tolerant run's other replica groups (torchft's;
each group is its own job), the derived compute copies (derived from the masters after
every step by a function, so a wrong master is what shows) and buffers under
``buffers="local"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed import ops

__all__ = ["ReplicaMismatchError", "check_replicas", "leaf_hashes", "period"]

BUFFERS = "buffers/"  # the labels of the model's persistent buffers


class ReplicaMismatchError(RuntimeError):
    """Ranks that hold the same rows of a leaf hold different bits (raised on every rank).

    Attributes:
      mismatches: one :class:`Mismatch` per leaf and group of ranks that disagree.
    """

    def __init__(self, mismatches: list[Mismatch]) -> None:
        self.mismatches = mismatches
        lines = [m.describe() for m in mismatches[:20]]
        if len(mismatches) > 20:
            lines.append(f"... and {len(mismatches) - 20} more")
        super().__init__(
            f"check_replicas: {len(mismatches)} leaf/leaves differ between ranks that must "
            "hold the same bits (silent data corruption on a device, or ranks that did not "
            "run the same step):\n  " + "\n  ".join(lines)
        )


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One leaf whose ``axis`` group (its global ``ranks``) holds more than one hash."""

    leaf: str
    axis: str
    ranks: tuple[int, ...]
    hashes: tuple[int, ...]  # one per rank of ``ranks``

    def describe(self) -> str:
        by_hash: dict[int, list[int]] = {}
        for rank, h in zip(self.ranks, self.hashes, strict=True):
            by_hash.setdefault(h, []).append(rank)
        sides = sorted(by_hash.values(), key=lambda rs: (-len(rs), rs))
        said = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: crc32c "
            f"{next(h for h, r in by_hash.items() if r is rs):08x}"
            for rs in sides
        )
        return f"{self.leaf!r} over {self.axis!r}: {said}"


def period(every: Any) -> int:
    """``fs.init``'s ``check_replicas_every``, checked: an int >= 0 (0: never)."""
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"init: check_replicas_every must be an int, got {every!r}")
    if every < 0:
        raise ValueError(f"init: check_replicas_every must be >= 0 (0: never), got {every}")
    return every


def _crc(t: torch.Tensor) -> int:
    """crc32c of a tensor's bytes (its elements in row-major order)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    raw = flat.view(torch.uint8).cpu().numpy()
    return crc32c.crc32c(raw)


def leaf_hashes(state: Any) -> dict[str, int]:
    """One crc32c per leaf of this rank's rows: ``params/<name>`` for the masters and
    ``opt_state/<path>/<name>`` for every per-parameter optimizer-state part (padding
    excluded; scalars such as a step count under their path) and ``buffers/<name>`` for the
    model's persistent buffers that must agree, in the same order on every rank."""
    out = {f"params/{name}": _crc(t) for name, t in state.params.items()}
    for path, x in _tensors(state.opt_state_by_name(), ()):
        out["opt_state/" + "/".join(path)] = _crc(x)
    if state.buffers.agree:  # whole on every data-parallel rank
        out.update({f"{BUFFERS}{n}": _crc(t) for n, t in state.buffers.values().items()})
    return out


def _tensors(tree: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    """Every tensor of an optimizer state keyed by name, with its path (NamedTuple fields,
    indices and keys, as :func:`funcshard.layout.buckets.map_parts` names them)."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        for field in tree._fields:
            yield from _tensors(getattr(tree, field), (*path, field))
    elif isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            yield from _tensors(v, (*path, str(i)))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, (*path, str(k)))


def _groups(state: Any, labels: list[str]) -> list[tuple[str, Any, list[str]]]:
    """(axis, group, labels it must agree on) for each group of ranks holding the same rows."""
    layout = state.layout
    on_experts = lambda label: layout.tensor.on_experts(label.rsplit("/", 1)[-1])  # noqa: E731
    experts = [label for label in labels if on_experts(label)]
    dense = [label for label in labels if not on_experts(label)]
    groups = []
    # HSDP's "replicate", the world under no_shard; an expert leaf's among its expert index's
    for placement, part in ((layout.placement, dense), (_experts_placement(layout), experts)):
        if part and placement.replica_count > 1:
            groups.append((placement.replicas_axis, placement.replicas, part))
    return groups + layout.tensor.replica_groups(labels)


def _experts_placement(layout: Any) -> Any:
    return layout.experts_view.placement if layout.expert_mesh is not None else layout.placement


def check_replicas(state: Any) -> None:
    """Raises :class:`ReplicaMismatchError` on every rank where ranks holding the same rows of
    a leaf hold different bits (a collective: every rank calls it).

    Args:
      state: a live :class:`funcshard.TrainState` (it is read, not consumed).

    Raises:
      ReplicaMismatchError: naming each leaf, the axis and the ranks on each side.
      ConsumedStateError: ``state`` was donated.
    """
    state.check()
    hashes = leaf_hashes(state)
    labels = [label for label in hashes if not label.startswith(BUFFERS)]
    found: list[Mismatch] = []
    groups = _groups(state, labels)
    buffers = [label for label in hashes if label.startswith(BUFFERS)]
    if buffers and state.layout.dp_size > 1:  # one rank's are saved for all
        groups.append(("world", mesh_lib.world_group(state.layout.mesh), buffers))
    for axis, group, names in groups:
        local = torch.tensor([hashes[n] for n in names], dtype=torch.int64)
        size = dist.get_world_size(group)
        every = ops.all_gather(local, group, axis=axis, kind="replica_check").view(size, -1)
        ranks = tuple(dist.get_process_group_ranks(group))
        differ = (every != every[0]).any(dim=0).nonzero().flatten().tolist()
        found += [Mismatch(names[i], axis, ranks, tuple(every[:, i].tolist())) for i in differ]
    if not groups and state.pipeline is None:  # a pipeline rank may hold no group others do
        return
    # every rank raises, or none: the flag over every rank the state spans, then the findings
    world = dist.group.WORLD
    flag = ops.all_reduce(
        torch.tensor([float(bool(found))]), world, axis=ops.Axis.WORLD, kind="replica_check"
    )
    if flag.item() == 0:
        return
    gathered: list[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(gathered, found, group=world)
    unique = sorted({m for ms in gathered for m in ms}, key=lambda m: (m.leaf, m.axis, m.ranks))
    raise ReplicaMismatchError(unique)
