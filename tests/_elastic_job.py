"""experiments/train.py under torchrun with pause points: the job of test_nodes' elastic test.

    torchrun ... tests/_elastic_job.py --hold_dir=DIR --hold=6:4,7:2 [train.py's flags]

Exactly train.py's main, flags and loop, plus: after step S in a world of W (each
``--hold=S:W``), rank 0 writes ``DIR/held<S>`` and every rank waits until ``DIR/go<S>`` exists,
all-reducing a flag every 0.1 s. So the test knows where the run is when it kills a node; a
lost peer fails the wait as it would fail a step (the survivors' agent restarts them), and a
node that joins makes the agent stop the waiting ranks for a new round, as it would stop a
step. All ranks leave a wait together. If step S saves a checkpoint, that asynchronous save
writes nothing until ``DIR/go<S>`` exists either: a node killed during the wait is killed in
the middle of the save.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from absl import app, flags

from experiments import train, trainer
from funcshard.checkpoint.commit import Saver

flags.DEFINE_string("hold_dir", None, "Where held<S> is written and go<S> is awaited.")
flags.DEFINE_list("hold", [], "S:W pairs: wait after step S when the world size is W.")
FLAGS = flags.FLAGS


def _hold(step: int, world: int) -> None:
    go = _held(step, world)
    if go is None:
        return
    if dist.get_rank() == 0:
        (go.parent / f"held{step}").touch()
    while True:
        flag = torch.tensor(float(go.exists()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag:
            return
        time.sleep(0.1)


def _held(step: int, world: int) -> Path | None:
    """``DIR/go<step>`` where ``--hold`` names this step and world, else None."""
    if f"{step}:{world}" not in FLAGS.hold:
        return None
    return Path(FLAGS.hold_dir) / f"go{step}"


def _write_when_released(write_arrays):
    @functools.wraps(write_arrays)
    def write(self, item_dir: str, *args, **kwargs):
        # item_dir: <root>/<step>.orbax-checkpoint-tmp-<ns>/<item>
        step = os.path.basename(os.path.dirname(item_dir)).split(".")[0]
        go = _held(int(step), dist.get_world_size()) if step.isdigit() else None
        while go is not None and not go.exists():
            time.sleep(0.05)
        return write_arrays(self, item_dir, *args, **kwargs)

    return write


def main(argv: list[str]) -> None:
    Saver.write_arrays = _write_when_released(Saver.write_arrays)
    train.run = functools.partial(trainer.run, after_step=_hold)
    train.main(argv)


if __name__ == "__main__":
    app.run(main)
