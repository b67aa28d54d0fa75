"""Every rank of a layout's mesh built the same model: checked once, at ``fs.init``.

A rank whose model differs (a config read per rank, a sequence length taken from that rank's
data) may pack other shapes into buckets of the same sizes: the step's gathers and reduce-
scatters would then pair one rank's rows of a weight with another rank's rows of another
weight, with no error. Where a size differs, gloo aborted a rank in the first step ("collective
mismatch"; a GPT whose position table was sized per rank); NCCL may hang.
:meth:`InitAgreement.check` compares one hash of the parameters' names, shapes and dtypes (and
the settings that shape the step's collectives: strategy, outer strategy, units, policy,
offload fraction, deterministic, ``compile=``'s backend and overlap) and one of the mesh's
shape across the mesh in one all-reduce; only where they differ does every rank send its lists,
so that every rank raises the same :class:`ValueError` naming the first setting or parameter
(or mesh) that differs and the rank. A rank given other units, another policy or offload
fraction packs other buckets: gloo aborted in ``fs.init``'s first collectives or the first step
("collective mismatch"). A rank given a mesh of another shape (both meshes made on every rank
before): with ``make_mesh(replicate=2)`` where the others passed ``make_mesh()``, every rank
initialized and the first step's gathers waited on other groups than its peers'; with
``make_mesh(tensor=2)``, ``fs.init``'s check itself waited (that rank in a group's creation,
the others in the exchange of their lists).

That all-reduce is ``fs.init``'s one agreement (:class:`InitAgreement`): a rank whose own part
of ``fs.init`` raised (``units=`` naming no module, ``offload_fraction=3.0``, an unknown
strategy, policy or ``compile=`` backend) takes part in it with a "failed" flag instead of its
hash, so that every rank of the mesh raises at once, not that rank alone while its peers wait
in the all-reduce until the process group's timeout."""

from __future__ import annotations

import hashlib
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import mesh as mesh_lib
from funcshard.layout.layout import Layout

__all__ = ["InitAgreement"]

Spec = list[tuple[str, tuple[int, ...], str]]
Settings = tuple[tuple[str, str], ...]


def spec_of(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Spec:
    """The parameters as compared: name, global shape and dtype, in name order."""
    return [(n, tuple(s), str(d).removeprefix("torch.")) for n, (s, d) in sorted(shapes.items())]


def settings_of(layout: Layout) -> Settings:
    """The layout's settings every rank must share, shown as compared: each decides the
    buckets or the collectives (a rank's own device, mesh and rows are not among them; the
    mesh's shape is compared by :class:`InitAgreement` itself)."""
    return (
        ("strategy", repr(layout.strategy.value)),
        ("outer_strategy", repr(layout.outer.value)),
        ("units", repr(layout.units)),
        ("policy", repr(layout.policy)),
        ("offload_fraction", repr(layout.offload_fraction)),
        ("deterministic", repr(layout.deterministic)),
    )


def _shape_of(mesh: DeviceMesh) -> str:
    """``"replicate=2 x shard=2"``: the mesh's axes and sizes (an unnamed axis by its index)."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))


def _digest(spec: Any, settings: Any) -> int:
    blob = repr((settings, spec)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2  # -h fits int64


class InitAgreement:
    """The part of ``fs.init`` that may fail on one rank alone, run as a ``with`` block that
    ends with :meth:`check`: one all-reduce (max) of five int64 over every rank of the mesh,
    a "failed" flag, the hash of the rank's model and settings and its negation, and the hash
    of its mesh's shape and its negation (a rank given a mesh of another shape would go on
    along other groups than its peers': ValueError on every rank, naming it). A rank
    whose block raises before its check takes part in that all-reduce with the flag set; the
    ranks then exchange their errors' texts (only then): that rank's own error goes on, and
    every other rank raises a ValueError naming the first rank that failed and its error (one
    line), promptly, not after the process group's timeout.

    The group is the world where the mesh spans it (its tensor, expert, context and pipeline
    ranks included: a rank of another stage or tensor rank is told too). Where the layout's
    data-parallel ranks are fewer (a tensor, context or pipeline axis, across which the
    models differ by design), the hash is compared over them in a second all-reduce of two
    int64; else the one all-reduce carries both. A mesh that does not span the world agrees
    over the layout's data-parallel ranks alone. Not agreed on: an error raised before the
    block or by ``mesh=`` itself (no group is known yet), or after it (among collectives):
    where one rank alone raises there, the others wait in their next collective.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.device, self.checked = _group_of(mesh), None, False
        if self.group is not None:
            self.device = mesh_lib.local_device(mesh)
            self.shape = _shape_of(mesh)

    def __enter__(self) -> InitAgreement:
        return self

    def __exit__(
        self, kind: type | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """A block that raised before its check: the peers are told, the error goes on here."""
        if isinstance(error, Exception) and not self.checked:
            self.checked = True
            self._agree(0, f"{type(error).__name__}: {' '.join(str(error).split())}")

    def check(self, layout: Layout, named: dict[str, torch.Tensor], more: Settings = ()) -> None:
        """The block's last step: ValueError on every rank where a rank's block failed
        (naming it and its error) or where the data-parallel ranks' ``named`` params' names,
        shapes or dtypes, or their settings (:func:`settings_of`, then ``more``: settings
        of the step not in the layout, ``compile=``'s), differ (module docstring).
        A tensor-parallel param's shape is its global one."""
        spec = spec_of({n: (tuple(p.shape), p.dtype) for n, p in named.items()})
        settings = settings_of(layout) + tuple(more)
        h = _digest(spec, settings)
        together = self.group is not None and layout.mesh.size() == self._size  # compares too
        self.checked = True
        same = self._agree(h if together else 0, None)
        if not together and layout.mesh.size() > 1:  # its group made after: a collective
            same = _max_of([h, -h], mesh_lib.world_group(layout.mesh), self.device) == [h, -h]
        if same:
            return
        peers = mesh_lib.world_group(layout.mesh)
        every: list[Any] = [None] * dist.get_world_size(peers)
        dist.all_gather_object(every, (settings, spec), group=peers)  # only where they differ
        raise ValueError(f"init: {difference(every)}")

    @property
    def _size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def _agree(self, h: int, failure: str | None) -> bool:
        """The one all-reduce over the group: whether every rank gave hash ``h``; ValueError
        where another rank failed (``failure``: this rank's own, which goes on after) or
        where the ranks' meshes differ in shape (before a rank's next step depends on it)."""
        if self._size == 1:
            return True
        m = _digest(self.shape, ())
        got = _max_of([int(failure is not None), h, -h, m, -m], self.group, self.device)
        if got[0]:
            told: list[Any] = [None] * self._size
            dist.all_gather_object(told, (dist.get_rank(), failure), group=self.group)
            failed = [(r, f) for r, f in told if f is not None]
            if failure is None:
                more = "".join(f", rank {r}" for r, _ in failed[1:])
                raise ValueError(f"init failed on rank {failed[0][0]}{more}: {failed[0][1]}")
            return False
        if got[3] != -got[4]:  # only then: their shapes
            shapes: list[Any] = [None] * self._size
            dist.all_gather_object(shapes, self.shape, group=self.group)
            r = next(r for r, shape in enumerate(shapes) if shape != shapes[0])
            raise ValueError(
                f"init: rank {r} of the mesh gave a mesh of {shapes[r]}, rank 0 of "
                f"{shapes[0]} (every rank passes a mesh of one shape)"
            )
        return got[1] == -got[2]  # max == min: one hash on every rank


def _group_of(mesh: Any) -> Any:
    """The group ``fs.init`` agrees over (:class:`InitAgreement`); None where ``mesh`` is not
    a mesh (nothing to agree over: each rank's own error goes on)."""
    if not isinstance(mesh, DeviceMesh):
        return None
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh_lib.world_group(mesh_lib.data_parallel(mesh_lib.without_pipeline(mesh)))


def _max_of(values: list[int], group: Any, device: torch.device) -> list[int]:
    """``values`` (int64) all-reduced with max over ``group``."""
    both = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both.tolist()


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
