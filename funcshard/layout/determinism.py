"""Layout-independent reductions: what ``fs.init(..., deterministic=True)`` runs (the pure
math; the collectives are :class:`funcshard.comm.wires.TreeWire`'s and
:class:`funcshard.step.reduction.TreeReduction`'s).

A step's global batch is split into G = dp_size * microbatches equal gradient chunks; chunk
``c = dp_index * microbatches + m`` (``dp_index = replicate * shard_size + shard``) holds the
same rows whichever layout runs it, and its gradient is computed from the same bits. What
normally depends on the layout is the ORDER of the floating-point sums over the chunks, over
the rows of the norm and over the losses. Here every such sum follows one tree fixed by the
chunk or row index alone:

* gradients: the adjacent pairwise tree over ``c`` (``((c0+c1)+(c2+c3))...``). A rank's
  microbatches form its lowest subtrees (:class:`PairwiseSum`, a binary counter), the shard
  axis the next levels (:class:`funcshard.comm.wires.TreeWire`: an all-to-all of rank blocks,
  then the same tree over the blocks locally), the replicate axis the top ones (that
  reduce-scatter and an all-gather). Both move exactly the bytes of the ring collectives
  they replace, and since ``a + b == b + a`` bitwise only the tree's shape matters, not which
  rank adds. The 1/G scaling is a power of two, hence exact wherever it happens.
* the global norm (:func:`row_sums`, :func:`norm_of_rows`): rows are never split between
  ranks, so each row's sum of squares (fp64, exact squares, a halving tree over its columns)
  is the same on every layout; the row sums are all-gathered over the shard axis and summed
  in parameter order by one halving tree.
* the loss (:meth:`funcshard.step.reduction.TreeReduction.mean_loss`): every chunk's loss is
  all-gathered and summed by a tree.

A chunk's gradient must come from the same bits too, and CPU kernels round differently at
another alignment of the same values, while a leaf's offset in a full buffer follows the
padding, hence the shard count: a deterministic layout pads every leaf's shard to a multiple
of ``build.DETERMINISTIC_ALIGN`` elements (whole rows), so each leaf starts aligned.

With G > 1 microbatches under ``optim_grads`` / ``optim_grads_params`` the microbatch
subtrees come before the shard levels, so a rank keeps its microbatches' unreduced gradients
(log2(microbatches) full-size partial sums at most) and reduce-scatters once per step,
instead of reduce-scattering every microbatch into its shard. The last microbatch completes
each bucket's sum (:meth:`PairwiseSum.total`) as soon as backward is done with the bucket and
starts its reduce-scatter then, overlapped with the rest of backward, as the default does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from funcshard.layout.layout import Layout

__all__ = [
    "PairwiseSum",
    "pairwise_sum",
    "halving_sum",
    "row_sums",
    "norm_of_rows",
    "check_microbatches",
]

# Elements of one fp64 slab of the norm's row sums (bounds its temporary memory).
_NORM_SLAB = 1 << 22


def check_microbatches(dp_size: int, microbatches: int) -> None:
    """Raises unless G = dp_size * microbatches is a power of two."""
    g = dp_size * microbatches
    if g & (g - 1):
        raise ValueError(
            f"deterministic=True: dp_size * microbatches = {dp_size} * "
            f"{microbatches} = {g} gradient chunks; it must be a power of two"
        )


def pairwise_sum(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((x0 + x1) + (x2 + x3)) + ...``: adjacent pairs, level by level (a new tensor)."""
    if not xs:
        raise ValueError("pairwise_sum of nothing")
    level = list(xs)
    while len(level) > 1:
        nxt = [a + b for a, b in zip(level[0::2], level[1::2], strict=False)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0] if len(xs) > 1 else level[0].clone()


def halving_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by a fixed tree: zero-pad to a power of two, add the halves, repeat.

    Every step is an elementwise add, so the bits depend on the values and the length of
    ``dim`` only: not on the other dims, threads, vector width or memory alignment.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


class PairwiseSum:
    """Adds per-bucket values one microbatch at a time in the adjacent pairwise tree.

    A binary counter: two partial sums of the same level merge at once, so at most
    log2(count) + 1 are held. With a power-of-two count the result is ``pairwise_sum`` of the
    values in the order they came. ``None`` (a bucket no gradient reached) adds nothing.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, list[torch.Tensor | None]]] = []

    def add(self, values: Sequence[torch.Tensor | None]) -> None:
        level, values = 0, list(values)
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            values = [_add(a, b) for a, b in zip(left, values, strict=True)]
            level += 1
        self._stack.append((level, values))

    def result(self) -> list[torch.Tensor | None]:
        if not self._stack:
            raise ValueError("PairwiseSum: nothing was added")
        *rest, (_, out) = self._stack
        for _, left in reversed(rest):
            out = [_add(a, b) for a, b in zip(left, out, strict=True)]
        return out

    def total(self, index: int, last: torch.Tensor | None) -> torch.Tensor | None:
        """``add`` of a last value, then ``result()[index]``, for one entry alone: the same
        additions in the same order, so the same bits. Consumes that entry's partial sums
        (call it once per index, after the last ``add``); the other entries are untouched."""
        value, level, stack = last, 0, list(self._stack)
        while stack and stack[-1][0] == level:
            value = _add(stack.pop()[1][index], value)
            level += 1
        for _, left in reversed(stack):
            value = _add(left[index], value)
        return value


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return a.add_(b)  # a is a partial sum this accumulator owns


def _row_sums(flat: torch.Tensor, spec) -> torch.Tensor:
    """Sums of squares (fp64) of this rank's padded rows of one leaf inside a bucket flat."""
    rows = flat[spec.offset : spec.offset + spec.shard_numel].view(
        spec.rows_per_shard, spec.row_numel
    )
    step = max(1, _NORM_SLAB // max(1, spec.row_numel))
    return torch.cat(
        [
            halving_sum(rows[i : i + step].double().square())
            for i in range(0, max(1, spec.rows_per_shard), step)
        ]
    )


def row_sums(
    layout: Layout, grads: list[torch.Tensor], *, experts: bool = False
) -> torch.Tensor | None:
    """This rank's sums of squares of its rows of every leaf (fp64, parameter order; None: no
    leaves); a row's sum is the same bits on every layout. ``experts``: of the expert
    buckets' leaves instead of the others'."""
    local = []
    for bucket, g in zip(layout.buckets, grads, strict=True):
        if bucket.expert != experts:
            continue
        g = g.to(layout.device)
        local.extend(_row_sums(g, spec) for spec in layout.bucket_leaves(bucket))
    return torch.cat(local) if local else None


def norm_of_rows(
    layout: Layout,
    sums: torch.Tensor | None,
    counts: Callable[[str], bool] | None = None,
    expert_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """The squared L2 norm (0-d fp64) from every shard's :func:`row_sums` in shard order: every
    real row in parameter order, summed by :func:`halving_sum`; padding rows are dropped, so
    they never count, and so are the leaves ``counts(name)`` leaves out (tensor parallel: a
    replicated leaf counts on one tensor rank). ``expert_sums``: the expert leaves' row sums
    of every expert rank (dim 0, in expert order) and every shard of its expert index (each
    expert rank's experts are consecutive global rows)."""
    where, at = {}, [0, 0]  # columns of a leaf among its kind's (dense, expert) row sums
    for bucket in layout.buckets:
        for spec in layout.bucket_leaves(bucket):
            where[spec.name] = at[bucket.expert]
            at[bucket.expert] += spec.rows_per_shard
    dense = None if sums is None else sums.view(layout.shard_size, at[0])
    experts = None
    if expert_sums is not None:
        experts = expert_sums.view(expert_sums.shape[0], layout.experts_view.shard_size, at[1])

    def real(s) -> torch.Tensor:
        if layout.buckets[s.bucket].expert:
            cols = experts[:, :, where[s.name] : where[s.name] + s.rows_per_shard]
            return cols.reshape(cols.shape[0], -1)[:, : s.rows].reshape(-1)
        return dense[:, where[s.name] : where[s.name] + s.rows_per_shard].reshape(-1)[: s.rows]

    rows = [real(s) for s in layout.leaves if counts is None or counts(s.name)]
    if not rows:
        return torch.zeros((), dtype=torch.float64, device=layout.device)
    return halving_sum(torch.cat(rows))
