"""``python -m funcshard inspect | verify | convert``: checkpoints without a training world.

One process, no torch.distributed, no model class:

* ``inspect DIR``: the format (funcshard / Orbax, Hugging Face safetensors, DCP), the step,
  and a table of every leaf (global shape, dtype, bytes, chunks);
* ``verify DIR``: reads every metadata file and chunk against the checksums ``fs.save``
  recorded; exit 0 when all match, 1 naming each bad file (and a chunk's leaf and byte range),
  or when a checkpoint funcshard wrote with checksums has lost them, 2 when there is nothing
  to verify against (no checksums);
* ``convert SRC DST --to=safetensors|dcp|orbax [--dtype=bf16]``: the params of a checkpoint
  of any of those formats into another, leaf by leaf.

A ``CheckpointManager`` root is accepted too: ``inspect`` and ``convert`` take its latest
step, ``verify`` every step.

Memory of ``convert``: one leaf at a time, so the peak over the interpreter's own footprint
is a small multiple of the largest leaf, whatever the checkpoint's total size (the multiple
per format, with the command that measures it: docs/benchmarks.md, "convert"): the cast of
``--dtype`` adds one, tensorstore's chunk buffer (orbax) and DCP's writer (it holds the
previous tensor while the next loads, and serializes each with ``torch.save``) more.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from funcshard.checkpoint import commit as commit_lib
from funcshard.checkpoint import dcp as dcp_lib
from funcshard.checkpoint import safetensors as st
from funcshard.checkpoint import steps as steps_lib
from funcshard.checkpoint import storage, writing
from funcshard.checkpoint.api import open_source
from funcshard.checkpoint.checksums import Checksums
from funcshard.checkpoint.format import (
    CHUNK_BYTES,
    COMMIT_FILE,
    FORMAT_VERSION,
    TMP_MARK,
    ZARR_DTYPE,
    Keys,
    chunk_rows,
    param_dir,
)
from funcshard.checkpoint.hf import SafetensorsSource
from funcshard.checkpoint.orbax import OrbaxSource
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.checkpoint.tree import ArrayWrite

__all__ = ["main", "inspect", "verify", "convert"]

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


# --- reading any checkpoint ------------------------------------------------------------------


def manager_steps(path: str) -> list[str]:
    """The complete steps of a ``CheckpointManager`` root (empty when ``path`` is not one)."""
    if storage.is_object(path):
        if storage.isfile(os.path.join(path, COMMIT_FILE)):
            return []  # one checkpoint
    elif not storage.isdir(path) or storage.exists(os.path.join(path, COMMIT_FILE)):
        return []
    return [os.path.join(path, str(s)) for s in steps_lib.committed(path)]  # an s3 root's index


def _open(path: str) -> Source:
    steps = manager_steps(path)
    if steps:
        print(
            f"CheckpointManager root; steps {[os.path.basename(s) for s in steps]}: "
            f"reading the latest, {steps[-1]}"
        )
        path = steps[-1]
    return open_source(path)


def format_name(source: Source) -> str:
    if isinstance(source, OrbaxSource):
        return "funcshard (Orbax layout)" if source.info is not None else "Orbax"
    if isinstance(source, SafetensorsSource):
        return "Hugging Face safetensors"
    return "torch.distributed.checkpoint (DCP)"


def _step_of(source: Source) -> int | None:
    if source.info is not None and "step" in source.info:
        return int(source.info["step"])
    if ("step",) in source.scalars():
        return int(source.read_scalar(("step",)))
    return None


def _chunks(source: Source, keys: Keys) -> str:
    if isinstance(source, OrbaxSource):
        ranges = source.chunk_rows(keys)
        return "-" if ranges is None else str(len(ranges))
    if isinstance(source, dcp_lib.DCPSource):
        return str(len(source.tensor_metadata(keys).chunks))
    return "1"


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name} has no torch equivalent")
    return dtype


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    itemsize = _torch_dtype(dtype).itemsize if hasattr(torch, dtype) else 0
    return math.prod(shape) * itemsize


def inspect(path: str) -> int:
    """Prints the format, the step and a table of the checkpoint's leaves."""
    source = _open(path)
    arrays = source.arrays()
    print(f"format: {format_name(source)}")
    step = _step_of(source)
    print(f"step: {'-' if step is None else step}")
    if isinstance(source, OrbaxSource):
        print(f"checksums: {'crc32c' if source.checksums is not None else 'none'}")
    rows = [("leaf", "global shape", "dtype", "bytes", "chunks")]
    total = 0
    for keys, (shape, dtype) in arrays.items():
        n = _nbytes(shape, dtype)
        total += n
        name = param_dir(keys) if isinstance(source, OrbaxSource) else keys[1]
        rows.append((name, str(tuple(shape)), dtype, str(n), _chunks(source, keys)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print(
            "  ".join(
                c.ljust(w) if i < 3 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    for keys in sorted(source.scalars()):
        print(f"{param_dir(keys)} = {source.read_scalar(keys)}")
    print(f"total: {len(arrays)} arrays, {total} bytes")
    return 0


def verify(path: str) -> int:
    """Verifies every chunk of every step; 0 all good, 1 damage found, 2 nothing to check."""
    paths = manager_steps(path) or [path]
    status = 0
    for p in paths:
        try:
            source = open_source(p)
        except (OSError, ValueError) as e:  # e.g. its _CHECKSUMS or _METADATA is damaged
            print(f"BAD {p}: {e}")
            status = 1
            continue
        if not isinstance(source, OrbaxSource) or source.checksums is None:
            print(f"{p}: {format_name(source)} without checksums: cannot be verified")
            status = max(status, 2)
            continue
        bad = 0
        leaves = source.leaves()  # each verified with its .zarray, whatever the others hold
        for keys in leaves:
            problems = source.verify(keys)
            for problem in problems:
                print(f"BAD {param_dir(keys)}: {problem}")
            bad += bool(problems)
        if bad:
            print(f"{p}: {bad} of {len(leaves)} leaves damaged")
            status = 1
        else:
            print(f"{p}: OK, {len(leaves)} leaves verified")
    return status


# --- converting ------------------------------------------------------------------------------


def _params(source: Source) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's tensors by name: a training checkpoint's params, any other's tensors."""
    return {k[1]: v for k, v in source.arrays().items() if k[0] == "params"}


def _loader(source: Source, dtype: torch.dtype | None) -> Callable[[str], torch.Tensor]:
    arrays = _params(source)

    def load(name: str) -> torch.Tensor:
        shape, stored = arrays[name]
        out = torch.empty(shape if shape else (1,), dtype=_torch_dtype(stored))
        rows = shape[0] if shape else 1
        source.read_into([ReadRequest(("params", name), 0, rows, out)])
        out = out.reshape(shape)
        if dtype is not None and out.is_floating_point():
            out = out.to(dtype)
        return out

    return load


def _out_dtype(stored: str, dtype: torch.dtype | None) -> torch.dtype:
    t = _torch_dtype(stored)
    return dtype if dtype is not None and t.is_floating_point else t


def _write_safetensors(tmp: str, source: Source, dtype: torch.dtype | None) -> None:
    load = _loader(source, dtype)
    entries = [
        st.Entry(name, name, _out_dtype(stored, dtype), tuple(shape))
        for name, (shape, stored) in _params(source).items()
    ]
    files = st.plan_files(entries, 5 << 30)
    names = st.file_names(len(files))
    for name, entries_i in zip(names, files, strict=True):
        head, _ = st.header_bytes(entries_i)
        storage.write_stream(os.path.join(tmp, name), _file_parts(head, entries_i, load))
    st.write_index(tmp, names, files)


def _file_parts(head: bytes, entries: list, load: Callable[[str], torch.Tensor]):
    """A safetensors file's bytes, one tensor at a time."""
    yield head
    for e in entries:
        t = load(e.name).contiguous().reshape(-1)
        yield memoryview(t.view(torch.uint8).numpy())
        del t


def _write_dcp(tmp: str, source: Source, dtype: torch.dtype | None) -> None:
    tensors = {
        name: (tuple(shape), _out_dtype(stored, dtype))
        for name, (shape, stored) in _params(source).items()
    }
    dcp_lib.save_streaming(tmp, tensors, _loader(source, dtype))


def _write_orbax(tmp: str, source: Source, dtype: torch.dtype | None, final: str) -> None:
    started = time.time_ns()
    load = _loader(source, dtype)
    checksums: Checksums = {}
    written: list[Keys] = []
    for name, (shape, stored) in _params(source).items():
        out_dtype = _out_dtype(stored, dtype)
        if out_dtype not in ZARR_DTYPE:
            print(f"skipping {name}: dtype {out_dtype} is not a parameter dtype")
            continue
        t = load(name)
        rows = shape[0] if shape else 1
        row_bytes = t[0].numel() * t.element_size() if shape else t.element_size()
        keys = ("params", name)
        write = ArrayWrite(
            keys, tuple(shape), out_dtype, chunk_rows(rows, row_bytes, CHUNK_BYTES), 0, rows, t
        )
        checksums.update(writing.write_arrays(tmp, [write], {}, True))
        written.append(keys)
        del t, write
    step = _step_of(source)
    scalars = {("step",): step} if step is not None else {}
    checksums.update(writing.write_arrays(tmp, [], scalars, True))
    info = {
        "version": FORMAT_VERSION,
        "optimizer": None,
        "step": step or 0,
        "converted_from": format_name(source),
    }
    writing.write_records(
        tmp, tmp, os.path.basename(final), None, (written, list(scalars)), info, started, checksums
    )


def convert(src: str, dst: str, to: str, dtype: torch.dtype | None = None) -> int:
    """Writes the params of ``src`` as a ``to`` checkpoint at ``dst`` (which must not exist),
    leaf by leaf, atomically (a temporary directory renamed into place)."""
    source = _open(src)
    final = storage.normalize(dst)
    if storage.is_object(final) and to != "orbax":
        raise ValueError(f"convert: --to={to} writes a local directory; {final} is an object store")
    if storage.exists(final):
        raise FileExistsError(f"convert: {final} already exists")
    if not _params(source):
        raise ValueError(f"convert: {src} holds no params")
    # an object store has no rename: written in place, it counts from its commit file, last
    tmp = f"{final}{TMP_MARK}{time.time_ns()}" if storage.atomic_rename(final) else final
    storage.makedirs(tmp)
    try:
        if to == "safetensors":
            _write_safetensors(tmp, source, dtype)
        elif to == "dcp":
            _write_dcp(tmp, source, dtype)
        else:
            _write_orbax(tmp, source, dtype, final)
        storage.fsync_dir(tmp)
        commit_lib.commit(tmp, final)
    except BaseException:
        commit_lib.remove_tree(tmp)
        raise
    n = len(_params(source))
    print(f"wrote {n} tensors of {format_name(source)} {src} as {to} at {final}")
    return 0


# --- the command line --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m funcshard", description="Inspect, verify and convert checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="format, step and every leaf of a checkpoint")
    p.add_argument("directory")
    p = sub.add_parser("verify", help="check every chunk against its checksum (exit 1: damage)")
    p.add_argument("directory")
    p = sub.add_parser("convert", help="a checkpoint's params into another format")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["safetensors", "dcp", "orbax"])
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating tensors to this dtype (default: as stored)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return inspect(args.directory)
        if args.command == "verify":
            return verify(args.directory)
        return convert(args.src, args.dst, args.to, DTYPES.get(args.dtype or ""))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
