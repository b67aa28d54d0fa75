"""Muon's step on sharded state: owner-computes beside the replicated way.

For GPT-shaped fp32 leaves (Muon for the block matrices, AdamW for embedding, biases, norms) on
``--nproc`` CPU ranks (gloo, one thread each), times ``fs.offload_step`` (the optimizer step,
where the two ways differ) with

* owner-computes (``fs.optim.muon``): each matrix orthogonalized once, by its owner; the rows
  travel in bf16 through two all-to-alls per round;
* replicated (``muon(owner_computes=False)``): every rank all-gathers every whole matrix and
  orthogonalizes all of them, as a Muon bolted onto ZeRO without an owner would.

Also prints the exchange bytes per rank and step beside the gradient bytes a ZeRO-3 step
reduce-scatters (``fs.plan``, one microbatch), and checks both ways give the same params.

With ``--replicate=R`` (a 2-D mesh) or ``--strategy=no_shard`` (every rank a replica) the
replicas share the matrices out and all-gather the results; the replicated way has every
replica do all of them (under ``no_shard``: every rank orthogonalizes every matrix, as a
data-parallel Muon without sharing does).

Run:  python experiments/bench_muon.py --nproc=2   (and --nproc=4, --strategy=no_shard,
      --nproc=4 --replicate=2)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from absl import app, flags
from torch import nn

import funcshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package
from experiments.timing import median_time  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("nproc", 2, "CPU ranks (gloo)")
flags.DEFINE_integer("d_model", 256, "model width")
flags.DEFINE_integer("layers", 2, "blocks (4 matrices each: qkv, proj, fc, fc2)")
flags.DEFINE_integer("vocab", 2048, "embedding rows (AdamW)")
flags.DEFINE_integer("repeats", 3, "timed repetitions (the median is reported)")
flags.DEFINE_string("strategy", "optim_grads_params", "fs.init strategy")
flags.DEFINE_integer("replicate", 1, "replicas (the mesh's replicate axis)")


class GPTLeaves(nn.Module):
    """The parameter shapes of a GPT block stack (no forward: only the optimizer runs)."""

    def __init__(self, d: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, d))
        shapes = [
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
            (d,),
            (d,),
        ]
        self.blocks = nn.ModuleList(
            nn.ParameterList(nn.Parameter(torch.randn(s) * 0.02) for s in shapes)
            for _ in range(layers)
        )


def is_matrix(name: str, shape: tuple) -> bool:
    return len(shape) == 2 and not name.startswith("wte")


def recipe(owner_computes: bool) -> fs.optim.Optimizer:
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0),
        fs.optim.multi_transform(
            {
                "muon": fs.optim.muon(0.02, owner_computes=owner_computes),
                "adamw": fs.optim.adamw(3e-4, weight_decay=0.1, mask=fs.optim.decay_mask),
            },
            lambda name, shape: "muon" if is_matrix(name, shape) else "adamw",
        ),
    )


def worker(d: int, layers: int, vocab: int, repeats: int, strategy: str, replicate: int) -> dict:
    torch.set_num_threads(1)
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    torch.manual_seed(0)
    model = GPTLeaves(d, layers, vocab)
    g = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in model.named_parameters()}
    shards = fs.shard(grads, mesh, strategy=strategy)
    out = {}
    for way, owner in (("owner", True), ("replicated", False)):
        box = [fs.init(model, recipe(owner), mesh=mesh, strategy=strategy)]

        def step(box=box) -> None:
            box[0] = fs.offload_step(box[0], {n: t.clone() for n, t in shards.items()})
            dist.barrier()

        step()  # warm-up
        with fs.comm_stats() as stats:
            step()
        out[way] = median_time(step, repeats)
        out[way + "_bytes"] = stats.bytes["muon"]
        out[way + "_params"] = fs.full_params(box[0])
    out["same"] = all(
        torch.allclose(out["owner_params"][n], out["replicated_params"][n], rtol=0, atol=0)
        for n in out["owner_params"]
    )
    del out["owner_params"], out["replicated_params"]
    return out


def main(argv: list[str]) -> None:
    del argv
    results = fs.launch(
        worker,
        FLAGS.d_model,
        FLAGS.layers,
        FLAGS.vocab,
        FLAGS.repeats,
        FLAGS.strategy,
        FLAGS.replicate,
        nproc=FLAGS.nproc,
    )
    model = GPTLeaves(FLAGS.d_model, FLAGS.layers, FLAGS.vocab)
    mats = sum(p.numel() for n, p in model.named_parameters() if is_matrix(n, tuple(p.shape)))
    p = fs.plan(
        model,
        world_size=FLAGS.nproc,
        replicate=FLAGS.replicate,
        strategy=FLAGS.strategy,
        optimizer=recipe(True),
        device_type="cpu",
    )
    owner = max(r["owner"] for r in results)
    replicated = max(r["replicated"] for r in results)
    print(
        f"{FLAGS.strategy}, {FLAGS.nproc} CPU ranks x 1 thread (replicate "
        f"{FLAGS.replicate}); {mats / 1e6:.2f}M Muon params in "
        f"{4 * FLAGS.layers} matrices, "
        f"{sum(p_.numel() for p_ in model.parameters()) / 1e6:.2f}M params in all"
    )
    print(f"{'optimizer step':<28}{'ms/step':>10}{'muon bytes/rank':>18}")
    print(
        f"{'owner-computes':<28}{owner * 1e3:>10.1f}{max(r['owner_bytes'] for r in results):>18,}"
    )
    print(
        f"{'replicated':<28}{replicated * 1e3:>10.1f}"
        f"{max(r['replicated_bytes'] for r in results):>18,}"
    )
    print(f"replicated / owner-computes: {replicated / owner:.2f}x")
    grad_bytes = p.comm["reduce_scatter"] + p.comm["all_reduce"]
    print(
        f"gradient reduce-scatter + all-reduce bytes/rank (fs.plan): {grad_bytes:,}; "
        f"owner exchange / gradient bytes: "
        f"{max(r['owner_bytes'] for r in results) / grad_bytes:.3f}"
    )
    print(
        f"plan: muon bytes (busiest rank) {p.comm['muon']:,}, owner's whole-matrix memory "
        f"{p.memory.muon_owner:,} B"
    )
    print(f"same params both ways: {all(r['same'] for r in results)}")


if __name__ == "__main__":
    app.run(main)
