"""``fs.summed``: an aux value that ``train_step`` sums over the step's microbatches and its
data-parallel ranks, such as a router's tokens per expert (DeepSeek-V3's bias update reads the
step's global load).

A ``loss_fn`` that returns ``(loss, aux)`` may put ``fs.summed(tensor)`` anywhere in ``aux``;
``metrics["aux"]`` then holds, in its place, the tensor summed over every microbatch of the
step and every data-parallel rank, once per rank: the ranks of one tensor group see the same
tokens, so the sum runs over the data-parallel ranks of one tensor rank (every tensor rank gets
the same total). The other leaves of ``aux`` are the last microbatch's, as before.

Every microbatch's aux, and every rank's, must hold the same ``fs.summed`` leaves with the
same shapes (a count over a variable number of classes needs a fixed size:
``torch.bincount(x, minlength=n)``): a leaf absent from the step's first microbatch or of
another shape on a later one raises ``ValueError`` naming it; across ranks, a hash of the
leaves and shapes (:func:`header`) rides with the loss's all-reduce, and ranks that disagree
all raise ``ValueError`` naming the leaf and each rank's shape, before the totals travel in
one all-reduce of their own (an all-gather summed in rank order under ``deterministic=True``).
Under fault tolerance the totals are then summed over the replica groups of the step's quorum
too (torchft's all-reduce, as the gradients are), so every group's tokens count once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import crc32c
import optree
import torch
import torch.distributed as dist

__all__ = ["Summed", "summed", "add_summed", "flat_sums", "header", "check_agreed", "with_totals"]


class Summed(NamedTuple):
    """A tensor of ``aux`` the step sums (made by :func:`summed`)."""

    value: torch.Tensor


def summed(value: torch.Tensor, /) -> Summed:
    """Marks ``value`` (a tensor of ``loss_fn``'s aux) as summed over the step's microbatches
    and data-parallel ranks in ``metrics["aux"]`` (see the module docstring).

    >>> summed(torch.tensor([3, 1])).value
    tensor([3, 1])

    Raises:
      TypeError: ``value`` is not a tensor.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"fs.summed: expected a tensor, got {type(value).__name__}")
    return Summed(value.detach())


def _is_summed(x: Any) -> bool:
    return isinstance(x, Summed)


def _summed_leaves(aux: Any) -> list[tuple[str, torch.Tensor]]:
    paths, leaves, _ = optree.tree_flatten_with_path(aux, is_leaf=_is_summed, none_is_leaf=True)
    return [
        ("/".join(map(str, p)) or "<aux>", x.value)
        for p, x in zip(paths, leaves, strict=True)
        if _is_summed(x)
    ]


Sums = list[tuple[str, torch.Tensor]]  # (leaf path, running sum), in aux order


def _shapes(leaves: Sums) -> list[tuple[str, tuple[int, ...]]]:
    return [(p, tuple(v.shape)) for p, v in leaves]


def add_summed(sums: Sums | None, aux: Any, first: bool) -> Sums | None:
    """``sums`` (the earlier microbatches' ``fs.summed`` tensors by leaf path, None when they
    had none) plus this microbatch's (``first``: the step's first microbatch).

    Raises:
      ValueError: the microbatches' aux hold different ``fs.summed`` leaves or shapes (the
        leaf named, with what the first microbatch held): a leaf absent from one microbatch
        would go uncounted there.
    """
    mine = _summed_leaves(aux)
    if first:
        return [(p, v.clone()) for p, v in mine] if mine else None
    theirs = sums or []
    if _shapes(mine) != _shapes(theirs):
        held = dict(_shapes(theirs))
        now = dict(_shapes(mine))
        odd = next(
            (p for p in [*now, *held] if now.get(p) != held.get(p)),
            "<order>",  # the same leaves and shapes in another order
        )
        raise ValueError(
            f"train_step: fs.summed leaf {odd!r} is {_described(now.get(odd))} in this "
            f"microbatch's aux and {_described(held.get(odd))} in the first's: every "
            "microbatch's aux must hold the same fs.summed leaves with the same shapes (this "
            f"one: {_shapes(mine)}, the first: {_shapes(theirs)})"
        )
    pairs = zip(theirs, mine, strict=True)
    return [(p, s.add_(v.to(s.device, s.dtype))) for (p, s), (_, v) in pairs]


def _described(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else f"of shape {shape}"


def flat_sums(sums: Sums | None, device: torch.device) -> torch.Tensor | None:
    """The sums as one float64 vector on ``device``, for the step's reduction (integer counts
    stay exact up to 2**53)."""
    if not sums:
        return None
    return torch.cat([s.reshape(-1).to(device, torch.float64) for _, s in sums])


def with_totals(aux: Any, sums: Sums | None, totals: torch.Tensor | None) -> Any:
    """The last microbatch's ``aux`` with every ``fs.summed`` leaf replaced by its reduced
    total (the flat ``totals``), in the dtype, shape and device of the summed tensor."""
    if not sums:
        return aux
    parts = iter(totals.split([s.numel() for _, s in sums]))
    shaped = [next(parts).reshape(s.shape).to(s.device) for _, s in sums]
    out = [
        t.round().to(s.dtype) if not s.dtype.is_floating_point else t.to(s.dtype)
        for t, (_, s) in zip(shaped, sums, strict=True)
    ]
    values = iter(out)
    return optree.tree_map(
        lambda x: next(values) if _is_summed(x) else x, aux, is_leaf=_is_summed, none_is_leaf=True
    )


_HASH_BITS = 16  # n * (2**16)**2 stays exact in float64 for n < 2**21 ranks


def header(sums: Sums | None, device: torch.device) -> torch.Tensor:
    """This rank's ``fs.summed`` leaves (paths and shapes) as ``[h, h * h]`` (float64, ``h``
    a 16-bit hash of them): what rides with the loss, whatever the leaves, so that the ranks
    find out whether they agree before the totals' own collective (whose size is theirs)."""
    h = crc32c.crc32c(repr(_shapes(sums or [])).encode()) % (1 << _HASH_BITS)
    return torch.tensor([h, h * h], dtype=torch.float64, device=device)


def check_agreed(sums: Sums | None, total: torch.Tensor, group: Any) -> None:
    """Raises on every rank of ``group`` when its ranks' ``fs.summed`` leaves differ (the
    same verdict on every rank: ``total`` is the headers' sum, the same everywhere; equal
    hashes iff ``n * sum(h**2) == sum(h)**2``).

    Raises:
      ValueError: naming the first leaf whose shape differs, with every rank's shape.
    """
    n = dist.get_world_size(group)
    s1, s2 = (int(round(float(x))) for x in total.tolist())
    if n * s2 == s1 * s1:
        return
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, _shapes(sums or []), group=group)
    paths = list(dict.fromkeys(p for shapes in everyone for p, _ in shapes))
    per_rank = [dict(shapes) for shapes in everyone]
    odd = next((p for p in paths if len({str(r.get(p)) for r in per_rank}) > 1), "<order>")
    ranks = dist.get_process_group_ranks(group)
    said = "; ".join(
        f"rank {rank}: {_described(r.get(odd))}" for rank, r in zip(ranks, per_rank, strict=True)
    )
    raise ValueError(
        f"train_step: fs.summed leaf {odd!r} differs across the data-parallel ranks ({said}): "
        "every rank's aux must hold the same fs.summed leaves with the same shapes, as the "
        "totals are summed element by element (give a count a fixed size, e.g. "
        "torch.bincount(..., minlength=n))"
    )
