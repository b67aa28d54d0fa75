"""Learning-rate schedules: ``step -> lr``, step = updates done before this one (0 first).

The same ``step`` as ``torch.optim.lr_scheduler.LambdaLR``'s epoch, so ``LambdaLR(opt,
lambda s: sched(s) / peak)`` reproduces any of them in plain torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["constant", "warmup_cosine", "warmup_linear"]


def constant(value: float) -> Callable[[int], float]:
    """``value`` at every step.

    >>> constant(0.1)(7)
    0.1
    """
    return lambda step: float(value)


def _warmup_then(
    peak: float, warmup: int, total: int, final: float, what: str, decay: Callable[[float], float]
) -> Callable[[int], float]:
    if warmup < 0 or total <= warmup:
        raise ValueError(f"{what}: need 0 <= warmup < total, got warmup={warmup} total={total}")

    def schedule(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        t = min(step - warmup, total - warmup) / (total - warmup)
        return final + (peak - final) * decay(t)

    return schedule


def warmup_cosine(peak: float, warmup: int, total: int, final: float = 0.0):
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine to ``final`` at ``total``.

    >>> s = warmup_cosine(1.0, warmup=2, total=6, final=0.0)
    >>> [round(s(i), 3) for i in range(7)]
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]
    """
    return _warmup_then(
        peak, warmup, total, final, "warmup_cosine", lambda t: 0.5 * (1 + math.cos(math.pi * t))
    )


def warmup_linear(peak: float, warmup: int, total: int, final: float = 0.0):
    """Linear warmup to ``peak`` over ``warmup`` steps, then linear to ``final`` at ``total``.

    >>> s = warmup_linear(1.0, warmup=2, total=6, final=0.0)
    >>> [round(s(i), 3) for i in range(7)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    return _warmup_then(peak, warmup, total, final, "warmup_linear", lambda t: 1 - t)
