"""The main job's final loss on each wire beside the fp32 wire (issue 23, figure b).

Runs ``experiments/train.py --nproc=4 --replicate=2`` (HSDP: ZeRO-3 over 2 ranks, 2 replicas;
fp32 compute) once per row, one run at a time, every row with the same ``--steps`` and
``--seed`` (the data, the initial weights and the schedule are the same), and prints per row:

* train loss: the last step's, and the mean of the last ``--tail`` steps' (one step's loss is
  one batch's, and moves by more than the wires do);
* held-out loss: train.py's final loss (``--eval_batches`` held-out batches, master weights);
* each one's difference relative to the fp32 row's;
* bytes per rank and step on the "shard" and "replicate" axes (``fs.plan(...).comm_by_axis``
  for the run's GPT, optimizer, policy and mesh; the run's own, rank 0's per step in its
  metrics.jsonl, must equal it, or the row fails) and the replicate bytes relative to the fp32
  row's;
* the load average before and after the run (the losses do not depend on it; the wall time
  does).

Rows: the grad wires (``--grad_comm_dtype``) bf16 / fp8 / int8 with the compute-dtype param
wire; the param wires (``--param_comm_dtype``) with the fp32 grad wire; int8 + int8 and
fp8 + fp8; under HFSDP (``--outer_strategy=optim``) the same grad wires, the int8 param wire
(the masters packed once, gathered over "replicate" and again over "shard") and int8 + int8.
``--seeds`` adds the fp32 row again with other seeds: how far the loss moves with the seed
alone, the yardstick of the wires' differences.

Run:  python experiments/bench_wire_loss.py                       (every row, 500 steps)
      python experiments/bench_wire_loss.py --rows=fp32,int8+int8 --steps=100
      python experiments/bench_wire_loss.py --rows="fp32,HFSDP param int8" --steps=3 \
          --tail=2 --n_layer=1 --d_model=16 --batch_size=8    (a check that the rows run)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from absl import app, flags

import funcshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package
from experiments.gpt import GPT, GPTConfig  # noqa: E402
from experiments.trainer import Config, make_optimizer  # noqa: E402

FLAGS = flags.FLAGS
TRAIN = Path(__file__).resolve().parent / "train.py"
WIRES = {"none": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    grad: str  # --grad_comm_dtype
    param: str  # --param_comm_dtype
    outer: str = "no_shard"  # --outer_strategy
    seed_offset: int = 0  # added to --seed (the seed-noise rows)


ROWS = {
    "fp32": Row("none", "none"),
    "grad bf16": Row("bf16", "none"),
    "grad fp8": Row("fp8", "none"),
    "grad int8": Row("int8", "none"),
    "param bf16": Row("none", "bf16"),
    "param fp8": Row("none", "fp8"),
    "param int8": Row("none", "int8"),
    "int8+int8": Row("int8", "int8"),
    "fp8+fp8": Row("fp8", "fp8"),
    "HFSDP fp32": Row("none", "none", "optim"),
    "HFSDP grad bf16": Row("bf16", "none", "optim"),
    "HFSDP grad fp8": Row("fp8", "none", "optim"),
    "HFSDP grad int8": Row("int8", "none", "optim"),
    "HFSDP param int8": Row("none", "int8", "optim"),
    "HFSDP int8+int8": Row("int8", "int8", "optim"),
}

flags.DEFINE_list("rows", list(ROWS), f"rows to run, in this order: {', '.join(ROWS)}")
flags.DEFINE_list("seeds", [], "more seeds for the fp32 row (the seed-to-seed spread)")
flags.DEFINE_integer("steps", 500, "optimizer steps of every run (train.py's default: 500)")
flags.DEFINE_integer("seed", 0, "train.py --seed of every row")
flags.DEFINE_integer("nproc", 4, "ranks", lower_bound=2)
flags.DEFINE_integer("replicate", 2, "replicas", lower_bound=2)
flags.DEFINE_integer("tail", 20, "the train loss is also averaged over this many last steps")
flags.DEFINE_string("out_dir", "out/wire_loss", "each run's train.py --out_dir is under it")
flags.DEFINE_integer("n_layer", 2, "train.py --n_layer (its default: 2)", lower_bound=1)
flags.DEFINE_integer("d_model", 64, "train.py --d_model (its default: 64)", lower_bound=4)
flags.DEFINE_integer("batch_size", 64, "train.py --batch_size (its default: 64)", lower_bound=1)
flags.register_validator(
    "rows", lambda v: set(v) <= set(ROWS), message=f"--rows: expected some of {list(ROWS)}"
)


def _config() -> Config:
    """The runs' train.py config as far as the bytes go (its Markov source has 16 tokens)."""
    model = GPTConfig(vocab=16, seq_len=32, n_layer=FLAGS.n_layer, n_head=4, d_model=FLAGS.d_model)
    return Config(model=model, steps=FLAGS.steps)


def _policy(row: Row) -> fs.MixedPrecisionPolicy:
    return fs.MixedPrecisionPolicy(
        param_dtype=torch.float32,
        grad_comm_dtype=WIRES[row.grad],
        param_comm_dtype=WIRES[row.param],
    )


def _bytes(row: Row) -> dict[str, int]:
    cfg = _config()
    p = fs.plan(
        GPT(cfg.model),
        world_size=FLAGS.nproc,
        replicate=FLAGS.replicate,
        policy=_policy(row),
        optimizer=make_optimizer(cfg),
        outer_strategy=row.outer,
        device_type="cpu",
    )
    return p.comm_by_axis


def _train(name: str, row: Row) -> dict:
    """One train.py run; its losses, wall time and the load average around it."""
    out = Path(FLAGS.out_dir) / name.replace(" ", "_").replace("+", "_")
    seed = FLAGS.seed + row.seed_offset
    args = [
        sys.executable,
        str(TRAIN),
        f"--nproc={FLAGS.nproc}",
        f"--replicate={FLAGS.replicate}",
        f"--outer_strategy={row.outer}",
        "--param_dtype=fp32",
        f"--grad_comm_dtype={row.grad}",
        f"--param_comm_dtype={row.param}",
        f"--steps={FLAGS.steps}",
        f"--n_layer={FLAGS.n_layer}",
        f"--d_model={FLAGS.d_model}",
        f"--batch_size={FLAGS.batch_size}",
        f"--seed={seed}",
        f"--out_dir={out}",
    ]
    load, t0 = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"bench_wire_loss: {name} failed ({' '.join(args)}):\n{done.stderr[-4000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [x["loss"] for x in lines if "step" in x]
    summary = next(x for x in lines if "final_loss" in x)
    planned = {axis: n for axis, n in _bytes(row).items() if n}
    for x in lines:
        if "step" in x and x["comm_by_axis"] != planned:
            sys.exit(
                f"bench_wire_loss: {name}: step {x['step']} moved {x['comm_by_axis']} bytes "
                f"per axis on rank 0, fs.plan predicts {planned} ({' '.join(args)})"
            )
    return {
        "train": steps[-1],
        "tail": sum(steps[-FLAGS.tail :]) / len(steps[-FLAGS.tail :]),
        "held": summary["final_loss"],
        "floor": summary["floor"],
        "wall": wall,
        "load": (load, os.getloadavg()[0]),
        "seed": seed,
        "command": " ".join(["python", "experiments/train.py", *args[2:]]),
    }


def _load(load: tuple[float, float]) -> str:
    return f"{load[0]:.1f} -> {load[1]:.1f}"


def _rel(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.3f}%"


def main(argv: list[str]) -> None:
    del argv
    rows = {n: ROWS[n] for n in FLAGS.rows}
    for s in FLAGS.seeds:
        rows[f"fp32 seed {FLAGS.seed + int(s)}"] = Row("none", "none", seed_offset=int(s))
    ref_name = "fp32" if "fp32" in rows else next(iter(rows))
    results = {}
    for name, row in rows.items():
        results[name] = _train(name, row)
        r = results[name]
        print(
            f"{name}: train {r['train']:.5f} (last {FLAGS.tail}: {r['tail']:.5f}) held-out "
            f"{r['held']:.5f}, {r['wall']:.0f} s, load {_load(r['load'])}",
            flush=True,
        )
    ref = results[ref_name]
    ref_bytes = _bytes(rows[ref_name])
    print(
        f"\nexperiments/train.py --nproc={FLAGS.nproc} --replicate={FLAGS.replicate} "
        f"--param_dtype=fp32 --steps={FLAGS.steps} --n_layer={FLAGS.n_layer} "
        f"--d_model={FLAGS.d_model} --batch_size={FLAGS.batch_size} --seed={FLAGS.seed} "
        "(+ each row's wires); "
        f"entropy-rate floor {ref['floor']:.4f}; relative to the {ref_name!r} row; bytes per "
        "rank and step from fs.plan (equal to every step's measured bytes)"
    )
    head = (
        f"{'row':<18}{'grad':>6}{'param':>6}{'outer':>9}{'train':>9}{'vs':>9}"
        f"{f'last {FLAGS.tail}':>9}{'vs':>9}{'held-out':>9}{'vs':>9}"
        f"{'shard B':>11}{'repl. B':>10}{'repl. x':>8}{'wall s':>8}{'load':>15}"
    )
    print(head)
    for name, row in rows.items():
        r, b = results[name], _bytes(row)
        repl = b["replicate"] / ref_bytes["replicate"]
        print(
            f"{name:<18}{row.grad:>6}{row.param:>6}{row.outer:>9}{r['train']:>9.5f}"
            f"{_rel(r['train'], ref['train']):>9}{r['tail']:>9.5f}{_rel(r['tail'], ref['tail']):>9}"
            f"{r['held']:>9.5f}{_rel(r['held'], ref['held']):>9}"
            f"{b['shard']:>11,}{b['replicate']:>10,}{repl:>8.3f}{r['wall']:>8.0f}"
            f"{_load(r['load']):>15}"
        )


if __name__ == "__main__":
    app.run(main)
