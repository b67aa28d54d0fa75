"""One replica group of a fault-tolerant run, for tests/test_ft.py and experiments/bench_ft.py.

``python _ft_job.py ROOT GROUP STEPS LIGHTHOUSE RANK PORT [KILL_AT]`` is rank RANK of 2 (the
group's store on 127.0.0.1:PORT, hosted by rank 0; :func:`start_group` starts both, in a
process group of their own). It trains the small MLP (fp32 SGD with
momentum, ZeRO-3 unless told another strategy) as replica group GROUP of a torchft lighthouse,
until the committed step counter reaches STEPS. Each step's batch is a function of (GROUP, the
state's step), built again for every call, so a retried step sees the same batch and a step
after a heal the batch of the step healed to. Each rank appends JSON lines to
``ROOT/g<GROUP>/rank<r>.jsonl``: ``init`` (the state ``fs.init`` returned: its step and hash),
one ``step`` line per call (step, committed, replicas, healed, the hash of the input state
and of the returned one, the pid, the time) and ``final``; rank 0 saves the final full params as
``final.pt``. With KILL_AT, rank 0 SIGKILLs its process group (both ranks) inside the loss of
step KILL_AT: after the step's quorum, before its cross-group all-reduce.

:func:`start_group`'s options reach the ranks as environment variables: the strategy
(``FT_JOB_STRATEGY``), the torchft timeout (``FT_JOB_TIMEOUT``, seconds), ``FT_JOB_RAISE_AT``
(both ranks raise once inside the loss of that step; the loop catches it, records an
``error`` line and calls again, as it does with a quorum's ``TimeoutError``: a ``timeout``
line) and ``FT_JOB_STALE`` (a group that healed in ``fs.init`` then "restores an older
checkpoint": its weights and optimizer state halved, its step set back to 1). Each ``step``
line also holds the step's bytes per axis (``fs.comm_stats``), and ``init`` the bytes per axis
``fs.plan`` predicts for a step of two groups.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import funcshard as fs  # noqa: E402

import models  # noqa: E402

ROWS = 8
LR, MOMENTUM = 0.05, 0.9
RETRIES = 20  # errors and quorum timeouts a rank catches before it gives up


def state_hash(state: fs.TrainState) -> str:
    """A hash of every value of this rank's state: masters, optimizer state, step, scale."""
    h = hashlib.sha256(f"{state.step}:{state.loss_scale}".encode())
    leaves = fs.tree.leaves(state.opt_state, none_is_leaf=True)
    for t in (*state.master, *leaves):
        if isinstance(t, torch.Tensor):
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(t).encode())
    return h.hexdigest()


def batch_for(group: int, step: int) -> dict:
    """Group ``group``'s global batch of step ``step``."""
    return models.global_batch(1000 * group + step, ROWS)


def stale(state: fs.TrainState) -> fs.TrainState:
    """An older state than ``state``, as a checkpoint restored over it gives: new buffers
    (halved values) and step 1."""
    older = fs.tree.map(lambda x: x.clone().mul_(0.5) if torch.is_tensor(x) else x, state)
    return older.replace(step=1)


def job(root: str, group: int, steps: int, lighthouse: str, kill_at: int | None) -> None:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = os.path.join(root, f"g{group}")
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, f"rank{rank}.jsonl"), "a")

    def write(**record) -> None:
        log.write(json.dumps({**record, "pid": os.getpid(), "t": time.time()}) + "\n")
        log.flush()

    strategy = os.environ.get("FT_JOB_STRATEGY", "optim_grads_params")
    raise_at = int(os.environ.get("FT_JOB_RAISE_AT", "-1"))
    summed = bool(os.environ.get("FT_JOB_SUMMED"))
    model = models.make_model(seed=0)
    timeout = float(os.environ.get("FT_JOB_TIMEOUT", "60"))
    ft = fs.FaultTolerance(replica_id=str(group), lighthouse=lighthouse, timeout=timeout)
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    t0 = time.perf_counter()
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(model, opt, mesh=mesh, strategy=strategy, fault_tolerance=ft)
    planned = fs.plan(
        model,
        world_size=world,
        strategy=strategy,
        optimizer=opt,
        device_type="cpu",
        replica_groups=2,
    ).comm_by_axis
    write(
        kind="init",
        step=state.step,
        hash=state_hash(state),
        s=time.perf_counter() - t0,
        planned=planned,
    )
    if os.environ.get("FT_JOB_STALE") and state.step > 1:
        state = stale(state)
    loss = models.make_loss_fn(model)
    failures = 0
    while state.step < steps:
        step = state.step

        def loss_fn(params, batch, step=step):
            if step == kill_at and rank == 0:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            if summed:  # the rows this rank saw, summed over the ranks and the groups
                return loss(params, batch), {"rows": fs.summed(torch.tensor([len(batch["y"])]))}
            return loss(params, batch)

        def raising(params, batch, step=step):
            raise RuntimeError(f"a user's error in the loss of step {step}")

        time.sleep(float(os.environ.get("FT_JOB_STEP_SLEEP", "0")))  # a longer step (bench)
        before = state_hash(state)
        batch = models.local_batch(batch_for(group, step), rank, world)
        t0 = time.perf_counter()
        try:
            with fs.comm_stats() as stats:
                state, metrics = fs.train_step(
                    state, batch, raising if step == raise_at else loss_fn
                )
        except (TimeoutError, RuntimeError) as e:  # the state is unchanged: call again
            failures += 1
            write(kind="timeout" if isinstance(e, TimeoutError) else "error", step=step, e=str(e))
            if failures > RETRIES:
                raise
            raise_at = -1 if step == raise_at else raise_at  # the user's error is once
            continue
        write(
            kind="step",
            step=step,
            committed=metrics["committed"],
            replicas=metrics["replicas"],
            healed=metrics.get("healed", 0),
            before=before,
            after=state_hash(state),
            s=time.perf_counter() - t0,
            by_axis={k: v for k, v in stats.bytes_by_axis.items() if v},
            rows=metrics["aux"]["rows"].tolist() if "aux" in metrics else None,
        )
    write(kind="final", step=state.step, hash=state_hash(state))
    if rank == 0:
        torch.save(fs.full_params(state), os.path.join(out, "final.pt"))
    else:
        fs.full_params(state)
    state.replicas.shutdown()


def start_group(
    root: str,
    group: int,
    steps: int,
    lighthouse: str,
    kill_at: int | None = None,
    *,
    strategy: str = "optim_grads_params",
    timeout: float = 60.0,
    raise_at: int | None = None,
    stale: bool = False,
    summed: bool = False,
) -> list[subprocess.Popen]:
    """Starts group ``group``'s 2 ranks, in a new process group (rank 0 leads it); the
    options are the module docstring's."""
    from funcshard.distributed.launch import free_port

    port, procs = free_port(), []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.update(FT_JOB_STRATEGY=strategy, FT_JOB_TIMEOUT=str(timeout))
    env.update(FT_JOB_RAISE_AT=str(-1 if raise_at is None else raise_at))
    env.update({"FT_JOB_STALE": "1"} if stale else {})
    env.update({"FT_JOB_SUMMED": "1"} if summed else {})
    os.makedirs(os.path.join(root, f"g{group}"), exist_ok=True)
    for rank in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), root, str(group), str(steps)]
        cmd += [lighthouse, str(rank), str(port)] + ([str(kill_at)] if kill_at is not None else [])
        out = open(os.path.join(root, f"g{group}", f"out{rank}.log"), "a")
        pgid = procs[0].pid if procs else 0  # rank 0 leads a new process group
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=pgid)
        )
    return procs


def main(argv: list[str]) -> None:
    from funcshard.distributed.launch import init_process_group

    root, group, steps, lighthouse, rank, port = argv[:6]
    kill_at = int(argv[6]) if len(argv) > 6 else None
    init_process_group(int(rank), 2, int(port), backend="gloo")
    job(root, int(group), int(steps), lighthouse, kill_at)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
