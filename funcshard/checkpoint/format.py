"""The on-disk contract: Orbax's PyTree layout with zarr v2 arrays, as funcshard writes it.

A checkpoint directory holds one *item* (Orbax's PyTreeCheckpointHandler layout):

* one zarr v2 array per leaf in ``<item>/<key.key...>/`` (``.zarray`` + chunk files ``i.0``),
  uncompressed, C order, chunked along dim 0 only so that a chunk never has two writers;
* ``<item>/_METADATA``: the tree (every leaf's keys and whether it is an array or a scalar);
* ``<item>/_CHECKSUMS``: funcshard's crc32c of every chunk file's bytes and of every
  metadata file (Orbax ignores it; see ``funcshard.checkpoint.checksums``);
* ``_CHECKPOINT_METADATA`` (Orbax's step metadata, with funcshard's own record under
  ``custom_metadata["funcshard"]``) and ``commit_success.txt`` at the top.

funcshard marks a checkpoint it writes in three places, each with the format version and the
checksum algorithm (``"none"`` only for a ``Saver(checksums=False)``): its record in
``_CHECKPOINT_METADATA``, ``custom_metadata["funcshard"]`` of ``_METADATA`` and a second line
of every ``commit_success.txt`` (Orbax only checks that the file exists). A checkpoint that any
of them says has checksums is verified or refused: losing ``_CHECKSUMS`` and one marker never
turns verification off.

``fs.save`` writes the item at the top of the directory (``PyTreeCheckpointer().restore(dir)``
reads it); ``fs.CheckpointManager`` writes it as ``<step>/default/`` with the step metadata
Orbax's ``CheckpointManager(root).restore(step)`` expects.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from funcshard.checkpoint import storage
from funcshard.state.dtypes import ZARR_DTYPE

# 2: chunk checksums in <item>/_CHECKSUMS (funcshard.checkpoint.checksums); 3: checksums of
# the metadata files too, and the marker in _METADATA and the commit files
FORMAT_VERSION = 3
CHUNK_BYTES = 64 << 20  # default target size of one zarr chunk
TMP_MARK = ".orbax-checkpoint-tmp-"
DELETE_MARK = ".orbax-checkpoint-deleting-"
COMMIT_FILE = "commit_success.txt"
METADATA_FILE = "_METADATA"
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
DEFAULT_ITEM = "default"  # the item name of Orbax's CheckpointManager for a single item
ORBAX_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"

Keys = tuple[str, ...]

# --- dtypes --------------------------------------------------------------------------------

# dtypes numpy lacks: ml_dtypes' (a tensor's bytes are viewed as the int of their width).
# ml_dtypes costs about a second of import: it loads when a checkpoint first needs a dtype.
_ML_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16}


def _ml_dtype(dtype: torch.dtype) -> Any:
    """ml_dtypes' numpy type for a torch dtype numpy lacks, None for the others."""
    name = _ML_NAMES.get(dtype)
    if name is None:
        return None
    import ml_dtypes

    return getattr(ml_dtypes, name)


def _numpy_of(dtype: torch.dtype) -> np.dtype:
    ml = _ml_dtype(dtype)
    if ml is not None:
        return np.dtype(ml)
    return torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")


class _Built(Mapping):
    """A mapping built by ``build`` at its first read (the dtype tables need ml_dtypes)."""

    def __init__(self, build: Any) -> None:
        self._build = build

    @functools.cached_property
    def _table(self) -> dict:
        return self._build()

    def __getitem__(self, key: Any) -> Any:
        return self._table[key]

    def __iter__(self) -> Iterator:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


NUMPY_DTYPE: Mapping[str, np.dtype] = _Built(
    lambda: {z: _numpy_of(t) for t, z in ZARR_DTYPE.items()}
)
"""zarr dtype string -> numpy dtype (what chunk files hold, little-endian)."""
TORCH_FROM_NUMPY: Mapping[np.dtype, torch.dtype] = _Built(
    lambda: {np.dtype(NUMPY_DTYPE[z]).newbyteorder("="): t for t, z in ZARR_DTYPE.items()}
)
FLOAT_NAMES = ("float32", "float64", "float16", "bfloat16")
EIGHT_BIT_NAMES = ("int8", "uint8")  # 8-bit optimizer moments


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array (bf16 and float8 as ml_dtypes', no copy if
    able)."""
    t = t.detach().cpu().contiguous()
    ml = _ml_dtype(t.dtype)
    if ml is not None:
        return t.view(_INT_OF_WIDTH[t.element_size()]).numpy().view(ml)
    return t.numpy()


def to_torch(a: np.ndarray, where: str) -> torch.Tensor:
    dtype = TORCH_FROM_NUMPY.get(a.dtype)
    if dtype is None:
        raise TypeError(
            f"{where}: dtype {a.dtype} is none that funcshard reads "
            f"({', '.join(sorted(n.name for n in TORCH_FROM_NUMPY))})"
        )
    a = np.ascontiguousarray(a)
    if dtype in _ML_NAMES:
        width = _INT_OF_WIDTH[a.dtype.itemsize]
        return torch.from_numpy(a.view(_numpy_of(width))).view(dtype)
    return torch.from_numpy(a)


# --- names and chunking ------------------------------------------------------------------


def param_dir(keys: Keys) -> str:
    """Orbax's name for a leaf's directory (and its name in messages)."""
    return ".".join(keys)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def chunk_rows(piece_rows: int, row_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: a divisor of the rows one writer owns, so no chunk has two writers.

    The largest divisor whose chunk fits ``chunk_bytes``; when only tiny ones fit (a prime
    row count), the divisor nearest to ``chunk_bytes`` in ratio, so a chunk may exceed it.
    """
    if piece_rows <= 1 or piece_rows * row_bytes <= chunk_bytes:
        return max(piece_rows, 1)
    divs = _divisors(piece_rows)
    fitting = [d for d in divs if d * row_bytes <= chunk_bytes]
    if fitting and fitting[-1] * row_bytes * 8 >= chunk_bytes:
        return fitting[-1]
    return min(divs, key=lambda d: abs(math.log(d * row_bytes / chunk_bytes)))


def zarr_metadata(
    shape: Sequence[int], dtype: str, rows_per_chunk: int, split: tuple[int, int] | None = None
) -> dict:
    """The ``.zarray`` of one leaf (``dtype`` a zarr dtype string); ``split``: ``(dim,
    width)`` of chunks also split along a dim >= 1 (a tensor-parallel leaf's blocks)."""
    chunks = [rows_per_chunk, *(max(d, 1) for d in shape[1:])] if shape else []
    if split is not None:
        chunks[split[0]] = split[1]
    return {
        "zarr_format": 2,
        "shape": list(shape),
        "chunks": chunks,
        "dtype": dtype,
        "compressor": None,
        "fill_value": None,
        "filters": None,
        "order": "C",
        "dimension_separator": ".",
    }


def chunk_file(
    index: int, ndim: int, separator: str = ".", at: tuple[int, int] | None = None
) -> str:
    """The chunk file of the ``index``-th row chunk (every other dim has one chunk, but for
    ``at``: ``(dim, index)`` of a chunk split along that dim too)."""
    if ndim == 0:
        return "0"
    parts = [str(index)] + ["0"] * (ndim - 1)
    if at is not None:
        parts[at[0]] = str(at[1])
    return separator.join(parts)


def scalar_dtype(value: int | float) -> str:
    return "<i8" if isinstance(value, int) else "<f8"


# --- metadata files ------------------------------------------------------------------------


def leaf_metadata(keys: Keys, value_type: str) -> dict:
    return {
        "key_metadata": [{"key": k, "key_type": 2} for k in keys],
        "value_metadata": {"value_type": value_type, "skip_deserialize": False},
    }


def write_json(path: str, obj: Any) -> None:
    """Writes ``obj`` durably (fsync) at ``path``."""
    storage.write_bytes(path, json.dumps(obj).encode())


def read_json(path: str) -> dict:
    """A JSON object file; a damaged one raises naming the file."""
    return parse_json(storage.read_bytes(path), path)


def parse_json(data: bytes, path: str) -> dict:
    """The JSON object in ``data`` (the bytes of the file ``path``); damage raises naming it."""
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ValueError(
            f"restore: {path} is not valid JSON ({e}); the checkpoint is damaged"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(
            f"restore: {path} holds a JSON {type(obj).__name__}, expected an "
            "object; the checkpoint is damaged"
        )
    return obj


def marker(checksums: str | None) -> dict:
    """funcshard's mark on a checkpoint it writes: the format and the checksum algorithm."""
    return {"version": FORMAT_VERSION, "checksums": checksums or "none"}


_COMMIT_MARK = re.compile(r"^funcshard format (\d+), checksums (\S+)$", re.MULTILINE)


def write_commit_file(directory: str, name: str, mark: dict | None = None) -> None:
    """Orbax's ``commit_success.txt``, with funcshard's ``mark`` on a second line."""
    text = f"Checkpoint commit was successful to {name}"
    if mark is not None:
        text += f"\nfuncshard format {mark['version']}, checksums {mark['checksums']}\n"
    storage.write_bytes(os.path.join(directory, COMMIT_FILE), text.encode())


def read_commit_mark(directory: str) -> dict | None:
    """The mark in ``directory``'s ``commit_success.txt``; None without one (or without the
    file: Orbax's own checkpoints, and funcshard's before format 3)."""
    try:
        text = storage.read_bytes(os.path.join(directory, COMMIT_FILE))[:4096]
    except FileNotFoundError:
        return None
    found = _COMMIT_MARK.search(text.decode(errors="replace"))
    return None if found is None else {"version": int(found[1]), "checksums": found[2]}


def write_item_metadata(
    item_dir: str,
    arrays: Sequence[Keys],
    scalars: Sequence[Keys],
    mark: dict | None = None,
    *,
    commit_file: bool = True,
) -> None:
    """The item's ``_METADATA`` (its tree, and funcshard's ``mark``) and, with
    ``commit_file``, its ``commit_success.txt`` (an item that is its checkpoint's directory
    gets the checkpoint's, written last)."""
    tree = {str(k): leaf_metadata(k, "np.ndarray") for k in arrays}
    tree.update({str(k): leaf_metadata(k, "scalar") for k in scalars})
    write_json(
        os.path.join(item_dir, METADATA_FILE),
        {
            "tree_metadata": tree,
            "use_ocdbt": False,
            "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None if mark is None else {"funcshard": mark},
        },
    )
    if commit_file:
        write_commit_file(item_dir, os.path.basename(item_dir), mark)


def write_checkpoint_metadata(
    directory: str,
    final_name: str,
    item: str | None,
    info: dict,
    started_ns: int,
    mark: dict | None = None,
) -> None:
    """``_CHECKPOINT_METADATA`` and ``commit_success.txt`` of a checkpoint or step directory.

    ``item`` None: the item is the directory itself (``PyTreeCheckpointer`` reads it);
    otherwise ``item_handlers`` maps the item's name to its handler, as Orbax's
    ``CheckpointManager`` requires of a step.
    """
    handlers: str | dict = ORBAX_HANDLER if item is None else {item: ORBAX_HANDLER}
    write_json(
        os.path.join(directory, CHECKPOINT_METADATA_FILE),
        {
            "item_handlers": handlers,
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": started_ns,
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": {"funcshard": info},
        },
    )
    write_commit_file(directory, final_name, mark)
