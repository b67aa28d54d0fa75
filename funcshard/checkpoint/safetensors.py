"""The safetensors file format: headers, dtype codes, the files of a checkpoint.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
raw row-major bytes of each tensor at ``8 + header length + begin``, so every header and
offset follows from the shapes alone. A sharded checkpoint is
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` (``weight_map``:
tensor name -> file). Pure format, no state: read by ``hf`` (import, export) and the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

from funcshard.checkpoint import storage

__all__ = [
    "SINGLE",
    "INDEX",
    "DTYPES",
    "CODES",
    "Entry",
    "is_safetensors",
    "files",
    "read_header",
    "header_bytes",
    "plan_files",
    "file_names",
    "write_index",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

MAX_HEADER = 100 << 20  # safetensors' own limit on the header size

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}


def is_safetensors(path: str) -> bool:
    """A safetensors file, or a directory holding ``model.safetensors`` or the index."""
    if path.endswith(".safetensors") and storage.isfile(path):
        return True
    return (
        storage.isdir(path)
        and not storage.exists(os.path.join(path, "_METADATA"))
        and any(storage.exists(os.path.join(path, f)) for f in (SINGLE, INDEX))
    )


def files(path: str) -> list[str]:
    """The safetensors files of a checkpoint (one file, ``model.safetensors`` or the index's)."""
    if path.endswith(".safetensors") and storage.isfile(path):
        return [path]
    index = os.path.join(path, INDEX)
    if storage.exists(index):
        try:
            weight_map = json.loads(storage.read_bytes(index))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"restore: {index} is not a safetensors index ({e})") from None
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    return [os.path.join(path, SINGLE)]


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (without ``__metadata__``) and where its data starts."""
    reader = storage.open_reader(path)
    try:
        head = bytearray(8)
        if reader.preadv([memoryview(head)], 0) != 8:
            raise ValueError(f"restore: {path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"restore: {path} is not a safetensors file (header length {n})")
        raw = bytearray(n)
        reader.preadv([memoryview(raw)], 8)
    finally:
        reader.close()
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"restore: {path}: the safetensors header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of an exported file."""

    name: str  # the name in the files (a parameter's, or a tied alias's)
    param: str  # the parameter holding its values
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header_bytes(entries: Sequence[Entry]) -> tuple[bytes, list[int]]:
    """A file's header (padded to 8 bytes with spaces) and each entry's data offset."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, at = [], 0
    for e in entries:
        header[e.name] = {
            "dtype": CODES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        offsets.append(at)
        at += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def plan_files(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """The entries grouped into files of at most ``max_shard_bytes`` each, in order (a
    larger tensor gets a file of its own)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def file_names(n: int) -> list[str]:
    """The names of a checkpoint's ``n`` files (``model.safetensors`` when one)."""
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(directory: str, names: list[str], files: list[list[Entry]]) -> None:
    """``model.safetensors.index.json`` of a checkpoint of several files (fsynced); nothing
    for one file."""
    if len(files) <= 1:
        return
    total = sum(e.nbytes for f in files for e in f)
    weight_map = {e.name: n for n, f in zip(names, files, strict=True) for e in f}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    storage.write_bytes(os.path.join(directory, INDEX), json.dumps(index, indent=2).encode())
