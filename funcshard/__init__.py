"""funcshard: functional fully-sharded data parallel training on torch.func."""

from funcshard import optim
from funcshard.checkpoint import CheckpointManager, export_safetensors, restore, save
from funcshard.comm.grads import reduce_scatter_grads
from funcshard.comm.ops import CommStats, comm_stats
from funcshard.fault import FaultTolerance
from funcshard.functional import GatheredParams, functional_call
from funcshard.launch import init_from_env, launch
from funcshard.layout import STRATEGIES
from funcshard.mesh import make_mesh
from funcshard.offload import offload_step
from funcshard.plan import plan
from funcshard.policy import MixedPrecisionPolicy
from funcshard.replica_check import ReplicaMismatchError, check_replicas
from funcshard.sharding import shard
from funcshard.state import ConsumedStateError, LossScale, TrainState, init, tree
from funcshard.step import full_params, train_step
from funcshard.strategy import OuterStrategy, Strategy
from funcshard.summary import describe
from funcshard.units import UnitParamsError

__all__ = [
    "STRATEGIES",
    "CheckpointManager",
    "CommStats",
    "ConsumedStateError",
    "FaultTolerance",
    "GatheredParams",
    "LossScale",
    "MixedPrecisionPolicy",
    "OuterStrategy",
    "ReplicaMismatchError",
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
    "plan",
    "reduce_scatter_grads",
    "restore",
    "save",
    "shard",
    "train_step",
    "tree",
]
