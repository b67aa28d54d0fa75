"""Hugging Face safetensors, both ways, each rank moving only its own rows.

Rows ``[a, b)`` of a tensor in a safetensors file (see ``safetensors`` for the format) are one
byte range: importing reads exactly those of the rows a rank owns, and exporting computes
every header and offset from the shapes alone, so each rank writes its own rows into the
files in parallel. Stacked experts (transformers' ``experts.gate_up_proj``) are read from and
written as transformers' per-expert tensors (:mod:`funcshard.checkpoint.hf_experts`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from funcshard.checkpoint import commit as commit_lib
from funcshard.checkpoint import hf_experts, stats, storage
from funcshard.checkpoint import safetensors as st
from funcshard.checkpoint import tree as tree_lib
from funcshard.checkpoint.coords import Coords, segments
from funcshard.checkpoint.format import Keys
from funcshard.checkpoint.sources import ReadRequest
from funcshard.state.state import TrainState

__all__ = ["SafetensorsSource", "export_safetensors"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Tensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


class SafetensorsSource:
    """A Hugging Face safetensors checkpoint; names map 1:1 to parameter names, and
    transformers' per-expert tensors also make the stacked parameters they are saved from."""

    def __init__(self, path: str) -> None:
        self.label = path
        self.info = None
        self.tensors: dict[Keys, _Tensor] = {}
        self.dtype_names: dict[Keys, str] = {}
        for file in st.files(path):
            if not storage.exists(file):
                raise FileNotFoundError(f"restore: {file} (named by {path}) does not exist")
            header, data = st.read_header(file)
            for name, entry in header.items():
                try:
                    code, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
                    begin, end = (int(x) for x in entry["data_offsets"])
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"restore: {file}: header entry {name!r} lacks {e}") from None
                dtype = st.DTYPES.get(code)
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
        self.stacked: dict[Keys, tuple[tuple[int, ...], tuple[tuple[Keys, ...], ...]]] = {}
        for stacked in hf_experts.stacked_in(k[-1] for k in self.tensors):
            self._stack(stacked)

    def _stack(self, stacked: hf_experts.Stacked) -> None:
        """Offers ``stacked`` as one array where every expert's tensors agree in shape and
        dtype (row ``e``: expert ``e``'s tensors back to back)."""
        parts = tuple(tuple(("params", n) for n in row) for row in stacked.parts)
        first = [self.tensors[k] for k in parts[0]]
        same = lambda row: [(t.shape, t.dtype) for t in map(self.tensors.__getitem__, row)]  # noqa: E731
        if len({t.shape[1:] for t in first}) != 1 or len({t.dtype for t in first}) != 1:
            return
        if any(same(row) != same(parts[0]) for row in parts):
            return
        shape = (len(parts), sum(t.shape[0] for t in first), *first[0].shape[1:])
        self.stacked[("params", stacked.name)] = (shape, parts)
        self.dtype_names[("params", stacked.name)] = self.dtype_names[parts[0][0]]

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        """Every tensor by name, but the per-expert ones: the stacked arrays they make."""
        parts = {k for _, rows in self.stacked.values() for row in rows for k in row}
        out = {k: (t.shape, self.dtype_names[k]) for k, t in self.tensors.items() if k not in parts}
        out.update((k, (shape, self.dtype_names[k])) for k, (shape, _) in self.stacked.items())
        return out

    def _expand(self, requests: Sequence[ReadRequest]) -> list[ReadRequest]:
        """``requests`` with those of stacked arrays as the whole per-expert tensors their
        rows are made of, each read into its place in the row."""
        out = []
        for request in requests:
            keys, start, stop, into, box = request
            if keys not in self.stacked:
                out.append(request)
                continue
            if box is not None:
                raise ValueError(f"restore: {keys[-1]}: stacked experts split along dim {box[0]}")
            _, parts = self.stacked[keys]
            for e in range(start, stop):
                row, at = into[e - start].reshape(-1), 0
                for part in parts[e]:
                    t = self.tensors[part]
                    n = math.prod(t.shape)
                    out.append(ReadRequest(part, 0, t.shape[0], row[at : at + n].view(t.shape)))
                    at += n
        return out

    def scalars(self) -> set[Keys]:
        return set()

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Every file holds the bytes the requests read (safetensors has no checksums)."""
        sizes: dict[str, int] = {}
        for keys, start, stop, _, box in self._expand(requests):
            t = self.tensors[keys]
            if t.file not in sizes:
                reader = storage.open_reader(t.file)
                sizes[t.file] = reader.size()
                reader.close()
            segs = list(segments(t.shape, t.dtype.itemsize, start, stop, box))
            end = max((t.offset + offset + n for offset, n in segs), default=0)
            if end > sizes[t.file]:
                raise OSError(
                    f"restore: {t.file}: {keys[-1]} is short ({sizes[t.file]} bytes, rows "
                    f"{start}:{stop} end at byte {end})"
                )

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        fds: dict[str, storage.Reader] = {}
        try:
            for keys, start, stop, out, box in self._expand(requests):
                t = self.tensors[keys]
                direct = out.device.type == "cpu" and out.is_contiguous() and out.dtype == t.dtype
                buf = out if direct else torch.empty(out.shape, dtype=t.dtype)
                view = memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else None
                if t.file not in fds:
                    fds[t.file] = storage.open_reader(t.file)
                at = 0  # the rows' bytes, or the box's runs (one a row)
                for offset, n in segments(t.shape, t.dtype.itemsize, start, stop, box):
                    got = fds[t.file].preadv([view[at : at + n]], t.offset + offset)
                    if got != n:
                        raise OSError(
                            f"restore: {t.file}: {keys[-1]} is short ({got} of {n} bytes "
                            f"at rows {start}:{stop})"
                        )
                    at += n
                if not direct:
                    out.copy_(buf)
                stats.count(True, at)
        finally:
            for reader in fds.values():
                reader.close()

    def read_scalar(self, keys: Keys) -> Any:
        raise KeyError(keys)


# --- export -------------------------------------------------------------------------------


def export_safetensors(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    split_experts: bool = True,
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
      split_experts: write transformers' stacked experts (``experts.gate_up_proj``,
        ``experts.down_proj``) as the per-expert tensors of its checkpoints
        (``experts.{e}.gate_proj.weight``, ...), which ``from_pretrained`` reads; False: as the
        stacked parameters ``load_state_dict`` takes.

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
    if dtype is not None and dtype not in st.CODES:
        raise ValueError(f"export_safetensors: dtype {dtype} has no safetensors code")
    layout = state.layout
    specs = {s.name: s for s in layout.leaves}
    shapes = {s.name: Coords(layout.tensor).shape(s.name, s.shape) for s in layout.leaves}
    entries, split = _entries(layout.leaves, shapes, dtype, split_experts)
    entries += [
        st.Entry(a, p, dtype or specs[p].dtypes.model, shapes[p]) for a, p in layout.aliases
    ]
    entries = _whole_model(state, entries)
    files = st.plan_files(entries, max_shard_bytes)
    names = st.file_names(len(files))
    headers = [st.header_bytes(f) for f in files]

    agreement = commit_lib.Agreement.of_state(state)
    final = storage.normalize(directory)
    tmp = commit_lib.start(final, agreement)

    def create_files() -> None:  # every file at its full size, so every rank can write into it
        for name, (head, _), entries_i in zip(names, headers, files, strict=True):
            size = len(head) + sum(e.nbytes for e in entries_i)
            storage.create_file(os.path.join(tmp, name), head, size)

    def write_index(_: list[Any]) -> None:
        st.write_index(tmp, names, files)
        storage.fsync_dir(tmp)

    commit_lib.write_and_commit(
        agreement,
        tmp,
        final,
        f"export to {final}",
        prepare=create_files,
        write=lambda: _write_rows(state, tmp, names, headers, files, split),
        finish=write_index,
    )


def _entries(leaves, shapes: dict, dtype: torch.dtype | None, split_experts: bool):
    """Every leaf's entry, a stacked experts leaf's as its per-expert ones (``split``: entry
    name -> (expert, index of the part in the expert's row, parts))."""
    entries, split = [], {}
    for s in leaves:
        shape, dt = shapes[s.name], dtype or s.dtypes.model
        parts = hf_experts.split_names(s.name, shape[0]) if split_experts and shape else None
        if parts is None or len(shape) < 2 or shape[1] % len(parts[0]):
            entries.append(st.Entry(s.name, s.name, dt, shape))
            continue
        for e, row in enumerate(parts):
            for k, part in enumerate(row):
                entries.append(st.Entry(part, s.name, dt, (shape[1] // len(row), *shape[2:])))
                split[part] = (e, k, len(row))
    return entries, split


def _whole_model(state: TrainState, entries: list[st.Entry]) -> list[st.Entry]:
    """A pipelined state's entries with every other pipeline rank's (a collective over
    "pipeline"), in the stages' order: the same files on every rank, of the whole model.
    Without a pipeline, ``entries``."""
    run = state.pipeline
    if run is None:
        return entries
    told: list[Any] = [None] * dist.get_world_size(run.group)
    dist.all_gather_object(told, entries, group=run.group)
    names = [n for stage in run.stages for n, _ in stage.named_parameters(remove_duplicate=False)]
    order = {n: i for i, n in reversed(list(enumerate(names)))}  # a name's first place
    merged = {e.name: e for mine in told for e in mine}
    return sorted(merged.values(), key=lambda e: order.get(e.param, len(order)))


def _write_rows(
    state: TrainState,
    tmp: str,
    names: list[str],
    headers: list[tuple[bytes, list[int]]],
    files: list[list[st.Entry]],
    split: dict[str, tuple[int, int, int]],
) -> None:
    """This rank's rows of every entry (a tensor-parallel shard's rows or block of the full
    tensor; of a per-expert entry, its part of the expert's row where this rank writes it),
    at their offsets, then fsync of every file."""
    layout = state.layout
    coords = Coords(layout.tensor)
    specs = {s.name: s for s in layout.leaves}
    for name, (head, offsets), entries in zip(names, headers, files, strict=True):
        writer = storage.Writer(os.path.join(tmp, name))
        try:
            for e, offset in zip(entries, offsets, strict=True):
                if e.param not in specs:  # another pipeline rank's stage: written there
                    continue
                if e.name in split:
                    at = len(head) + offset
                    _write_expert(state, specs[e.param], split[e.name], writer, at, e)
                    continue
                spec = specs[e.param]
                writers, r = tree_lib.Writers.of(layout, spec), layout.spec_rank(spec)
                start, stop, _ = writers.rows(spec)
                if stop <= start or not coords.writes(spec.name):
                    continue
                flat = state.master[spec.bucket]
                rows = writers.local_rows(flat, spec, r, start, stop)
                data = rows.detach().to("cpu", e.dtype).contiguous()
                buf = memoryview(data.view(torch.uint8).numpy()).cast("B")
                start, stop, box = coords.rows(spec.name, start, stop)
                at = 0
                for where, n in segments(e.shape, e.dtype.itemsize, start, stop, box):
                    writer.pwrite_all(buf[at : at + n], len(head) + offset + where)
                    at += n
                stats.count(False, len(buf))
        finally:
            writer.close()


def _write_expert(state: TrainState, spec, where: tuple[int, int, int], writer, at: int, e) -> None:
    """Part ``k`` of expert ``expert``'s row of a stacked leaf, if this rank writes that row."""
    expert, k, parts = where
    layout = state.layout
    writers, r = tree_lib.Writers.of(layout, spec), layout.spec_rank(spec)
    start, stop, _ = writers.rows(spec)
    if stop <= start or not Coords(layout.tensor).writes(spec.name):
        return
    first, last, _ = Coords(layout.tensor).rows(spec.name, start, stop)  # global expert rows
    if not first <= expert < last:
        return
    local = start + expert - first
    row = writers.local_rows(state.master[spec.bucket], spec, r, local, local + 1)[0]
    data = row.detach().chunk(parts)[k].to("cpu", e.dtype).contiguous()
    writer.pwrite_all(memoryview(data.view(torch.uint8).numpy()).cast("B"), at)
    stats.count(False, data.numel() * data.element_size())
