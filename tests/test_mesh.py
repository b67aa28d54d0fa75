"""funcshard.distributed.mesh: the ("replicate", "shard") mesh over every rank, and its checks.

``make_mesh`` builds a replicate x shard mesh with the shard axis fastest (the ranks of one
shard group are neighbours), ``shard=-1`` takes what ``replicate`` leaves, and a shape that
does not cover the world, or a call before ``torch.distributed`` is initialized, is refused
with the numbers in the message.
"""

from __future__ import annotations

import datetime
import gc
import os

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed import ops as collectives
from funcshard.distributed.launch import free_port, init_process_group

import models


def axes_worker(shard: int, replicate: int) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    return {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "shard": (mesh_lib.axis_size(mesh, "shard"), mesh_lib.axis_rank(mesh, "shard")),
        "replicate": (mesh_lib.axis_size(mesh, "replicate"), mesh_lib.axis_rank(mesh, "replicate")),
        "shard_group": dist.get_process_group_ranks(mesh_lib.axis_group(mesh, "shard")),
        "world": dist.get_world_size(mesh_lib.world_group(mesh)),
        "device": str(mesh_lib.local_device(mesh)),
    }


@pytest.mark.parametrize("shard, replicate", [(-1, 1), (2, 2), (-1, 2), (1, 4)])
def test_the_shard_axis_is_fastest_and_covers_the_world(pool4, shard, replicate) -> None:
    size = 4 // replicate if shard == -1 else shard
    for rank, r in enumerate(pool4.run(axes_worker, shard, replicate)):
        assert r["names"] == ("replicate", "shard") and r["shape"] == (replicate, size)
        assert r["shard"] == (size, rank % size)
        assert r["replicate"] == (replicate, rank // size)
        first = rank - rank % size
        assert r["shard_group"] == list(range(first, first + size))
        assert r["world"] == 4 and r["device"] == "cpu"


def tensor_worker() -> dict:
    mesh = fs.make_mesh(shard=2, tensor=2, device_type="cpu")
    v1 = fs.make_mesh(4, 1, "cpu")  # v1's positional device_type
    new = fs.make_mesh(1, 2, 2, "cpu")  # v4's order: shard, replicate, tensor, device_type
    return {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "tensor_group": dist.get_process_group_ranks(mesh["tensor"].get_group()),
        "dp": tuple(mesh_lib.data_parallel(mesh).shape),
        "dp_world": dist.get_world_size(mesh_lib.world_group(mesh_lib.data_parallel(mesh))),
        "v1": (v1.mesh_dim_names, tuple(v1.shape), v1.device_type),
        "new": (new.mesh_dim_names, tuple(new.shape)),
    }


def test_the_tensor_axis_is_innermost(pool4) -> None:
    """rank = (r * S + s) * T + t: a tensor group is T consecutive ranks."""
    for rank, r in enumerate(pool4.run(tensor_worker)):
        assert r["names"] == ("replicate", "shard", "tensor") and r["shape"] == (1, 2, 2)
        assert r["tensor_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["dp"] == (1, 2) and r["dp_world"] == 2
        assert r["v1"] == (("replicate", "shard"), (1, 4), "cpu")
        assert r["new"] == (("replicate", "shard", "tensor"), (2, 1, 2))


def errors_worker() -> list[str]:
    messages = []
    for kw in ({"shard": 3}, {"replicate": 3}, {"replicate": 0}, {"shard": 2, "replicate": 1}):
        try:
            fs.make_mesh(device_type="cpu", **kw)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_a_shape_that_does_not_cover_the_world_is_refused(pool4) -> None:
    shard3, replicate3, replicate0, short = pool4.run(errors_worker)[0]
    assert "shard (3) x replicate (1)" in shard3 and "world size 4" in shard3
    assert "not divisible by replicate=3" in replicate3
    assert "replicate must be >= 1, got 0" in replicate0
    assert "shard (2) x replicate (1)" in short


def test_make_mesh_needs_an_initialized_process_group() -> None:
    # The test process itself never joins a group (ranks live in the pools).
    with pytest.raises(RuntimeError, match="not initialized; run under torchrun or fs.launch"):
        fs.make_mesh(device_type="cpu")


def timeouts_worker(seconds: float) -> dict:
    """Every group funcshard makes, on a world whose timeout is ``seconds``."""
    from funcshard.checkpoint.commit import Saver

    world = dist.group.WORLD
    before = mesh_lib.world_timeout()
    world.set_timeout(datetime.timedelta(seconds=seconds))
    try:
        mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
        groups = {
            "shard": mesh_lib.axis_group(mesh, "shard"),
            "replicate": mesh_lib.axis_group(mesh, "replicate"),
            "master": mesh_lib.master_group(mesh),
            "saver": Saver()._agreement(None, background=True).group,
        }
        return {
            name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, g in groups.items()
        }
    finally:  # the mesh is shared with later tests: give its groups the world's again
        world.set_timeout(before)
        mesh_lib.master_group(fs.make_mesh(shard=2, replicate=2, device_type="cpu"))


def test_groups_wait_as_long_as_the_world(pool4) -> None:
    """A mesh axis, HFSDP's master-order group and a checkpoint saver's group give up on a
    collective when the default group does (``fs.init_from_env(timeout=)``), not after
    torch's 30 minutes: a node cut off must not hold the survivors longer than they asked."""
    for r in pool4.run(timeouts_worker, 42.0):
        assert r == {"shard": 42.0, "replicate": 42.0, "master": 42.0, "saver": 42.0}, r


def reuse_worker() -> dict:
    first = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    threads = len(os.listdir("/proc/self/task"))
    again = [fs.make_mesh(shard=2, replicate=2, device_type="cpu") for _ in range(5)]
    return {
        "same": all(m is first for m in again),
        "new_threads": len(os.listdir("/proc/self/task")) - threads,
        "other": fs.make_mesh(shard=4, device_type="cpu") is not first,
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_same_mesh_again_makes_no_groups(pool4) -> None:
    """A mesh's groups live as long as the world, each with gloo's event-loop threads: the
    same shape on the same world is the same mesh, so asking again starts no thread."""
    for r in pool4.run(reuse_worker):
        assert r == {"same": True, "new_threads": 0, "other": True}, r


def _threads() -> dict[int, str]:
    """This process's threads: {thread id: name}."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            threads[int(tid)] = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:  # it ended while we looked (ENOENT or ESRCH, by timing)
            pass
    return threads


def _ports(n: int) -> list[int]:
    """``n`` free ports of rank 0's, on every rank (the launcher's world carries them)."""
    ports = [[free_port() for _ in range(n)] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ports)
    return ports[0]


def exit_worker(port: int) -> dict:
    """A world of the job's own, a mesh, HFSDP's group and a collective, then the world
    destroyed as a job ends."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()  # the launcher's world: the baseline is taken without one
    mesh_lib._free_groups_at_exit()
    gc.collect()
    before = _threads()  # the runner's own threads
    init_process_group(rank, world, port, "gloo")
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    mesh_lib.master_group(mesh)
    out = collectives.all_gather(torch.ones(2), mesh_lib.axis_group(mesh, "shard"), axis="shard")
    del mesh, out  # the job's own references gone, as when its main function returns
    dist.destroy_process_group()
    destroyed = _threads()
    mesh_lib._free_groups_at_exit()  # what the interpreter's exit runs, before it finalizes
    return {"before": before, "destroyed": destroyed, "at_exit": _threads()}


def ends_worker(directory: str) -> dict:
    """:func:`exit_worker`, then :func:`kept_worker` at 2x2 (HFSDP) in a third world: the
    two 4-rank runs in one launch (a launch of 4 ranks is ~13 s of process starts on 2
    cores)."""
    rank, (exit_port, kept_port) = dist.get_rank(), _ports(2)
    destroyed = exit_worker(exit_port)
    init_process_group(rank, 4, kept_port, "gloo")
    return {"destroyed": destroyed, "kept": kept_worker(directory, 2)}


@pytest.fixture(scope="module")
def ends(tmp_path_factory) -> list[dict]:
    """Each rank's :func:`ends_worker` result."""
    return fs.launch(ends_worker, str(tmp_path_factory.mktemp("ends")), nproc=4)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_no_gloo_thread_outlives_a_destroyed_world(ends) -> None:
    """``destroy_process_group`` only unregisters the groups; the mesh cache held them and
    their gloo worker threads into interpreter finalization, where a worker freeing its last
    collective (its tensors' Python objects need the GIL) was ended inside a C++ destructor:
    "terminate called without an active exception" at about 1 exit in 10 of test_nodes' job.
    At exit the groups of a destroyed world are freed first: of the threads its world and
    funcshard started none is left, and the process's own (those before the world) all are."""
    for r in (e["destroyed"] for e in ends):
        started = {t: name for t, name in r["destroyed"].items() if t not in r["before"]}
        assert "gloo_tcp_loop" in started.values(), r  # the groups' threads were there
        assert r["at_exit"] == r["before"], r  # exactly those are gone


def kept_worker(directory: str, replicate: int) -> dict:
    """README's loop, everything kept to the end as its module globals are: the mesh, a state
    (its layout caches the groups), a CheckpointManager that saved (its saver's own group)."""
    before = _threads()
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    model = models.make_model()
    state = fs.init(
        model,
        fs.optim.adamw(1e-3),
        mesh=mesh,
        strategy="optim_grads_params",
        outer_strategy="optim" if replicate > 1 else "no_shard",
    )
    world = dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 4 * world), dist.get_rank(), world)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model), 2)
    mgr = fs.CheckpointManager(directory)
    mgr.save(1, state)
    mgr.wait()
    kept = (mesh, model, state, mgr)
    dist.destroy_process_group()
    destroyed = _threads()
    mesh_lib._free_groups_at_exit()
    return {"before": before, "destroyed": destroyed, "at_exit": _threads(), "kept": len(kept)}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize(("nproc", "replicate"), [(2, 1), (4, 2)], ids=["2", "2x2-hfsdp"])
def test_no_gloo_thread_outlives_the_world_whatever_the_program_keeps(
    request, tmp_path, nproc: int, replicate: int
) -> None:
    """A program that keeps the mesh, the state and a CheckpointManager in its globals (as
    README's loop does) still has every group funcshard made freed at exit, before the
    interpreter finalizes (see test_no_gloo_thread_outlives_a_destroyed_world): the holders
    drop the groups of a destroyed world, and no gloo thread is left (a checkpoint leaves
    threads of its own, tensorstore's). test_launch.py runs such a script under torchrun.
    2x2: the ranks of ``ends`` (after a world of their own, destroyed)."""
    if nproc == 4:
        results = [e["kept"] for e in request.getfixturevalue("ends")]
    else:
        results = fs.launch(kept_worker, str(tmp_path), replicate, nproc=nproc)
    for r in results:
        gloo = {k: [n for n in v.values() if "gloo" in n] for k, v in r.items() if k != "kept"}
        assert len(gloo["destroyed"]) > len(gloo["before"]), r  # the groups' threads were there
        assert gloo["at_exit"] == [], r  # and are gone, the world's with them
