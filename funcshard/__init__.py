"""funcshard: functional fully-sharded data parallel training on torch.func."""

from funcshard import optim
from funcshard.collectives import CommStats, comm_stats
from funcshard.functional import GatheredParams, functional_call
from funcshard.launch import launch
from funcshard.layout import STRATEGIES
from funcshard.mesh import make_mesh
from funcshard.offload import offload_step
from funcshard.policy import MixedPrecisionPolicy
from funcshard.reduce import reduce_scatter_grads
from funcshard.sharding import shard
from funcshard.state import LossScale, TrainState, describe, init, tree
from funcshard.state import ConsumedStateError
from funcshard.step import full_params, train_step

__all__ = [
    "STRATEGIES",
    "CommStats",
    "ConsumedStateError",
    "GatheredParams",
    "LossScale",
    "MixedPrecisionPolicy",
    "TrainState",
    "comm_stats",
    "describe",
    "full_params",
    "functional_call",
    "init",
    "launch",
    "make_mesh",
    "offload_step",
    "optim",
    "reduce_scatter_grads",
    "shard",
    "train_step",
    "tree",
]
