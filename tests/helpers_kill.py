"""The kill-during-save trials, shared by ``test_kill_restart.py`` (a path) and
``test_object_store.py`` (s3): the job is ``tests/_kill_job.py``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from _kill_job import ckpt_root, params_hash

import funcshard as fs

import models

HERE = os.path.dirname(os.path.abspath(__file__))
KILL_TRIALS = int(os.environ.get("FUNCSHARD_KILL_TRIALS", "3"))
KILL_NPROC = os.environ.get("FUNCSHARD_KILL_NPROC")


def check_kill_root(root: str, env: dict | None = None) -> dict:
    """Restores every listed step of the job's checkpoints on another layout; their hashes.

    ``env`` holds while it runs only: the pool's ranks outlive the test (a leftover
    ``FUNCSHARD_KILL_CKPT`` sent a later path trial's check to a stopped S3 server)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return _check_kill_root(root)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_kill_root(root: str) -> dict:
    mgr = fs.CheckpointManager(ckpt_root(root), max_to_keep=None)
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


def kill_trials(pool2, root: str, env: dict | None = None, trials: int = KILL_TRIALS) -> None:
    """``trials`` kills at random moments; after each, every listed step restores to the
    params recorded before it was saved, and the last committed step is listed. ``env``
    reaches the pool's ranks (an object store's endpoint; the job inherits this process's)."""
    rng = random.Random(1234)
    for trial in range(trials):
        _kill_trial(root, rng, int(KILL_NPROC) if KILL_NPROC else 1 + trial % 2)
        r = pool2.run(check_kill_root, root, env)[0]
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
