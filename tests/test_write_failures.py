"""Write failures during a save: an injected ENOSPC (chunks, async chunks, metadata) and a full
tmpfs keep the previous checkpoint intact, leave no debris, and the manager saves again after.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.checkpoint import storage

import models
from helpers_errors import cpu_params, error_text


def write_failure_worker(root: str, stage: str) -> dict:
    """Saves step 1, then step 2 with an injected ENOSPC on one rank at ``stage``."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    mgr = fs.CheckpointManager(root, max_to_keep=2, async_save=stage.endswith("async"))
    mgr.save(1, state)
    mgr.wait()
    at1 = cpu_params(fs.full_params(state))
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
        error = error_text(lambda: (mgr.save(2, state), mgr.wait()))
    finally:
        mgr.saver.write_arrays, mgr.saver.write_metadata = real_arrays, real_meta
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    restored = cpu_params(fs.full_params(mgr.restore(like=like)))
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
    at1 = cpu_params(fs.full_params(state))
    if dist.get_rank() == 0:
        st = os.statvfs(root)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        with open(filler, "wb") as f:  # leave room for a third of a checkpoint
            f.write(b"\0" * max(st.f_bavail * st.f_frsize - used // 3, 0))
    dist.barrier()
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    error = error_text(lambda: mgr.save(2, state))
    dist.barrier()  # rank 0 may still be removing the failed save's files
    listing = sorted(os.listdir(root))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(filler)
    dist.barrier()
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    restored = cpu_params(fs.full_params(mgr.restore(like=like)))
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


def retention_failure_worker(root: str) -> dict:
    """max_to_keep=1; retention's removal of step 1 fails after step 2 is committed."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    mgr = fs.CheckpointManager(root, max_to_keep=1, async_save=False)
    mgr.save(1, state)
    real = storage.rename

    def refused(src: str, dst: str) -> None:  # retention renames the step aside first
        if fs.checkpoint.DELETE_MARK not in dst:
            return real(src, dst)  # the commit's rename
        raise OSError(errno.EACCES, f"{src}: Permission denied (injected)")

    storage.rename = refused
    try:
        error = error_text(lambda: mgr.save(2, state))
    finally:
        storage.rename = real
    after_failure = mgr.all_steps()
    mgr.save(3, state)  # retention runs again, and succeeds
    return {"error": error, "after_failure": after_failure, "end": mgr.all_steps()}


def test_a_retention_failure_after_the_commit_is_logged_and_the_save_stands(pool2, tmp_path):
    """The save committed: its caller learns of no failure (rank 0 logs retention's), and
    the next save's retention removes what this one's could not."""
    for r in pool2.run(retention_failure_worker, str(tmp_path / "run")):
        assert r["error"] is None, r
        assert r["after_failure"] == [1, 2] and r["end"] == [3], r
