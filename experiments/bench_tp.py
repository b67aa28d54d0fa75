"""Tensor parallel x fully sharded: funcshard on (S=4, T=1) and (S=2, T=2) beside PyTorch's
FSDP2 + TP on the same plan, one GPT, one data stream, 4 gloo CPU ranks.

    python experiments/bench_tp.py                         # 4 ranks, short
    python experiments/bench_tp.py --steps=20 --d_model=512 --n_layer=4

The tensor-parallel runs split every block with ``gpt.tensor_plan`` (torchtitan's Llama plan:
q, k, v and the MLP's first layer colwise, the projections back rowwise) through torch's
``parallelize_module`` on ``mesh["tensor"]``; funcshard then shards each DTensor's local shard
over "shard" (``fs.init``), FSDP2 its own way (``fully_shard`` per block, then the root, on the
"shard" submesh: 2-D DTensors). ZeRO-3 both (``reshard_after_forward=True``), fp32, AdamW.
The three runners step in turn (funcshard S4, funcshard S2xT2, FSDP2 S2xT2, then again ...)
so that all see the same machine load. Printed: median step time (wall, and CPU time of the
rank's process), the ratio funcshard / FSDP2 at T=2, the state bytes per rank (params,
gradients' accumulators are per step), funcshard's bytes per step by mesh axis
(``fs.comm_stats``), and the loss curves' largest difference.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from absl import app, flags
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import turns  # noqa: E402
from gpt import GPT, GPTConfig, tensor_plan  # noqa: E402

import funcshard as fs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 8, "Timed steps per runner.")
flags.DEFINE_integer("warmup", 1, "Untimed steps first.")
flags.DEFINE_integer("microbatches", 2, "Microbatches per step.")
flags.DEFINE_integer("batch", 4, "Sequences per data-parallel rank per step.")
flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
flags.DEFINE_integer("vocab", 4096, "Vocabulary size.")
flags.DEFINE_integer("d_model", 256, "Model width.")
flags.DEFINE_integer("n_layer", 4, "Transformer blocks.")
flags.DEFINE_integer("n_head", 8, "Attention heads (divisible by 2: split over T=2).")
flags.DEFINE_integer("threads", 1, "Intra-op threads per rank.")

LR = 1e-3
NPROC = 4


def _funshard(model: GPT, mesh, tensor: int) -> turns.FunShard:
    """funcshard ZeRO-3 on a (shard, tensor) mesh."""
    model = copy.deepcopy(model)
    if tensor > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tensor"], tensor_plan())
    state = fs.init(model, fs.optim.adamw(LR), mesh=mesh)
    return turns.FunShard(model, state, FLAGS.microbatches)


def _fsdp2(model: GPT, mesh) -> turns.Fsdp2:
    """FSDP2 + TP on the same plan: fully_shard per block and the root on mesh["shard"]."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tensor"], tensor_plan())
        fully_shard(block, mesh=mesh["shard"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["shard"], reshard_after_forward=True)
    return turns.Fsdp2(model, LR, FLAGS.microbatches)


def worker(cfg: GPTConfig, argv: list[str]) -> dict:
    FLAGS(argv)  # a spawned rank parses the flags again
    torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = fs.make_mesh(shard=2, tensor=2, device_type="cpu")
    runners = {
        "funcshard S4": _funshard(model, fs.make_mesh(shard=4, device_type="cpu"), 1),
        "funcshard S2xT2": _funshard(model, mesh, 2),
        "FSDP2+TP S2xT2": _fsdp2(model, mesh),
    }
    rank = dist.get_rank()
    dp = {"funcshard S4": (rank, 4), "funcshard S2xT2": (rank // 2, 2)}
    dp["FSDP2+TP S2xT2"] = dp["funcshard S2xT2"]

    def batch_of(name: str, step: int) -> torch.Tensor:
        index, size = dp[name]
        return turns.global_batch(step, cfg.vocab, cfg.seq_len, 4 * FLAGS.batch).chunk(size)[index]

    return turns.in_turns(runners, batch_of, FLAGS.steps, FLAGS.warmup)


def main(argv: list[str]) -> None:
    del argv
    cfg = GPTConfig(
        vocab=FLAGS.vocab,
        seq_len=FLAGS.seq_len,
        n_layer=FLAGS.n_layer,
        n_head=FLAGS.n_head,
        d_model=FLAGS.d_model,
        tied=False,
    )
    out = fs.launch(worker, cfg, list(sys.argv), nproc=NPROC)
    r0 = out[0]
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT {n_params / 1e6:.1f}M params, {NPROC} gloo CPU ranks, fp32, ZeRO-3, AdamW")
    turns.print_table(out, width=18)
    ours, theirs = r0["wall"]["funcshard S2xT2"], r0["wall"]["FSDP2+TP S2xT2"]
    ours_c, theirs_c = r0["cpu"]["funcshard S2xT2"], r0["cpu"]["FSDP2+TP S2xT2"]
    print(f"funcshard / FSDP2+TP at T=2: wall {ours / theirs:.2f}, cpu {ours_c / theirs_c:.2f}")
    print(f"funcshard T=2 / T=1: wall {ours / r0['wall']['funcshard S4']:.2f}")
    diff = turns.largest_loss_difference(r0, "funcshard S4")
    print(f"largest loss difference between runners: {diff:.2e}")


if __name__ == "__main__":
    app.run(main)
