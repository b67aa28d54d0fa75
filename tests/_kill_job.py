"""A training job that saves every step, for the kill -9 tests of test_kill_restart.py.

``python _kill_job.py ROOT NPROC STEPS`` trains the small MLP on NPROC gloo ranks (NPROC 1:
a 1-rank group in this process, else ``fs.launch``), resuming
from ``CheckpointManager(ROOT/ckpt).latest_step()`` if there is one, and saves every step
asynchronously. Before saving step ``s`` rank 0 records the hash of ``fs.full_params`` as
``ROOT/records/<s>`` (so every checkpoint that can ever be listed has its record), and after
the save is known to be committed it appends ``s`` to ``ROOT/done``. It prints ``ready`` once
training starts. The test kills it at random moments.

``torchrun --max-restarts=1 ... _kill_job.py ROOT torchrun UNTIL KILL_AT`` trains up to step
UNTIL; in the first attempt rank 1 kills itself (SIGKILL) once step KILL_AT is committed, and
torchrun restarts the job, which resumes from the latest checkpoint. Rank 0 appends the
attempt number to ``ROOT/attempts`` and writes the final params' hash to ``ROOT/final``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import funcshard as fs  # noqa: E402

import models  # noqa: E402

ROWS = 8


def params_hash(params: dict[str, torch.Tensor]) -> str:
    """A hash of every parameter's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def ckpt_root(root: str) -> str:
    """Where the job's CheckpointManager writes: ``root/ckpt``, or ``$FUNCSHARD_KILL_CKPT``
    (an s3:// URL: the object-store variant of the kill test)."""
    return os.environ.get("FUNCSHARD_KILL_CKPT") or os.path.join(root, "ckpt")


def job(root: str, steps: int, until: int | None = None, kill_at: int | None = None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    mgr = fs.CheckpointManager(ckpt_root(root), max_to_keep=2)
    start = mgr.latest_step()
    if start is not None:
        state = mgr.restore(like=state)
    start = start or 0
    os.makedirs(os.path.join(root, "records"), exist_ok=True)
    loss_fn = models.make_loss_fn(model)
    if rank == 0:
        print("ready", flush=True)
    stop = until if until is not None else start + steps
    for step in range(start + 1, stop + 1):
        batch = models.local_batch(models.global_batch(step, ROWS), rank, world)
        state, _ = fs.train_step(state, batch, loss_fn)
        digest = params_hash(fs.full_params(state))
        if rank == 0:
            _write_atomic(os.path.join(root, "records", str(step)), digest)
        dist.barrier()  # the record exists before any rank can commit the checkpoint
        mgr.save(step, state)
        if step > start + 1 and rank == 0:  # the previous save was awaited by this one
            with open(os.path.join(root, "done"), "a") as f:
                f.write(f"{step - 1}\n")
                f.flush()
                os.fsync(f.fileno())
        if step == kill_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            mgr.wait()  # step KILL_AT is committed
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    digest = params_hash(fs.full_params(state))
    if rank == 0 and until is not None:
        _write_atomic(os.path.join(root, "final"), digest)


def torchrun_main(root: str, until: int, kill_at: int) -> None:
    """The entry point under torchrun (the group comes from its environment).

    torchrun's agent hosts the store by default and keeps it across attempts, with the first
    attempt's keys in it: a plain ``dist.init_process_group("gloo")`` in the restarted attempt
    would read the killed rank's address. ``fs.init_from_env`` gives each attempt a store of
    its own instead: worker rank 0 hosts a new one and publishes its port with a random nonce
    in the agent's store, and the other ranks join the store that answers with that nonce (not
    a key per ``TORCHELASTIC_RESTART_COUNT``: a membership change does not advance it).
    """
    fs.init_from_env("gloo")
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, "attempts"), "a") as f:
            f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?") + "\n")
    job(root, 0, until=until, kill_at=kill_at)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2] == "torchrun":
        torchrun_main(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    root_dir, nproc, n_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if nproc == 1:  # a 1-rank gloo group in this very process: no spawn to wait for
        from funcshard.distributed.launch import free_port, init_process_group

        init_process_group(0, 1, free_port(), backend="gloo")
        job(root_dir, n_steps)
        dist.destroy_process_group()
    else:
        fs.launch(job, root_dir, n_steps, nproc=nproc)
