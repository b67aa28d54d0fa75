"""``fs.summed``: an aux value that ``train_step`` sums over the step's microbatches and its
data-parallel ranks, such as a router's tokens per expert (DeepSeek-V3's bias update reads the
step's global load).

A ``loss_fn`` that returns ``(loss, aux)`` may put ``fs.summed(tensor)`` anywhere in ``aux``;
``metrics["aux"]`` then holds, in its place, the tensor summed over every microbatch of the
step and every data-parallel rank, once per rank: the ranks of one tensor group see the same
tokens, so the sum runs over the data-parallel ranks of one tensor rank (every tensor rank gets
the same total). The other leaves of ``aux`` are the last microbatch's, as before. Every
``fs.summed`` leaf of a step travels in the one all-reduce that averages the loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

__all__ = ["Summed", "summed", "add_summed", "flat_sums", "with_totals"]


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


def add_summed(sums: list[torch.Tensor] | None, aux: Any) -> list[torch.Tensor] | None:
    """``sums`` (the earlier microbatches' ``fs.summed`` tensors, None at first) plus this
    microbatch's, in aux order.

    Raises:
      ValueError: the microbatches' aux hold different ``fs.summed`` leaves (named).
    """
    mine = _summed_leaves(aux)
    if sums is None:
        return [v.clone() for _, v in mine] if mine else None
    if len(mine) != len(sums) or any(
        v.shape != s.shape for (_, v), s in zip(mine, sums, strict=True)
    ):
        raise ValueError(
            "train_step: every microbatch's aux must hold the same fs.summed leaves with the "
            f"same shapes; this one holds {[(p, tuple(v.shape)) for p, v in mine]}, the first "
            f"{[tuple(s.shape) for s in sums]}"
        )
    return [s.add_(v.to(s.device, s.dtype)) for s, (_, v) in zip(sums, mine, strict=True)]


def flat_sums(sums: list[torch.Tensor] | None, device: torch.device) -> torch.Tensor | None:
    """The sums as one float64 vector on ``device``, for the step's reduction (integer counts
    stay exact up to 2**53)."""
    if not sums:
        return None
    return torch.cat([s.reshape(-1).to(device, torch.float64) for s in sums])


def with_totals(aux: Any, sums: list[torch.Tensor] | None, totals: torch.Tensor | None) -> Any:
    """The last microbatch's ``aux`` with every ``fs.summed`` leaf replaced by its reduced
    total (the flat ``totals``), in the dtype, shape and device of the summed tensor."""
    if not sums:
        return aux
    parts = iter(totals.split([s.numel() for s in sums]))
    shaped = [next(parts).reshape(s.shape).to(s.device) for s in sums]
    out = [
        t.round().to(s.dtype) if not s.dtype.is_floating_point else t.to(s.dtype)
        for t, s in zip(shaped, sums, strict=True)
    ]
    values = iter(out)
    return optree.tree_map(
        lambda x: next(values) if _is_summed(x) else x, aux, is_leaf=_is_summed, none_is_leaf=True
    )
