"""Context parallel against one rank on whole sequences: the GPT of experiments/gpt.py at
growing sequence lengths, ``C`` gloo CPU ranks splitting each sequence (``fs.ContextParallel``,
both algorithms) beside one rank running the same batch whole. fp32, SGD, ZeRO-3.

    python experiments/bench_context.py                          # C=2, L=256 and 1024
    python experiments/bench_context.py --context=4 --lengths=4096

Printed per (L, algorithm): median step time, tokens per second per rank, the peak resident
memory a step adds on rank 0 (activations, mostly: ``funcshard.testing.PeakMemory``; start with
``MALLOC_MMAP_THRESHOLD_=65536`` for allocations to show up and go as they happen), the
"context" bytes per step, and the ratios against C=1. Not a timed assertion: a table.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402

import funcshard as fs  # noqa: E402
from funcshard.parallel import ring  # noqa: E402
from funcshard.parallel.attention import Chunks  # noqa: E402
from funcshard.testing import PeakMemory  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("context", 2, "Ranks per context group.")
flags.DEFINE_list("lengths", ["256", "1024"], "Sequence lengths.")
flags.DEFINE_list("algorithms", ["all_to_all", "ring"], "Context-parallel algorithms.")
flags.DEFINE_integer("steps", 3, "Timed steps.")
flags.DEFINE_integer("batch", 2, "Sequences per step.")
flags.DEFINE_integer("n_layer", 2, "Layers.")
flags.DEFINE_integer("d_model", 64, "Width.")
flags.DEFINE_integer("n_head", 4, "Heads.")

SEQ_DIMS = {"tokens": 1, "labels": 1, "positions": 1}


def _batch(step: int, rows: int, length: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (rows, length + 1), generator=g)
    positions = torch.arange(length).expand(rows, length).contiguous()
    return {"tokens": x[:, :-1], "labels": x[:, 1:], "positions": positions}


def worker(length: int, algorithm: str | None, cfg: dict, steps: int, rows: int) -> dict:
    context = dist.get_world_size()
    torch.set_num_threads(1)
    mesh = fs.make_mesh(context=context, device_type="cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=length, **cfg))
    cp = fs.ContextParallel(seq_dims=SEQ_DIMS, algorithm=algorithm) if algorithm else None
    state = fs.init(model, fs.optim.sgd(1e-3), mesh=mesh, context=cp)

    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["tokens"], batch["positions"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    times, peaks, exchanged = [], [], 0
    for step in range(steps + 1):
        batch = _batch(step, rows, length, 64)
        with PeakMemory() as peak, fs.comm_stats() as stats:
            start = time.perf_counter()
            state, _ = fs.train_step(state, batch, loss_fn)
            elapsed = time.perf_counter() - start
        if step:  # the first step warms up
            times.append(elapsed)
            peaks.append(peak.extra)
            exchanged = stats.bytes_by_axis["context"]
    return {"time": statistics.median(times), "peak": max(peaks), "context": exchanged}


def main(argv: list[str]) -> None:
    del argv
    cfg = {"n_layer": FLAGS.n_layer, "d_model": FLAGS.d_model, "n_head": FLAGS.n_head}
    print(f"C={FLAGS.context}, batch {FLAGS.batch}, {cfg}, median of {FLAGS.steps} steps")
    header = f"{'L':>6} {'run':>14} {'step s':>8} {'tok/s/rank':>11} {'peak MB':>8}"
    print(header + f" {'context MB':>11} {'time/C=1':>9} {'mem/C=1':>8}")
    for length in map(int, FLAGS.lengths):
        run = (cfg, FLAGS.steps, FLAGS.batch)
        base = fs.launch(worker, length, None, *run, nproc=1)[0]
        runs = [("C=1", base)]
        for algorithm in FLAGS.algorithms:
            out = fs.launch(worker, length, algorithm, *run, nproc=FLAGS.context)[0]
            runs.append((algorithm, out))
        for name, r in runs:
            ranks = 1 if name == "C=1" else FLAGS.context
            tokens = FLAGS.batch * length / ranks / r["time"]
            print(
                f"{length:>6} {name:>14} {r['time']:>8.3f} {tokens:>11.0f} "
                f"{r['peak'] / 1e6:>8.1f} {r['context'] / 1e6:>11.2f} "
                f"{r['time'] / base['time']:>9.2f} {r['peak'] / max(base['peak'], 1):>8.2f}"
            )
        _print_flops(length, cfg)


def _print_flops(length: int, cfg: dict) -> None:
    """The ring's attention FLOPs per rank (forward, every layer; what its kernel calls run:
    ``ring.flops``), load balanced and not, and their spread."""
    C = FLAGS.context
    shape = (FLAGS.batch, cfg["n_head"], length // C, cfg["d_model"] // cfg["n_head"])
    for balanced in (True, False):
        per = [cfg["n_layer"] * ring.flops(Chunks(C, balanced), r, True, shape) for r in range(C)]
        spread = (max(per) - min(per)) / max(per)
        print(
            f"{length:>6} ring FLOPs/rank (load_balance={balanced}): "
            f"{', '.join(f'{f / 1e9:.3f}G' for f in per)}; spread {100 * spread:.1f}%"
        )


if __name__ == "__main__":
    app.run(main)
