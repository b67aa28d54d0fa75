"""Which leaves an ``offload_fraction`` steps on the CPU: whole leaves, chosen from their
sizes alone, so that every rank that sees the same sizes picks the same leaves."""

from __future__ import annotations

__all__ = ["pick_offloaded"]


def pick_offloaded(sizes: list[int], fraction: float) -> set[int]:
    """Whole leaves whose summed size is close to ``fraction`` of the total, deterministically.

    Largest leaves first (ties broken by position), a leaf is taken while it still fits under
    the target; then the smallest leaf left out is added if that lands closer. The result is
    within half a leaf of the target: ``|sum - target| <= min(left out) / 2``.
    """
    if fraction <= 0:
        return set()
    if fraction >= 1:
        return set(range(len(sizes)))
    target = fraction * sum(sizes)
    chosen: set[int] = set()
    acc = 0
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if acc + sizes[i] <= target:
            chosen.add(i)
            acc += sizes[i]
    left = [i for i in range(len(sizes)) if i not in chosen and sizes[i] > 0]
    if left:
        smallest = min(left, key=lambda i: (sizes[i], i))
        if abs(acc + sizes[smallest] - target) < abs(acc - target):
            chosen.add(smallest)
    return chosen
