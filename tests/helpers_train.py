"""``experiments/train.py``'s loop on a pool's ranks: ``trainer.run`` of the ``Config`` the
script's flags give, as ``fs.launch`` runs it on each rank (``tests/test_train.py``: a pool's
warm ranks instead of a process per rank, which costs ~10 s of imports per run)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from absl import logging

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # `experiments` as a package, in a rank spawned before the test's import
    sys.path.insert(0, ROOT)

from experiments import trainer  # noqa: E402
from funcshard.checkpoint.commit import Saver  # noqa: E402


def _savers() -> int:
    gc.collect()
    return sum(isinstance(o, Saver) for o in gc.get_objects())


def run(cfg: trainer.Config) -> dict[str, Any]:
    """``trainer.run(cfg)`` on this rank; the rank's threads and log level as they were after.

    Raises:
      AssertionError: the run left a checkpoint saver alive in this warm rank (one not closed
        stays in ``atexit``'s hooks, with its staging buffers, for the rank's life).
    """
    threads, savers = torch.get_num_threads(), _savers()
    try:
        result = trainer.run(cfg)
    finally:
        torch.set_num_threads(threads)
        logging.set_verbosity(logging.WARNING)
    left = _savers() - savers
    assert not left, f"rank {dist.get_rank()}: trainer.run left {left} checkpoint saver(s) alive"
    return result
