"""The cost of train_step's batch check on a tensor group: what a rank received fingerprinted
(:func:`funcshard.parallel.batch.batch_fingerprint`), the fingerprints and losses all-gathered
over "tensor" and compared, beside the check it replaced (the loss alone all-gathered).

    python experiments/bench_batch_check.py                  # 2 gloo CPU ranks, T=2
    python experiments/bench_batch_check.py --rows=8192 --seq_len=2048
    python experiments/bench_batch_check.py --dtype=uint8 --rows=4800 --seq_len=500  # 4.6 MiB

Printed: median microseconds of each part on the slower rank (the two batch leaves, "x" and
"y", are ``--dtype`` of ``rows x seq_len``: int64 a realistic global batch of token ids), the
ratio of the whole check (fingerprint + gather and verdict, timed apart: the step
fingerprints as it starts and gathers after backward) to the loss-only one it replaced, what
it adds to a step, and the fingerprint beside a clone of the batch: time and the peak memory
it adds (its scratch; the ranks run with ``MALLOC_MMAP_THRESHOLD_`` so freed blocks leave).
"""

from __future__ import annotations

import os
import sys

import torch
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import median_time  # noqa: E402

import funcshard as fs  # noqa: E402
from funcshard.distributed import ops  # noqa: E402
from funcshard.parallel import batch as batch_lib  # noqa: E402
from funcshard.parallel import tensor as tp_lib  # noqa: E402
from funcshard.testing import PeakMemory  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 2048, "Rows of each batch leaf.")
flags.DEFINE_integer("seq_len", 8, "Tokens per row.")
flags.DEFINE_integer("repeats", 200, "Timed calls per part.")
flags.DEFINE_integer("threads", 1, "torch threads per rank.")
flags.DEFINE_enum("dtype", "int64", ["int64", "uint8"], "dtype of the batch leaves.")
NPROC = 2


def worker(argv: list[str]) -> dict:
    FLAGS(argv)  # a spawned rank parses the flags again
    torch.set_num_threads(FLAGS.threads)
    mesh = fs.make_mesh(shard=1, tensor=NPROC, device_type="cpu")
    tensor = tp_lib.TensorParallel(mesh["tensor"], {})
    g = torch.Generator().manual_seed(0)
    dtype, high = (torch.int64, 50_000) if FLAGS.dtype == "int64" else (torch.uint8, 256)
    shape = (FLAGS.rows, FLAGS.seq_len)
    batch = {k: torch.randint(0, high, shape, generator=g, dtype=dtype) for k in "xy"}
    cpu, loss = torch.device("cpu"), torch.tensor(3.5, dtype=torch.float64)

    check = tensor.batch_check(batch, cpu)  # fingerprints the batch

    def verdict():  # the step fingerprints as it starts, gathers after backward
        assert check.flag([loss]) == 0.0

    def loss_only():  # the check this one replaced: 8 bytes a rank
        ops.all_gather(loss.reshape(1), tensor.group, axis="tensor", kind="metrics").tolist()

    def fingerprint():
        batch_lib.batch_fingerprint(batch, cpu)

    with PeakMemory() as peak:
        fingerprint()
    return {
        "fingerprint": median_time(fingerprint, FLAGS.repeats),
        "verdict": median_time(verdict, FLAGS.repeats),
        "loss only": median_time(loss_only, FLAGS.repeats),
        "clone": median_time(lambda: {k: v.clone() for k, v in batch.items()}, FLAGS.repeats),
        "scratch": peak.extra,
    }


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it
    out = fs.launch(worker, list(sys.argv), nproc=NPROC)
    worst = {k: max(o[k] for o in out) for k in out[0]}
    mib = 2 * FLAGS.rows * FLAGS.seq_len * (8 if FLAGS.dtype == "int64" else 1) / 2**20
    print(
        f"batch {{x, y}}: {FLAGS.dtype} {FLAGS.rows} x {FLAGS.seq_len} each ({mib:.1f} MiB), "
        f"T={NPROC} gloo CPU ranks"
    )
    print(f"{'part':<40}{'us':>10}")
    print(f"{'fingerprint of the batch':<40}{worst['fingerprint'] * 1e6:>10.1f}")
    print(f"{'its all-gather with the loss, verdict':<40}{worst['verdict'] * 1e6:>10.1f}")
    print(f"{'the loss-only check it replaced':<40}{worst['loss only'] * 1e6:>10.1f}")
    check = worst["fingerprint"] + worst["verdict"]
    print(f"check / loss-only: {check / worst['loss only']:.2f}")
    print(f"added per step: {(check - worst['loss only']) * 1e6:.0f} us")
    print(f"fingerprint / a clone of the batch: {worst['fingerprint'] / worst['clone']:.2f}")
    print(f"fingerprint's peak extra memory: {worst['scratch'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    app.run(main)
