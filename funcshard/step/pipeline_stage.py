"""A pipeline stage as torch's ``PipelineStage`` runs it within a funcshard step
(:class:`StageModule`: the user's stage module called with the step's leaves as its
parameters, a stand-in output where it raised), and each stage's output shape from a
meta-device run of every stage (:func:`propagate`), by which a stand-in is sized."""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from funcshard.layout.model_units import tied_aliases
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.step.functional import Swap
from funcshard.step.pipeline_regather import Regather
from funcshard.step.units.placeholders import Absent

__all__ = ["StageModule", "as_meta", "propagate"]


def as_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _sendable(out: Any, meta: Any, index: int) -> Any:
    """``out`` as torch's stage sends it: contiguous (gloo sends and receives contiguous
    buffers only; the gradients received for it are made like it), and of the shapes and
    dtypes the stage has on the meta device (ValueError otherwise: the receiving stage sized
    its buffers by them)."""
    out = optree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, out)
    if meta is not None:
        got = [(tuple(t.shape), t.dtype) for t in optree.tree_leaves(out)]
        want = [(tuple(m.shape), m.dtype) for m in optree.tree_leaves(meta)]
        if got != want:
            raise ValueError(
                f"pipeline stage {index}: its output (shapes, dtypes) {got} differs from "
                f"what it gives on the meta device, {want}, by which the next stage sized "
                "its buffers"
            )
    return out


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: torch's stage sends a
    stage's input gradients as autograd gives them and the previous stage receives them into
    buffers strided as the first step's were (gloo takes contiguous buffers only; an expanded
    zero gradient, e.g. of an input a stage ignores, is not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad.contiguous()


def _stage_inputs(args: tuple, dtype: torch.dtype | None) -> tuple:
    """A stage's inputs as its forward sees them: floating-point ones cast to ``dtype`` (the
    policy's compute dtype, FSDP2's ``cast_forward_inputs``; None: as given), every input
    that requires grad giving back a contiguous gradient (:class:`ContiguousGrad`)."""
    out = []
    for t in args:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t = ContiguousGrad.apply(t)
        if isinstance(t, torch.Tensor) and dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out.append(t)
    return tuple(out)


class StageModule(nn.Module):
    """A stage as torch's ``PipelineStage`` runs it: the user's stage module called with the
    step's leaves swapped in for its parameters (as ``torch.func.functional_call`` does, its
    tied names and submodules found once, not on every microbatch), held there until the
    step's schedule is over (:meth:`release`; ``regather``: each microbatch's gathered params
    during its forward only); ``parameters()`` are those leaves; its floating-point inputs
    cast to the policy's compute dtype (``cast``, set per step)."""

    def __init__(self, stage: nn.Module, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)  # not a child: its parameters are not ours
        self.index = index
        self.names = [n for n, _ in stage.named_parameters()]
        # what each microbatch's swap would otherwise find by walking the stage's tree again
        self._aliases = tied_aliases(stage)
        self._accessor = NamedMemberAccessor(stage)
        self._held: Swap | None = None  # the step's leaves in the stage (:meth:`_hold`)
        self._holding: dict[str, torch.Tensor] = {}
        self._placeholders: dict[str, torch.Tensor] | None = None  # regather: :meth:`_absent`
        self.leaves: dict[str, torch.Tensor] = {}
        self.wrap: Callable[[str, torch.Tensor], torch.Tensor] = _plain  # the model axis's
        self.error: str | None = None
        self.out_meta: Any = None  # one microbatch's output as meta tensors (None: unknown)
        self.cast: torch.dtype | None = None  # the policy's param_dtype
        self.regather: Regather | None = None  # ZeRO-3 per microbatch (the step's)
        # the groups of the model axes inside the stage (tensor, expert): a failed forward's
        # stand-in must join their collectives (:meth:`_rerun`)
        self.peers: tuple[Any, ...] = ()
        self.rejoin = True  # whether this step's failure came before any peer collective
        # regather: the buckets the stage's last real forward saved from (its backward gathers
        # them again; None: none ran yet, every bucket assumed)
        self.saved_buckets: frozenset[int] | None = None
        # torch's first-step shape inference is running this stage on inputs that are not
        # the batch's (zeros: :meth:`_on_synthetic`)
        self.synthetic = False
        # this step's stand-in guessed its output's shape (:meth:`_unsized`)
        self.guessed = False

    @contextlib.contextmanager
    def buffers_kept(self, keep: bool = True) -> Iterator[None]:
        """The stage's buffers (persistent or not) put back as they were before the block
        (``keep`` False: left as the block leaves them): torch's shape inference runs the
        stage's forward once more than the microbatches (the first stage on the first
        microbatch, the others on zeros), and its backward inference and a zero-bubble
        schedule's weight backward (but the first stage's, its whole backward) recompute
        what activation checkpointing recomputes once more than one process does; their
        in-place updates (BatchNorm's running statistics and counter) no step makes. Copied
        back in place with the buffer's version kept: torch's backward inference that follows
        runs through what this forward saved (BatchNorm saves its running statistics, whose
        values its training-mode backward does not read; that backward gives only shapes)."""
        if not keep:
            yield
            return
        kept = {n: b.detach().clone() for n, b in self.stage.named_buffers()}
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in kept.items():
                    buf = self.stage.get_buffer(name)
                    if buf.shape == value.shape and buf.dtype == value.dtype:
                        with torch.autograd._unsafe_preserve_version_counter(buf):
                            buf.copy_(value)
                    else:  # the forward reassigned it: the tensor it was before
                        owner, _, leaf = name.rpartition(".")
                        setattr(self.stage.get_submodule(owner), leaf, value)

    def parameters(self, recurse: bool = True):  # noqa: ARG002
        return iter([self.leaves[n] for n in self.names if n in self.leaves])  # none off a step

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        del recurse, remove_duplicate
        return iter([(prefix + n, self.leaves[n]) for n in self.names if n in self.leaves])

    def forward(self, *args: Any) -> Any:
        if self.regather is not None:
            return self.regather.call(self.names, lambda p: self._regathered(args, p))
        if self.synthetic and self.out_meta is None and self.error is None and not self.peers:
            sent = self._on_synthetic(args, {n: self.leaves[n] for n in self.names})
            if sent is not None:
                return sent
        if self.error is None:
            before = self._issued()
            sent = self._attempt(args, {n: self.leaves[n] for n in self.names})
            if sent is not None:
                return sent
            self.rejoin = self._issued() == before
            if not self.rejoin:
                warnings.warn(
                    f"pipeline stage {self.index} raised after its tensor / expert peers' "
                    "collectives began: they wait for the collective timeout\n" + self.error,
                    stacklevel=2,
                )
        # with peers, the stage itself joins their collectives; a stage the meta device
        # cannot run and that never gave an output is sized by that run
        if self.rejoin and (self.peers or self.out_meta is None):
            try:
                sent = self._rerun(args)
                if self.out_meta is None:
                    self.out_meta = optree.tree_map(as_meta, sent)
                return sent
            except Exception:  # noqa: BLE001 (the first failure is the one reported)
                self.rejoin = False
                if self.peers:
                    warnings.warn(
                        f"pipeline stage {self.index} raised again on zero inputs, so its "
                        "stand-in cannot join its tensor / expert peers' collectives: they "
                        "wait for the collective timeout\n" + self.error,
                        stacklevel=2,
                    )
        return self._stand_in(args)

    def _regathered(self, args: tuple, params: dict[str, torch.Tensor]) -> Any:
        """The stage on ``params`` gathered for this microbatch (``regather=True``); where it
        raises, a stand-in that saves one element of each gathered bucket, so that its
        backward gathers each bucket again as its data-parallel peers' backward does."""
        if self.error is None:
            run = self._on_synthetic if self.synthetic and self.out_meta is None else None
            sent = (run or self._attempt)(args, params)
            if sent is not None:
                self.saved_buckets = frozenset(self.regather.saved)
                return sent
        if self.out_meta is None and self.rejoin:  # sized by the stage run on zeros
            try:
                sent = self._rerun(args, params)
                self.out_meta = optree.tree_map(as_meta, sent)
                self.saved_buckets = frozenset(self.regather.saved)
                return sent
            except Exception:  # noqa: BLE001 (the first failure is the one reported)
                self.rejoin = False
        return self._stand_in(args, params)

    def _on_synthetic(self, args: tuple, params: dict[str, torch.Tensor]) -> Any:
        """A stage the meta device cannot run, in torch's first-step shape inference (its
        inputs zeros, not the batch's): where it raises on them (a check that rejects zeros:
        a padding-only row, a norm without epsilon), it runs again on a fixed standard
        normal, its output times zero, and only where that raises too is the error kept
        (None then). Not with tensor / expert peers (a retry would issue their collectives
        again: :meth:`forward`'s own rerun handles them)."""
        sent = self._attempt(args, params)
        if sent is None:
            first, self.error = self.error, None
            try:
                sent = self._rerun(args, params, normal=True)
            except Exception:  # noqa: BLE001 (the first failure is the one reported)
                self.error = first
                return None
            self.out_meta = optree.tree_map(as_meta, sent)
        return sent

    def regathered_buckets(self) -> list[int]:
        """The buckets this stage's backward gathers again (regather): those its last real
        forward saved from, or every bucket it uses before one ran."""
        if self.saved_buckets is not None:
            return sorted(self.saved_buckets)
        return sorted({self.regather.bucket_of[n] for n in self.names})

    def _attempt(self, args: tuple, params: dict[str, torch.Tensor]) -> Any:
        """The stage's output as sent, None where it raised (the error kept for the step's
        agreement)."""
        try:
            sent = _sendable(self._run(args, params), self.out_meta, self.index)
        except Exception:  # noqa: BLE001 (every rank is told, at the step's agreement)
            self.error = traceback.format_exc(limit=-3)
            return None
        if self.out_meta is None:  # the meta-device run failed: sized by this one
            self.out_meta = optree.tree_map(as_meta, sent)
        return sent

    def _run(self, args: tuple, params: dict[str, torch.Tensor]) -> Any:
        inputs = _stage_inputs(args, self.cast)
        wrapped = {n: self.wrap(n, t) for n, t in params.items()}
        self._hold(wrapped)
        if self.regather is None:  # the step's leaves: held until :meth:`release`
            return self.stage(*inputs)
        try:  # this microbatch's gathered params, for its forward only
            return self.stage(*inputs)
        finally:
            self._hold(self._absent(wrapped))

    def _absent(self, wrapped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the stage holds between its forwards under ``regather=True``: a placeholder
        per parameter, whose use (a recomputation in backward: activation checkpointing)
        raises naming it, where the stage's own parameters would give other gradients
        silently (the microbatch's gathered ones are gone by then)."""
        if self._placeholders is None:
            self._placeholders = {
                n: Absent(
                    tuple(t.shape),
                    t.dtype,
                    f"pipeline stage {self.index}: parameter {n!r} was read outside the "
                    "stage's forward under fs.Pipeline(regather=True), where its gathered "
                    "value is gone (activation checkpointing recomputes the forward in "
                    "backward); use regather=False (the default), which keeps the step's "
                    "parameters until the schedule ends",
                )
                for n, t in wrapped.items()
            }
        return self._placeholders

    def _hold(self, wrapped: dict[str, torch.Tensor]) -> None:
        """The step's leaves (as the model axis wraps them) put into the stage until
        :meth:`release`, not only while a forward runs: a recomputation in backward
        (``torch.utils.checkpoint``) sees them, not the stage's own parameters. Swapped
        again only where a wrapper differs from the one held (a DTensor per microbatch)."""
        if self._held is None:
            self._held = Swap(self.stage, wrapped, aliases=self._aliases, accessor=self._accessor)
        elif any(self._holding.get(n) is not t for n, t in wrapped.items()):
            self._held.replace(wrapped)
        self._holding = wrapped

    def release(self) -> None:
        """The stage's own parameters back in it (the step's schedule is over)."""
        held, self._held, self._holding = self._held, None, {}
        if held is not None:
            held.restore()

    def _issued(self) -> list[int]:
        """How many collectives this rank has issued on each peer group."""
        return [g._get_sequence_number_for_group() for g in self.peers]

    def _rerun(
        self, args: tuple, params: dict[str, torch.Tensor] | None = None, normal: bool = False
    ) -> Any:
        """The stand-in of a stage with tensor or expert peers, or of one whose output shape
        is not known yet (the meta device cannot run it): the stage itself on zero inputs,
        its output times zero, so that its forward and backward issue the collectives its
        peers wait in (the same, from the shapes alone: TP's and the experts'), and it hands
        on and back zeros."""
        zeroed = tuple(_fake_input(t, normal) if isinstance(t, torch.Tensor) else t for t in args)
        params = params if params is not None else {n: self.leaves[n] for n in self.names}
        out = self._run(zeroed, params)
        out = optree.tree_map(lambda t: t * 0 if t.is_floating_point() else t, out)
        return _sendable(out, self.out_meta, self.index)

    def fail(self, error: str) -> None:
        """Keeps the first failure of this step (a later forward then hands on the stand-in)."""
        if self.error is None:
            self.error = error

    def _stand_in(self, args: tuple, gathered: dict[str, torch.Tensor] | None = None) -> Any:
        """Zeros of the output's shape, in the graph of the inputs and leaves (so that the
        schedule's backward runs and sends zeros back, contiguous: not the expanded zeros
        of a sum's gradient, by which torch would size the previous stage's buffers). Under
        ``regather``, ``gathered`` (this microbatch's params): the leaves' zero gradients
        come through them, and one element of each bucket, in bucket order, is saved for
        backward (each multiplied into a chain from an input's element, or squared where no
        input requires grad, so that backward unpacks them last bucket first, as a stage
        using its buckets in order does): its re-gathers. The chain lies on the inputs'
        path, so torch's backward to the inputs alone (its first-step shape inference)
        gathers them too, as a real stage's does for the weights its input gradient reads."""
        args = _stage_inputs(args, None)
        leaves = [] if gathered is not None else list(self.leaves.values())
        anchor = sum(
            # (t * 0).sum(), not t.sum() * 0: each input and leaf gets a dense zero gradient,
            # not a sum's expanded one (zero-bubble schedules add into .grad in place)
            ((t * 0).sum() for t in [*args, *leaves] if _differentiable(t)),
            torch.zeros((), device=_device(args, self.leaves)),
        )
        if gathered is not None and self.regather is not None:
            one: dict[int, torch.Tensor] = {}
            saves = set(self.regathered_buckets())
            for name, t in gathered.items():
                bucket = self.regather.bucket_of[name]
                if t.numel() and bucket in saves:
                    one.setdefault(bucket, t[(0,) * t.dim()])
            chain = next((t.reshape(-1)[0] * 0 for t in args if _differentiable(t)), None)
            for bucket in sorted(one):  # a product saves both (one: a gathered buffer's view)
                if chain is None:
                    anchor = anchor + (one[bucket] * one[bucket]).to(anchor.dtype) * 0
                else:
                    chain = chain.to(one[bucket].dtype) * one[bucket]
            if chain is not None:
                anchor = anchor + chain.to(anchor.dtype)
        meta = self.out_meta
        if meta is None:
            meta, self.guessed = self._unsized(args), True
        return optree.tree_map(
            lambda m: (
                torch.zeros(m.shape, dtype=m.dtype, device=anchor.device) + anchor.to(m.dtype)
                if m.is_floating_point()
                else torch.zeros(m.shape, dtype=m.dtype, device=anchor.device)
            ),
            meta,
        )

    def _unsized(self, args: tuple) -> torch.Tensor:
        """The stand-in's shape where the stage's output shape is unknown (it never gave an
        output: the meta device could not run it, nor could it run on zeros; a stage raising
        on every input, or on one rank alone, in its first step): its first input's, in
        floating point. torch's first-step shape inference hands that shape on, so every
        stage after it runs and the schedule ends on every rank (the step fails on all);
        the next step infers the shapes again (:meth:`PipelineRun.agree`)."""
        first = next(t for t in optree.tree_leaves(args) if isinstance(t, torch.Tensor))
        dtype = first.dtype if first.is_floating_point() else (self.cast or torch.float32)
        return torch.empty(first.shape, dtype=dtype, device="meta")


def _fake_input(t: torch.Tensor, normal: bool) -> torch.Tensor:
    """A stand-in's input for ``t``: zeros (``normal``: a standard normal, the same on every
    rank and call, for floating point), in ``t``'s graph where it is floating point (its
    gradient then zeros)."""
    if not t.is_floating_point():
        return torch.zeros_like(t)
    if not normal:
        return t * 0
    g = torch.Generator().manual_seed(0)
    return t * 0 + torch.randn(t.shape, generator=g).to(t.device, t.dtype)


def _plain(name: str, local: torch.Tensor) -> torch.Tensor:
    del name
    return local


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _device(args: tuple, leaves: dict[str, torch.Tensor]) -> torch.device:
    for t in [*args, *leaves.values()]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def propagate(stages: list[nn.Module], x: tuple, policy: MixedPrecisionPolicy) -> list[Any]:
    """Each stage's output for one microbatch, as meta tensors (None from the first stage
    that cannot run on the meta device on): its parameters in their compute dtypes and its
    inputs cast, as :class:`StageModule` runs it."""
    out: list[Any] = []
    with torch.no_grad():
        for stage in stages:
            if x is None:
                out.append(None)
                continue
            params = {
                n: as_meta(p).to(policy.resolve(p.dtype).compute)
                for n, p in stage.named_parameters()
            }
            params.update({n: as_meta(b) for n, b in stage.named_buffers()})
            try:
                y = torch.func.functional_call(stage, params, _stage_inputs(x, policy.param_dtype))
            except Exception:  # noqa: BLE001 (no stand-in for it: the collective timeout)
                y = None
            out.append(y)
            x = None if y is None else (y if isinstance(y, tuple) else (y,))
    return out
