"""``save``, ``restore`` and ``rebuild_from_params``: the collective entry points."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from funcshard.checkpoint import buffers as buffers_lib
from funcshard.checkpoint import checksums, hf, matching, pipelined, reading, sources, storage
from funcshard.checkpoint import safetensors as st
from funcshard.checkpoint.agreement import Agreement
from funcshard.checkpoint.commit import Saver
from funcshard.checkpoint.format import CHUNK_BYTES, COMMIT_FILE
from funcshard.checkpoint.orbax import OrbaxSource
from funcshard.checkpoint.sources import DictSource, Source
from funcshard.state.state import Donation, TrainState

__all__ = ["save", "restore", "rebuild_from_params", "open_source"]


def save(
    directory: str | os.PathLike, state: TrainState, *, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Writes ``state`` as one Orbax checkpoint at ``directory`` (collective).

    Every rank writes its own rows of each array; the directory appears only when complete.
    The model's persistent buffers (``state.buffers``, read from the model now) go beside the
    params as ``("buffers", name)`` arrays. For asynchronous saves, use ``CheckpointManager``.

    Args:
      directory: where the checkpoint goes; must not exist.
      state: the state to save (not consumed).
      chunk_bytes: target size of one zarr chunk (a chunk never spans two writers' rows).

    Raises:
      RuntimeError: the state holds no values, or writing failed on some rank (on every rank).
      OSError: ``directory`` exists or cannot be created.
    """
    Saver(chunk_bytes=chunk_bytes).save(directory, state)


def open_source(path: str, names: Sequence[str] = ()) -> Source:
    """The reader for the checkpoint at ``path``: Hugging Face safetensors, DCP or Orbax
    (``names``: the target's parameter names, a DCP state's choice between its FQNs as they
    are and under ``model.``)."""
    if st.is_safetensors(path):
        return hf.SafetensorsSource(path)
    if sources.is_dcp(path):  # torch's DCP (DTensor with it: most of a second) for DCP only
        from funcshard.checkpoint import dcp

        source = dcp.DCPSource(path)
        source.align(names)
        return source
    return OrbaxSource(path)


def restore(
    directory: str | os.PathLike, *, like: TrainState, model_only: bool = False
) -> TrainState:
    """Reads a checkpoint into ``like``'s layout (collective; consumes ``like`` on success).

    Each rank reads only the rows its shards need; the mesh, strategy, policy and offload
    fraction may all differ from those at save time.

    Args:
      directory: a funcshard checkpoint (or a CheckpointManager step); with ``model_only``
        also a torch.distributed.checkpoint (DCP) directory whose tensors are keyed by
        parameter name (each rank reads the stored chunks that overlap its rows),
        also any Orbax checkpoint whose params tree is keyed by parameter names (nested keys
        joined with "."; a step directory of Orbax's CheckpointManager finds its single item
        or the "params" item of a Composite), or a Hugging Face safetensors checkpoint (one
        ``.safetensors`` file, or a directory with ``model.safetensors`` or
        ``model.safetensors.index.json``).
      like: a state from ``fs.init`` for the target layout (may be unfilled, from a
        meta-device model). None of its values survive; its buffers do. First every rank
        reads and verifies every byte it will read, keeping none (checksum blocks one at a
        time); once all agree, ``like`` is donated and the checkpoint is read into its own
        buffers, the compute copies derived into its own, so a restore needs a little
        scratch, not a second state (an unfilled ``like`` has no buffers: they are made).
        With ``model_only`` its optimizer state is dropped before the fresh one is made.
      model_only: read only the params and start a fresh optimizer state at step 0.

    The model's persistent buffers that the checkpoint holds (``fs.save`` writes those of the
    saved state's model: :mod:`funcshard.state.buffers`) are copied into the buffers of
    ``like``'s model, in place, with or without ``model_only``. A checkpoint that holds
    buffers must hold exactly the model's, of the same shapes and dtypes; one that holds none
    leaves the model's (:mod:`funcshard.checkpoint.buffers`).

    Returns:
      The restored state; every buffer derives from the checkpoint's values (cast to the
      master dtype).

    Raises (on every rank; an error found by the check, which covers all of those below,
    leaves ``like`` unconsumed and unchanged on every rank, so an older checkpoint can be
    restored with it; one that only the read itself meets, after the check, such as an I/O
    error, leaves ``like`` refusing use on every rank with a ``ConsumedStateError`` that
    names the failed restore, as its buffers then hold part of the checkpoint):
      CheckpointMismatchError: listing every mismatched name, shape, dtype or optimizer kind
        beside what the checkpoint holds.
      ChecksumError: bytes read differ from those ``save`` wrote, naming the leaf, the file
        and the byte range, or a metadata file differs from what was written, naming it.
        A checkpoint without checksums that funcshard did not write (or wrote before it
        recorded them) restores with an ``UnverifiedCheckpointWarning``; one of ours whose
        checksums were lost raises, naming what says it had them.
      RuntimeError: reading failed on some rank.
    """
    like.check()
    agreement = Agreement.of_state(like)
    other_params, other_buffers = pipelined.others(like)  # other pipeline ranks' stages
    path = storage.normalize(directory)
    error: BaseException | None = None
    try:
        if storage.is_object(path) and not storage.exists(os.path.join(path, COMMIT_FILE)):
            raise FileNotFoundError(
                f"restore: {path} holds no committed checkpoint (no {COMMIT_FILE}: a save "
                "that never finished, or nothing)"
            )
        source = open_source(path, like.layout.names)
        if isinstance(source, OrbaxSource) and source.checksums is None:
            checksums.warn_unverified(path)
        problems, keymap = matching.match(like, source, model_only, others=other_params)
        buffer_reads, bad_buffers = buffers_lib.buffer_reads(like, source, others=other_buffers)
        if problems or bad_buffers:
            raise matching.mismatch_error(f"checkpoint {path}", problems + bad_buffers, source)
        plan = reading.plan(like, source, model_only=model_only, keymap=keymap)
        plan.check()  # every byte this rank reads, verified and dropped: like is untouched
        source.check(buffer_reads)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
        error = e
    agreement.raise_if_failed(f"restore from {path}: checking", error)
    by = f"restore from {path}"
    donated = _donate(like, by, model_only)
    try:
        plan.fill(donated)
        source.read_into(buffer_reads)
        buffers_lib.copy_into_model(like, buffer_reads)  # the model's buffers, in place
    except BaseException as e:  # noqa: BLE001
        error = e
    _raise_spoiled(agreement, like, by, "reading into its buffers", error)
    compute = None
    try:
        compute = reading.derive(donated, plan.master)
    except BaseException as e:  # noqa: BLE001
        error = e
    _raise_spoiled(agreement, like, by, "deriving the compute copies", error)
    return plan.state(donated, compute)


def _donate(like: TrainState, by: str, model_only: bool) -> Donation:
    """``like``'s leaves for a restore to read into; ``like`` keeps none of them, and with
    ``model_only`` nothing keeps its optimizer state (a fresh one replaces it: both would
    otherwise be alive at once)."""
    donated = like.donate(by, release=True)
    if model_only:
        donated = donated.replace(opt_state=None)
    return donated


def _raise_spoiled(
    agreement: Agreement, like: TrainState, by: str, what: str, error: BaseException | None
) -> None:
    """Agrees on ``what`` (a phase after ``like`` was donated and written into); on failure
    (on any rank) ``like`` refuses use on every rank, naming the failed restore, and the
    error is raised."""
    try:
        agreement.raise_if_failed(f"{by}: {what}", error)
    except BaseException as e:
        cause = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        like.spoil(  # the whole cause: on the other ranks it is the failed ranks' errors
            f"{by}, which failed while {what} after every rank had checked the checkpoint "
            f"({type(e).__name__}: {cause}); its buffers hold part of the checkpoint: "
            "build a fresh state with fs.init and restore into it"
        )
        raise


def rebuild_from_params(like: TrainState, params: dict[str, torch.Tensor]) -> TrainState:
    """``like`` rebuilt from full parameter tensors (any float dtype), fresh optimizer state.

    The in-memory twin of ``restore(..., model_only=True)``; consumes ``like`` on success.
    """
    source = DictSource(params)
    problems, keymap = matching.match(like, source, model_only=True)
    if problems:
        raise matching.mismatch_error("params", problems, source)
    plan = reading.plan(like, source, model_only=True, keymap=keymap)
    donated = _donate(like, "rebuild_from_params", model_only=True)
    try:
        plan.fill(donated)
        return plan.state(donated, reading.derive(donated, plan.master))
    except BaseException as e:
        like.spoil(f"rebuild_from_params, which failed after writing into its buffers: {e!r}")
        raise
