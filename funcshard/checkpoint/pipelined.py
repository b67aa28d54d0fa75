"""A pipelined state's share of a whole-model checkpoint.

A pipelined state (``fs.init(stages, ..., pipeline=)``) holds only its pipeline rank's
stages; its checkpoint is nevertheless the whole model's, laid out as a plain state's: each
pipeline rank writes its own stages' arrays (params and optimizer state at their full
shapes, sharded over its data-parallel sub-world as any state's), the first rank of each
sub-world creates its stages' array metadata, the world's first rank writes the scalars and
the item's metadata listing every rank's arrays, and the whole world agrees on the commit.
A restore reads this rank's stages' arrays and leaves those of the other stages to theirs.

A buffer registered on a module every stage keeps (the root) is written once, by the
pipeline rank of the first stage holding it; each stage reads it back.
"""

from __future__ import annotations

from funcshard.checkpoint.format import Keys
from funcshard.state.buffers import ModelBuffers
from funcshard.state.state import TrainState

__all__ = ["others", "creates_arrays", "writes_scalars", "skipped_buffers"]


def _stage_names(state: TrainState, index: int) -> tuple[set[str], set[str]]:
    stage = state.pipeline.stages[index]
    params = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
    return params, set(ModelBuffers.of(stage).names)


def others(state: TrainState) -> tuple[frozenset[str], frozenset[str]]:
    """``(params, buffers)``: the names only the other pipeline ranks' stages hold (empty
    without a pipeline): a checkpoint of the whole model holds them, this rank reads none."""
    run = state.pipeline
    if run is None:
        return frozenset(), frozenset()
    mine_p, mine_b, all_p, all_b = set(), set(), set(), set()
    for i in range(len(run.stages)):
        params, buffers = _stage_names(state, i)
        all_p |= params
        all_b |= buffers
        if i in run.mine:
            mine_p |= params
            mine_b |= buffers
    return frozenset(all_p - mine_p), frozenset(all_b - mine_b)


def creates_arrays(state: TrainState, world_rank: int) -> bool:
    """Whether this rank creates the metadata of the arrays it plans: the world's first
    rank, or under a pipeline the first rank of each pipeline rank's sub-world (its
    data-parallel, tensor and expert coordinates all 0: the tensor ranks of a stage write
    their shards of the same global arrays)."""
    if state.pipeline is None:
        return world_rank == 0
    return state.pipeline.leads  # not each tensor rank's data-parallel world's first


def writes_scalars(world_rank: int) -> bool:
    """Whether this rank writes the scalars (the step, ...): the world's first rank (every
    pipeline rank holds the same)."""
    return world_rank == 0


def skipped_buffers(state: TrainState, keys: list[Keys]) -> set[Keys]:
    """Of ``keys``, the buffers this pipeline rank does not write: those whose first stage
    holding them is another rank's (that rank writes them)."""
    run = state.pipeline
    if run is None:
        return set()
    first: dict[str, int] = {}
    for i in range(len(run.stages)):
        for name in _stage_names(state, i)[1]:
            first.setdefault(name, i)
    return {k for k in keys if k[0] == "buffers" and first.get(k[1], min(run.mine)) not in run.mine}
