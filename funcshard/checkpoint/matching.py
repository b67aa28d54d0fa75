"""Does a checkpoint fit a target state, and which of its keys feeds which leaf.

Every mismatch is collected (shapes, dtypes, missing and unexpected arrays with the closest
name on the other side, the optimizer's kind and scalars) and raised as one
``CheckpointMismatchError``; moments stored 8-bit on one side only are paired with the scales
they convert with (``conversions``).
"""

from __future__ import annotations

import difflib
from typing import Any

from funcshard.checkpoint.coords import Coords, block_spans
from funcshard.checkpoint.format import FLOAT_NAMES, Keys, param_dir
from funcshard.checkpoint.sources import Source
from funcshard.checkpoint.tree import (
    is_8bit,
    opt_blocks,
    opt_kind,
    opt_layout,
    scale_path,
    spec_in,
)
from funcshard.layout.layout import Layout
from funcshard.state.state import TrainState

__all__ = ["CheckpointMismatchError", "expected_arrays", "conversions", "match", "mismatch_error"]


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state; the message lists every mismatch."""


def _closest(
    name: str,
    shape: tuple[int, ...],
    candidates: dict[str, tuple[int, ...]],
    unpaired: set[str],
    n: int = 3,
) -> str:
    """Up to ``n`` candidates most like ``name``: unpaired ones first, then those of the same
    shape, then by ``difflib``'s similarity of the names."""

    def rank(c: str) -> tuple:
        return (
            c in unpaired,
            tuple(candidates[c]) == tuple(shape),
            difflib.SequenceMatcher(None, name, c).ratio(),
        )

    near = sorted(candidates, key=rank, reverse=True)[:n]
    return ", ".join(f"{c} {tuple(candidates[c])}" for c in near)


def expected_arrays(like: TrainState, model_only: bool) -> dict[Keys, tuple[int, ...]]:
    """Every array ``like``'s layout reads, by key, with its full shape."""
    layout = like.layout
    coords = Coords(layout.tensor)  # a tensor-parallel state's arrays are global
    out: dict[Keys, tuple[int, ...]] = {
        ("params", s.name): coords.shape(s.name, s.shape) for s in layout.leaves
    }
    if not model_only:
        paths, _ = opt_layout(like.opt_state, len(layout.buckets))
        blocks = opt_blocks(like.opt_state, len(layout.buckets))
        for p, present in paths.items():
            for s in layout.leaves:
                if present[s.bucket]:
                    local = spec_in(s, blocks.get(p), s.bucket).shape
                    out[("opt_state", *p, s.name)] = coords.shape(s.name, local, p in blocks)
    return out


def source_blocks(info: dict | None, name: str, shape: tuple[int, ...]):
    """``(split dim, tensor degree)`` a checkpoint's 8-bit scales of ``name`` were cut by
    (its record's ``split_dims`` and ``tensor``; ``(None, 1)`` when it records none)."""
    dims = (info or {}).get("split_dims") or {}
    dim = dims.get(name)
    return (None, 1) if dim is None else (dim, int(info["tensor"]))


def reblocks(layout: Layout, info: dict | None, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the checkpoint's 8-bit blocks of ``name`` (global ``shape``) cut a global row
    otherwise than the target's (another tensor degree whose shards' rows the blocks follow):
    then the moment is dequantized with the source's blocks and quantized with the target's.
    A checkpoint without ``split_dims`` (written before it was recorded) is read as stored."""
    if info is None or "split_dims" not in info:
        return False
    tensor = layout.tensor
    dim = tensor.leaves[name].dim if name in tensor.leaves else None
    size = tensor.size
    return block_spans(shape, *source_blocks(info, name, shape)) != block_spans(shape, dim, size)


def _scales(keys: Keys) -> bool:
    """Whether ``keys`` name an 8-bit scales array (``tree.scale_path``'s)."""
    return len(keys) > 2 and keys[-2].endswith("_scale")


def conversions(
    layout: Layout, opt_state: Any, found: dict[Keys, tuple], info: dict | None = None
) -> dict[Keys, Keys | None]:
    """Optimizer moments stored 8-bit on one side and not on the other, or 8-bit on both with
    other blocks (``reblocks``): per target moment key, the source scale key it must be
    dequantized with (None: the source is not 8-bit and the target quantizes it); the target's
    scale keys of a moment it quantizes map to None."""
    n = len(layout.buckets)
    coords = Coords(layout.tensor)
    paths, _ = opt_layout(opt_state, n)
    blocks = opt_blocks(opt_state, n)
    out: dict[Keys, Keys | None] = {}
    for p, present in paths.items():
        if p in blocks:
            continue
        scale_blocks = blocks.get(scale_path(p))
        for s in layout.leaves:
            keys = ("opt_state", *p, s.name)
            if not present[s.bucket] or keys not in found:
                continue
            target_8bit = scale_blocks is not None and scale_blocks[s.bucket] is not None
            source_8bit = is_8bit(found[keys][1])
            if target_8bit and not source_8bit:
                out[keys] = None
                out[("opt_state", *scale_path(p), s.name)] = None
            elif source_8bit and not target_8bit:
                out[keys] = ("opt_state", *scale_path(p), s.name)
            elif source_8bit and reblocks(layout, info, s.name, coords.shape(s.name, s.shape)):
                out[keys] = ("opt_state", *scale_path(p), s.name)
                out[("opt_state", *scale_path(p), s.name)] = None
    return out


def _optimizer_problems(like: TrainState, source: Source) -> tuple[list[str], dict]:
    """What keeps ``source``'s optimizer state from ``like``'s, and the paths of its
    per-bucket parts."""
    paths, scalars = opt_layout(like.opt_state, len(like.layout.buckets))
    kind = opt_kind(like.opt_state)
    problems: list[str] = []
    if source.info is None:
        problems.append(
            "optimizer: the checkpoint was not written by funcshard (no "
            "optimizer state it can map); restore it with model_only=True"
        )
    elif source.info.get("optimizer") is None:
        problems.append(
            "optimizer: the checkpoint holds params only (converted); restore it with "
            "model_only=True"
        )
    elif source.info.get("optimizer") != kind:
        problems.append(
            f"optimizer: the checkpoint holds {source.info.get('optimizer')}, "
            f"the target state has {kind}"
        )
    have_scalars = source.scalars()
    for p in [("opt_state", *p) for p in scalars] + [("step",)]:
        if p not in have_scalars:
            problems.append(f"{param_dir(p)}: missing from the checkpoint")
    return problems, paths


def _unpaired_problems(
    expected: dict[Keys, tuple[int, ...]],
    found: dict,
    missing: list[Keys],
    extra: list[Keys],
) -> list[str]:
    """Expected arrays the checkpoint lacks and arrays it holds that nothing expects, each
    with the closest name on the other side."""
    held = {param_dir(k): s for k, (s, _) in found.items()}
    wanted = {param_dir(k): s for k, s in expected.items()}
    unpaired_held = {param_dir(k) for k in extra}
    unpaired_wanted = {param_dir(k) for k in missing}
    problems = []
    for keys in missing:
        near = _closest(param_dir(keys), expected[keys], held, unpaired_held)
        problems.append(
            f"{param_dir(keys)}: missing from the checkpoint (expected shape "
            f"{expected[keys]})" + (f"; closest there: {near}" if near else "")
        )
    for keys in extra:
        near = _closest(param_dir(keys), found[keys][0], wanted, unpaired_wanted)
        problems.append(
            f"{param_dir(keys)}: in the checkpoint but not in the target state "
            f"(shape {found[keys][0]})" + (f"; closest expected: {near}" if near else "")
        )
    return problems


def match(
    like: TrainState, source: Source, model_only: bool, others: frozenset[str] = frozenset()
) -> tuple[list[str], dict[Keys, Keys]]:
    """Every way ``source`` does not fit ``like`` (empty when it fits), and for each expected
    key the source key that feeds it (itself, or a tied alias under which the source holds
    the weight). ``others``: the parameters of a pipelined state's other stages (the
    checkpoint of the whole model holds their arrays; this rank reads none of them)."""
    layout = like.layout
    found = source.arrays()
    expected = expected_arrays(like, model_only)
    keymap: dict[Keys, Keys] = {}
    problems, paths = ([], {}) if model_only else _optimizer_problems(like, source)
    missing: list[Keys] = []
    convert = {} if model_only else conversions(layout, like.opt_state, found, source.info)
    for keys, shape in expected.items():
        if keys in convert and convert[keys] is None and (keys not in found or _scales(keys)):
            continue  # the scales of a moment the target quantizes (from a wider one, or
            # from 8-bit of other blocks: the source's scales are read with their moment)
        src = keys
        if keys not in found and keys[0] == "params":
            alias = next(
                (("params", a) for a in layout.aliases_of(keys[1]) if ("params", a) in found), None
            )
            src = alias or keys
        if src not in found:
            missing.append(keys)
            continue
        keymap[keys] = src
        got_shape, got_dtype = found[src]
        if got_shape != shape:
            problems.append(
                f"{param_dir(src)}: shape {got_shape} in the checkpoint, expected {shape}"
            )
        if got_dtype not in FLOAT_NAMES and not (keys[0] == "opt_state" and is_8bit(got_dtype)):
            problems.append(
                f"{param_dir(src)}: dtype {got_dtype} in the checkpoint, expected a floating dtype"
            )
    prefixes = {("params",)} | {("opt_state", *p) for p in paths}
    used = set(keymap.values()) | {("params", a) for a, _ in layout.aliases}
    used |= {k for k in convert.values() if k is not None and k in found}
    used |= {k for k in found if k[:1] in (("params",), ("opt_state",)) and k[-1] in others}
    extra = [k for k in found if k not in used and k[:-1] in prefixes]
    problems += _unpaired_problems(expected, found, missing, extra)
    if not model_only:
        problems += [
            f"{param_dir(k)}: optimizer state the target optimizer lacks"
            for k in found
            if k[:1] == ("opt_state",) and k not in used and k[:-1] not in prefixes
        ]
    return problems, keymap


def mismatch_error(where: str, problems: list[str], source: Source) -> CheckpointMismatchError:
    """One error listing every problem, and what the checkpoint's params are."""
    held = sorted((k, s) for k, (s, _) in source.arrays().items() if k[0] == "params")
    listing = ", ".join(f"{param_dir(k[1:])} {s}" for k, s in held[:40])
    more = f", ... ({len(held) - 40} more)" if len(held) > 40 else ""
    return CheckpointMismatchError(
        f"{where} does not fit the target state:\n  "
        + "\n  ".join(problems)
        + f"\n  the checkpoint's params ({len(held)}): {listing}{more}"
    )
