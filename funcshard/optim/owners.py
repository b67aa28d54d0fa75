"""Who orthogonalizes which matrix of ``fs.optim.muon``, and what that moves (``fs.plan``).

Owners are assigned from shapes alone (the model's: under tensor parallelism the GLOBAL
shapes, so every tensor rank gives a matrix the same owner index), balancing Newton-Schulz
FLOPs; the owners work in rounds (their k-th matrices in round k). :func:`exchange_plan`
counts the bytes of :mod:`funcshard.optim.matrices`' exchange as ``fs.comm_stats`` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["ns_flops", "assign_owners", "order", "rounds_of", "ExchangePlan", "exchange_plan"]


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """Multiply-add FLOPs of ``steps`` Newton-Schulz iterations on a matrix of ``shape`` (or
    on each of the matrices a 3-D ``shape`` stacks on dim 0: experts)."""
    *stacked, a, b = shape
    n, m = sorted((a, b))
    return math.prod(stacked) * steps * (4 * n * n * m + 2 * n**3)


def assign_owners(shapes: Sequence[Sequence[int]], size: int, steps: int = 5) -> list[int]:
    """An owner rank per matrix, balancing Newton-Schulz FLOPs (largest first, each to the least
    loaded rank; ties to the lower rank). The same on every rank: it reads shapes only."""
    owners = [0] * len(shapes)
    load = [0] * size
    for i in order(shapes, steps):
        rank = min(range(size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += ns_flops(shapes[i], steps)
    return owners


def order(shapes: Sequence[Sequence[int]], steps: int) -> list[int]:
    """Matrix indices, the most FLOPs first (ties by index)."""
    return sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i], steps), i))


def rounds_of(owners: list[int], size: int, ordered: list[int]) -> list[list[int | None]]:
    """Round k holds, per owner rank, its k-th matrix (or None)."""
    per_owner: list[list[int]] = [[] for _ in range(size)]
    for i in ordered:
        per_owner[owners[i]].append(i)
    n = max((len(x) for x in per_owner), default=0)
    return [[x[k] if k < len(x) else None for x in per_owner] for k in range(n)]


@dataclasses.dataclass(frozen=True, slots=True)
class ExchangePlan:
    """Per-rank traffic and owner memory of one update, from shapes alone (``fs.plan``).

    Per shard rank, the busiest rank of that shard index over the replicas."""

    sent_bytes: tuple[int, ...]  # every "muon" byte (the parts below included)
    owner_bytes: tuple[int, ...]  # the most whole-matrix bytes held at once
    rounds: int  # of all-to-alls (two each), in the busiest replica
    gathers: int = 0  # all-gathers over the replicas (0 or 1)
    gather_bytes: tuple[int, ...] = ()  # the part of sent_bytes gathered over the replicas
    tensor_bytes: tuple[int, ...] = ()  # the part of sent_bytes gathered over "tensor"
    calls: int = 0  # collectives of the busiest rank

    @property
    def shard_bytes(self) -> tuple[int, ...]:
        """The all-to-alls within the shard group."""
        extra = zip(self.gather_bytes or self.zeros, self.tensor_bytes or self.zeros, strict=True)
        return tuple(s - g - t for s, (g, t) in zip(self.sent_bytes, extra, strict=True))

    @property
    def zeros(self) -> tuple[int, ...]:
        return (0,) * len(self.sent_bytes)


# A matrix of the plan: (its shape in the buffers, its row range per shard rank) and, under
# tensor parallelism, (the model's shape, elements of its all-gather over "tensor", 0: none).
PlannedMatrix = tuple


def exchange_plan(
    matrices: Sequence[PlannedMatrix], size: int, steps: int = 5, replicas: int = 1
) -> ExchangePlan:
    """Bytes of the owner-computes exchange for ``(shape, row ranges per rank[, full shape,
    tensor gather numel])`` matrices, on the busiest rank of each shard rank: with
    ``replicas`` > 1, each replica's share within its shard group, then the all-gather of the
    results over the replicas. An owner of a matrix split over "tensor" all-gathers it there
    (bfloat16) before it orthogonalizes it."""
    matrices = [m if len(m) == 4 else (*m, m[0], 0) for m in matrices]
    if replicas == 1:
        return _exchange_within(matrices, size, steps)
    share = assign_owners([m[2] for m in matrices], replicas, steps)
    parts = [[m for m, q in zip(matrices, share, strict=True) if q == r] for r in range(replicas)]
    within = [_exchange_within(part, size, steps) for part in parts]
    rows_numel = lambda part, r: sum((m[1][r][1] - m[1][r][0]) * m[0][1] for m in part)
    gather = [replicas * 2 * max(rows_numel(part, r) for part in parts) for r in range(size)]
    gathers = int(max(gather) > 0)
    return ExchangePlan(
        tuple(max(w.sent_bytes[r] for w in within) + gather[r] for r in range(size)),
        tuple(max(w.owner_bytes[r] for w in within) for r in range(size)),
        max(w.rounds for w in within),
        gathers=gathers,
        gather_bytes=tuple(gather),
        tensor_bytes=tuple(max(w.tensor_bytes[r] for w in within) for r in range(size)),
        calls=max(w.calls for w in within) + gathers,
    )


def _exchange_within(matrices: Sequence[PlannedMatrix], size: int, steps: int) -> ExchangePlan:
    """``exchange_plan`` of one shard group (only the tensor gathers when it is one rank)."""
    sent, held, tensor, tcalls = [0] * size, [0] * size, [0] * size, [0] * size
    if size == 1:
        tensor[0] = sum(2 * m[3] for m in matrices)
        calls = sum(m[3] > 0 for m in matrices)
        return ExchangePlan(tuple(tensor), (0,), 0, tensor_bytes=tuple(tensor), calls=calls)
    shapes, fulls = [m[0] for m in matrices], [m[2] for m in matrices]
    rounds = rounds_of(assign_owners(fulls, size, steps), size, order(fulls, steps))
    for k, rnd in enumerate(rounds):
        for o, i in enumerate(rnd):
            if i is None:
                continue
            (_, cols), rows, full, gathered = matrices[i]
            for r, (a, b) in enumerate(rows):
                sent[r] += 2 * (b - a) * cols  # rows to the owner, bf16
            sent[o] += 2 * math.prod(shapes[i])  # the result back, bf16
            tensor[o] += 2 * gathered  # the full matrix over "tensor", bf16
            tcalls[o] += gathered > 0
            nxt = rounds[k + 1][o] if k + 1 < len(rounds) else None
            whole = 2 * math.prod(full) + (2 * math.prod(shapes[nxt]) if nxt is not None else 0)
            n, m = sorted(full)
            workspace = 2 * (2 * n * n + 2 * n * m)  # gram, its update, the next iterate (bf16)
            held[o] = max(held[o], whole + workspace)
    return ExchangePlan(
        tuple(s + t for s, t in zip(sent, tensor, strict=True)),
        tuple(held),
        len(rounds),
        tensor_bytes=tuple(tensor),
        calls=2 * len(rounds) + max(tcalls),
    )
