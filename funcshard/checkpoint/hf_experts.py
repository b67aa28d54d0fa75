"""Stacked experts and the per-expert tensors of transformers' checkpoints.

transformers 5 holds a mixture-of-experts layer's experts stacked in memory:
``mlp.experts.gate_up_proj`` of shape ``(num_experts, 2 * I, H)`` (each expert's gate and up
projections concatenated along dim 1) and ``mlp.experts.down_proj`` ``(num_experts, H, I)``,
while its checkpoints (``save_pretrained``, the Hub's Qwen2/3-MoE, OLMoE, DeepSeek files) keep
one tensor per expert and projection: ``mlp.experts.{e}.gate_proj.weight`` ``(I, H)`` and so on.
Row ``e`` of a stacked tensor is expert ``e``'s tensors back to back (``gate`` then ``up``), so
each rank still reads and writes only its own rows: a row is a few whole tensors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

__all__ = ["Stacked", "stacked_in", "split_names"]

# a stacked parameter's suffix -> the projections one of its rows is made of, in order
STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


@dataclasses.dataclass(frozen=True, slots=True)
class Stacked:
    """A stacked parameter as per-expert tensors: ``parts[e]`` the names whose tensors make
    row ``e``, in order."""

    name: str
    parts: tuple[tuple[str, ...], ...]


def split_names(name: str, experts: int) -> tuple[tuple[str, ...], ...] | None:
    """Per expert, the checkpoint names of stacked parameter ``name`` (None: not stacked).

    >>> split_names("mlp.experts.gate_up_proj", 2)[1]
    ('mlp.experts.1.gate_proj.weight', 'mlp.experts.1.up_proj.weight')
    >>> split_names("mlp.experts.w1", 2) is None
    True
    """
    prefix, _, suffix = name.rpartition(".")
    if suffix not in STACKS or not prefix.endswith("experts"):
        return None
    return tuple(
        tuple(f"{prefix}.{e}.{proj}.weight" for proj in STACKS[suffix]) for e in range(experts)
    )


def stacked_in(names: Iterable[str]) -> list[Stacked]:
    """The stacked parameters a checkpoint's per-expert tensors make (every expert ``0..n-1``
    and every projection of a stack present)."""
    found: dict[str, dict[int, set[str]]] = {}
    for name in names:
        m = _PER_EXPERT.match(name)
        if m:
            found.setdefault(m["experts"], {}).setdefault(int(m["e"]), set()).add(m["proj"])
    out = []
    for experts, by_index in found.items():
        count = len(by_index)
        if sorted(by_index) != list(range(count)):
            continue
        for suffix, projs in STACKS.items():
            if all(set(projs) <= by_index[e] for e in range(count)):
                parts = split_names(f"{experts}.{suffix}", count)
                out.append(Stacked(f"{experts}.{suffix}", parts))
    return out
