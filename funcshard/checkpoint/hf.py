"""Hugging Face safetensors, both ways, each rank moving only its own rows.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
raw row-major bytes of each tensor at ``8 + header length + begin``. Rows ``[a, b)`` of a
tensor are therefore one byte range: importing reads exactly those of the rows a rank owns,
and exporting computes every header and offset from the shapes alone, so each rank writes its
own rows into the files in parallel. A sharded checkpoint is
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` (``weight_map``:
tensor name -> file).
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

from funcshard.checkpoint import commit as commit_lib
from funcshard.checkpoint import stats
from funcshard.checkpoint import tree as tree_lib
from funcshard.checkpoint.format import Keys, fsync_dir
from funcshard.checkpoint.sources import ReadRequest
from funcshard.state import TrainState

__all__ = ["SafetensorsSource", "export_safetensors", "is_safetensors", "SINGLE", "INDEX"]

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
    if os.path.isfile(path):
        return path.endswith(".safetensors")
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "_METADATA"))
        and any(os.path.exists(os.path.join(path, f)) for f in (SINGLE, INDEX))
    )


def _files(path: str) -> list[str]:
    """The safetensors files of a checkpoint (one file, ``model.safetensors`` or the index's)."""
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"restore: {index} is not a safetensors index ({e})") from None
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    return [os.path.join(path, SINGLE)]


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (without ``__metadata__``) and where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"restore: {path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"restore: {path} is not a safetensors file (header length {n})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"restore: {path}: the safetensors header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


@dataclasses.dataclass(frozen=True, slots=True)
class _Tensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


class SafetensorsSource:
    """A Hugging Face safetensors checkpoint; names map 1:1 to parameter names."""

    def __init__(self, path: str) -> None:
        self.label = path
        self.info = None
        self.tensors: dict[Keys, _Tensor] = {}
        self.dtype_names: dict[Keys, str] = {}
        for file in _files(path):
            if not os.path.exists(file):
                raise FileNotFoundError(f"restore: {file} (named by {path}) does not exist")
            header, data = read_header(file)
            for name, entry in header.items():
                try:
                    code, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
                    begin, end = (int(x) for x in entry["data_offsets"])
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"restore: {file}: header entry {name!r} lacks {e}") from None
                dtype = DTYPES.get(code)
                if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
                    raise ValueError(
                        f"restore: {file}: {name} spans {end - begin} bytes, its "
                        f"shape {shape} and dtype {code} need "
                        f"{math.prod(shape) * dtype.itemsize}"
                    )
                keys = ("params", name)
                self.dtype_names[keys] = (
                    str(dtype).removeprefix("torch.") if dtype is not None else code
                )
                self.tensors[keys] = _Tensor(file, dtype or torch.uint8, shape, data + begin)

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        return {k: (t.shape, self.dtype_names[k]) for k, t in self.tensors.items()}

    def scalars(self) -> set[Keys]:
        return set()

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        fds: dict[str, int] = {}
        try:
            for keys, start, stop, out in requests:
                t = self.tensors[keys]
                row_bytes = math.prod(t.shape[1:]) * t.dtype.itemsize
                direct = out.device.type == "cpu" and out.is_contiguous() and out.dtype == t.dtype
                buf = out if direct else torch.empty(out.shape, dtype=t.dtype)
                view = memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else b""
                n = (stop - start) * row_bytes
                if t.file not in fds:
                    fds[t.file] = os.open(t.file, os.O_RDONLY)
                got = os.preadv(fds[t.file], [view], t.offset + start * row_bytes) if n else 0
                if got != n:
                    raise OSError(
                        f"restore: {t.file}: {keys[-1]} is short ({got} of {n} bytes "
                        f"at rows {start}:{stop})"
                    )
                if not direct:
                    out.copy_(buf)
                stats.count(True, n)
        finally:
            for fd in fds.values():
                os.close(fd)

    def read_scalar(self, keys: Keys) -> Any:
        raise KeyError(keys)


# --- export -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    name: str  # the name in the files (a parameter's, or a tied alias's)
    param: str  # the parameter holding its values
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header_bytes(entries: Sequence[_Entry]) -> tuple[bytes, list[int]]:
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


def _plan_files(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _file_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def export_safetensors(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
) -> None:
    """Writes the params of ``state`` as a Hugging Face safetensors checkpoint (collective).

    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most
    ``max_shard_bytes`` each (a larger tensor gets a file of its own) and
    ``model.safetensors.index.json``. Every parameter of ``model.state_dict()`` is there, tied
    aliases included, so ``transformers``' ``from_pretrained`` and
    ``load_state_dict(strict=True)`` take it (buffers are not part of a state). Every rank
    writes its own rows at their offsets; nothing is gathered. The directory appears only
    when complete (a temporary name, fsync, rename); write the model's config into it after.

    Args:
      directory: must not exist.
      state: not consumed.
      dtype: dtype of every tensor in the files; None = each parameter's model dtype.
      max_shard_bytes: the size above which the tensors are split into several files.

    Raises:
      OSError: ``directory`` exists or cannot be created.
      RuntimeError: the state holds no values, or writing failed on some rank (on every rank).
    """
    state.check()
    if not state.filled:
        raise RuntimeError(
            "export_safetensors: the state holds no values (built from a "
            "meta-device model); fill it with fs.restore first"
        )
    if dtype is not None and dtype not in CODES:
        raise ValueError(f"export_safetensors: dtype {dtype} has no safetensors code")
    layout = state.layout
    specs = {s.name: s for s in layout.leaves}
    entries = [_Entry(s.name, s.name, dtype or s.dtypes.model, s.shape) for s in layout.leaves]
    entries += [
        _Entry(a, p, dtype or specs[p].dtypes.model, specs[p].shape) for a, p in layout.aliases
    ]
    files = _plan_files(entries, max_shard_bytes)
    names = _file_names(len(files))
    headers = [_header_bytes(f) for f in files]

    agreement = commit_lib.Agreement.of(layout)
    final = os.path.abspath(os.fspath(directory))
    tmp = commit_lib.start(final, agreement)
    first = agreement.rank == 0
    error: BaseException | None = None
    if first:  # every file at its full size, so that every rank can write into it
        try:
            for name, (head, _), entries_i in zip(names, headers, files, strict=True):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(head)
                    f.truncate(len(head) + sum(e.nbytes for e in entries_i))
        except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
            error = e
    _agree(agreement, f"export to {final}: creating the files", error, tmp)
    try:
        _write_rows(state, tmp, names, headers, files)
    except BaseException as e:  # noqa: BLE001
        error = e
    _agree(agreement, f"export to {final}: writing", error, tmp)
    if first:
        try:
            if len(files) > 1:
                total = sum(e.nbytes for e in entries)
                weight_map = {e.name: n for n, f in zip(names, files, strict=True) for e in f}
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump(
                        {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2
                    )
                    f.flush()
                    os.fsync(f.fileno())
            fsync_dir(tmp)
            commit_lib.commit(tmp, final)
        except BaseException as e:  # noqa: BLE001
            error = e
            if not os.path.exists(final):
                commit_lib.remove_tree(tmp)
    agreement.raise_if_failed(f"export to {final}: commit", error)


def _agree(
    agreement: commit_lib.Agreement, what: str, error: BaseException | None, tmp: str
) -> None:
    failed = agreement.failed_ranks(error is None)
    if failed:
        if agreement.rank == 0:
            commit_lib.remove_tree(tmp)
        raise error or RuntimeError(f"{what} failed on rank(s) {failed}; see their errors")


def _write_rows(
    state: TrainState,
    tmp: str,
    names: list[str],
    headers: list[tuple[bytes, list[int]]],
    files: list[list[_Entry]],
) -> None:
    """This rank's rows of every entry, at their offsets, then fsync of every file."""
    layout = state.layout
    writers = tree_lib.Writers.of(layout)
    r = layout.shard_rank
    specs = {s.name: s for s in layout.leaves}
    for name, (head, offsets), entries in zip(names, headers, files, strict=True):
        fd = os.open(os.path.join(tmp, name), os.O_WRONLY)
        try:
            for e, offset in zip(entries, offsets, strict=True):
                spec = specs[e.param]
                start, stop, _ = writers.rows(spec)
                if stop <= start:
                    continue
                flat = state.master[spec.bucket]
                rows = writers.local_rows(flat, spec, r, start, stop)
                data = rows.detach().to("cpu", e.dtype).contiguous()
                buf = memoryview(data.view(torch.uint8).numpy()).cast("B")
                at = len(head) + offset + start * spec.row_numel * e.dtype.itemsize
                done = 0
                while done < len(buf):
                    done += os.pwrite(fd, buf[done:], at + done)
                stats.count(False, len(buf))
            os.fsync(fd)
        finally:
            os.close(fd)
