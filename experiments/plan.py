"""Predicted per-rank memory and per-step communication of each strategy, from shapes alone.

python experiments/plan.py                                   # Llama-2-70B on 1024 ranks
python experiments/plan.py --model=zero_7.5b --world_size=64 --policy=fp16_grads16
python experiments/plan.py --model=llama8b --world_size=32 --replicate=4 --outer_strategy=optim
python experiments/plan.py --model=llama8b --world_size=32 --replicate=4 --outer_strategy=optim \
    --grad_comm_dtype=int8 --param_comm_dtype=int8
"""

from __future__ import annotations

import dataclasses

import torch
from absl import app, flags

import funcshard as fs
from funcshard.planner.plan import format_bytes, transformer_shapes

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "llama70b", ["llama70b", "llama8b", "zero_7.5b"], "Shapes to plan.")
flags.DEFINE_integer("world_size", 1024, "Data-parallel ranks.")
flags.DEFINE_integer("replicate", 1, "Replicas (HSDP when > 1).")
flags.DEFINE_enum(
    "outer_strategy", "no_shard", ["no_shard", "optim"], "optim: HFSDP (sharded over replicas)."
)
flags.DEFINE_integer("microbatches", 1, "Microbatches per step.")
flags.DEFINE_integer(
    "replica_groups",
    1,
    "Fault-tolerant replica groups of --world_size ranks each (torchft's all-reduce across "
    'them: the axis "replicas").',
    lower_bound=1,
)
flags.DEFINE_float("offload_fraction", 0.0, "Share of the optimizer stepped on the host.")
flags.DEFINE_enum("optimizer", "adamw", ["adamw", "sgd_momentum", "sgd"], "Optimizer kind.")
flags.DEFINE_enum(
    "policy",
    "bf16",
    ["fp32", "bf16", "bf16_wire", "fp16_grads16"],
    "fp32 | bf16 compute + fp32 master/grads | ... + bf16 wire | the ZeRO paper's "
    "(fp16 params and grads, fp32 master)",
)

WIRES = {"none": None, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
flags.DEFINE_enum(
    "grad_comm_dtype", "none", list(WIRES), "The gradients' wire (none: the policy's)."
)
flags.DEFINE_enum("param_comm_dtype", "none", list(WIRES), "The params' wire (none: the policy's).")

POLICIES = {
    "fp32": fs.MixedPrecisionPolicy(),
    "bf16": fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "bf16_wire": fs.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, grad_comm_dtype=torch.bfloat16
    ),
    "fp16_grads16": fs.MixedPrecisionPolicy(param_dtype=torch.float16, main_grads_dtype=None),
}
SHAPES = {
    "llama70b": transformer_shapes,
    "llama8b": lambda: transformer_shapes(
        n_layers=32, dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, vocab=128256
    ),
    "zero_7.5b": lambda: {"w": (7_500_000_000,)},
}
COLUMNS = ("master", "compute", "compute_shard", "grads", "opt_state", "gathered_peak", "host")


def _policy() -> fs.MixedPrecisionPolicy:
    """``--policy`` with the wires the flags name instead of its own."""
    wires = {
        name: WIRES[getattr(FLAGS, name)]
        for name in ("grad_comm_dtype", "param_comm_dtype")
        if getattr(FLAGS, name) != "none"
    }
    return dataclasses.replace(POLICIES[FLAGS.policy], **wires)


def main(argv: list[str]) -> None:
    del argv
    shapes = SHAPES[FLAGS.model]()
    policy = _policy()
    plans = [
        fs.plan(
            shapes,
            world_size=FLAGS.world_size,
            replicate=FLAGS.replicate,
            strategy=s,
            policy=policy,
            microbatches=FLAGS.microbatches,
            offload_fraction=FLAGS.offload_fraction,
            optimizer=FLAGS.optimizer,
            outer_strategy=FLAGS.outer_strategy,
            replica_groups=FLAGS.replica_groups,
        )
        for s in fs.STRATEGIES
        if s != "no_shard" or FLAGS.outer_strategy == "no_shard"
    ]
    p0 = plans[-1]
    print(
        f"{FLAGS.model}: {p0.numel:,} params, {p0.units} units; world={FLAGS.world_size} "
        f"replicate={FLAGS.replicate} outer_strategy={FLAGS.outer_strategy} "
        f"policy={FLAGS.policy} grad_comm_dtype={FLAGS.grad_comm_dtype} "
        f"param_comm_dtype={FLAGS.param_comm_dtype} optimizer={FLAGS.optimizer} "
        f"microbatches={FLAGS.microbatches} replica_groups={FLAGS.replica_groups}"
    )
    print("\nmemory per rank (GB = 1e9 B)")
    print(f"{'strategy':<20}" + "".join(f"{c:>15}" for c in (*COLUMNS, "model_states")))
    for p in plans:
        vals = [getattr(p.memory, c) for c in COLUMNS] + [p.memory.model_states]
        print(f"{p.strategy:<20}" + "".join(f"{format_bytes(v):>15}" for v in vals))
    print("\ncommunicated per rank per step (calls)")
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "metrics")
    print(f"{'strategy':<20}" + "".join(f"{k:>24}" for k in kinds))
    for p in plans:
        cells = [f"{format_bytes(p.comm[k])} ({p.calls[k]})" for k in kinds]
        print(f"{p.strategy:<20}" + "".join(f"{c:>24}" for c in cells))
    print('\nthe same per mesh axis ("replicate": between nodes)')
    print(f"{'strategy':<20}" + "".join(f"{a:>15}" for a in p0.comm_by_axis))
    for p in plans:
        cells = [format_bytes(v) for v in p.comm_by_axis.values()]
        print(f"{p.strategy:<20}" + "".join(f"{c:>15}" for c in cells))


if __name__ == "__main__":
    app.run(main)
