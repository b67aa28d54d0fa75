"""``fs.ContextParallel``: long sequences split across the ranks of the mesh's "context" axis.

The seam is one call in ``train_step`` (:meth:`ContextGroup.apply`): it keeps this rank's
part of every sequence leaf of the batch (chunk ``c`` of ``C``, or the head-tail pair ``c``
and ``2C - 1 - c`` of ``2C`` when load balanced, so each rank does equal causal attention
work) and hands back a ``loss_fn`` inside which every
``torch.nn.functional.scaled_dot_product_attention`` call attends over the whole sequence
(:mod:`funcshard.parallel.attention`). The rest of the engine sees a data-parallel group of
``shard x context`` ranks (``fs.make_mesh(context=C)``: "shard" is the flattened
"shard_outer" x "context"), which shards the parameters over both and averages the
gradients over both: with equal tokens per rank, the mean of the ranks' mean losses is the
global mean, and attention's backward carries the gradients across the context group.

A state without context parallelism holds :data:`NO_CONTEXT`, which changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from funcshard.distributed import mesh as mesh_lib
from funcshard.parallel import attention as attention_lib
from funcshard.parallel.attention import Chunks
from funcshard.parallel.batch import leaf_paths

__all__ = ["ContextParallel", "ContextGroup", "NO_CONTEXT", "bind", "ALGORITHMS"]

ALGORITHMS = ("all_to_all", "ring")

LossFn = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ContextParallel:
    """How ``train_step`` splits sequences over the mesh's "context" axis.

    Args:
      seq_dims: batch leaf (its path, "/"-joined for nested batches) -> its sequence dim.
        Every rank of a context group passes the same batch; the step keeps this rank's part
        of each named leaf (tokens, labels, positions).
      algorithm: "all_to_all" (DeepSpeed-Ulysses: heads divisible by C) or "ring".
      load_balance: the causal head-tail split (chunks ``c`` and ``2C - 1 - c`` of ``2C``);
        False: chunk ``c`` of ``C``.
      buffers: model buffer name -> its sequence dim (positions, RoPE tables): during
        ``loss_fn`` the buffer is sliced to ``[0, L)`` and split as the batch is.

    >>> ContextParallel(seq_dims={"tokens": 1}).algorithm
    'all_to_all'
    """

    seq_dims: Mapping[str, int]
    algorithm: str = "all_to_all"
    load_balance: bool = True
    buffers: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"ContextParallel: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"
            )
        for field in ("seq_dims", "buffers"):
            given = getattr(self, field)
            if not isinstance(given, Mapping):
                raise TypeError(f"ContextParallel: {field} must be a mapping name -> dim")
            for name, dim in given.items():
                if not isinstance(dim, int) or isinstance(dim, bool):
                    raise TypeError(
                        f"ContextParallel: {field}[{name!r}] must be an int dim, got {dim!r}"
                    )
            object.__setattr__(self, field, dict(given))
        if not self.seq_dims:
            raise ValueError("ContextParallel: seq_dims names no batch leaf to split")


class _NoContext:
    """The context of a state without context parallelism: the batch and loss_fn as given."""

    size = 1
    cp = None

    def apply(self, batch: Any, loss_fn: LossFn) -> tuple[Any, LossFn]:
        return batch, loss_fn

    def __repr__(self) -> str:
        return "NO_CONTEXT"


NO_CONTEXT = _NoContext()


def bind(cp: ContextParallel | None, mesh: DeviceMesh, model: nn.Module) -> Any:
    """``cp`` on ``mesh``'s context axis (``fs.init``'s ``context=``), or :data:`NO_CONTEXT`.

    A mesh without a context axis is a context group of one rank: the batch's sequence leaves
    are checked, nothing is split.

    Raises:
      TypeError: ``cp`` is not an ``fs.ContextParallel``.
      ValueError: a ``buffers`` name the model has no buffer of.
    """
    if cp is None:
        return NO_CONTEXT
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"init: context must be an fs.ContextParallel, got {type(cp).__name__}")
    for name in cp.buffers:
        try:
            model.get_buffer(name)
        except AttributeError:
            raise ValueError(
                f"ContextParallel: buffers names {name!r}, which the model has no buffer of"
            ) from None
    axis = mesh_lib.context_axis(mesh)
    if axis is None:
        return ContextGroup(cp, None, 1, 0, model)
    return ContextGroup(cp, axis.get_group(), axis.size(), axis.get_local_rank(), model)


class ContextGroup:
    """A :class:`ContextParallel` bound to this rank's context group (``size`` ranks, this one
    ``rank``) and the model whose ``cp.buffers`` it splits."""

    def __init__(
        self,
        cp: ContextParallel,
        group: dist.ProcessGroup | None,
        size: int,
        rank: int,
        model: nn.Module,
    ) -> None:
        self.cp, self.group, self.size, self.rank = cp, group, size, rank
        self.chunks = Chunks(size, cp.load_balance)
        self.model = model

    def __repr__(self) -> str:
        return f"ContextGroup({self.cp}, size={self.size}, rank={self.rank})"

    def apply(self, batch: Any, loss_fn: LossFn) -> tuple[Any, LossFn]:
        """This rank's part of ``batch`` and ``loss_fn`` attending over whole sequences.

        Raises:
          ValueError: a ``seq_dims`` leaf missing from the batch, without that dim, or of a
            length not divisible by C (2C load balanced), or the leaves' lengths differ: on
            every rank of the group alike, before any collective.
        """
        length = self._seq_len(batch)
        if self.size == 1:
            return batch, loss_fn
        paths = leaf_paths(batch)
        leaves, treedef = optree.tree_flatten(batch)
        parts = [
            self._part(leaf, self.cp.seq_dims[path]) if path in self.cp.seq_dims else leaf
            for path, leaf in zip(paths, leaves, strict=True)
        ]
        local = optree.tree_unflatten(treedef, parts)

        def attending(params: Any, mb: Any) -> Any:
            with self._buffers_split(length), _SplitAttention(self, length // self.size):
                return loss_fn(params, mb)

        return local, attending

    def _seq_len(self, batch: Any) -> int:
        leaves = dict(zip(leaf_paths(batch), optree.tree_leaves(batch), strict=True))
        lengths = {}
        for path, dim in self.cp.seq_dims.items():
            leaf = leaves.get(path)
            if not isinstance(leaf, torch.Tensor):
                raise ValueError(
                    f"ContextParallel: seq_dims leaf {path!r} is missing from the batch "
                    f"(its tensor leaves: {sorted(p for p, t in leaves.items() if _is_t(t))})"
                )
            if not -leaf.dim() <= dim < leaf.dim():
                raise ValueError(
                    f"ContextParallel: seq_dims leaf {path!r} has no dim {dim} "
                    f"(shape {tuple(leaf.shape)})"
                )
            lengths[path] = leaf.shape[dim]
        count = self.chunks.count
        for path, length in lengths.items():
            if self.size > 1 and length % count:
                how = f"2 x context = {count} (load_balance)" if self.chunks.balanced else count
                raise ValueError(
                    f"ContextParallel: seq_dims leaf {path!r} has sequence length {length}, "
                    f"not divisible by {how}"
                )
        if len(set(lengths.values())) > 1:
            raise ValueError(f"ContextParallel: the seq_dims leaves' lengths differ: {lengths}")
        return next(iter(lengths.values()))

    def _part(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunks of ``full`` along ``dim``, in the order it holds them."""
        size = full.shape[dim] // self.chunks.count
        pieces = [full.narrow(dim, c * size, size) for c in self.chunks.of(self.rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    @contextlib.contextmanager
    def _buffers_split(self, length: int) -> Iterator[None]:
        """Each of ``cp.buffers`` sliced to ``[0, length)`` and split, while ``loss_fn`` runs."""
        kept = []
        try:
            for name, dim in self.cp.buffers.items():
                owner_name, _, attr = name.rpartition(".")
                owner = self.model.get_submodule(owner_name)
                full = getattr(owner, attr)  # a buffer: setattr writes it back
                if full.shape[dim] < length:
                    raise ValueError(
                        f"ContextParallel: buffer {name!r} has {full.shape[dim]} positions "
                        f"along dim {dim}, fewer than the sequence length {length}"
                    )
                kept.append((owner, attr, full))
                setattr(owner, attr, self._part(full.narrow(dim, 0, length), dim))
            yield
        finally:
            for owner, attr, full in kept:
                setattr(owner, attr, full)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention`` of this rank's query chunks over the whole
        sequence (the arguments are SDPA's).

        Raises:
          ValueError: an ``attn_mask`` (causal or none only), ``enable_gqa``, tensors not
            ``(B, H, L / C, D)``, heads not divisible by C under "all_to_all", or dropout under
            "ring"; alike on every rank, before the exchange.
        """
        algorithm = self.cp.algorithm
        if attn_mask is not None:
            raise ValueError(
                "ContextParallel: scaled_dot_product_attention got an attn_mask; under context "
                "parallel only is_causal=True or no mask is supported"
            )
        if enable_gqa:
            raise ValueError("ContextParallel: enable_gqa is not supported under context parallel")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(
                    f"ContextParallel: attention's {name} must be (batch, heads, seq, dim), "
                    f"got shape {tuple(t.shape)}"
                )
            if algorithm == "all_to_all" and t.shape[1] % self.size:
                raise ValueError(
                    f"ContextParallel: attention's {name} has {t.shape[1]} heads, not "
                    f"divisible by context={self.size} (algorithm='all_to_all')"
                )
        if algorithm == "all_to_all":
            return attention_lib.all_to_all(
                query,
                key,
                value,
                chunks=self.chunks,
                group=self.group,
                is_causal=is_causal,
                dropout_p=dropout_p,
                scale=scale,
            )
        if dropout_p:
            raise ValueError(
                f"ContextParallel: dropout_p={dropout_p} in attention is not supported by "
                "algorithm='ring'"
            )
        return attention_lib.ring(
            query,
            key,
            value,
            chunks=self.chunks,
            group=self.group,
            is_causal=is_causal,
            scale=scale,
        )


class _SplitAttention(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to the context group's algorithm while
    ``loss_fn`` runs; every other function runs as called."""

    def __init__(self, context: ContextGroup, local: int) -> None:
        super().__init__()
        self.context, self.local = context, local

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value")[len(args[:3]) :]
            qkv = (*args[:3], *(kwargs[n] for n in names if n in kwargs))
            _check_parts(qkv, self.local, self.context.cp.algorithm)
            return self.context.attention(*args, **kwargs)
        return func(*args, **kwargs)


def _check_parts(qkv: tuple[torch.Tensor, ...], local: int, algorithm: str) -> None:
    """q, k and v are this rank's ``local`` positions of the sequence, of one batch and one
    head count (ValueError otherwise, before any exchange: a shape error inside the exchange
    would leave its sends posted and the group's next exchange waiting)."""
    names = ("query", "key", "value")
    for name, t in zip(names, qkv, strict=False):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return  # attention() names it
        if t.shape[2] != local:
            raise ValueError(
                f"ContextParallel: attention's {name} has {t.shape[2]} positions (shape "
                f"{tuple(t.shape)}), not this rank's {local} of the split sequence: q, k and v "
                "must be split as the batch is (attention to an unsplit memory, or to tokens "
                "added inside the model, is not supported)"
            )
    if len(qkv) < 3:
        return
    q, k, v = qkv
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[3] == k.shape[3]):
        raise ValueError(
            f"ContextParallel: attention's query {tuple(q.shape)}, key {tuple(k.shape)} and "
            f"value {tuple(v.shape)} must share batch and heads (fewer k, v heads are not "
            "supported) and q, k their head dim"
        )
    if algorithm == "ring" and v.shape[3] != q.shape[3]:
        raise ValueError(
            f"ContextParallel: attention's value head dim {v.shape[3]} differs from the "
            f"query's {q.shape[3]}: not supported by algorithm='ring' (all_to_all takes it)"
        )


def _is_t(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
