"""The attention exchange of context parallel in a plan (``fs.plan(..., context=C)``).

What :mod:`funcshard.parallel.attention` sends per rank and step, for ``calls`` attention
calls of ``heads`` heads of ``head_dim`` over sequences of ``seq_len`` tokens, ``batch_size``
rows (the batch each rank passes to ``train_step``), each rank holding ``seq_len / C`` tokens
of each (every exchange counts its input buffer, as :func:`funcshard.distributed.ops.record`):

* "all_to_all": q, k, v and the output, forward and backward: 8 buffers of
  ``rows x heads x seq_len / C x head_dim`` per call, under "all_to_all";
* "ring": k and v passed ``C - 1`` times forward and ``C - 1`` times again in the backward
  (nothing received is kept for it), and their gradients, accumulated in fp32, ``C`` times:
  ``4 (C - 1)`` buffers of that size and ``2 C`` of it in fp32 per call, under "send".

>>> comm, calls, axes = {}, {}, {}
>>> add_context_exchange(2, "all_to_all", 16, 8, (2, 4, 4), 4, 1, comm, calls, axes)
>>> comm["all_to_all"], calls["all_to_all"], axes["context"]
(65536, 16, 65536)
"""

from __future__ import annotations

from funcshard.parallel.context import ALGORITHMS

__all__ = ["add_context_exchange", "attention_saved", "check_context"]


def check_context(
    context: int,
    algorithm: str,
    seq_len: int | None,
    attention: tuple[int, int, int] | None,
    load_balance: bool = True,
) -> None:
    """Raises ValueError on a plan's context arguments that ``train_step`` would refuse."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"plan: context_algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if context == 1 or seq_len is None:
        return
    if seq_len % (2 * context if load_balance else context):
        how = f"2 x context = {2 * context} (load_balance)" if load_balance else context
        raise ValueError(f"plan: seq_len {seq_len} is not divisible by {how}")
    if attention is not None and algorithm == "all_to_all" and attention[1] % context:
        raise ValueError(
            f"plan: {attention[1]} heads are not divisible by context={context} "
            "(algorithm='all_to_all')"
        )


def add_context_exchange(
    context: int,
    algorithm: str,
    seq_len: int | None,
    batch_size: int | None,
    attention: tuple[int, int, int] | None,
    itemsize: int,
    microbatches: int,
    comm: dict[str, int],
    calls: dict[str, int],
    by_axis: dict[str, int],
) -> None:
    """Adds a step's attention exchange over the "context" axis (none on one rank, or where
    ``seq_len``, ``batch_size`` or ``attention`` is not given)."""
    if context == 1 or seq_len is None or batch_size is None or attention is None:
        return
    n_calls, heads, head_dim = attention
    part = batch_size * heads * (seq_len // context) * head_dim
    if algorithm == "all_to_all":
        kind, nbytes, sends = "all_to_all", 8 * part * itemsize, 8
    else:
        # k, v: C - 1 shifts forward and C - 1 backward; their fp32 gradients: C shifts
        kind, sends = "send", 3 * context - 2
        nbytes = 4 * (context - 1) * part * itemsize + 2 * context * part * 4
    comm[kind] = comm.get(kind, 0) + n_calls * nbytes
    calls[kind] = calls.get(kind, 0) + n_calls * sends * microbatches
    by_axis["context"] = by_axis.get("context", 0) + n_calls * nbytes


def attention_saved(
    context: int,
    seq_len: int | None,
    batch_size: int | None,
    attention: tuple[int, int, int] | None,
    itemsize: int,
    microbatches: int,
) -> int:
    """Bytes the attention calls of one microbatch keep for the backward on a rank of a
    context group: q, k, v and the output of its ``seq_len / C`` tokens of the microbatch's
    rows (the first, largest one) in the compute dtype, and the fp32 log-sum-exp; 0 where
    ``seq_len``, ``batch_size`` or ``attention`` is not given.

    >>> attention_saved(2, 16, 8, (2, 4, 4), 4, 2)  # 2 x (4 x 128 tokens x 4 x 4 B + 128 x 4 B)
    17408
    """
    if context == 1 or seq_len is None or batch_size is None or attention is None:
        return 0
    n_calls, heads, head_dim = attention
    rows = -(-batch_size // microbatches)
    tokens = rows * heads * (seq_len // context)
    return n_calls * (4 * tokens * head_dim * itemsize + tokens * 4)
