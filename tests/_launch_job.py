"""A job for the torchrun tests of ``fs.init_from_env`` (test_launch.py, test_nodes.py).

    torchrun ... tests/_launch_job.py LOG_DIR [--die=ATTEMPT:RANK] [--slow=RANK] [--until_stop]

Every worker joins with ``fs.init_from_env("gloo")``, all-reduces a one and appends
``<restart count> <group rank> <rank> <world> <sum>`` to ``LOG_DIR/inits``. ``--die``: the rank
exits (code 1) right after that in the given ``TORCHELASTIC_RESTART_COUNT``, so torchrun starts
a new round. ``--slow``: that rank waits 3 s before joining in every round after the first
(which order the ranks reach the store in is what breaks a stale store). ``--until_stop``: all
ranks keep all-reducing until ``LOG_DIR/stop`` exists (for membership changes). ``--idle=S``:
in the first round the ranks that do not die sleep S seconds without communicating, as in a
long compute step: their agent then stops them for the next round without counting a failure.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import funcshard as fs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("log_dir")
    p.add_argument("--die", default=None, help="ATTEMPT:RANK")
    p.add_argument("--slow", type=int, default=None)
    p.add_argument("--until_stop", action="store_true")
    p.add_argument("--idle", type=float, default=0.0)
    a = p.parse_args()
    env = os.environ
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "?")
    log = os.path.join(a.log_dir, "inits")
    later_round = os.path.exists(log) and len(open(log).readlines()) >= int(env["WORLD_SIZE"])
    if a.slow is not None and int(env["RANK"]) == a.slow and later_round:
        time.sleep(3.0)
    fs.init_from_env("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(())
    dist.all_reduce(x)
    line = f"{attempt} {env.get('GROUP_RANK', '?')} {rank} {world} {int(x)}\n"
    with open(log, "a") as f:
        f.write(line)
    if a.die == f"{attempt}:{rank}":
        os._exit(1)
    if not later_round:
        time.sleep(a.idle)  # computing, not communicating: a new round stops it, no failure
    stop = os.path.join(a.log_dir, "stop")
    while a.until_stop:
        flag = torch.tensor(float(os.path.exists(stop)))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank leaves in the same step
        if flag:
            break
        time.sleep(0.2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
