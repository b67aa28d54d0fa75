"""torch's ``PipelineStage`` as a funcshard step runs it (:class:`CountingStage`): what it
sends counted under ``comm_stats``'s "pipeline" axis, its first-step shape inference kept from
the stage's buffers, and a backward that raises kept for the step's agreement while the
stage hands back zero input gradients, so that no peer waits on a send
(docs/pipeline-parallel.md)."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from funcshard.distributed import ops

__all__ = ["CountingStage"]


class CountingStage(PipelineStage):
    """torch's ``PipelineStage``, counting what it sends (stage outputs to another rank, the
    gradients of its inputs back) under ``comm_stats``'s "pipeline" axis, kind "send". A
    boundary inside one rank sends nothing: torch passes the tensors on locally."""

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _counted(super().get_bwd_send_ops(bwd_chunk_id))

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """torch's first-step shape inference (every stage but the first on inputs not the
        batch's: :meth:`StageModule._on_synthetic`), no microbatch's: its buffer updates undone."""
        self.submod.synthetic = not self.is_first
        try:
            with self.submod.buffers_kept():
                return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.synthetic = False

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self.submod.buffers_kept():  # its recomputations (activation checkpointing) too
            return super()._backward_metadata_inference(*args, **kwargs)

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        """torch's first-step metadata inference materializes a stage's inputs it only knows
        the shapes of (every stage but the first) with ``torch.empty``: zeros here, so that a
        stage reading its input's values (a check, data-dependent routing) sees neither the
        allocator's garbage nor NaN, alike on every rank and run."""
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                t.zero_()
        return t

    def _compute_input_grads(self, outputs: Any, all_fwd_inputs: Any, *args: Any) -> Any:
        """torch's backward of its shape inference (the first step): where it raises, as
        :meth:`backward_one_chunk` does, the error is kept and zeros of the inputs' shapes
        stand for their gradients."""
        try:
            return super()._compute_input_grads(outputs, all_fwd_inputs, *args)
        except Exception:  # noqa: BLE001 (every rank is told, at the step's agreement)
            self.submod.fail(traceback.format_exc(limit=-3))
            if self.submod.regather is not None:  # the gathers its peers' backward makes
                self.submod.regather.gather_rest(self.submod.regathered_buckets())
            return tuple(_zero_grad(t) for t in all_fwd_inputs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """torch's backward of one microbatch; where it raises, the error is kept for the
        step's agreement and the stage hands back zero input gradients (the previous stage
        waits for them), its weight backward then skipped: the schedule runs to its end on
        every rank, and the step fails on all."""
        inputs = self.fwd_cache.get(bwd_chunk_id, (None, ()))[1]
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        except Exception:  # noqa: BLE001 (every rank is told, at the step's agreement)
            self.submod.fail(traceback.format_exc(limit=-3))
            if self.submod.regather is not None:  # the gathers its peers' backward makes
                self.submod.regather.gather_rest(self.submod.regathered_buckets())
            n = len(self._stage_meta.inputs or ())
            self.bwd_cache[bwd_chunk_id] = tuple(_zero_grad(t) for t in inputs)[:n]
            self.dw_runner[bwd_chunk_id] = lambda: None
            self.backward_state.pop(bwd_chunk_id, None)
            return None
        finally:  # regather=True: the buffers gathered again for it are freed
            if self.submod.regather is not None:
                self.submod.regather.release()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        try:
            if bwd_chunk_id not in self.backward_state and self.dw_builder is None:
                self.dw_runner.pop(bwd_chunk_id, None)  # its input backward failed
                return None
            with self.submod.buffers_kept(not self.is_first):  # a second recomputation: undone
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        except Exception:  # noqa: BLE001 (no send follows a weight backward)
            self.submod.fail(traceback.format_exc(limit=-3))
            return None
        finally:
            if self.submod.regather is not None:
                self.submod.regather.release()


def _zero_grad(t: Any) -> torch.Tensor | None:
    """What torch's backward gives an input: its gradient where it requires one (here zeros,
    contiguous), None otherwise."""
    if isinstance(t, torch.Tensor) and t.requires_grad:
        return torch.zeros_like(t, memory_format=torch.contiguous_format)
    return None


def _counted(p2p: list[dist.P2POp]) -> list[dist.P2POp]:
    for op in p2p:
        ops.record("send", op.tensor, ops.Axis.PIPELINE)
    return p2p
