"""Checkpoints in Orbax's on-disk format, written and read shard by shard; Hugging Face
safetensors in and out.

A plain JAX process restores a checkpoint with no target and gets::

    {"params": {name: full master array}, "opt_state": {"count": int, "mu": {...}, ...},
     "step": int, "loss_scale": {"scale": float, "good_steps": int},   # loss_scale: fp16 only
     "buffers": {name: the model's persistent buffer}}   # funcshard.state.buffers

Every rank writes its own rows of each array (nothing is gathered) and reads exactly the rows
its target layout needs (any world size, mesh, strategy, offload fraction); the restored state
is rebuilt from the values read, none of ``like``'s survive.

Modules, along the seams:

* ``format``: the on-disk contract (zarr v2 arrays, ``_METADATA``, ``_CHECKPOINT_METADATA``);
* ``checksums``: crc32c of every chunk written (``_CHECKSUMS``), verified on every read;
* ``tree``: a state as keyed arrays (the optimizer state's tree, what each rank writes);
  ``matching``: does a checkpoint fit a target state; ``reading``: filling a layout;
* ``sources``: the readers behind one protocol (Orbax/tensorstore, in-memory dicts) and
  ``safetensors``: the safetensors file format, ``hf``: Hugging Face safetensors (a reader,
  and ``export_safetensors``), ``dcp``:
  torch.distributed.checkpoint directories (a reader, and a streaming writer);
* ``commit``: agreement, temporary directory, fsync, rename, leftovers, and the ``Saver``;
  ``staging``: a background save's host buffers (pinned for accelerator rows), reused;
* ``manager``: ``CheckpointManager``; ``steps``: its root's committed steps (an object store's
  index of them) and the sweep of killed saves; ``api``: ``save``, ``restore``; ``buffers``:
  the model's persistent buffers read back into ``like``'s model.
"""

from funcshard.checkpoint.api import rebuild_from_params, restore, save
from funcshard.checkpoint.checksums import ChecksumError, UnverifiedCheckpointWarning
from funcshard.checkpoint.commit import Saver
from funcshard.checkpoint.format import CHUNK_BYTES, DELETE_MARK, TMP_MARK
from funcshard.checkpoint.hf import export_safetensors
from funcshard.checkpoint.manager import CheckpointManager
from funcshard.checkpoint.matching import CheckpointMismatchError
from funcshard.checkpoint.stats import IOStats, io_stats

__all__ = [
    "CHUNK_BYTES",
    "DELETE_MARK",
    "TMP_MARK",
    "CheckpointManager",
    "CheckpointMismatchError",
    "ChecksumError",
    "IOStats",
    "Saver",
    "UnverifiedCheckpointWarning",
    "export_safetensors",
    "io_stats",
    "rebuild_from_params",
    "restore",
    "save",
]
