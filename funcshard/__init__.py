"""funcshard: functional fully-sharded data parallel training on torch.func."""

from funcshard import optim
from funcshard.checkpoint import CheckpointManager, export_safetensors, restore, save
from funcshard.comm.grads import reduce_scatter_grads
from funcshard.distributed.launch import init_from_env, launch
from funcshard.distributed.mesh import make_mesh
from funcshard.distributed.ops import CommStats, comm_stats
from funcshard.fault.replicas import FaultTolerance
from funcshard.layout.layout import STRATEGIES
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.sharding import shard
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.parallel import pipeline
from funcshard.parallel.context import ContextParallel
from funcshard.parallel.pipeline import Pipeline
from funcshard.planner.experts import Routing
from funcshard.planner.plan import plan
from funcshard.planner.summary import describe
from funcshard.state.replica_check import ReplicaMismatchError, check_replicas
from funcshard.state.state import ConsumedStateError, LossScale, TrainState, tree
from funcshard.step.functional import GatheredParams, functional_call
from funcshard.step.init import init
from funcshard.step.summed import summed
from funcshard.step.train import full_params, train_step
from funcshard.step.units import UnitParamsError
from funcshard.step.update import offload_step

__all__ = [
    "STRATEGIES",
    "CheckpointManager",
    "CommStats",
    "ConsumedStateError",
    "ContextParallel",
    "ExpertParallel",
    "FaultTolerance",
    "GatheredParams",
    "LossScale",
    "MixedPrecisionPolicy",
    "OuterStrategy",
    "Pipeline",
    "ReplicaMismatchError",
    "Routing",
    "Strategy",
    "TrainState",
    "UnitParamsError",
    "check_replicas",
    "comm_stats",
    "describe",
    "export_safetensors",
    "full_params",
    "functional_call",
    "init",
    "launch",
    "init_from_env",
    "make_mesh",
    "offload_step",
    "optim",
    "pipeline",
    "plan",
    "reduce_scatter_grads",
    "restore",
    "save",
    "shard",
    "summed",
    "train_step",
    "tree",
]


def __getattr__(name: str):
    """``fs.ExpertParallel``, imported at its first use: a torch ``ParallelStyle``, whose
    import (DTensor's) takes most of a second that a program without experts never needs."""
    if name == "ExpertParallel":
        from funcshard.parallel.experts import ExpertParallel

        return ExpertParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
