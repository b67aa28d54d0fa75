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
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from _kill_job import ROWS, params_hash

import funcshard as fs
from funcshard import checkpoint as ckpt_lib

import models

HERE = os.path.dirname(os.path.abspath(__file__))
KILL_TRIALS = int(os.environ.get("FUNCSHARD_KILL_TRIALS", "3"))
KILL_NPROC = os.environ.get("FUNCSHARD_KILL_NPROC")


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
