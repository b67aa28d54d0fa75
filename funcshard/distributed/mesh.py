"""Device meshes: a torch DeviceMesh with axes ("replicate", "shard"), and "tensor" innermost
when the model is tensor-parallel; with experts, "shard" is the flattened pair ("shard_outer",
"expert"), with a context axis the flattened pair ("shard_outer", "context")
(:class:`~funcshard.distributed.dims.MeshDims`)."""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from funcshard.distributed.dims import (
    CONTEXT,
    DATA_AXES,
    EXPERT,
    PIPELINE,
    SHARD_OUTER,
    TENSOR,
    MeshDims,
)

__all__ = [
    "make_mesh",
    "local_device",
    "axis_size",
    "axis_rank",
    "axis_group",
    "world_group",
    "master_group",
    "world_timeout",
    "inherit_timeout",
    "hold",
    "data_parallel",
    "tensor_axis",
    "expert_axis",
    "expert_data_parallel",
    "context_axis",
    "pipeline_axis",
    "without_pipeline",
]


def make_mesh(
    shard: int = -1,
    replicate: int = 1,
    tensor: int | str | None = 1,
    device_type: str | None = None,
    expert: int = 1,
    context: int = 1,
    pipeline: int = 1,
) -> DeviceMesh:
    """Builds the ("replicate", "shard") mesh over all ranks, or ("replicate", "shard",
    "tensor") with ``tensor > 1``.

    Args:
      shard: ranks per shard group; -1 means world_size // (replicate * tensor).
      replicate: number of replicas (HSDP when > 1).
      tensor: ranks per tensor-parallel group, innermost: rank ``(r * S + s) * T + t``, so a
        tensor group is ``T`` consecutive ranks. ``mesh["tensor"]`` is the mesh to
        ``parallelize_module`` the model on, before ``fs.init``. 1: the 2-D mesh. (A string
        here is v1's positional ``device_type``, still taken.)
      device_type: "cuda" or "cpu"; None picks "cuda" when available.
      expert: ranks per expert-parallel group, carved out of "shard", innermost within it
        (shard rank ``s = s_outer * expert + e``); ``mesh["expert"]`` is the mesh to put the
        experts on (``Shard(0)``), before ``fs.init``. The mesh's dims are then
        ``("replicate", "shard_outer", "expert"[, "tensor"])``, ``mesh["shard"]`` their
        flattened "shard_outer" x "expert". 1: the mesh without it, unchanged.
      context: ranks per context-parallel group (``fs.ContextParallel``), between "shard" and
        "tensor": rank ``((r * S + s) * C + c) * T + t``. The mesh's dims are then
        ``("replicate", "shard_outer", "context"[, "tensor"])``, ``mesh["shard"]`` their
        flattened "shard_outer" x "context": parameters are sharded and gradients reduced
        over both. 1: the mesh without it, unchanged.
      pipeline: pipeline ranks (``fs.Pipeline``), the outermost axis: global rank ``p *
        (world // pipeline)`` + the rank the mesh without it gives; every other axis lives
        inside one pipeline rank (``shard=-1``: what the others leave of ``world //
        pipeline``). ``mesh["pipeline"]`` is the 1-D mesh of the pipeline ranks sharing every
        other coordinate. 1: the mesh without it, unchanged.

    The same shape on the same world gives the same mesh: its groups are made once.

    Raises:
      RuntimeError: torch.distributed is not initialized.
      ValueError: shard x replicate x context x tensor does not equal the world size,
        ``expert`` does not divide ``shard``, ``expert`` and ``context`` both above 1, or a
        cuda mesh has more ranks on this node than visible GPUs.
    """
    if not isinstance(tensor, int):  # None, or v1's third argument: make_mesh(S, R, "cpu")
        tensor, device_type = 1, tensor if device_type is None else device_type
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh: torch.distributed is not initialized; run under torchrun or fs.launch"
        )
    dims = MeshDims.resolve(
        dist.get_world_size(),
        shard=shard,
        replicate=replicate,
        tensor=tensor,
        expert=expert,
        context=context,
        who="make_mesh",
        pipeline=pipeline,
    )
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        _use_own_gpu()
    _forget_dead_worlds()
    world_pg = dist.group.WORLD
    key = (id(world_pg), device_type, dims)
    if key not in _MESHES:
        mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=dims.names)
        if dims.has_experts:
            mesh[SHARD_OUTER, EXPERT]._flatten(DATA_AXES[1])
        if dims.has_context:
            mesh[SHARD_OUTER, CONTEXT]._flatten(DATA_AXES[1])
        _MESHES[key] = (world_pg, hold(mesh, drop_mesh_groups))
    mesh = _MESHES[key][1]
    for axis in mesh.mesh_dim_names:
        inherit_timeout(mesh.get_group(axis))
    if dims.has_experts or dims.has_context:
        inherit_timeout(sliced(mesh, DATA_AXES[1]).get_group())
    return mesh


def sliced(mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]``, where a name may be the flattened "shard" of a mesh with experts (torch
    warns that such slicing will move; the mesh is kept, so the slice is made once by torch).
    A pipeline rank's sub-world (:func:`without_pipeline`) takes such a name from its root
    mesh, where torch registered the flattened axis: the slice holding this rank."""
    wanted = (names,) if isinstance(names, str) else tuple(names)
    if not set(wanted) <= set(mesh.mesh_dim_names or ()):
        mesh = mesh._get_root_mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mesh[names]


def expert_axis(mesh: DeviceMesh) -> DeviceMesh | None:
    """``mesh["expert"]``, or None for a mesh without an expert axis."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh[EXPERT] if EXPERT in names else None


def expert_data_parallel(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ("replicate", "shard_outer") mesh of this rank's expert index (and tensor rank):
    the ranks holding the same experts, over which expert weights are data-parallel; None for
    a mesh without an expert axis."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if EXPERT not in names:
        return None
    return sliced(mesh, (DATA_AXES[0], SHARD_OUTER))


def context_axis(mesh: DeviceMesh) -> DeviceMesh | None:
    """``mesh["context"]``, or None for a mesh without a context axis."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh[CONTEXT] if CONTEXT in names else None


def pipeline_axis(mesh: DeviceMesh) -> DeviceMesh | None:
    """``mesh["pipeline"]``, or None for a mesh without a pipeline axis."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh[PIPELINE] if PIPELINE in names else None


def without_pipeline(mesh: DeviceMesh) -> DeviceMesh:
    """This pipeline rank's sub-world: ``mesh`` sliced to every axis but "pipeline" (the
    mesh itself where it has none). Every data-parallel, tensor and expert collective of a
    pipelined state runs on it, so pipeline ranks holding different stages never meet in one."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if PIPELINE not in names:
        return mesh
    return sliced(mesh, tuple(n for n in names if n != PIPELINE))


def tensor_axis(mesh: DeviceMesh) -> DeviceMesh | None:
    """``mesh["tensor"]``, or None for a mesh without a tensor axis."""
    names = mesh.mesh_dim_names or ()
    return mesh[TENSOR] if TENSOR in names else None


class _ByIdentity:
    """A cache of values per mesh OBJECT, each kept while its mesh lives. Not a
    WeakKeyDictionary: DeviceMesh compares and hashes by value, so an equal mesh another test
    or job left alive on some ranks (and collected on others) would answer for this one there,
    and the ranks that missed would make a group alone: a collective the others never join."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, mesh: DeviceMesh) -> Any:
        entry = self._entries.get(id(mesh))
        return entry[1] if entry is not None and entry[0]() is mesh else None

    def put(self, mesh: DeviceMesh, value: Any) -> Any:
        key, entries = id(mesh), self._entries

        def collected(ref: weakref.ref) -> None:
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(mesh, collected), value)
        return value

    def pop(self, mesh: DeviceMesh) -> None:
        if self.get(mesh) is not None:
            del self._entries[id(mesh)]


# The data-parallel submesh of each 3-D mesh, kept while the mesh lives.
_DATA_PARALLEL = _ByIdentity()


def data_parallel(mesh: DeviceMesh) -> DeviceMesh:
    """The ("replicate", "shard") mesh of this rank's tensor rank: ``mesh`` itself for a mesh
    without a tensor or expert axis (with one, "shard" is the flattened "shard_outer" x
    "expert": every rank its own data-parallel rank)."""
    if tuple(getattr(mesh, "mesh_dim_names", None) or ()) in ((), DATA_AXES):
        return mesh
    dp = _DATA_PARALLEL.get(mesh)
    if dp is None:
        dp = _DATA_PARALLEL.put(mesh, sliced(mesh, DATA_AXES))
    return dp


# One mesh per shape of a world: a DeviceMesh's groups live as long as the world (torch never
# frees them), and gloo gives each group its own TCP event-loop threads. A program (or a test
# pool) making the same mesh again and again piled them up: 1,160 threads in each rank of a
# test pool, a few dozen of them running at any time. Keyed by the default group (held, so
# that its id cannot come back) and the shape. Let go of once that group is destroyed
# (``_forget_dead_worlds``).
_MESHES: dict[tuple[int, str, MeshDims], tuple[object, DeviceMesh]] = {}


def world_timeout() -> datetime.timedelta | None:
    """The default group's collective timeout (``init_process_group(timeout=)``,
    ``fs.init_from_env(timeout=)``), or None where the backend does not say."""
    return _timeout_of(dist.group.WORLD)


def _timeout_of(group: dist.ProcessGroup) -> datetime.timedelta | None:
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def inherit_timeout(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` waiting on a collective as long as the default group does, not the 30
    minutes torch gives every group made after it (a node cut off from the others would
    hold the survivors that long on a mesh axis or a checkpoint's group). Set only where it
    differs: a group's timeout is not changed under a collective in flight on it."""
    timeout = world_timeout()
    if timeout is not None and group is not dist.group.WORLD and _timeout_of(group) != timeout:
        group.set_timeout(timeout)
    return group


def _use_own_gpu() -> None:
    """Puts this rank on GPU ``LOCAL_RANK``; NCCL needs one GPU per rank of a node."""
    gpus = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if gpus == 0 or local_world > gpus:
        raise ValueError(
            f"make_mesh: a cuda mesh runs one rank per GPU, but this node has {local_world} "
            f"ranks and {gpus} visible GPU(s); start at most {gpus} ranks per node or use "
            "device_type='cpu'"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % gpus))
    torch.cuda.set_device(local_rank)


def local_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    return mesh.size(DATA_AXES.index(axis))


def axis_rank(mesh: DeviceMesh, axis: str) -> int:
    """This rank's place along data-parallel ``axis`` of a ("replicate", "shard") mesh (by
    position: an expert view's second dim is "shard_outer")."""
    return mesh.get_local_rank(DATA_AXES.index(axis))


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    return mesh.get_group(DATA_AXES.index(axis))


# The flattened group of each mesh, kept while the mesh lives (keyed by the mesh object: an
# equal mesh's group, or a collected mesh's reused id, never answers for it).
_FLAT_GROUPS = _ByIdentity()


def world_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A group over every rank of the mesh (the data-parallel world)."""
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    group = _FLAT_GROUPS.get(mesh)
    if group is None:
        name = "dp" if tuple(mesh.mesh_dim_names or ()) == DATA_AXES else "expert_dp"
        group = _FLAT_GROUPS.put(mesh, inherit_timeout(mesh._flatten(name).get_group()))
        hold(mesh, _FLAT_GROUPS.pop)
    return group


# HFSDP's master-order groups, one per rank order of a world: keyed by the order and the default
# group (held, so that its id cannot come back), not by the mesh, which compares by value. Every
# rank then makes a group at the same call (the first for that order), whatever the
# garbage collector has done with older meshes of the same shape.
_MASTER_GROUPS: dict[tuple[int, tuple[int, ...]], tuple[object, dist.ProcessGroup]] = {}


def master_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """Every rank of the mesh, rank ``(r, s)`` at place ``s * R + r`` (HFSDP's master order).

    A collective on first use for a rank order (every rank must call it: ``fs.init`` does).
    Where that order is the mesh's own (``R == 1`` or ``S == 1``) it is the world group.
    """
    replicate, shard = mesh.size(0), mesh.size(1)
    if replicate == 1 or shard == 1:
        return world_group(mesh)
    world = dist.group.WORLD
    # every rank makes the groups of every tensor rank's submesh (and, for an expert view of
    # S / E shard ranks, every expert index's), in rank order
    root = mesh._get_root_mesh() if mesh.size() < dist.get_world_size() else mesh
    # rank (r * S + s) * T + t, experts or not; ((r * S / E + s_outer) * E + e) * T + t
    slices = root.mesh.reshape(replicate, shard, -1)
    mine = None
    for t in range(slices.shape[-1]):
        ranks = slices[..., t]  # (replicate, shard) global ranks
        order = tuple(int(ranks[r, s]) for s in range(shard) for r in range(replicate))
        key = (id(world), order)
        if key not in _MASTER_GROUPS:
            _MASTER_GROUPS[key] = (world, dist.new_group(list(order), sort_ranks=False))
        if dist.get_rank() in order:
            mine = _MASTER_GROUPS[key][1]
    return inherit_timeout(mine)


# Every object that keeps groups of a world (a mesh, a layout's placement, a checkpoint saver's
# group, the flattened group of a mesh), with what drops them: once that world is destroyed they
# are dropped (``_forget_dead_worlds``), even where the program still holds the object (README's
# loop keeps mesh, state and a CheckpointManager in module globals to the end). Keyed by a
# counter, the entry going with its object; the default group held as in ``_MESHES``.
_HOLDERS: dict[int, tuple[object, weakref.ref, Callable[[Any], None]]] = {}
_HOLDER_KEYS = itertools.count()

T = TypeVar("T")


def hold(owner: T, release: Callable[[T], None]) -> T:
    """Registers ``owner`` as keeping process groups of the current world; ``release(owner)``
    drops them once that world is destroyed (at exit, before the interpreter finalizes, or when
    a new world makes its first mesh). Every funcshard object that stores a group calls it."""
    key = next(_HOLDER_KEYS)
    ref = weakref.ref(owner, lambda _, key=key, holders=_HOLDERS: holders.pop(key, None))
    _HOLDERS[key] = (dist.group.WORLD, ref, release)
    return owner


def drop_mesh_groups(mesh: DeviceMesh) -> None:
    """Empties a mesh's registry of groups (a DeviceMesh holds its groups and its flattened
    meshes' in the root mesh's registry); for a mesh of a destroyed world only."""
    root = getattr(mesh, "_root_mesh", None) or mesh
    for m in (mesh, root, *getattr(root, "_flatten_mapping", {}).values()):
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def _forget_dead_worlds() -> bool:
    """Drops the cached meshes and groups of a default group that is no longer the current one
    (``dist.destroy_process_group``, then maybe a new ``init_process_group``), and has every
    holder of that world's groups (``hold``) drop them; True if any. Run by ``make_mesh`` (a
    new world's first mesh comes before its master group, so ``master_group``, on the step's
    path, need not) and at exit.

    ``destroy_process_group`` only unregisters the groups: a gloo group's worker threads stop
    when the group itself is freed, and these caches (a DeviceMesh holds its groups) would
    keep every group, and its threads, to the end of the interpreter. There a worker still
    dropping its last collective (the tensors' Python objects need the GIL) while Python
    finalizes is ended by the interpreter inside a C++ destructor: std::terminate, "terminate
    called without an active exception", about 1 exit in 5-30 of a 4-rank gloo job."""
    world = dist.group.WORLD if dist.is_initialized() else None
    dead = [k for k, (w, _) in _MESHES.items() if w is not world]
    dead_master = [k for k, (w, _) in _MASTER_GROUPS.items() if w is not world]
    dead_holders = [k for k, (w, _, _) in _HOLDERS.items() if w is not world]
    for k in dead:
        del _MESHES[k]
    for k in dead_master:
        del _MASTER_GROUPS[k]
    for k in dead_holders:
        entry = _HOLDERS.pop(k, None)
        owner = entry[1]() if entry is not None else None
        if owner is not None:
            entry[2](owner)
    return bool(dead or dead_master or dead_holders)


@atexit.register
def _free_groups_at_exit() -> None:
    """Frees the groups of a destroyed world while the interpreter is whole (before it
    finalizes), whatever objects the program still holds: each gloo group joins its worker
    threads as it is freed (see ``_forget_dead_worlds``). A world still initialized at exit is
    left as it is."""
    if _forget_dead_worlds():
        gc.collect()  # meshes in reference cycles (a flattened mesh and its root)
