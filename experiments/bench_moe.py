"""Mixture of experts under expert parallel: funcshard with its experts on mesh["expert"]
(S=4, E flag) beside the same model trained as a dense one (S=4, every expert gathered on every
rank) and beside PyTorch's FSDP2 with the experts on their own mesh (torchtitan's recipe with
torch's APIs: the experts ``Shard(0)`` on mesh["expert"] by ``fs.ExpertParallel``, then
``fully_shard`` of the experts over "shard_outer" and of each block and the root over
"shard"). One MoE GPT (8 experts, top-2), one data stream, 4 gloo CPU ranks, fp32, AdamW.

    python experiments/bench_moe.py                        # 4 ranks, short
    python experiments/bench_moe.py --expert=4 --strategy=optim_grads

The runners step in turn so that all see the same machine load. Printed: median step time
(wall, and CPU time of the rank's process), the ratios funcshard EP / funcshard dense and
funcshard EP / FSDP2 EP, the state bytes per rank, funcshard's bytes per step by mesh axis
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
from gpt import GPT, GPTConfig, GroupedExperts  # noqa: E402

import funcshard as fs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 8, "Timed steps per runner.")
flags.DEFINE_integer("warmup", 1, "Untimed steps first.")
flags.DEFINE_integer("microbatches", 2, "Microbatches per step.")
flags.DEFINE_integer("batch", 4, "Sequences per data-parallel rank per step.")
flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
flags.DEFINE_integer("d_model", 256, "Model width.")
flags.DEFINE_integer("n_layer", 2, "Transformer blocks.")
flags.DEFINE_integer("n_head", 4, "Attention heads.")
flags.DEFINE_integer("experts", 8, "Experts per block.")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_integer("expert", 2, "Expert-parallel ranks (out of the 4 shard ranks).")
flags.DEFINE_enum("strategy", "optim_grads_params", list(fs.STRATEGIES), "funcshard's strategy.")
flags.DEFINE_integer("threads", 1, "Intra-op threads per rank.")

LR = 1e-3
NPROC = 4


def _experts(model: GPT) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def _funshard(model: GPT, mesh) -> turns.FunShard:
    """funcshard on ``mesh``: its experts over mesh["expert"] where it has one, else dense."""
    model = copy.deepcopy(model)
    for experts in _experts(model) if "expert" in mesh.mesh_dim_names else ():
        parallelize_module(experts, mesh["expert"], fs.ExpertParallel())
    state = fs.init(model, fs.optim.adamw(LR), mesh=mesh, strategy=FLAGS.strategy)
    return turns.FunShard(model, state, FLAGS.microbatches)


def _fsdp2(model: GPT, mesh) -> turns.Fsdp2:
    """FSDP2 with the experts on their own mesh: Shard(0) on mesh["expert"], fully_shard of
    the experts over "shard_outer", of each block and the root over "shard" (ZeRO-3)."""
    model = copy.deepcopy(model)
    for experts in _experts(model):
        parallelize_module(experts, mesh["expert"], fs.ExpertParallel())
        fully_shard(experts, mesh=mesh["shard_outer"], reshard_after_forward=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["shard"], reshard_after_forward=True)
    size = mesh["expert"].size()

    def mean_over_every_rank() -> None:
        # fully_shard over "shard_outer" averages the experts' gradients over S / E ranks;
        # the mean over all S is E times smaller (torchtitan sets the divide factor, which
        # gloo's reduce-scatter does not take: PREMUL_SUM)
        for experts in _experts(model):
            for p in experts.parameters():
                p.grad.div_(size)

    return turns.Fsdp2(model, LR, FLAGS.microbatches, after_backward=mean_over_every_rank)


def worker(cfg: GPTConfig, argv: list[str]) -> dict:
    FLAGS(argv)  # a spawned rank parses the flags again
    torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = fs.make_mesh(shard=4, expert=FLAGS.expert, device_type="cpu")
    ep = f"funcshard EP S4xE{FLAGS.expert}"
    runners = {
        ep: _funshard(model, mesh),
        "funcshard dense S4": _funshard(model, fs.make_mesh(shard=4, device_type="cpu")),
    }
    try:
        runners[f"FSDP2 EP S4xE{FLAGS.expert}"] = _fsdp2(model, mesh)
    except Exception as e:  # noqa: BLE001 - reported, the others still run
        print(f"FSDP2 with experts on their own mesh did not build: {type(e).__name__}: {e}")
    rows, rank = 4 * FLAGS.batch, dist.get_rank()
    batch_of = lambda name, step: turns.global_batch(  # noqa: E731
        step, cfg.vocab, cfg.seq_len, rows
    ).chunk(4)[rank]
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
        experts=FLAGS.experts,
        top_k=FLAGS.top_k,
    )
    out = fs.launch(worker, cfg, list(sys.argv), nproc=NPROC)
    r0 = out[0]
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    print(
        f"MoE GPT {n_params / 1e6:.1f}M params ({FLAGS.experts} experts, top-{FLAGS.top_k}), "
        f"{NPROC} gloo CPU ranks, fp32, {FLAGS.strategy}, AdamW"
    )
    turns.print_table(out)
    names = list(r0["wall"])
    ep, dense = names[0], names[1]
    print(f"funcshard EP / funcshard dense: wall {r0['wall'][ep] / r0['wall'][dense]:.2f}")
    if len(names) > 2:
        print(f"funcshard EP / FSDP2 EP: wall {r0['wall'][ep] / r0['wall'][names[2]]:.2f}")
    diff = turns.largest_loss_difference(r0, ep)
    print(f"largest loss difference between runners: {diff:.2e}")


if __name__ == "__main__":
    app.run(main)
