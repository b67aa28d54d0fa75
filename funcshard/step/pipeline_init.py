"""``fs.init(stages, ..., pipeline=)``: the stages checked and placed before any collective,
this pipeline rank's stages merged into the model ``fs.init`` shards over the rank's
data-parallel sub-world, and their :class:`~funcshard.step.pipelined.PipelineRun`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed.dims import CONTEXT, DATA_AXES, EXPERT, TENSOR
from funcshard.parallel.pipeline import Pipeline, check_stages
from funcshard.parallel.pipeline_split import merge

__all__ = ["prepare"]


def prepare(
    model: Any, mesh: DeviceMesh, pipeline: Pipeline | None, refused: dict[str, Any]
) -> tuple[Any, DeviceMesh, Any]:
    """``(model to shard, mesh to shard it over, the run)``: ``(model, mesh, None)`` without
    a pipeline; with one, this rank's stages merged, its sub-world and its schedule.

    ``refused``: fs.init's arguments that do not combine with a pipeline yet, by name
    (a true value refused; ``outer_strategy``, HFSDP, only where the pipeline rank's
    data-parallel ranks are both replicated and sharded).

    Raises:
      ValueError: a pipeline without a "pipeline" mesh axis or the other way round, a split
        the schedule cannot place or with a name in two stages, microbatches torch's
        schedule refuses, or an argument or mesh axis not supported under a pipeline yet;
        all before any collective, on every rank.
      TypeError: ``pipeline`` not an ``fs.Pipeline``; stages not a list of modules.
    """
    axis = mesh_lib.pipeline_axis(mesh)
    if pipeline is None:
        if axis is not None:
            raise ValueError(
                "init: the mesh has a 'pipeline' axis; pass the model's stages and "
                "pipeline=fs.Pipeline(...)"
            )
        return model, mesh, None
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"init: pipeline must be an fs.Pipeline, got {type(pipeline).__name__}")
    if axis is None:
        raise ValueError(
            "init: pipeline= needs a mesh with a 'pipeline' axis: fs.make_mesh(pipeline=P) "
            "with P > 1"
        )
    if isinstance(model, nn.Module) or not isinstance(model, (list, tuple)):
        raise TypeError(
            "init: under a pipeline the model is the list of stages (fs.pipeline.split), "
            f"got {type(model).__name__}"
        )
    _refuse(mesh, pipeline, refused)
    stages, P = list(model), axis.size()
    check_stages(stages, pipeline, P)
    mine = pipeline.stages_of(axis.get_local_rank(), P, len(stages))
    sub = mesh_lib.without_pipeline(mesh)
    names = sub.mesh_dim_names or ()
    from funcshard.step.pipelined import PipelineRun  # torch's pipelining loads dynamo

    run = PipelineRun(
        pipeline,
        stages,
        mine,
        mesh_lib.inherit_timeout(axis.get_group()),
        mesh_lib.local_device(mesh),
        world=mesh_lib.world_group(mesh),
        counts_norm=all(c == 0 for c in sub.get_coordinate()),
        counts_loss=TENSOR not in names or sub.get_local_rank(TENSOR) == 0,
        peers=[mesh[a].get_group() for a in (TENSOR, EXPERT) if a in names and mesh[a].size() > 1],
    )
    _own_buffers([stages[i] for i in mine])
    return merge([stages[i] for i in mine]), sub, run


def _own_buffers(stages: list[nn.Module]) -> None:
    """Each of this rank's stages given its own copy of a buffer an earlier one holds (one on
    a module the split copied into both: the root, a cut container), as torchtitan's stages
    (each a copy of the model) have it: a forward updating it in place (a counter on the
    root) then does so once a microbatch, as the unsplit model's does, not once a stage."""
    seen: set[int] = set()
    for stage in stages:
        copies: dict[int, torch.Tensor] = {}  # a buffer tied within the stage stays tied
        for name, buf in list(stage.named_buffers(remove_duplicate=False)):
            if id(buf) in seen:
                if id(buf) not in copies:
                    copies[id(buf)] = buf.detach().clone()
                owner, _, leaf = name.rpartition(".")
                setattr(stage.get_submodule(owner), leaf, copies[id(buf)])
        seen |= {id(b) for _, b in stage.named_buffers(remove_duplicate=False)}


def _refuse(mesh: DeviceMesh, pipe: Pipeline, refused: dict[str, Any]) -> None:
    names = set(mesh.mesh_dim_names or ())
    for axis in (CONTEXT,):
        if axis in names:
            raise ValueError(
                f"init: Pipeline(schedule={pipe.schedule!r}) on a mesh with a {axis!r} axis "
                "is not supported yet"
            )
    model_axes = [a for a in (TENSOR, EXPERT) if a in names]
    if pipe.regather and model_axes:
        raise ValueError(
            f"init: Pipeline(regather=True) on a mesh with a {model_axes[0]!r} axis is not "
            "supported yet (the per-microbatch gather is tested on plain stages only)"
        )
    refused = dict(refused)
    hfsdp = refused.pop("outer_strategy", None)
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))
    if hfsdp and sizes.get(DATA_AXES[0], 1) > 1 and sizes.get(DATA_AXES[1], 1) > 1:
        raise ValueError(
            f"init: Pipeline(schedule={pipe.schedule!r}) with outer_strategy={hfsdp!r} on "
            f"replicate={sizes[DATA_AXES[0]]} x shard={sizes[DATA_AXES[1]]} ranks per "
            "pipeline rank is not supported yet (HFSDP's master groups span one pipeline "
            "rank only where replicate or shard is 1)"
        )
    for name, value in refused.items():
        if value:
            raise ValueError(
                f"init: Pipeline(schedule={pipe.schedule!r}) with {name}={value!r} is not "
                "supported yet"
            )
