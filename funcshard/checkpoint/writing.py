"""Writing a checkpoint's files durably: this rank's rows of every array as zarr chunks
through tensorstore (with the crc32c of every chunk, computed while it writes), and, once the
arrays are written, the records (``_METADATA``, ``_CHECKSUMS``, ``_CHECKPOINT_METADATA``, the
commit files). The commit protocol (``commit``) decides when and where they are called.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from funcshard.checkpoint import stats, storage
from funcshard.checkpoint import tree as tree_lib
from funcshard.checkpoint.checksums import (
    ALGORITHM,
    Checksums,
    block_crcs,
    byte_view,
    file_crc,
    info_crc,
    write_checksums,
)
from funcshard.checkpoint.coords import box_slices
from funcshard.checkpoint.format import (
    METADATA_FILE,
    ZARR_DTYPE,
    Keys,
    chunk_file,
    marker,
    param_dir,
    scalar_dtype,
    to_numpy,
    write_checkpoint_metadata,
    write_item_metadata,
    zarr_metadata,
)
from funcshard.checkpoint.storage import ts

__all__ = ["write_arrays", "write_records"]


def _settle(futures: list[Any]) -> list[Any]:
    """Waits for every future, then raises the first error: nothing is still writing after."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: BLE001 - raised once all have finished
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results


def write_arrays(
    item_dir: str,
    arrays: list[tree_lib.ArrayWrite],
    scalars: dict[Keys, Any],
    is_first: bool,
    *,
    checksums: bool = True,
) -> Checksums:
    """Writes this rank's rows (and, on the first rank, array metadata and scalars) durably.

    Returns the checksums of the chunks it wrote, computed from the bytes in hand while
    tensorstore writes them. Returns or raises only once every write it started has
    finished, so that a failed save's directory can be removed without a late write
    recreating files in it.
    """
    storage.makedirs(item_dir)
    ctx = ts.Context()
    specs, sources = [], []
    for a in arrays:
        if a.data is None and not is_first:
            continue
        spec = {
            "driver": "zarr",
            "kvstore": storage.kvstore(os.path.join(item_dir, param_dir(a.keys))),
            "metadata": zarr_metadata(a.shape, ZARR_DTYPE[a.dtype], a.chunk_rows, a.split),
        }
        # one rank writes each .zarray; the others only write their chunks
        spec.update({"create": True} if is_first else {"open": True, "assume_metadata": True})
        specs.append(spec)
        sources.append(a)
    if is_first:
        for keys, value in scalars.items():
            dtype = scalar_dtype(value)
            specs.append(
                {
                    "driver": "zarr",
                    "create": True,
                    "kvstore": storage.kvstore(os.path.join(item_dir, param_dir(keys))),
                    "metadata": zarr_metadata((), dtype, 1),
                }
            )
            sources.append((keys, np.asarray(value, dtype=np.dtype(dtype))))
    opened = _settle([ts.open(spec, context=ctx) for spec in specs])
    writes, to_sum = [], []
    for source, arr in zip(sources, opened, strict=True):
        if isinstance(source, tuple):
            keys, value = source
            writes.append(arr.write(value))
            to_sum.append((param_dir(keys), chunk_file(0, 0), byte_view(value.reshape(1))))
        elif source.data is not None:
            src = to_numpy(source.data)
            index = box_slices(len(source.shape), source.start, source.stop, source.box)
            target = arr[index] if source.shape else arr
            writes.append(target.write(src.reshape(target.shape)))
            to_sum += _chunks_of(source, src)
            stats.count(False, src.nbytes)
    sums: Checksums = {}
    try:  # while tensorstore writes (crc32c releases the GIL)
        for leaf, chunk, data in to_sum if checksums else ():
            sums.setdefault(leaf, {})[chunk] = block_crcs(data)
    finally:
        _settle(writes)
    return sums


def _chunks_of(a: tree_lib.ArrayWrite, src: np.ndarray) -> list[tuple[str, str, memoryview]]:
    """``(leaf, chunk file, data bytes)`` of every chunk of ``a`` this rank writes (whole
    chunks: a chunk never has two writers)."""
    data = byte_view(src.reshape(-1).view(np.uint8))
    leaf = param_dir(a.keys)
    if not len(data):  # no bytes (a shape with a 0): tensorstore writes no chunk file
        return []
    if not a.shape:
        return [(leaf, chunk_file(0, 0), data)]
    row_bytes = len(data) // (a.stop - a.start)
    assert a.start % a.chunk_rows == 0, "a chunk never has two writers"
    out = []
    for lo in range(a.start, a.stop, a.chunk_rows):
        hi = min(lo + a.chunk_rows, a.stop)
        at = None if a.split is None else (a.split[0], a.box[1] // a.split[1])
        chunk = chunk_file(lo // a.chunk_rows, len(a.shape), at=at)
        out.append((leaf, chunk, data[(lo - a.start) * row_bytes : (hi - a.start) * row_bytes]))
    return out


def write_records(
    item_dir: str,
    top: str,
    final_name: str,
    item: str | None,
    leaves: tuple[list[Keys], list[Keys]],
    info: dict,
    started_ns: int,
    sums: Checksums | None,
) -> None:
    """Everything but the arrays, once they are written: ``_METADATA``, ``_CHECKSUMS`` (the
    chunk crcs ``sums``, and the crcs of ``_METADATA``, of every ``.zarray`` and of ``info``),
    ``_CHECKPOINT_METADATA`` and the commit files, each marked as funcshard's of this format.

    Args:
      item_dir: the item; top: the checkpoint's (temporary) directory, ``item_dir`` itself
        when ``item`` is None; final_name: the name it is renamed to.
      leaves: the keys of the arrays and of the scalars written.
      info: funcshard's record of the checkpoint (its ``checksums`` is set here).
      sums: None writes no checksums (``Saver(checksums=False)``, to measure their cost):
        marked ``"none"``, the checkpoint restores with a warning that it is unverified.
    """
    arrays, scalars = leaves
    mark = marker(None if sums is None else ALGORITHM)
    info = {**info, "checksums": mark["checksums"]}
    # the checkpoint's commit file last: an object store has no rename, it counts from there
    write_item_metadata(item_dir, arrays, scalars, mark, commit_file=item is not None)
    if sums is not None:
        names = [METADATA_FILE] + [f"{param_dir(k)}/.zarray" for k in (*arrays, *scalars)]
        metadata = {
            name: file_crc(storage.read_bytes(os.path.join(item_dir, name))) for name in names
        }
        write_checksums(item_dir, sums, metadata, info_crc(info))
    write_checkpoint_metadata(top, final_name, item, info, started_ns, mark)
    storage.fsync_dir(item_dir)
    storage.fsync_dir(top)
