"""Checksums of a checkpoint's chunk files and metadata: computed while writing, verified on
every read.

Each chunk file's data bytes (its rows inside the array's shape, in the order they lie in
the file) are cut into blocks of ``BLOCK_BYTES``; one crc32c per block is recorded in the
item's ``_CHECKSUMS`` file (JSON; Orbax ignores it, so JAX still restores the checkpoint),
beside one crc32c of every metadata file of the item (``_METADATA``, each ``.zarray``: they
say how the bytes are read) and one of funcshard's record in ``_CHECKPOINT_METADATA`` (its
JSON with sorted keys; Orbax's own fields there are not funcshard's to check)::

    {"algorithm": "crc32c", "block_bytes": 1048576, "version": 3,
     "arrays": {"params.fc.weight": {"0.0": [crc, ...], "1.0": [...]}, "step": {"0": [crc]}},
     "metadata": {"_METADATA": crc, "params.fc.weight/.zarray": crc, ...}, "info": crc}

(format 2 had no ``version``, ``metadata`` nor ``info``.)

Blocks rather than whole chunks so that a resharding read, which takes part of a chunk,
verifies what it reads at the cost of at most one block more on either side, not the chunk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import crc32c

from funcshard.checkpoint import storage
from funcshard.checkpoint.format import FORMAT_VERSION, read_json, write_json

__all__ = [
    "ALGORITHM",
    "BLOCK_BYTES",
    "CHECKSUM_FILE",
    "ChecksumError",
    "Checksums",
    "Record",
    "UnverifiedCheckpointWarning",
    "block_crcs",
    "file_crc",
    "info_crc",
    "read_checksums",
    "write_checksums",
]

ALGORITHM = "crc32c"
BLOCK_BYTES = 1 << 20
CHECKSUM_FILE = "_CHECKSUMS"

# leaf directory -> chunk file name -> one crc per block of its data bytes
Checksums = dict[str, dict[str, list[int]]]


class ChecksumError(OSError):
    """Bytes read from a checkpoint do not match the checksum recorded when they were written.

    The message names the leaf, the file and the byte range.
    """


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without checksums (written before they existed, or not by funcshard)."""


def block_crcs(data: memoryview, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """One crc32c per ``block_bytes`` of ``data`` (the last block may be shorter)."""
    return [
        crc32c.crc32c(data[at : at + block_bytes]) for at in range(0, len(data), block_bytes)
    ] or [crc32c.crc32c(b"")]


def byte_view(a: Any) -> memoryview:
    """``a``'s bytes as a flat unsigned-byte memoryview (no copy)."""
    return memoryview(a).cast("B")


def file_crc(data: bytes) -> int:
    """The crc32c of a whole (metadata) file."""
    return crc32c.crc32c(data)


def info_crc(info: dict) -> int:
    """The crc32c of funcshard's record of a checkpoint, as JSON with sorted keys (the same
    bytes for the record written and the record read back)."""
    return crc32c.crc32c(json.dumps(info, sort_keys=True, separators=(",", ":")).encode())


@dataclasses.dataclass(frozen=True)
class Record:
    """An item's ``_CHECKSUMS``: ``metadata`` and ``info`` are None in format 2."""

    path: str
    arrays: Checksums
    block_bytes: int
    version: int
    metadata: dict[str, int] | None
    info: int | None

    def verify_file(self, data: bytes, name: str, path: str) -> None:
        """Checks a metadata file's bytes (``name``: its path in the item) when the record
        holds metadata checksums.

        Raises:
          ChecksumError: naming the file: its crc differs, or none is recorded for it.
        """
        if self.metadata is None:
            return
        got, want = file_crc(data), self.metadata.get(name)
        if got != want:
            found = "none recorded" if want is None else f"recorded {want:#010x}"
            raise ChecksumError(
                f"checksum mismatch in metadata file {path}: crc32c {got:#010x}, {found} in "
                f"{self.path}; the checkpoint is damaged"
            )

    def verify_info(self, info: dict | None, path: str) -> None:
        """Checks funcshard's record in ``_CHECKPOINT_METADATA`` (at ``path``) when the
        record holds its checksum.

        Raises:
          ChecksumError: naming the file: the record differs, or is missing.
        """
        if self.info is None:
            return
        if info is None:
            raise ChecksumError(
                f"{path} lacks funcshard's record (custom_metadata.funcshard), though "
                f"{self.path} holds its checksum; the checkpoint is damaged"
            )
        got = info_crc(info)
        if got != self.info:
            raise ChecksumError(
                f"checksum mismatch in {path} (custom_metadata.funcshard): crc32c {got:#010x}, "
                f"recorded {self.info:#010x} in {self.path}; the checkpoint is damaged"
            )


def write_checksums(
    item_dir: str,
    arrays: Checksums,
    metadata: dict[str, int] | None = None,
    info: int | None = None,
) -> None:
    """The item's ``_CHECKSUMS`` file (durably): chunk crcs, and those of the metadata files
    (by path in the item) and of funcshard's record (``info_crc``)."""
    record: dict[str, Any] = {
        "algorithm": ALGORITHM,
        "block_bytes": BLOCK_BYTES,
        "version": FORMAT_VERSION,
        "arrays": arrays,
    }
    if metadata is not None:
        record["metadata"] = metadata
    if info is not None:
        record["info"] = info
    write_json(os.path.join(item_dir, CHECKSUM_FILE), record)


def read_checksums(item_dir: str) -> Record | None:
    """The ``_CHECKSUMS`` of the item at ``item_dir``; None when it has none.

    Raises:
      ValueError: the file is damaged or uses another algorithm.
    """
    path = os.path.join(item_dir, CHECKSUM_FILE)
    if not storage.exists(path):
        return None
    record = read_json(path)
    if record.get("algorithm") != ALGORITHM:
        raise ValueError(
            f"{path}: checksum algorithm {record.get('algorithm')!r}, expected {ALGORITHM!r}"
        )
    try:
        metadata = record.get("metadata")
        info = record.get("info")
        return Record(
            path,
            dict(record["arrays"]),
            int(record["block_bytes"]),
            int(record.get("version", 2)),
            None if metadata is None else {str(k): int(v) for k, v in dict(metadata).items()},
            None if info is None else int(info),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} lacks {e}; the checkpoint is damaged") from None


def blocks_of(lo: int, hi: int, size: int, block_bytes: int) -> tuple[int, int, int]:
    """``(first block, byte start, byte stop)``: the whole blocks covering bytes ``[lo, hi)``
    of a chunk's ``size`` data bytes (what a verified read of that range must read)."""
    first = lo // block_bytes
    last = -(-hi // block_bytes) if hi > lo else first + 1
    return first, first * block_bytes, min(last * block_bytes, size)


def verify(
    data: memoryview,
    first_block: int,
    recorded: list[int],
    block_bytes: int,
    *,
    leaf: str,
    file: str,
    at: int = 0,
) -> None:
    """Checks ``data`` (whole blocks from ``first_block``, at byte ``at`` of the file).

    Raises:
      ChecksumError: naming the leaf, the file and the byte range of the first bad block.
    """
    for i, (lo, got) in enumerate(_crcs(data, block_bytes)):
        hi = lo + min(block_bytes, len(data) - lo)
        verify_crc(got, first_block + i, recorded, leaf=leaf, file=file, span=(at + lo, at + hi))


def verify_crc(
    got: int, block: int, recorded: list[int], *, leaf: str, file: str, span: tuple[int, int]
) -> None:
    """Checks one block's crc32c ``got`` (computed as it streamed by) against the recorded.

    Raises:
      ChecksumError: naming the leaf, the file and the block's byte range ``span``.
    """
    want = recorded[block] if block < len(recorded) else None
    if got != want:
        found = "no checksum recorded" if want is None else f"recorded {want:#010x}"
        raise ChecksumError(
            f"checksum mismatch in {leaf}: file {file}, bytes {span[0]}:{span[1]}: "
            f"crc32c {got:#010x}, {found}; the checkpoint is damaged"
        )


def crc_update(data: memoryview, crc: int = 0) -> int:
    """``crc`` (a crc32c of the bytes before ``data``) continued over ``data``."""
    return crc32c.crc32c(data, value=crc)


def _crcs(data: memoryview, block_bytes: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, max(len(data), 1), block_bytes):
        yield lo, crc32c.crc32c(data[lo : lo + block_bytes])


def warn_unverified(path: str) -> None:
    warnings.warn(
        f"{path} has no checksums (saved before funcshard recorded them, or not by "
        "funcshard): its bytes cannot be verified",
        UnverifiedCheckpointWarning,
        stacklevel=3,
    )
