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
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from absl import app, flags
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def _global_batch(step: int, cfg: GPTConfig) -> torch.Tensor:
    """The step's global batch: ``FLAGS.batch`` sequences per data-parallel rank at S4."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, cfg.vocab, (4 * FLAGS.batch, cfg.seq_len + 1), generator=g)


class FunShard:
    """funcshard ZeRO-3 on a (shard, tensor) mesh."""

    def __init__(self, model: GPT, shard: int, tensor: int) -> None:
        self.mesh = fs.make_mesh(shard=shard, tensor=tensor, device_type="cpu")
        self.model = copy.deepcopy(model)
        if tensor > 1:
            for block in self.model.blocks:
                parallelize_module(block, self.mesh["tensor"], tensor_plan())
        self.state = fs.init(self.model, fs.optim.adamw(LR), mesh=self.mesh)
        self.dp_rank, self.dp_size = dist.get_rank() // tensor, shard
        self.bytes: dict[str, int] = {}

    def step(self, x: torch.Tensor) -> float:
        def loss_fn(params, batch):
            return _loss(fs.functional_call(self.model, params, (batch[:, :-1],)), batch)

        with fs.comm_stats() as stats:
            self.state, metrics = fs.train_step(
                self.state, x, loss_fn, microbatches=FLAGS.microbatches
            )
        self.bytes = dict(stats.bytes_by_axis)
        return metrics["loss"]

    def state_bytes(self) -> int:
        leaves = [t for t in fs.tree.leaves(self.state) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in leaves)


class Fsdp2:
    """FSDP2 + TP on the same plan: fully_shard per block and the root on mesh["shard"]."""

    def __init__(self, model: GPT, mesh) -> None:
        self.model = copy.deepcopy(model)
        for block in self.model.blocks:
            parallelize_module(block, mesh["tensor"], tensor_plan())
            fully_shard(block, mesh=mesh["shard"], reshard_after_forward=True)
        fully_shard(self.model, mesh=mesh["shard"], reshard_after_forward=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, foreach=True)

    def step(self, x: torch.Tensor) -> float:
        total = 0.0
        parts = x.chunk(FLAGS.microbatches)
        for part in parts:
            loss = _loss(self.model(part[:, :-1]), part) / len(parts)
            loss.backward()
            total += float(loss.detach())
        # no gradient norm: torch's clip_grad_norm_ refuses FSDP2 + TP's mix of meshes (the
        # 1-D and 2-D DTensors); funcshard computes its norm every step (a small advantage
        # to FSDP2 here)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mean = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(mean)  # the global mean, as funcshard's metrics
        return float(mean) / dist.get_world_size()  # a tensor group's ranks: the same loss

    def state_bytes(self) -> int:
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        params = [local(p) for p in self.model.parameters()]
        moments = [
            local(v)
            for s in self.opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return sum(t.numel() * t.element_size() for t in params + moments)


def worker(cfg: GPTConfig, argv: list[str]) -> dict:
    FLAGS(argv)  # a spawned rank parses the flags again
    torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(0)
    model = GPT(cfg)
    runners = {
        "funcshard S4": FunShard(model, 4, 1),
        "funcshard S2xT2": FunShard(model, 2, 2),
    }
    runners["FSDP2+TP S2xT2"] = Fsdp2(model, runners["funcshard S2xT2"].mesh)
    dp = {"funcshard S4": (dist.get_rank(), 4), "funcshard S2xT2": (dist.get_rank() // 2, 2)}
    dp["FSDP2+TP S2xT2"] = dp["funcshard S2xT2"]
    wall = {n: [] for n in runners}
    cpu = {n: [] for n in runners}
    losses = {n: [] for n in runners}
    for step in range(FLAGS.warmup + FLAGS.steps):
        for name, runner in runners.items():
            index, size = dp[name]
            x = _global_batch(step, cfg).chunk(size)[index]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(runner.step(x))
            if step >= FLAGS.warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return {
        "wall": {n: statistics.median(v) for n, v in wall.items()},
        "cpu": {n: statistics.median(v) for n, v in cpu.items()},
        "state_bytes": {n: r.state_bytes() for n, r in runners.items()},
        "bytes_by_axis": {n: r.bytes for n, r in runners.items() if isinstance(r, FunShard)},
        "losses": losses,
    }


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
    print(f"{'runner':<18}{'wall s':>9}{'cpu s':>9}{'state MB/rank':>15}  bytes/step by axis")
    for name in r0["wall"]:
        axes = r0["bytes_by_axis"].get(name, {})
        shown = ", ".join(f"{a} {b / 1e6:.2f} MB" for a, b in sorted(axes.items()) if b)
        print(
            f"{name:<18}{r0['wall'][name]:>9.3f}{r0['cpu'][name]:>9.3f}"
            f"{max(o['state_bytes'][name] for o in out) / 1e6:>15.2f}  {shown or '-'}"
        )
    ours, theirs = r0["wall"]["funcshard S2xT2"], r0["wall"]["FSDP2+TP S2xT2"]
    ours_c, theirs_c = r0["cpu"]["funcshard S2xT2"], r0["cpu"]["FSDP2+TP S2xT2"]
    print(f"funcshard / FSDP2+TP at T=2: wall {ours / theirs:.2f}, cpu {ours_c / theirs_c:.2f}")
    print(f"funcshard T=2 / T=1: wall {ours / r0['wall']['funcshard S4']:.2f}")
    curves = r0["losses"]
    diff = max(
        abs(a - b) for n in curves for a, b in zip(curves[n], curves["funcshard S4"], strict=True)
    )
    print(f"largest loss difference between runners: {diff:.2e}")


if __name__ == "__main__":
    app.run(main)
