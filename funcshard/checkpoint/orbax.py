"""An Orbax checkpoint as a ``Source``: read with tensorstore, or, for the uncompressed zarr
funcshard writes, as byte ranges of its chunk files, each verified against the checksums
recorded at save time.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from funcshard.checkpoint import checksums as checksums_lib
from funcshard.checkpoint import orbax_files as files
from funcshard.checkpoint import stats, storage
from funcshard.checkpoint.coords import Box, box_slices, read_box, split_of
from funcshard.checkpoint.format import (
    CHECKPOINT_METADATA_FILE,
    METADATA_FILE,
    NUMPY_DTYPE,
    TORCH_FROM_NUMPY,
    Keys,
    chunk_file,
    param_dir,
    parse_json,
    read_json,
    to_torch,
)
from funcshard.checkpoint.orbax_files import resolve_orbax_item
from funcshard.checkpoint.sources import ReadRequest, copy_rows
from funcshard.checkpoint.storage import ts

__all__ = ["OrbaxSource", "resolve_orbax_item"]

READ_THREADS = 4


class OrbaxSource:
    """An Orbax checkpoint (zarr or OCDBT, zarr v2 or v3).

    Nested trees match by joining keys with ".": ``{"params": {"layers": {"0": {"w": ..}}}}``
    holds ``("params", "layers.0.w")`` (which is also the leaf's directory name). Uncompressed
    C-order zarr v2 on a local disk (what ``save`` writes) is read as byte ranges of its chunk
    files, straight into the target buffers, and verified against ``_CHECKSUMS`` when the
    checkpoint has one (``checksums`` is then not None); anything else through tensorstore.
    """

    def __init__(self, path: str) -> None:
        self.label = path
        self.directory, step_dir, root_is_params = resolve_orbax_item(path)
        meta_path = os.path.join(self.directory, METADATA_FILE)
        meta_bytes = storage.read_bytes(meta_path)
        self.record = checksums_lib.read_checksums(self.directory)
        if self.record is not None:  # checked before it is parsed: it says how to read
            self.record.verify_file(meta_bytes, METADATA_FILE, meta_path)
        meta = parse_json(meta_bytes, meta_path)
        self.use_ocdbt = bool(meta.get("use_ocdbt", False))
        self.driver = "zarr3" if meta.get("use_zarr3", False) else "zarr"
        stored: dict[Keys, tuple[Keys, str]] = {}
        try:
            entries = [
                (tuple(str(k["key"]) for k in e["key_metadata"]), e["value_metadata"]["value_type"])
                for e in meta["tree_metadata"].values()
            ]
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"restore: {meta_path} lacks {e}; the checkpoint is damaged") from None
        if not root_is_params and not any(k[:1] == ("params",) for k, _ in entries):
            root_is_params = True  # a bare params tree (e.g. StandardSave(params))
        for keys, value_type in entries:
            if root_is_params:
                name: Keys = ("params", ".".join(keys))
            elif keys[:1] == ("params",) and len(keys) > 1:
                name = ("params", ".".join(keys[1:]))
            else:
                name = keys
            stored[name] = (keys, value_type)
        self.stored = stored
        self.info: dict | None = None
        info_path = None
        for d in (self.directory, step_dir):
            ckpt_meta = os.path.join(d, CHECKPOINT_METADATA_FILE)
            if storage.exists(ckpt_meta):
                info_path = ckpt_meta
                self.info = (read_json(ckpt_meta).get("custom_metadata") or {}).get("funcshard")
                break
        marks = files.marks(meta, meta_path, self.info, info_path, {self.directory, step_dir})
        self._check_record(marks, info_path or os.path.join(step_dir, CHECKPOINT_METADATA_FILE))
        record = self.record
        self.checksums: checksums_lib.Checksums | None = None if record is None else record.arrays
        self.block_bytes = 0 if record is None else record.block_bytes
        if self.checksums is not None and (self.use_ocdbt or self.driver != "zarr"):
            raise ValueError(
                f"restore: {meta_path} says the arrays are stored as "
                f"{'OCDBT' if self.use_ocdbt else self.driver}, which funcshard never writes, "
                f"though {checksums_lib.CHECKSUM_FILE} is there; the checkpoint is damaged"
            )
        self.ctx = ts.Context()
        self._open: dict[Keys, ts.TensorStore] = {}
        self._zarray: dict[Keys, dict | None] = {}

    def _check_record(self, marks: list[tuple[str, dict]], info_path: str) -> None:
        """Refuses a checkpoint whose marks say it has checksums when ``_CHECKSUMS`` is gone,
        or says more than ``_CHECKSUMS`` holds; checks funcshard's record against it.

        Raises:
          FileNotFoundError: ``_CHECKSUMS`` is missing, naming what says it was written.
          ValueError: ``_CHECKSUMS`` lacks the metadata checksums of its format.
          ChecksumError: funcshard's record in ``_CHECKPOINT_METADATA`` differs.
        """
        claims = [
            where
            for where, mark in marks
            if mark.get("checksums") == checksums_lib.ALGORITHM
            or (files.version(mark) >= 3 and "checksums" not in mark)  # format 3 always says
        ]
        record_path = os.path.join(self.directory, checksums_lib.CHECKSUM_FILE)
        if self.record is None:
            if claims:
                raise FileNotFoundError(
                    f"restore: {record_path} is missing, though the checkpoint was saved with "
                    f"checksums (so say {'; '.join(claims)}); the checkpoint is damaged"
                )
            return
        version = max([self.record.version, *(files.version(m) for _, m in marks)])
        if version >= 3 and (self.record.metadata is None or self.record.info is None):
            raise ValueError(
                f"restore: {record_path} holds no checksums of the metadata files, though the "
                f"checkpoint is of format {version}; the checkpoint is damaged"
            )
        self.record.verify_info(self.info, info_path)

    # --- metadata ----------------------------------------------------------------------------

    def _leaf_dir(self, keys: Keys) -> str:
        return param_dir(self.stored[keys][0])

    def _simple(self, keys: Keys) -> dict | None:
        """The ``.zarray`` of a leaf that can be read as byte ranges of local chunk files
        (uncompressed C-order zarr v2, chunked along dim 0 only), else None.

        Raises:
          ChecksumError: the ``.zarray`` differs from the one written (naming it).
          ValueError: it is damaged, or (the checkpoint has checksums) not such plain zarr:
            funcshard writes nothing else, and never reads checksummed data unverified.
        """
        if keys in self._zarray:
            return self._zarray[keys]
        md = None
        if not self.use_ocdbt and self.driver == "zarr":
            name = f"{self._leaf_dir(keys)}/.zarray"
            path = os.path.join(self.directory, self._leaf_dir(keys), ".zarray")
            try:
                data = storage.read_bytes(path)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"restore: {self.directory}: array "
                    f"{self._leaf_dir(keys)} is missing its .zarray"
                ) from None
            if self.record is not None:
                self.record.verify_file(data, name, path)
            md = parse_json(data, path)
            try:
                shape, chunks = list(md["shape"]), list(md["chunks"])
                simple = (
                    md.get("compressor") is None
                    and not md.get("filters")
                    and md.get("order") == "C"
                    and md["dtype"] in NUMPY_DTYPE
                    and split_of(shape, chunks) is not False
                    and (chunks or not shape)
                    and all(isinstance(d, int) and d >= 0 for d in shape)
                    and all(isinstance(c, int) and c > 0 for c in chunks)
                )
            except (KeyError, TypeError) as e:
                raise ValueError(f"restore: {path} lacks {e}; the checkpoint is damaged") from None
            if simple:
                md["_split"] = split_of(shape, chunks)
            if not simple:
                if self.checksums is not None:
                    raise ValueError(
                        f"restore: {path} is not the plain zarr v2 funcshard writes "
                        "(uncompressed, no filters, C order, a known dtype, chunked along dim 0 "
                        "and at most one other dim, evenly), though the checkpoint has "
                        f"{checksums_lib.CHECKSUM_FILE}: "
                        "its data would be read unverified; the checkpoint is damaged"
                    )
                md = None
        self._zarray[keys] = md
        return md

    def _spec(self, keys: Keys) -> dict:
        name = self._leaf_dir(keys)
        if self.use_ocdbt:
            kv = {"driver": "ocdbt", "base": storage.kvstore(self.directory), "path": name}
        else:
            kv = storage.kvstore(os.path.join(self.directory, name))
        spec = {"driver": self.driver, "kvstore": kv, "open": True}
        if self.info is not None:
            # funcshard writes every chunk, so a missing one is damage, not the fill value
            spec["fill_missing_data_reads"] = False
        return spec

    def _ts(self, keys: Sequence[Keys]) -> None:
        todo = [k for k in keys if k not in self._open]
        futs = [(k, ts.open(self._spec(k), context=self.ctx, read=True)) for k in todo]
        for k, f in futs:
            self._open[k] = f.result()

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        # a 0-d param may be stored as an Orbax "scalar": it is a 0-d zarr array all the same
        keys = [k for k, (_, v) in self.stored.items() if v != "scalar" or k[:1] == ("params",)]
        out = {}
        slow = []
        for k in keys:
            md = self._simple(k)
            if md is not None:
                out[k] = (tuple(md["shape"]), files.dtype_name(md["dtype"]))
            else:
                slow.append(k)
        self._ts(slow)
        for k in slow:
            out[k] = (tuple(self._open[k].shape), str(self._open[k].dtype.name))
        return {k: out[k] for k in keys}

    def scalars(self) -> set[Keys]:
        return {k for k, (_, v) in self.stored.items() if v == "scalar" and k[:1] != ("params",)}

    # --- data ----------------------------------------------------------------------------------

    def _pread_rows(
        self,
        keys: Keys,
        start: int,
        stop: int,
        buf: memoryview,
        box: Box | None = None,
        *,
        check_only: bool = False,
    ) -> bool:
        """Rows ``[start, stop)`` (and ``box``) of a simple array into ``buf``, verified
        against the recorded checksums when there are some; False when a chunk file is absent
        from a checkpoint funcshard did not write (Orbax omits fill-value chunks).

        Raises:
          ChecksumError: the bytes read differ from those written (naming leaf, file, range).
        """
        md = self._zarray[keys]
        assert md is not None
        if md["_split"] is not None or box is not None:
            return read_box(md, start, stop, buf, box, partial(self._read_chunk, keys))
        shape = md["shape"]
        row_bytes = math.prod(shape[1:]) * NUMPY_DTYPE[md["dtype"]].itemsize
        chunk = md["chunks"][0] if shape else 1
        rows = shape[0] if shape else 1
        if row_bytes == 0:  # nothing to read (tensorstore writes no chunk of no bytes)
            return True
        at = 0
        for k in range(start // chunk, (stop - 1) // chunk + 1):
            lo = (max(start, k * chunk) - k * chunk) * row_bytes
            hi = (min(stop, (k + 1) * chunk) - k * chunk) * row_bytes
            size = (min(rows, (k + 1) * chunk) - k * chunk) * row_bytes
            name = chunk_file(k, len(shape), md.get("dimension_separator", "."))
            span, out = (lo, hi, size), buf[at : at + hi - lo]
            if not self._read_chunk(keys, name, k, span, out, check_only=check_only):
                return False
            at += hi - lo
        return True

    def _pread_rows_checked(self, keys: Keys, start: int, stop: int, box: Box | None) -> bool:
        """What ``_pread_rows`` would do for rows ``[start, stop)`` (and ``box``), keeping no
        bytes: each chunk's checksum blocks read one at a time and verified, or, without
        checksums, its file's size checked. A read that takes part of a chunk's columns (a
        tensor-parallel block) reads its rows into scratch as ``_pread_rows`` does instead.
        False when a chunk file is absent from a checkpoint funcshard did not write."""
        md = self._zarray[keys]
        assert md is not None
        if md["_split"] is not None or box is not None:
            shape = [stop - start, *md["shape"][1:]]
            if box is not None:
                shape[box[0]] = box[2] - box[1]
            scratch = np.empty(shape, dtype=NUMPY_DTYPE[md["dtype"]])
            return self._pread_rows(
                keys, start, stop, memoryview(scratch.reshape(-1).view(np.uint8)), box
            )
        nothing = memoryview(b"")
        return self._pread_rows(keys, start, stop, nothing, check_only=True)

    def _read_chunk(
        self,
        keys: Keys,
        name: str,
        k: int,
        span: tuple[int, int, int],
        out: memoryview,
        check_only: bool = False,
    ) -> bool:
        """Bytes ``[lo, hi)`` of chunk file ``name`` (of ``size`` real bytes; ``span``) into
        ``out``, verified when there are checksums; False when it is absent from a
        checkpoint funcshard did not write."""
        lo, hi, size = span
        leaf_name = self._leaf_dir(keys)
        path = os.path.join(self.directory, leaf_name, name)
        recorded = None if self.checksums is None else self.checksums.get(leaf_name, {})
        try:
            fd = storage.open_reader(path)
        except FileNotFoundError:
            if self.info is not None or recorded is not None:  # funcshard wrote every chunk
                raise FileNotFoundError(
                    f"{self.directory}: chunk {k} of {leaf_name} is missing"
                ) from None
            return False
        try:
            if check_only and recorded is None:
                got = fd.size()
                if got < hi:
                    raise OSError(f"{leaf_name}: chunk {k} is short ({got} of {hi} bytes)")
            elif check_only:
                self._verify_blocks(fd, lo, hi, size, recorded.get(name, []), leaf_name, path)
            elif recorded is None:
                files.pread(fd, out, lo, leaf_name, k)
            else:
                crcs = recorded.get(name, [])
                self._pread_verified(fd, out, lo, hi, size, crcs, leaf_name, path)
        finally:
            fd.close()
        return True

    def _verify_blocks(
        self, fd: storage.Reader, lo: int, hi: int, size: int, crcs: list[int], leaf: str, path: str
    ) -> None:
        """Streams the checksum blocks around bytes ``[lo, hi)`` of a chunk file through a
        piece of scratch (``files.PIECE_BYTES`` at most) and verifies each (what
        ``_pread_verified`` checks)."""
        first, a, b = checksums_lib.blocks_of(lo, hi, size, self.block_bytes)
        step = self.block_bytes
        scratch = memoryview(bytearray(min(files.PIECE_BYTES, b - a)))
        for at in range(a, b, step):
            end = min(at + step, b)
            crc = files.pread_crc(fd, (at, end), scratch, 0, leaf, path)
            block = first + (at - a) // step
            checksums_lib.verify_crc(crc, block, crcs, leaf=leaf, file=path, span=(at, end))
        stats.count_checked(b - a)

    def _pread_verified(
        self,
        fd: storage.Reader,
        out: memoryview,
        lo: int,
        hi: int,
        size: int,
        crcs: list[int],
        leaf: str,
        path: str,
    ) -> None:
        """Bytes ``[lo, hi)`` of a chunk file into ``out``, reading the whole checksum blocks
        around them and verifying each: every byte of ``[lo, hi)`` straight into ``out``; the
        bytes of the (at most two) blocks it cuts through that lie outside it stream through
        a piece of scratch (``files.PIECE_BYTES`` at most, no more than they are), their
        crc32c continued around the part in ``out``."""
        assert self.checksums is not None
        first, a, b = checksums_lib.blocks_of(lo, hi, size, self.block_bytes)
        step = self.block_bytes
        outside = max(lo - a, b - hi)  # the most bytes of one cut block outside [lo, hi)
        scratch = memoryview(bytearray(min(files.PIECE_BYTES, outside))) if outside else None
        for at in range(a, b, step):  # each block checked while it is in cache
            end = min(at + step, b)
            c0, c1 = max(lo, at), min(hi, end)
            inside = out[c0 - lo : c1 - lo]
            files.pread(fd, inside, c0, leaf, path)
            if (c0, c1) == (at, end):
                crc = checksums_lib.crc_update(inside)
            else:
                assert scratch is not None
                crc = files.pread_crc(fd, (at, c0), scratch, 0, leaf, path)
                crc = checksums_lib.crc_update(inside, crc)
                crc = files.pread_crc(fd, (c1, end), scratch, crc, leaf, path)
            block = first + (at - a) // step
            checksums_lib.verify_crc(crc, block, crcs, leaf=leaf, file=path, span=(at, end))
        if (a, b) != (lo, hi):
            stats.count_verified(b - a - (hi - lo))

    def _read_one(self, req: ReadRequest) -> int:
        keys, start, stop, out, box = req
        md = self._simple(keys)
        if md is not None:
            np_dtype = NUMPY_DTYPE[md["dtype"]]
            direct = (
                out.device.type == "cpu"
                and out.is_contiguous()
                and out.dtype == TORCH_FROM_NUMPY.get(np_dtype)
            )
            if direct:
                buf = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
                if self._pread_rows(keys, start, stop, buf, box):
                    return len(buf)
            else:
                shape = [stop - start, *md["shape"][1:]]
                if box is not None:
                    shape[box[0]] = box[2] - box[1]
                tmp = np.empty(shape, dtype=np_dtype)
                bytes_view = memoryview(tmp.reshape(-1).view(np.uint8))
                if self._pread_rows(keys, start, stop, bytes_view, box):
                    copy_rows(out, to_torch(tmp, self._leaf_dir(keys)))
                    return tmp.nbytes
        self._ts([keys])
        arr = self._open[keys]
        a = np.asarray(
            (arr[box_slices(arr.ndim, start, stop, box)] if arr.ndim else arr).read().result()
        )
        copy_rows(out, to_torch(a, self._leaf_dir(keys)))
        return a.nbytes

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        for r in requests:
            self._simple(r.keys)
        slow = [r.keys for r in requests if self._zarray[r.keys] is None]
        self._ts(slow)
        if len(requests) > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
                sizes = list(pool.map(stats.in_context(self._read_one), requests))
        else:
            sizes = [self._read_one(r) for r in requests]
        for n in sizes:
            stats.count(True, n)

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Raises what ``read_into(requests)`` would raise for the bytes it reads, keeping
        none of them: every checksum block verified (one block in memory at a time), or,
        without checksums, every chunk file's size; arrays read through tensorstore are only
        opened. Writes no ``out``; ``READ_THREADS`` requests at a time, as ``read_into``."""
        for r in requests:
            self._simple(r.keys)
        self._ts([r.keys for r in requests if self._zarray[r.keys] is None])
        simple = [r for r in requests if self._zarray[r.keys] is not None]
        with concurrent.futures.ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            check = stats.in_context(
                lambda r: self._pread_rows_checked(r.keys, r.start, r.stop, r.box)
            )
            list(pool.map(check, simple))

    def chunk_rows(self, keys: Keys) -> list[tuple[int, int]] | None:
        """The row range of each chunk file of an array (a 0-d one: ``[(0, 1)]``); None when
        it is not read as chunk files (OCDBT, compressed, zarr3)."""
        md = self._simple(keys)
        if md is None:
            return None
        shape = md["shape"]
        if not shape:
            return [(0, 1)]
        chunk = md["chunks"][0]
        return [(lo, min(lo + chunk, shape[0])) for lo in range(0, shape[0], chunk)]

    def leaves(self) -> list[Keys]:
        """Every array's and scalar's keys, as ``_METADATA`` lists them."""
        return list(self.stored)

    def verify(self, keys: Keys) -> list[str]:
        """Reads every chunk of an array (or scalar) against its checksums, one chunk in memory
        at a time, after its ``.zarray``; the problems found (empty: all verified)."""
        try:
            ranges = self.chunk_rows(keys)
        except (OSError, ValueError) as e:  # ChecksumError, a damaged or missing .zarray
            return [str(e)]
        if ranges is None:
            return [f"{self._leaf_dir(keys)}: not stored as plain zarr chunks; not verified"]
        md = self._zarray[keys]
        assert md is not None
        row_bytes = math.prod(md["shape"][1:]) * NUMPY_DTYPE[md["dtype"]].itemsize
        problems = []
        for lo, hi in ranges:
            buf = bytearray((hi - lo) * row_bytes)
            try:
                if not self._pread_rows(keys, lo, hi, memoryview(buf)):
                    problems.append(f"{self._leaf_dir(keys)}: chunk of rows {lo}:{hi} is absent")
            except OSError as e:  # ChecksumError, a missing or short file
                problems.append(str(e))
        return problems

    def read_scalar(self, keys: Keys) -> Any:
        md = self._simple(keys)
        if md is not None and not md["shape"]:
            np_dtype = NUMPY_DTYPE[md["dtype"]]
            buf = bytearray(np_dtype.itemsize)
            if self._pread_rows(keys, 0, 1, memoryview(buf)):
                return np.frombuffer(bytes(buf), dtype=np_dtype)[0].item()
        if self.checksums is not None:  # the .zarray of a scalar funcshard wrote is 0-d
            raise ValueError(
                f"restore: {self.directory}/{self._leaf_dir(keys)}/.zarray: shape "
                f"{md and md['shape']} for the scalar {self._leaf_dir(keys)}, expected []; the "
                "checkpoint is damaged"
            )
        self._ts([keys])
        return np.asarray(self._open[keys].read().result()).item()
