"""torch.distributed.checkpoint (DCP) directories, both ways, through DCP's own reader,
writer and metadata (no file of it is parsed here).

In: ``DCPSource`` reads a DCP directory's tensors by parameter name (FSDP2 / torchtitan, or
``dcp.save(model.state_dict())``): optimizer, scheduler, data loader and train-state entries
are left out, and a nested ``{"model": state_dict, ...}`` is read without its ``model.``
prefix when that fits the target's names better. Each rank asks DCP's reader for the rows it
owns; DCP reads every stored chunk that overlaps them (a chunk is one saving rank's shard of
a tensor) and copies the overlap.

Out: ``save_streaming`` writes a DCP directory that ``dcp.load`` reads into a plain model's
``state_dict()``, one tensor in memory at a time (loaded on demand by the save planner).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from funcshard.checkpoint import stats
from funcshard.checkpoint import storage as storage_lib
from funcshard.checkpoint.format import Keys
from funcshard.checkpoint.sources import DCP_METADATA_FILE, ReadRequest, is_dcp

__all__ = ["DCPSource", "is_dcp", "save_streaming", "METADATA_FILE"]

METADATA_FILE = DCP_METADATA_FILE
_NOT_MODEL = ("optimizer.", "optim.", "lr_scheduler.", "dataloader.", "train_state.")


def read_metadata(path: str) -> Metadata:
    return dcp.FileSystemReader(path).read_metadata()


def param_names(metadata: Metadata, drop_model_prefix: bool = False) -> dict[str, str]:
    """Parameter name -> the FQN DCP stores it under, for every tensor of the model: all but
    optimizer, scheduler, data loader and train-state entries, or with ``drop_model_prefix``
    those under ``model.`` (a nested ``{"model": state_dict, ...}``), without it."""
    tensors = [
        fqn
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    ]
    if drop_model_prefix:
        return {f.removeprefix("model."): f for f in tensors if f.startswith("model.")}
    return {f: f for f in tensors if not f.startswith(_NOT_MODEL)}


class _IntoBuffers(LoadPlanner):
    """Hands DCP's reader the destination of each read: a slice of a request's ``out``."""

    def __init__(self, targets: dict[tuple[str, tuple[int, ...]], torch.Tensor]) -> None:
        self.targets = targets

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise NotImplementedError("funcshard reads only tensors from a DCP checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        out = self.targets[(index.fqn, tuple(index.offset))]
        for dim, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            out = out.narrow(dim, at, n)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DCPSource:
    """A DCP checkpoint's model tensors, by parameter name (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.label = path
        self.info = None
        self.path = path
        self.metadata = read_metadata(path)
        self.fqn = {("params", n): f for n, f in param_names(self.metadata).items()}

    def align(self, names: Sequence[str]) -> None:
        """Reads the params under ``model.`` as the model's when that names more of ``names``
        (the target's parameters) than the FQNs as they are: a nested ``{"model": ...}``
        state, told apart from a model whose own names start with ``model.``."""
        plain = param_names(self.metadata)
        nested = param_names(self.metadata, drop_model_prefix=True)
        if sum(n in nested for n in names) > sum(n in plain for n in names):
            self.fqn = {("params", n): f for n, f in nested.items()}

    def tensor_metadata(self, keys: Keys) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata[self.fqn[keys]]
        assert isinstance(md, TensorStorageMetadata)
        return md

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        out = {}
        for keys in self.fqn:
            md = self.tensor_metadata(keys)
            out[keys] = (tuple(md.size), str(md.properties.dtype).removeprefix("torch."))
        return out

    def scalars(self) -> set[Keys]:
        return set()

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Every file DCP's metadata names for the requested tensors exists (DCP records no
        checksums)."""
        fqns = {self.fqn[r.keys] for r in requests}
        storage = self.metadata.storage_data or {}
        for index, info in storage.items():
            if index.fqn in fqns:
                path = os.path.join(self.path, info.relative_path)
                if not storage_lib.exists(path):
                    raise FileNotFoundError(f"restore: {path} (of {index.fqn}) is missing")

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        """Reads each request's rows through DCP's ``FileSystemReader`` (no collectives):
        those read straight into their ``out`` at once, those cast through a buffer one at a
        time (so at most one tensor's rows are in scratch)."""
        direct = [r for r in requests if self._direct(r)]
        if direct:
            self._read(direct)
        for r in requests:
            if not self._direct(r):
                self._read([r])

    def _direct(self, r: ReadRequest) -> bool:
        return (
            r.out.dtype == self.tensor_metadata(r.keys).properties.dtype and r.out.is_contiguous()
        )

    def _read(self, requests: Sequence[ReadRequest]) -> None:
        items: list[ReadItem] = []
        targets: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        copies = []
        for keys, start, stop, out, box in requests:
            md, fqn = self.tensor_metadata(keys), self.fqn[keys]
            shape = tuple(md.size)
            offsets = [start, *(0 for _ in shape[1:])] if shape else []
            sizes = [stop - start, *shape[1:]] if shape else []
            if box is not None:  # a tensor-parallel shard's block
                offsets[box[0]], sizes[box[0]] = box[1], box[2] - box[1]
            offsets, sizes = tuple(offsets), tuple(sizes)
            direct = out.dtype == md.properties.dtype and out.is_contiguous()
            buf = out if direct else torch.empty(out.shape, dtype=md.properties.dtype)
            targets[(fqn, offsets)] = buf.view(sizes)
            if not direct:
                copies.append((out, buf))
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
            stats.count(True, buf.numel() * buf.element_size())
        reader = dcp.FileSystemReader(self.path)
        reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        plan = reader.prepare_global_plan([reader.prepare_local_plan(LoadPlan(items))])[0]
        reader.read_data(plan, _IntoBuffers(targets)).wait()
        for out, buf in copies:
            out.copy_(buf)

    def read_scalar(self, keys: Keys) -> Any:
        raise KeyError(keys)


# --- out ----------------------------------------------------------------------------------------


class _LazySavePlanner(dcp.DefaultSavePlanner):
    """A save planner whose state dict holds meta tensors: each tensor's values are loaded
    only when DCP's writer asks for them (one at a time with ``thread_count=1``)."""

    def __init__(self, load: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._load = load

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self._load(write_item.index.fqn)


def save_streaming(
    directory: str,
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    load: Callable[[str], torch.Tensor],
) -> None:
    """Writes a DCP checkpoint of ``tensors`` (name -> shape, dtype) at ``directory`` in one
    process, calling ``load(name)`` for each tensor's values when DCP writes it.

    Peak memory: two to four tensors (DCP's serial writer still holds the one it wrote while
    the next loads, and serializes each with ``torch.save``), never the whole checkpoint.
    """
    state_dict = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (shape, dtype) in tensors.items()
    }
    writer = dcp.FileSystemWriter(directory, thread_count=1, sync_files=True)
    with warnings.catch_warnings():  # one process on purpose: DCP need not say so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state_dict, storage_writer=writer, planner=_LazySavePlanner(load), no_dist=True)
