"""``muon``: torch.optim.Muon's update on sharded state, each matrix orthogonalized whole.

Muon orthogonalizes each 2-D update with a Newton-Schulz iteration, which needs the WHOLE
matrix, while a TrainState keeps row shards of flat buckets. Owner-computes: every matrix gets
one owner rank of the "shard" group (balanced by Newton-Schulz FLOPs); each rank sends the owner
its rows of the momentum-updated gradient, the owner orthogonalizes the full matrix and sends
every rank back its rows. Only those rows move (two all-to-alls per round, in bfloat16, which is
what the iteration reads and returns anyway, so nothing is lost on the wire), and the exchange of
round k+1 is in flight while the owners work on round k.

Replicas hold the same rows of the same matrices: on a 2-D mesh (and under ``no_shard``, where
every rank is a replica) they share the matrices out by FLOPs, each runs owner-computes on its
share within its shard group, and one all-gather over the replicas hands every rank its rows
of the other shares.

Under tensor parallelism a matrix split over "tensor" is a local shard of a larger one. Owners
are assigned from the GLOBAL shapes, so each tensor rank's data-parallel group gives a matrix the
same owner index: the T owners of its shards form one tensor group. Each gathers its local
matrix as above, they all-gather it over "tensor" along the split dim (bfloat16), every one
orthogonalizes the full matrix (the same bits) and keeps its own shard.

A 3-D parameter stacks experts on dim 0, ``(num_experts, m, n)``: each expert's matrix is
orthogonalized as its own (as torch.optim.Muon would the experts as separate parameters). Its
rows are experts, so a shard holds whole experts: the owner gathers the leaf's rows like a
matrix's and runs Newton-Schulz per expert; an expert-parallel rank's experts are whole on it,
so nothing is gathered over "expert" (the expert buckets have their own placement, their
groups: :meth:`funcshard.layout.layout.Placement.of`).

Everything else of the update (momentum, Nesterov, weight decay, the step itself) is elementwise
and runs on the local rows, exactly as torch does it on the whole tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import optree
import torch

from funcshard.distributed import ops as collectives
from funcshard.layout.buckets import NAMESPACE, Members
from funcshard.optim.base import Optimizer, PyTree, Schedule, leaf_params, not_negative
from funcshard.optim.moments import decode_flat, encode_flat
from funcshard.optim.owners import assign_owners, exchange_plan, ns_flops, order, rounds_of
from funcshard.optim.spec import Buffers, Moments, Scalars, Spec, build
from funcshard.parallel.axis import NO_AXIS

if TYPE_CHECKING:
    from funcshard.layout.layout import Placement

__all__ = ["MuonState", "muon", "newton_schulz", "ns_flops", "assign_owners", "exchange_plan"]

KIND = "muon"  # fs.comm_stats() kind of the exchange


class MuonState(NamedTuple):
    count: int
    momentum: PyTree
    momentum_scale: PyTree = None  # mu_dtype=torch.int8: the blocks' fp32 scales


def newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The orthogonalization of one whole matrix, exactly as torch.optim.Muon computes it
    (bfloat16; a tall matrix is worked on transposed). Returns a contiguous bfloat16 matrix of
    ``update``'s shape."""
    if update.dim() != 2:
        raise ValueError(f"newton_schulz: expected a 2-D matrix, got shape {tuple(update.shape)}")
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return (x.T if tall else x).contiguous()


@dataclasses.dataclass(frozen=True, slots=True)
class _Matrix:
    name: str
    shape: tuple[int, int]  # what this rank's buffers hold (a tensor-parallel local shard)
    rows: tuple[tuple[int, int], ...]  # [start, stop) per shard rank
    update: torch.Tensor | None  # this rank's rows (rows, cols), set for the live step
    full: tuple[int, int]  # the model's shape: owners, learning rate


def _leaf_members(tree: PyTree) -> list[Members | None]:
    paths, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False, namespace=NAMESPACE)
    return [p[-1] if p and isinstance(p[-1], Members) else None for p in paths]


def _check_2d(tree: PyTree) -> None:
    bad = [
        (name, shape)
        for pairs in leaf_params(tree)
        for name, shape in pairs
        if len(shape) not in (2, 3)
    ]
    if bad:
        name, shape = bad[0]
        raise ValueError(
            f"muon: parameter {name!r} has shape {shape}; Muon orthogonalizes 2-D "
            "matrices, and each matrix of a 3-D parameter stacking experts on dim 0, only "
            f"(give {[n for n, _ in bad]} to another optimizer, e.g. "
            "fs.optim.multi_transform({'muon': muon(...), 'adamw': adamw(...)}, "
            "labels))"
        )


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    a, b = shape[-2:]  # one matrix's (an expert's, of a 3-D parameter)
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    return lr * 0.2 * math.sqrt(max(a, b))  # "match_rms_adamw"


def muon(
    lr: float | Schedule = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
    *,
    owner_computes: bool = True,
    mu_dtype: torch.dtype | None = None,
) -> Optimizer:
    """torch.optim.Muon's update for 2-D parameters (and 3-D ones stacking experts on dim 0,
    each expert's matrix on its own), as a pure optimizer.

    Per matrix: ``buf.lerp_(g, 1 - momentum)``; the update is ``g.lerp(buf, momentum)``
    (Nesterov) or ``buf``; ``O`` its Newton-Schulz orthogonalization (bfloat16);
    ``p *= 1 - lr * weight_decay``; ``p -= adjusted_lr * O`` with ``adjusted_lr = lr *
    sqrt(max(1, rows / cols))`` ("original") or ``0.2 * lr * sqrt(max(rows, cols))``
    ("match_rms_adamw").

    On a TrainState each matrix is orthogonalized whole by one owner rank of the "shard" group
    (see the module docstring), and replicas (the "replicate" axis; every rank under
    ``no_shard``) share the matrices out and all-gather the results, so each matrix is
    orthogonalized once in the whole world. Offloaded Muon buckets work too: their rows go to
    the owner over the state's device and come back to the CPU.

    Args:
      lr: a float or a schedule ``step -> float``.
      weight_decay, momentum, nesterov, ns_steps, ns_coefficients, eps, adjust_lr_fn: as
        ``torch.optim.Muon``.
      owner_computes: False makes every rank gather every whole matrix and orthogonalize all of
        them (the replicated way, kept as the baseline of ``experiments/bench_muon.py``).
      mu_dtype: the dtype the momentum buffer is STORED in (None: the master dtype);
        bf16 / fp16 / int8 as ``fs.optim.adamw``'s ``mu_dtype`` (the update runs in fp32).

    Raises:
      ValueError: a parameter neither 2-D nor 3-D (named), or a hyperparameter is out of range.
    """
    not_negative("lr", 0.0 if callable(lr) else lr)
    not_negative("momentum", momentum)
    not_negative("weight_decay", weight_decay)
    if not 0 < ns_steps < 100:
        raise ValueError(f"muon: ns_steps must be in [1, 100), got {ns_steps}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"muon: ns_coefficients must be 3 floats, got {ns_coefficients}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(
            f"muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
            f"got {adjust_lr_fn!r}"
        )
    coefficients = tuple(float(c) for c in ns_coefficients)

    def orthogonalize(tensor, m: _Matrix, whole: torch.Tensor) -> torch.Tensor:
        """``m``'s orthogonalized update from its whole local matrix (gathered over "tensor"
        into the full one and cut back to this tensor rank's shard where it is split). A 3-D
        parameter's rows are experts, each orthogonalized as its own matrix (an expert rank
        holds its experts whole: nothing is gathered over "expert")."""
        if len(m.full) == 3:
            experts = whole.view(whole.shape[0], *m.full[1:])
            done = [newton_schulz(x, coefficients, ns_steps, eps) for x in experts]
            return torch.stack(done).reshape(whole.shape) if done else whole.bfloat16()
        if not tensor.splits(m.name):
            return newton_schulz(whole, coefficients, ns_steps, eps)
        full = tensor.gather_whole(m.name, whole.to(torch.bfloat16), kind=KIND)
        return tensor.part_of(m.name, newton_schulz(full, coefficients, ns_steps, eps))

    mu_rule = Moments(mu_dtype, "muon mu_dtype", signed=True, stochastic=False)

    def step(bufs: Buffers, s: Scalars, params: PyTree, placement: Placement | None) -> None:
        """The elementwise part on the local rows, then every matrix orthogonalized whole."""
        groups: dict[int, tuple] = {}  # per placement (expert buckets have their own)
        for j, (members, pairs) in enumerate(
            zip(_leaf_members(params), leaf_params(params), strict=True)
        ):
            p, g, wd = bufs.params[j], bufs.grads[j], bufs.decay[j]
            ((fmt, stored, scales),) = bufs.states(j)
            if s.grad_scale != 1.0:
                g.mul_(s.grad_scale)  # a copy unless donated
            narrow = stored.dtype != p.dtype or scales is not None
            buf = decode_flat(fmt, stored, scales) if narrow else stored
            if narrow and g.dtype != torch.float32:
                g = g.float()
            buf.lerp_(g, 1 - momentum)
            upd = g.lerp(buf, momentum) if nesterov else buf
            if narrow:
                encode_flat(fmt, buf, stored, scales)
            p.mul_(1 - s.lr * wd)
            where = placement if placement is None or members is None else placement.of(members)
            _, matrices, targets = groups.setdefault(id(where), (where, [], []))
            for name, shape, rows, u, target, full in _matrices_of(p, upd, members, pairs, where):
                matrices.append(_Matrix(name, shape, rows, u, full))
                targets.append((target, _adjusted_lr(s.lr, adjust_lr_fn, full)))
        for where, matrices, targets in groups.values():  # in bucket order on every rank
            tensor = NO_AXIS if where is None else where.tensor
            orth = functools.partial(orthogonalize, tensor)
            results = _orthogonalize_all(matrices, where, orth, ns_steps, owner_computes)
            for (target, alr), o in zip(targets, results, strict=True):
                target.add_(o.to(target.device), alpha=-alr)

    moments = {"momentum": mu_rule}
    return build(
        Spec("muon", lr, MuonState, moments, step, weight_decay, check=_check_2d, elementwise=False)
    )


def _matrices_of(
    param: torch.Tensor, update: torch.Tensor, members: Members | None, pairs, placement
):
    """``(name, local shape, row ranges per rank, local update rows, local param rows, the
    model's shape)`` per matrix held by one leaf (a whole tensor, or a flat buffer of row
    shards; under tensor parallelism of this tensor rank's local shards)."""
    if members is None:  # a plain pytree leaf: the whole matrix is here (3-D: rows of experts)
        ((name, shape),) = pairs
        rows = (shape[0], math.prod(shape[1:]))
        yield name, rows, ((0, shape[0]),), update.view(rows), param.view(rows), shape
        return
    if placement is None:
        raise ValueError(
            f"muon: the flat buffers of {list(members.names)} came without a "
            "placement; step a TrainState through fs.train_step / fs.offload_step"
        )
    for spec, (_, full) in zip(placement.leaves(members), pairs, strict=True):
        rows = tuple(spec.row_range(r) for r in range(placement.size))
        start, stop = rows[placement.rank]
        span = slice(spec.offset, spec.offset + (stop - start) * spec.row_numel)
        local = (stop - start, spec.row_numel)  # 3-D: a row is an expert's matrix
        shape = (spec.shape[0], spec.row_numel)
        yield spec.name, shape, rows, update[span].view(local), param[span].view(local), full


def _orthogonalize_all(
    matrices: list[_Matrix], placement, orthogonalize, steps: int, owner_computes: bool
) -> list[torch.Tensor]:
    """This rank's rows of every matrix's orthogonalized update (bfloat16)."""
    if owner_computes and placement is not None and placement.replica_count > 1:
        return _across_replicas(matrices, placement, orthogonalize, steps)
    return _within_shards(matrices, placement, orthogonalize, steps, owner_computes)


def _across_replicas(
    matrices: list[_Matrix], placement, orthogonalize, steps: int
) -> list[torch.Tensor]:
    """Replicas hold the same rows of the same matrices, so each works on a share of them
    (balanced by Newton-Schulz FLOPs, owner-computes within its shard group) and one all-gather
    over the replicas gives every rank its rows of the other shares. The same bits as one
    replica doing all: a matrix is orthogonalized from the same input by the same code."""
    R, me = placement.replica_count, placement.rank
    share = assign_owners([m.full for m in matrices], R, steps)
    done = _within_shards(
        [m for m, q in zip(matrices, share, strict=True) if q == placement.replica_rank],
        placement,
        orthogonalize,
        steps,
        True,
    )
    rows_numel = lambda m: (m.rows[me][1] - m.rows[me][0]) * m.shape[1]
    parts = [[i for i, q in enumerate(share) if q == r] for r in range(R)]
    width = max(sum(rows_numel(matrices[i]) for i in part) for part in parts)
    if width == 0:
        return [
            torch.empty(0, m.shape[1], dtype=torch.bfloat16, device=placement.device)
            for m in matrices
        ]
    local = torch.zeros(width, dtype=torch.bfloat16, device=placement.device)
    if done:
        mine = torch.cat([d.reshape(-1).to(placement.device) for d in done])
        local[: mine.numel()].copy_(mine)
    gathered = collectives.all_gather(
        local, placement.replicas, axis=placement.replicas_axis, kind=KIND
    ).view(R, width)
    results: list[torch.Tensor | None] = [None] * len(matrices)
    for r, part in enumerate(parts):
        offset = 0
        for i in part:
            n = rows_numel(matrices[i])
            a, b = matrices[i].rows[me]
            results[i] = gathered[r, offset : offset + n].view(b - a, matrices[i].shape[1])
            offset += n
    return results  # type: ignore[return-value]


def _within_shards(
    matrices: list[_Matrix], placement, orthogonalize, steps: int, owner_computes: bool
) -> list[torch.Tensor]:
    """``_orthogonalize_all`` within one shard group."""
    size = 1 if placement is None else placement.size
    if size == 1:  # an offloaded bucket's rows too are orthogonalized on the state's device
        device = None if placement is None else placement.device
        return [
            orthogonalize(m, m.update.to(device) if device is not None else m.update)
            for m in matrices
        ]
    if not owner_computes:
        return _replicated(matrices, placement, orthogonalize)
    return _owner_computes(matrices, placement, orthogonalize, steps)


def _replicated(matrices: list[_Matrix], placement, orthogonalize) -> list[torch.Tensor]:
    """Every rank gathers every whole matrix and orthogonalizes all of them."""
    out = []
    for m in matrices:
        rps = max(b - a for a, b in m.rows)
        cols = m.shape[1]
        local = torch.zeros(rps * cols, dtype=torch.bfloat16, device=placement.device)
        local[: m.update.numel()].copy_(m.update.reshape(-1))
        full = collectives.all_gather(local, placement.group, axis=placement.axis, kind=KIND)
        full = full.view(placement.size, rps, cols)
        whole = torch.cat([full[r, : b - a] for r, (a, b) in enumerate(m.rows)])
        a, b = m.rows[placement.rank]
        out.append(orthogonalize(m, whole)[a:b])
    return out


def _owner_computes(
    matrices: list[_Matrix], placement, orthogonalize, steps: int
) -> list[torch.Tensor]:
    """Owner-computes in rounds; round k+1's rows travel while round k is orthogonalized."""
    size, me, group, device = placement.size, placement.rank, placement.group, placement.device
    shapes = [m.shape for m in matrices]
    fulls = [m.full for m in matrices]  # the same on every tensor rank: so are the owners
    owners = assign_owners(fulls, size, steps)
    rounds = rounds_of(owners, size, order(fulls, steps))
    local_rows = lambda i, r: (matrices[i].rows[r][1] - matrices[i].rows[r][0]) * shapes[i][1]

    def send_rows(rnd: list[int | None]) -> collectives.Pending:
        """Every rank's rows of each owner's matrix of this round, to that owner."""
        parts = [matrices[i].update.reshape(-1) for i in rnd if i is not None]
        inp = (torch.cat(parts) if parts else torch.empty(0)).to(device, torch.bfloat16)
        in_splits = [local_rows(i, me) if i is not None else 0 for i in rnd]
        mine = rnd[me]
        out_splits = [local_rows(mine, r) if mine is not None else 0 for r in range(size)]
        out = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=device)
        return collectives.all_to_all(
            out, inp, out_splits, in_splits, group, axis=placement.axis, kind=KIND
        )

    results: list[torch.Tensor | None] = [None] * len(matrices)
    returns = []
    pending = send_rows(rounds[0]) if rounds else None
    for k, rnd in enumerate(rounds):
        whole = pending.wait()
        pending = send_rows(rounds[k + 1]) if k + 1 < len(rounds) else None
        mine = rnd[me]
        ortho = (
            orthogonalize(matrices[mine], whole.view(shapes[mine])).reshape(-1)
            if mine is not None
            else torch.empty(0, dtype=torch.bfloat16, device=device)
        )
        in_splits = [local_rows(mine, r) if mine is not None else 0 for r in range(size)]
        out_splits = [local_rows(i, me) if i is not None else 0 for i in rnd]
        out = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=device)
        returns.append(
            (
                rnd,
                out_splits,
                collectives.all_to_all(
                    out, ortho, out_splits, in_splits, group, axis=placement.axis, kind=KIND
                ),
            )
        )
    for rnd, splits, back in returns:
        parts = back.wait().split(splits)
        for i, part in zip(rnd, parts, strict=True):
            if i is not None:
                a, b = matrices[i].rows[me]
                results[i] = part.view(b - a, shapes[i][1])
    return results  # type: ignore[return-value]
