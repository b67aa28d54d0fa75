"""Reliability: kill -9 during saves, corrupt checkpoints, failing disks, nonfinite steps,
property tests of sharding and checkpoint round trips, consumed states.

The kill test is marked ``slow``; it runs ``FUNCSHARD_KILL_TRIALS`` trials (3 by default),
alternately on 1 rank (in the job's own process) and 2 ranks (``fs.launch``), or all on
``FUNCSHARD_KILL_NPROC`` ranks when that is set. The full count::

    FUNCSHARD_KILL_TRIALS=50 python -m pytest -q tests/test_reliability.py -k kill_during_save

The property tests draw parameter trees with hypothesis (0-d leaves, single rows, prime sizes,
bf16), ``FUNCSHARD_PROPERTY_EXAMPLES`` per world size (8 by default, derandomized so CI sees
the same cases every run)::

    FUNCSHARD_PROPERTY_EXAMPLES=200 python -m pytest -q tests/test_reliability.py -k identity
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from _kill_job import ROWS, params_hash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import funcshard as fs
from funcshard import checkpoint as ckpt_lib

import models

HERE = os.path.dirname(os.path.abspath(__file__))
LEAF = "params.blocks.0.fc.weight"  # 37 rows: rank 1 owns chunk "1.0"
KILL_TRIALS = int(os.environ.get("FUNCSHARD_KILL_TRIALS", "3"))
KILL_NPROC = os.environ.get("FUNCSHARD_KILL_NPROC")


def _cpu(params: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in params.items()}


def _error(fn) -> str | None:
    """``fn()``'s exception as text (with its causes), or None when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects every kind
        parts, cause = [f"{type(e).__name__}: {e}"], e.__cause__
        while cause is not None:
            parts.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        return " <- ".join(parts)
    return None


# --- 1. kill -9 during save ----------------------------------------------------------------------


def check_kill_root(root: str) -> dict:
    """Restores every listed step of ``root/ckpt`` on another layout; returns their hashes."""
    mgr = fs.CheckpointManager(os.path.join(root, "ckpt"), max_to_keep=None)
    mesh = fs.make_mesh(device_type="cpu")
    out = {}
    for step in mgr.all_steps():
        like = fs.init(
            models.make_model(seed=1),
            fs.optim.adamw(1e-2),
            mesh=mesh,
            strategy="optim",
            offload_fraction=0.5,
        )
        state = mgr.restore(step, like=like)
        out[step] = (state.step, params_hash(fs.full_params(state)))
    return {"steps": mgr.all_steps(), "latest": mgr.latest_step(), "restored": out}


def _done(root: str) -> list[int]:
    path = os.path.join(root, "done")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f.read().split()]


def _kill_trial(root: str, rng: random.Random, nproc: int) -> None:
    """Starts the job, waits for one more committed save, kills its process group at random."""
    before = len(_done(root))
    log = open(os.path.join(root, "job.log"), "a")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_kill_job.py"), root, str(nproc), "100000"],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(_done(root)) == before:  # progress first, so every trial commits something
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                with open(os.path.join(root, "job.log")) as f:
                    pytest.fail(f"the job made no progress:\n{f.read()[-4000:]}")
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # a random moment: mostly inside a save
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


@pytest.mark.slow
def test_kill_during_save_never_lists_a_partial_checkpoint(pool2, tmp_path):
    root = str(tmp_path)
    rng = random.Random(1234)
    for trial in range(KILL_TRIALS):
        _kill_trial(root, rng, int(KILL_NPROC) if KILL_NPROC else 1 + trial % 2)
        r = pool2.run(check_kill_root, root)[0]
        done = _done(root)
        assert r["steps"], f"trial {trial}: no checkpoint listed after saves {done}"
        assert r["latest"] >= max(done), (
            f"trial {trial}: step {max(done)} was committed, latest is {r['latest']}"
        )
        assert len(r["steps"]) <= 3, f"trial {trial}: retention kept {r['steps']}"
        for step, (restored_step, digest) in r["restored"].items():
            with open(os.path.join(root, "records", str(step))) as f:
                recorded = f.read()
            assert restored_step == step
            assert digest == recorded, f"trial {trial}: step {step} restored other params"


def leftovers_worker(root: str) -> list[str]:
    """Saves steps 6 and 7 next to the leftovers of a removal and a save that were killed."""
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(models.make_model(seed=0), fs.optim.sgd(0.1), mesh=mesh)
    mgr = fs.CheckpointManager(root, max_to_keep=2)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(root, "4" + ckpt_lib.DELETE_MARK + "1"))
        os.makedirs(os.path.join(root, "5" + ckpt_lib.TMP_MARK + "1"))
    dist.barrier()
    for step in (6, 7):
        mgr.save(step, state)
    mgr.close()
    return sorted(os.listdir(root))


def test_leftovers_of_killed_saves_and_removals_are_cleaned(pool2, tmp_path):
    for listing in pool2.run(leftovers_worker, str(tmp_path / "run")):
        assert listing == ["6", "7"]


def reference_hash(until: int) -> str:
    """The hash of _kill_job's params after ``until`` uninterrupted steps on this pool."""
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the job: the thread count may change the last bits
    try:
        mesh = fs.make_mesh(device_type="cpu")
        model = models.make_model(seed=0)
        state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
        loss_fn = models.make_loss_fn(model)
        for step in range(1, until + 1):
            batch = models.local_batch(models.global_batch(step, ROWS), rank, world)
            state, _ = fs.train_step(state, batch, loss_fn)
        return params_hash(fs.full_params(state))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_from_the_latest_checkpoint(pool2, tmp_path):
    root, until, kill_at = str(tmp_path / "job"), 6, 3
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        os.path.join(HERE, "_kill_job.py"),
        root,
        "torchrun",
        str(until),
        str(kill_at),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(root, "attempts")) as f:
        assert f.read().split() == ["0", "1"], "the rank was not killed and restarted"
    with open(os.path.join(root, "final")) as f:
        final = f.read()
    assert final == pool2.run(reference_hash, until)[0], "resuming changed the trajectory"


def test_init_from_env_names_what_is_missing(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE not set"):
        fs.init_from_env()


def save_small(directory: str) -> None:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    fs.save(directory, state)


def restore_probe(directory: str) -> str | None:
    """The error restoring ``directory`` raises on this rank, or None."""
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    return _error(lambda: fs.full_params(fs.restore(directory, like=like)))


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("reliability") / "ckpt")
    pool2.run(save_small, directory)
    return directory


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _set_dtype(zarray: str, dtype: str) -> None:
    with open(zarray) as f:
        meta = json.load(f)
    meta["dtype"] = dtype
    with open(zarray, "w") as f:
        json.dump(meta, f)


def _garble(path: str) -> None:
    with open(path, "w") as f:
        f.write('{"tree_metadata": {')


CORRUPTIONS = {  # name -> (damage, text every failing rank's error must hold)
    "truncated_chunk_of_rank_1": (lambda d: _truncate(os.path.join(d, LEAF, "1.0")), LEAF),
    "truncated_chunk_of_rank_0": (
        lambda d: _truncate(os.path.join(d, "opt_state.nu.inp.weight", "0.0")),
        "opt_state.nu.inp.weight",
    ),
    "garbled_zarray": (
        lambda d: _garble(os.path.join(d, "params.head.bias", ".zarray")),
        "params.head.bias",
    ),
    "deleted_leaf_directory": (
        lambda d: shutil.rmtree(os.path.join(d, "opt_state.mu.head.weight")),
        "opt_state.mu.head.weight",
    ),
    "integer_dtype": (
        lambda d: _set_dtype(os.path.join(d, "params.head.weight", ".zarray"), "<i4"),
        "params.head.weight",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_raises_on_every_rank_naming_the_leaf(pool2, saved, tmp_path, case):
    damage, needle = CORRUPTIONS[case]
    directory = str(tmp_path / "ckpt")
    shutil.copytree(saved, directory)
    damage(directory)
    errors = pool2.run(restore_probe, directory)
    assert all(e is not None for e in errors), f"{case}: silent success: {errors}"
    assert any(needle in e for e in errors), f"{case}: no rank names {needle}: {errors}"
    for e in errors:
        assert needle in e or "failed on rank(s)" in e, e


@pytest.mark.parametrize(
    "chunk",
    [
        f"{LEAF}/1.0",  # only rank 1 reads it
        "params.scale/0",  # a 0-d parameter
        "opt_state.count/0",
        "step/0",
    ],
)
def test_deleted_chunk_file_raises(pool2, saved, tmp_path, chunk):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(saved, directory)
    os.remove(os.path.join(directory, chunk))
    errors = pool2.run(restore_probe, directory)
    assert all(e is not None for e in errors), f"silent success: {errors}"
    leaf = chunk.split("/")[0]
    assert any(leaf in e for e in errors), errors
    for e in errors:
        assert leaf in e or "failed on rank(s)" in e, e


def test_garbled_metadata_names_the_file(pool2, saved, tmp_path):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(saved, directory)
    _garble(os.path.join(directory, "_METADATA"))
    errors = pool2.run(restore_probe, directory)
    assert all(e is not None and "_METADATA" in e for e in errors), errors


def other_model_probe(directory: str) -> str | None:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0, dim=36, n_blocks=2)  # other shapes, fewer names
    like = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    return _error(lambda: fs.restore(directory, like=like))


def test_checkpoint_of_another_model_lists_the_mismatches(pool2, saved):
    for e in pool2.run(other_model_probe, saved):
        assert e is not None and "CheckpointMismatchError" in e
        assert "params.inp.weight: shape (37, 5) in the checkpoint, expected (36, 5)" in e
        assert "params.blocks.2.fc.weight: in the checkpoint but not in the target" in e


# --- 6. consumed by restore (here: it shares the saved checkpoint) --------------------------------


def consumed_by_restore(directory: str) -> list[str | None]:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=1)
    like = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    state = fs.restore(directory, like=like)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    errors = [
        _error(use)
        for use in (
            lambda: like.params,
            lambda: fs.full_params(like),
            lambda: fs.save(directory + "-x", like),
            lambda: fs.restore(directory, like=like),
            lambda: fs.train_step(like, batch, models.make_loss_fn(model)),
        )
    ]
    fs.train_step(state, batch, models.make_loss_fn(model))  # the restored state works
    return errors


def test_restore_consumes_like(pool2, saved):
    for errors in pool2.run(consumed_by_restore, saved):
        for e in errors:
            assert e is not None and "ConsumedStateError" in e and "consumed by restore" in e, e
    assert not os.path.exists(saved + "-x")


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _set_shape(zarray: str, shape: list[int]) -> None:
    with open(zarray) as f:
        meta = json.load(f)
    meta["shape"] = shape
    with open(zarray, "w") as f:
        json.dump(meta, f)


FALLBACK_DAMAGE = {  # step -> (damage to its item, what the error names); rank 1 alone reads 1.0
    2: (lambda item: _flip_byte(os.path.join(item, LEAF, "1.0"), 5), "ChecksumError"),
    3: (lambda item: os.remove(os.path.join(item, LEAF, "1.0")), f"chunk 1 of {LEAF} is missing"),
    4: (lambda item: _set_shape(os.path.join(item, LEAF, ".zarray"), [37, 6]), f"{LEAF}/.zarray"),
}


def fallback_worker(root: str) -> dict:
    """Saves steps 1-4, damages 2-4, restores each with ONE ``like``, then falls back to 1."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    mgr = fs.CheckpointManager(root, max_to_keep=None, async_save=False)
    mgr.save(1, state)
    at1 = _cpu(fs.full_params(state))
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    for step, (damage, _) in FALLBACK_DAMAGE.items():
        mgr.save(step, state)
        if dist.get_rank() == 0:
            damage(os.path.join(root, str(step), "default"))
    dist.barrier()
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    before = _cpu(like.params)
    failures = {}
    for step in FALLBACK_DAMAGE:
        error = _error(lambda step=step: mgr.restore(step, like=like))
        failures[step] = {
            "error": error,
            "consumed": like.consumed,
            "unchanged": all(torch.equal(t, before[n]) for n, t in like.params.items()),
        }
    restored = mgr.restore(1, like=like)
    return {
        "failures": failures,
        "exact": all(torch.equal(t, at1[n]) for n, t in fs.full_params(restored).items()),
        "consumed_after_success": like.consumed,
    }


def test_failed_restore_leaves_like_usable_for_an_older_step(pool2, tmp_path):
    """A restore that fails on one rank only (a flipped byte, a missing chunk, a changed
    shape) consumes ``like`` on no rank and leaves its values as they were; the same ``like``
    then restores the previous step exactly."""
    for rank, r in enumerate(pool2.run(fallback_worker, str(tmp_path / "run"))):
        for step, f in r["failures"].items():
            needle = FALLBACK_DAMAGE[step][1]
            assert f["error"] is not None, f"rank {rank}, step {step}: silent success"
            assert needle in f["error"] or "failed on rank(s) [1]" in f["error"], f["error"]
            assert not f["consumed"], f"rank {rank}, step {step}: like consumed: {f['error']}"
            assert f["unchanged"], f"rank {rank}, step {step}: like's values were overwritten"
        assert r["exact"] and r["consumed_after_success"], r


# --- 3. write failures during save ----------------------------------------------------------------


def write_failure_worker(root: str, stage: str) -> dict:
    """Saves step 1, then step 2 with an injected ENOSPC on one rank at ``stage``."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    mgr = fs.CheckpointManager(root, max_to_keep=2, async_save=stage.endswith("async"))
    mgr.save(1, state)
    mgr.wait()
    at1 = _cpu(fs.full_params(state))
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    real_arrays, real_meta = mgr.saver.write_arrays, mgr.saver.write_metadata

    def arrays_then_enospc(*args, **kwargs):  # the chunks are written, then the disk is full
        real_arrays(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def meta_enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    if stage.startswith("arrays") and dist.get_rank() == 1:
        mgr.saver.write_arrays = arrays_then_enospc
    if stage == "metadata":  # only rank 0 writes the metadata
        mgr.saver.write_metadata = meta_enospc
    try:
        error = _error(lambda: (mgr.save(2, state), mgr.wait()))
    finally:
        mgr.saver.write_arrays, mgr.saver.write_metadata = real_arrays, real_meta
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    restored = _cpu(fs.full_params(mgr.restore(like=like)))
    same = all(torch.equal(restored[n], at1[n]) for n in at1)
    mgr.save(3, state)  # the manager still works
    mgr.wait()
    return {"error": error, "steps_after_failure_and_3": mgr.all_steps(), "intact": same}


@pytest.mark.parametrize("stage", ["arrays", "arrays-async", "metadata"])
def test_write_failure_keeps_the_previous_checkpoint(pool2, tmp_path, stage):
    root = tmp_path / "run"
    for r in pool2.run(write_failure_worker, str(root), stage):
        assert r["error"] is not None
        assert "No space left" in r["error"] or "save to" in r["error"], r["error"]
        assert r["intact"]
        assert r["steps_after_failure_and_3"] == [1, 3]
    if stage.startswith("arrays"):  # a failed write leaves nothing behind
        assert sorted(os.listdir(root)) == ["1", "3"]


def test_failed_commit_leaves_no_debris(pool2, tmp_path):
    root = tmp_path / "run"
    pool2.run(write_failure_worker, str(root), "metadata")
    assert sorted(os.listdir(root)) == ["1", "3"]


def tmpfs_worker(root: str, filler: str) -> dict:
    """Saves step 1, fills the disk, saves step 2 (fails), frees it, saves step 3."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    mgr = fs.CheckpointManager(root, max_to_keep=2, async_save=False)
    mgr.save(1, state)
    at1 = _cpu(fs.full_params(state))
    if dist.get_rank() == 0:
        st = os.statvfs(root)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        with open(filler, "wb") as f:  # leave room for a third of a checkpoint
            f.write(b"\0" * max(st.f_bavail * st.f_frsize - used // 3, 0))
    dist.barrier()
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    error = _error(lambda: mgr.save(2, state))
    dist.barrier()  # rank 0 may still be removing the failed save's files
    listing = sorted(os.listdir(root))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(filler)
    dist.barrier()
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    restored = _cpu(fs.full_params(mgr.restore(like=like)))
    mgr.save(3, state)
    return {
        "error": error,
        "listing": listing,
        "steps": mgr.all_steps(),
        "intact": all(torch.equal(restored[n], at1[n]) for n in at1),
    }


def test_full_disk_on_tmpfs(pool2, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root and mount to make a small tmpfs")
    try:
        results = pool2.run(tmpfs_worker, str(mount / "run"), str(mount / "filler"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    for r in results:
        assert r["error"] is not None and "No space left" in r["error"], r["error"]
        assert r["intact"] and r["listing"] == ["1"] and r["steps"] == [1, 3], r


# --- 4. numerics --------------------------------------------------------------------------------


def inf_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    base = models.make_loss_fn(model)
    rank = dist.get_rank()

    def poisoned(params, b):  # +Inf in head.bias's gradient, on rank 1 only
        loss = base(params, b)
        return loss + params["head.bias"].sum() * (float("inf") if rank == 1 else 0.0)

    runs = {}
    for name, losses in (("skip", (base, poisoned, base, base)), ("clean", (base, base, base))):
        state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy=strategy)
        good, trace = 0, []
        for loss_fn in losses:
            batch = models.local_batch(models.global_batch(good, 8), rank, 2)
            before = [t.clone() for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]
            state, metrics = fs.train_step(state, batch, loss_fn)
            after = [t for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]
            same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            trace.append((metrics["nonfinite"], metrics.get("nonfinite_params"), same))
            good += loss_fn is base
        runs[name] = (trace, _cpu(fs.full_params(state)), state.step)
    return runs


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_inf_gradient_skips_the_step_and_training_recovers(pool2, strategy):
    for r in pool2.run(inf_worker, strategy):
        trace, params, step = r["skip"]
        assert trace[1] == (1, ["head.bias"], True)
        assert [t[0] for t in trace] == [0, 1, 0, 0] and not any(t[2] for t in trace[2:])
        _, clean, clean_step = r["clean"]
        assert step == clean_step == 3
        assert all(torch.equal(params[n], clean[n]) for n in clean), "the skip left a trace"


# --- 5. properties: random parameter trees on 2, 3 and 4 ranks ----------------------------------

PRIMES = (2, 3, 5, 7, 11, 13)


class TreeModel(nn.Module):
    """A module holding a random tree of parameters; the loss is a weighted sum of squares."""

    def __init__(
        self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], gen: torch.Generator
    ) -> None:
        super().__init__()
        self.sub = nn.Module()
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            owner = self.sub if i % 2 else self
            owner.register_parameter(
                f"w{i}", nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p.float() ** 2).sum() for p in self.parameters()) * x.mean()


ROWS_CHOICES = (1, 2, *PRIMES, 37)
_rows = st.sampled_from(ROWS_CHOICES)
_prime = st.sampled_from(PRIMES)
_shape = st.one_of(
    st.just(()),
    st.tuples(_rows),
    st.tuples(_rows, _prime),
    st.tuples(st.just(1), _prime),
    st.tuples(_rows, st.just(1), st.sampled_from((2, 3))),
)
TREES = st.lists(
    st.tuples(_shape, st.sampled_from(("float32", "float32", "bfloat16"))), min_size=1, max_size=5
)
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("FUNCSHARD_PROPERTY_EXAMPLES", "8")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _tree_model(leaves: list[tuple[tuple[int, ...], str]], seed: int) -> TreeModel:
    gen = torch.Generator().manual_seed(seed)
    return TreeModel(
        [shape for shape, _ in leaves], [getattr(torch, dtype) for _, dtype in leaves], gen
    )


_MESHES: dict[int, object] = {}


def _mesh(replicate: int):
    if replicate not in _MESHES:
        _MESHES[replicate] = fs.make_mesh(replicate=replicate, device_type="cpu")
    return _MESHES[replicate]


def _gather_rows(local: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict:
    """Full tensors from every rank's rows (mesh with replicate=1, rank order = row order)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in local.items()})
    out = {}
    for n, shape in shapes.items():
        rows = [p[n].reshape(-1, *shape[1:]) if shape else p[n].reshape(-1) for p in parts]
        out[n] = torch.cat(rows).reshape(shape)
    return out


def _rows_of(full: torch.Tensor, spec, shard_rank: int) -> torch.Tensor:
    """The rows of ``full`` that ``shard_rank`` owns under ``spec``, flattened."""
    lo, hi = spec.row_range(shard_rank)
    return full.reshape(max(spec.rows, 1), -1)[lo:hi].reshape(-1)


def shard_gather_case(leaves: list, seed: int, strategy: str) -> bool:
    """fs.shard then gather, and fs.init then fs.full_params, are the identity."""
    model = _tree_model(leaves, seed)
    full = {n: p.detach() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in full.items()}
    local = fs.shard(full, _mesh(1), strategy=strategy)
    if strategy == "no_shard":  # every rank holds every param whole, 0-d ones included
        assert all(tuple(t.shape) == shapes[n] for n, t in local.items())
        back = local
    else:
        back = _gather_rows(local, shapes)
    for n in full:
        assert torch.equal(back[n], full[n]), f"shard/gather changed {n} {shapes[n]}"
    state = fs.init(model, fs.optim.sgd(0.1), mesh=_mesh(1), strategy=strategy)
    for n, t in fs.full_params(state).items():
        assert t.dtype == full[n].dtype and torch.equal(t, full[n]), f"init changed {n}"
    return True


def roundtrip_case(
    leaves: list, seed: int, a: str, b: str, replicate: int, offload: float, path: str
) -> bool:
    """Save on one layout, restore on another: params, optimizer state and step survive."""
    world = dist.get_world_size()
    replicate = replicate if world % replicate == 0 else 1
    model = _tree_model(leaves, seed)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=_mesh(1), strategy=a)
    batch = {"x": torch.ones(2)}
    loss_fn = lambda p, bt, m=model: fs.functional_call(m, p, (bt["x"],))  # noqa: E731
    state, _ = fs.train_step(state, batch, loss_fn)
    shapes = {s.name: s.shape for s in state.layout.leaves}
    full = _cpu(fs.full_params(state))
    opt = state.opt_state_by_name()
    moments = {
        k: (dict(getattr(opt, k)) if a == "no_shard" else _gather_rows(getattr(opt, k), shapes))
        for k in ("mu", "nu")
    }
    fs.save(path, state)
    like = fs.init(
        model, fs.optim.adamw(1e-2), mesh=_mesh(replicate), strategy=b, offload_fraction=offload
    )
    restored = fs.restore(path, like=like)
    assert restored.step == state.step == 1
    for n, t in fs.full_params(restored).items():
        assert torch.equal(t, full[n]), f"{a} -> {b}: {n} {shapes[n]} changed"
    ropt = restored.opt_state_by_name()
    assert ropt.count == opt.count
    for spec in restored.layout.leaves:
        for k in ("mu", "nu"):
            got = getattr(ropt, k)[spec.name].cpu().reshape(-1)
            want = _rows_of(moments[k][spec.name], spec, restored.layout.shard_rank)
            assert torch.equal(got, want.to(got.dtype)), f"{a} -> {b}: {k}.{spec.name} changed"
    return True


@pytest.mark.parametrize("pool_name", ["pool2", "pool3", "pool4"])
@PROPERTY_SETTINGS
@given(leaves=TREES, seed=st.integers(0, 2**16), strategy=st.sampled_from(fs.STRATEGIES))
def test_shard_then_gather_is_the_identity(request, pool_name, leaves, seed, strategy):
    pool = request.getfixturevalue(pool_name)
    assert pool.run(shard_gather_case, leaves, seed, strategy) == [True] * pool.nproc


@pytest.mark.parametrize("pool_name", ["pool2", "pool3", "pool4"])
@PROPERTY_SETTINGS
@given(
    leaves=TREES,
    seed=st.integers(0, 2**16),
    a=st.sampled_from(fs.STRATEGIES),
    b=st.sampled_from(fs.STRATEGIES),
    replicate=st.sampled_from((1, 2)),
    offload=st.sampled_from((0.0, 0.5, 1.0)),
)
def test_save_then_restore_on_another_layout_is_the_identity(
    request, pool_name, leaves, seed, a, b, replicate, offload
):
    pool = request.getfixturevalue(pool_name)
    path = os.path.join(tempfile.mkdtemp(prefix="funcshard-prop-"), "ckpt")
    try:
        assert (
            pool.run(roundtrip_case, leaves, seed, a, b, replicate, offload, path)
            == [True] * pool.nproc
        )
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
