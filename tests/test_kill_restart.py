"""Killed processes: kill -9 during saves never lists a partial checkpoint, leftovers of killed
saves and removals are cleaned, torchrun restarts a killed rank from the latest checkpoint.

The kill test is marked ``slow``; it runs ``FUNCSHARD_KILL_TRIALS`` trials (3 by default),
alternately on 1 rank (in the job's own process) and 2 ranks (``fs.launch``), or all on
``FUNCSHARD_KILL_NPROC`` ranks when that is set. The full count::

    FUNCSHARD_KILL_TRIALS=50 python -m pytest -q tests/test_kill_restart.py -k kill_during_save

The job is ``tests/_kill_job.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _kill_job import ROWS, params_hash

import funcshard as fs
from funcshard import checkpoint as ckpt_lib

import models
from helpers_kill import kill_trials

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_kill_during_save_never_lists_a_partial_checkpoint(pool2, tmp_path):
    kill_trials(pool2, str(tmp_path))


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
