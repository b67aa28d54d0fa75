"""How far one run's params are from another's (a captured step against eager)."""

from __future__ import annotations

from typing import Any

__all__ = ["ROUNDING", "params_difference"]

# A leaf whose reference norm is below this stays at zero up to rounding: each attention
# block's key bias (softmax ignores a shift of every key by one vector, so its gradient is 0
# in exact math, and what an update moves it by is the rounding of the other terms). Its
# relative difference compares two roundings (another compiler's fusions round otherwise: 1.2
# between eager and inductor on the GPT, with 2.5e-12 apart), so it is reported by its
# absolute difference instead.
ROUNDING = 1e-6


def params_difference(reference: dict, other: dict) -> dict[str, Any]:
    """``{"relative": (difference, name), "rounding": (difference, name)}``: the largest
    relative difference (the difference's norm over the reference's) of a leaf whose
    reference norm is at least :data:`ROUNDING`, and the largest absolute difference of the
    others, each with the leaf's name ("" where there is none)."""
    rel, tiny = (0.0, ""), (0.0, "")
    for name, p in reference.items():
        diff = float((other[name] - p).norm())
        norm = float(p.norm())
        if norm >= ROUNDING:
            rel = max(rel, (diff / norm, name))
        else:
            tiny = max(tiny, (diff, name))
    return {"relative": rel, "rounding": tiny}
