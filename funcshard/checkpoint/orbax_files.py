"""The files of an Orbax checkpoint item, below the ``Source`` that reads them: where the item
is in a step directory, its commit marks and format version, zarr dtypes, and a positioned
read of a chunk file's bytes.
"""

from __future__ import annotations

import os

from funcshard.checkpoint import storage
from funcshard.checkpoint.checksums import crc_update
from funcshard.checkpoint.format import (
    COMMIT_FILE,
    METADATA_FILE,
    NUMPY_DTYPE,
    read_commit_mark,
)

__all__ = ["dtype_name", "marks", "pread", "pread_crc", "resolve_orbax_item", "version"]

# Bytes a verified read streams through scratch at a time (checksum blocks are 1 MiB): a
# block's bytes that no target holds pass a piece at a time, their crc32c continued, so a
# rank's restore holds this much a read thread, not a block, whatever the state's size.
PIECE_BYTES = 64 << 10


def pread(fd: storage.Reader, out: memoryview, offset: int, leaf: str, chunk: int | str) -> None:
    got = fd.preadv([out], offset) if len(out) else 0
    if got != len(out):
        raise OSError(f"{leaf}: chunk {chunk} is short ({got} of {len(out)} bytes)")


def pread_crc(
    fd: storage.Reader,
    span: tuple[int, int],
    scratch: memoryview,
    crc: int,
    leaf: str,
    chunk: int | str,
) -> int:
    """``crc`` continued over bytes ``span`` (``[lo, hi)``) of ``fd``, read through
    ``scratch`` a piece at a time (the bytes are kept nowhere)."""
    for at in range(span[0], span[1], len(scratch)):
        piece = scratch[: min(len(scratch), span[1] - at)]
        pread(fd, piece, at, leaf, chunk)
        crc = crc_update(piece, crc)
    return crc


def resolve_orbax_item(path: str) -> tuple[str, str, bool]:
    """``(item_dir, step_dir, root_is_params)`` of the Orbax checkpoint at ``path``.

    ``path`` may be an item (it holds ``_METADATA``), or a step directory of Orbax's
    ``CheckpointManager``: its single item (``<step>/default``), or the ``params`` item of a
    Composite, whose tree is then the params themselves.
    """
    if storage.exists(os.path.join(path, METADATA_FILE)):
        return path, path, False
    if not storage.isdir(path):
        raise FileNotFoundError(f"restore: {path} does not exist")
    items = sorted(
        d for d in storage.listdir(path) if storage.exists(os.path.join(path, d, METADATA_FILE))
    )
    if len(items) == 1 or "params" in items:
        item = items[0] if len(items) == 1 else "params"
        return os.path.join(path, item), path, item == "params"
    if not items:
        raise FileNotFoundError(
            f"restore: {path} holds no Orbax checkpoint (no _METADATA in it nor in an item "
            f"directory of it) and no Hugging Face safetensors (model.safetensors or "
            f"model.safetensors.index.json); it holds {storage.listdir(path)[:20]}"
        )
    raise FileNotFoundError(
        f"restore: {path} holds several Orbax items {items} and none is "
        "named 'params'; pass the item's directory"
    )


def version(mark: dict) -> int:
    try:
        return int(mark.get("version", 0))
    except (TypeError, ValueError):
        return 0


def marks(
    meta: dict, meta_path: str, info: dict | None, info_path: str | None, dirs: set[str]
) -> list[tuple[str, dict]]:
    """funcshard's marks on a checkpoint (see ``funcshard.checkpoint.format``), each with
    where it was found: none on a checkpoint funcshard did not write."""
    out = []
    if isinstance(info, dict):
        out.append((f"{info_path} (custom_metadata.funcshard)", info))
    custom = meta.get("custom_metadata")
    if isinstance(custom, dict) and isinstance(custom.get("funcshard"), dict):
        out.append((f"{meta_path} (custom_metadata.funcshard)", custom["funcshard"]))
    for d in sorted(dirs):
        mark = read_commit_mark(d)
        if mark is not None:
            out.append((os.path.join(d, COMMIT_FILE), mark))
    return out


def dtype_name(zarr_dtype: str) -> str:
    np_dtype = NUMPY_DTYPE.get(zarr_dtype)
    return np_dtype.name if np_dtype is not None else zarr_dtype
