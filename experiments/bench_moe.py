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


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def _global_batch(step: int, cfg: GPTConfig) -> torch.Tensor:
    """The step's global batch: ``FLAGS.batch`` sequences per data-parallel rank at S4."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, cfg.vocab, (4 * FLAGS.batch, cfg.seq_len + 1), generator=g)


def _experts(model: GPT):
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


class FunShard:
    """funcshard on (shard=4, expert=E): its experts over mesh["expert"] (E > 1), or dense."""

    def __init__(self, model: GPT, expert: int) -> None:
        self.mesh = fs.make_mesh(shard=4, expert=expert, device_type="cpu")
        self.model = copy.deepcopy(model)
        for experts in _experts(self.model) if expert > 1 else ():
            parallelize_module(experts, self.mesh["expert"], fs.ExpertParallel())
        self.state = fs.init(
            self.model, fs.optim.adamw(LR), mesh=self.mesh, strategy=FLAGS.strategy
        )
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
    """FSDP2 with the experts on their own mesh: Shard(0) on mesh["expert"], fully_shard of
    the experts over "shard_outer", of each block and the root over "shard" (ZeRO-3)."""

    def __init__(self, model: GPT, mesh) -> None:
        self.model = copy.deepcopy(model)
        self.expert = mesh["expert"].size()
        for experts in _experts(self.model):
            parallelize_module(experts, mesh["expert"], fs.ExpertParallel())
            fully_shard(experts, mesh=mesh["shard_outer"], reshard_after_forward=True)
        for block in self.model.blocks:
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
        # fully_shard over "shard_outer" averages the experts' gradients over S / E ranks;
        # the mean over all S is E times smaller (torchtitan sets the divide factor, which
        # gloo's reduce-scatter does not take: PREMUL_SUM)
        for experts in _experts(self.model):
            for p in experts.parameters():
                p.grad.div_(self.expert)
        # no gradient norm: torch's clip_grad_norm_ refuses the experts' and the blocks'
        # mix of meshes; funcshard computes its norm every step (a small advantage to FSDP2)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mean = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(mean)  # the global mean, as funcshard's metrics
        return float(mean) / dist.get_world_size()

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
    ep = f"funcshard EP S4xE{FLAGS.expert}"
    runners = {ep: FunShard(model, FLAGS.expert), "funcshard dense S4": FunShard(model, 1)}
    try:
        runners[f"FSDP2 EP S4xE{FLAGS.expert}"] = Fsdp2(model, runners[ep].mesh)
    except Exception as e:  # noqa: BLE001 - reported, the others still run
        print(f"FSDP2 with experts on their own mesh did not build: {type(e).__name__}: {e}")
    dp = dict.fromkeys(runners, (dist.get_rank(), 4))
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
    print(f"{'runner':<22}{'wall s':>9}{'cpu s':>9}{'state MB/rank':>15}  bytes/step by axis")
    for name in r0["wall"]:
        axes = r0["bytes_by_axis"].get(name, {})
        shown = ", ".join(f"{a} {b / 1e6:.2f} MB" for a, b in sorted(axes.items()) if b)
        print(
            f"{name:<22}{r0['wall'][name]:>9.3f}{r0['cpu'][name]:>9.3f}"
            f"{max(o['state_bytes'][name] for o in out) / 1e6:>15.2f}  {shown or '-'}"
        )
    names = list(r0["wall"])
    ep, dense = names[0], names[1]
    print(f"funcshard EP / funcshard dense: wall {r0['wall'][ep] / r0['wall'][dense]:.2f}")
    if len(names) > 2:
        print(f"funcshard EP / FSDP2 EP: wall {r0['wall'][ep] / r0['wall'][names[2]]:.2f}")
    curves = r0["losses"]
    diff = max(abs(a - b) for n in curves for a, b in zip(curves[n], curves[ep], strict=True))
    print(f"largest loss difference between runners: {diff:.2e}")


if __name__ == "__main__":
    app.run(main)
