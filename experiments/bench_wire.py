"""How far a low-precision wire moves the reduced gradient: ring sums vs fp32 sums.

Each of ``--ranks`` CPU ranks (gloo, one process each) holds a ``--rows x --cols`` fp32 gradient
(a different seed per rank). The data-parallel mean is reduced with each wire and compared with
the fp64 mean (relative L2 error, over the whole tensor):

* ring: what ``grad_comm_dtype`` did before it was the wire only, the ring collectives summing
  in the wire dtype (a reduce-scatter under ZeRO-3, an all-reduce under ``no_shard``). 8-bit
  formats cannot be summed by a ring: "-".
* wire rs / wire ar: ``fs.reduce_scatter_grads`` now, each contribution rounded to the wire
  once and summed in fp32 (``optim_grads_params``: a reduce-scatter; ``no_shard``: an
  all-reduce, whose reduced parts come back on the wire once more).
* out / out+back: the bounds, computed in fp64 from every rank's gradient: each contribution
  rounded once (the reduce-scatter's ideal), and that sum rounded once more (the all-reduce's).

The fp32 wire is the reference and runs the ring collectives (it is ``main_grads_dtype``).

Then the bytes of one ZeRO-3 step of the main job's GPT (experiments/train.py's default
size) on ``--bytes_nproc`` ranks with ``--bytes_replicate`` replicas, each wire set as both
``grad_comm_dtype`` and ``param_comm_dtype``: measured by ``fs.comm_stats`` per mesh axis
beside ``fs.plan``'s prediction, and the ratio to the fp32 wire; and the bytes of the compute
copies the state keeps (under HFSDP, ``--bytes_outer_strategy=optim``: the packed inner shard).

Run:  python experiments/bench_wire.py                 (2, 4 and 8 ranks)
      python experiments/bench_wire.py --ranks=2,4 --rows=1024 --bytes_nproc=0
      python experiments/bench_wire.py --ranks=2 --rows=64 --bytes_outer_strategy=optim  (HFSDP)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from absl import app, flags

import funcshard as fs
from funcshard.comm import codec as wire
from funcshard.distributed import ops as collectives

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package

FLAGS = flags.FLAGS
flags.DEFINE_list("ranks", ["2", "4", "8"], "world sizes to measure")
flags.DEFINE_integer("rows", 4096, "gradient rows per rank")
flags.DEFINE_integer("cols", 64, "gradient columns (a row: the 8-bit formats' blocks)")
flags.DEFINE_integer("seed", 0, "seed of rank 0's gradient (rank r: seed + r)")
flags.DEFINE_integer("bytes_nproc", 4, "ranks of the bytes table (0: no bytes table)")
flags.DEFINE_integer("bytes_replicate", 2, "replicas of the bytes table's mesh")
flags.DEFINE_enum(
    "bytes_outer_strategy",
    "no_shard",
    ["no_shard", "optim"],
    "the bytes table's outer_strategy (optim: HFSDP, the masters packed once and kept so)",
)

WIRES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}


def _grad(rank: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed + rank))


def _rel(err_sq: float, ref_sq: float) -> float:
    return math.sqrt(err_sq / ref_sq)


def _global_rel(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of every rank's part together (each rank passes its own part)."""
    sums = torch.stack([(mine.double() - ref).square().sum(), ref.square().sum()])
    dist.all_reduce(sums)
    return _rel(float(sums[0]), float(sums[1]))


def _ring(g: torch.Tensor, dtype: torch.dtype, reduce_scatter: bool) -> torch.Tensor:
    """The ring sum in the wire dtype (the path ``grad_comm_dtype`` took before): this rank's
    rows of the mean (reduce-scatter) or all of it (all-reduce), in fp32."""
    world = dist.get_world_size()
    wire_g = (g.to(dtype) / world).reshape(-1)
    if reduce_scatter:
        return collectives.reduce_scatter(wire_g, dist.group.WORLD, axis="world").float()
    return collectives.all_reduce(wire_g, dist.group.WORLD, axis="world").float()


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (rows x cols) through the wire once, in fp64 (8-bit: row-local blocks)."""
    rows, cols = x.shape
    layout = wire.blocks(((rows, cols),))
    return wire.roundtrip(x.float().reshape(-1), dtype, layout).double().view(rows, cols)


def worker(rows: int, cols: int, seed: int) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(device_type="cpu")
    grads = [_grad(r, rows, cols, seed) for r in range(world)]
    mean = torch.stack([g.double() for g in grads]).mean(0)
    mine = slice(rank * rows // world, (rank + 1) * rows // world)
    out = {}
    for name, dtype in WIRES.items():
        policy = fs.MixedPrecisionPolicy(grad_comm_dtype=None if name == "fp32" else dtype)
        g = grads[rank]
        row: dict[str, float | None] = {"ring rs": None, "ring ar": None}
        if dtype not in wire.EIGHT_BIT:
            row["ring rs"] = _global_rel(_ring(g, dtype, True).view(-1, cols), mean[mine])
            row["ring ar"] = _rel(
                float((_ring(g, dtype, False).double().view(rows, cols) - mean).square().sum()),
                float(mean.square().sum()),
            )
        rs = fs.reduce_scatter_grads({"g": g}, mesh, policy, strategy="optim_grads_params")["g"]
        row["wire rs"] = _global_rel(rs, mean[mine])
        ar = fs.reduce_scatter_grads({"g": g}, mesh, policy, strategy="no_shard")["g"]
        row["wire ar"] = _rel(
            float((ar.double() - mean).square().sum()), float(mean.square().sum())
        )
        out_once = torch.stack([_rounded(x / world, dtype) for x in grads]).sum(0)
        back = _rounded(out_once, dtype)
        ref_sq = float(mean.square().sum())
        row["out"] = _rel(float((out_once - mean).square().sum()), ref_sq)
        row["out+back"] = _rel(float((back - mean).square().sum()), ref_sq)
        out[name] = row
    return out


def _gpt():
    from experiments.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=16, seq_len=32, n_layer=2, n_head=4, d_model=64))


def bytes_worker(replicate: int, outer: str = "no_shard") -> dict:
    """Per wire, one ZeRO-3 step's bytes per mesh axis (this rank), and the bytes of the
    compute copies the state keeps after it (HFSDP: the inner shard)."""
    torch.set_num_threads(1)
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    tokens = torch.randint(0, 16, (2, 33), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, dtype in WIRES.items():
        model = _gpt()
        wire_dtype = None if name == "fp32" else dtype
        policy = fs.MixedPrecisionPolicy(grad_comm_dtype=wire_dtype, param_comm_dtype=wire_dtype)
        state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, outer_strategy=outer)

        def loss_fn(params, batch, model=model):
            logits = fs.functional_call(model, params, (batch[:, :-1],))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

        with fs.comm_stats() as stats:
            state, _ = fs.train_step(state, tokens, loss_fn)
        out[name] = {k: v for k, v in stats.bytes_by_axis.items() if v}
        out[name]["kinds"] = {k: v for k, v in stats.bytes.items() if v and k != "metrics"}
        out[name]["kept"] = sum(
            c.numel() * c.element_size() for c in state.compute if c is not None
        )
    return out


def _bytes_table(nproc: int, replicate: int, outer: str) -> None:
    measured = fs.launch(bytes_worker, replicate, outer, nproc=nproc)[0]
    print(
        f"\nbytes per rank of one ZeRO-3 step of the main job's GPT ({nproc} ranks, "
        f"replicate={replicate}, outer_strategy={outer}; grads and params on the wire), and "
        "of the compute copies the state keeps"
    )
    head = ("shard", "replicate", "plan shard", "plan repl.", "vs fp32 shard", "vs fp32 repl.")
    head += ("kept", "plan kept")
    print(f"{'wire':<6}" + "".join(f"{h:>15}" for h in head))
    base = measured["fp32"]
    for name, dtype in WIRES.items():
        wire_dtype = None if name == "fp32" else dtype
        policy = fs.MixedPrecisionPolicy(grad_comm_dtype=wire_dtype, param_comm_dtype=wire_dtype)
        p = fs.plan(
            _gpt(),
            world_size=nproc,
            replicate=replicate,
            policy=policy,
            optimizer="sgd",
            outer_strategy=outer,
        )
        row = measured[name]
        cells = [
            row.get("shard", 0),
            row.get("replicate", 0),
            p.comm_by_axis["shard"],
            p.comm_by_axis["replicate"],
        ]
        ratios = [
            f"{row.get(a, 0) / base[a]:.3f}x" if base.get(a) else "-"
            for a in ("shard", "replicate")
        ]
        kept = [row["kept"], p.memory.compute]
        print(
            f"{name:<6}"
            + "".join(f"{c:>15,}" for c in cells)
            + "".join(f"{r:>15}" for r in ratios)
            + "".join(f"{c:>15,}" for c in kept)
        )


COLUMNS = ("ring rs", "wire rs", "out", "ring ar", "wire ar", "out+back")


def _cell(v: float | None) -> str:
    return f"{v:.3e}" if v is not None else "-"


def main(argv: list[str]) -> None:
    del argv
    ranks = [int(r) for r in FLAGS.ranks]
    results = {n: fs.launch(worker, FLAGS.rows, FLAGS.cols, FLAGS.seed, nproc=n)[0] for n in ranks}
    print(
        f"relative L2 error of the reduced mean vs fp64 ({FLAGS.rows}x{FLAGS.cols} fp32 per rank)"
    )
    print(f"{'wire':<6}{'ranks':>6}" + "".join(f"{c:>11}" for c in COLUMNS) + f"{'ring/wire':>11}")
    for name in WIRES:
        for n in ranks:
            row = results[n][name]
            ratio = (
                f"{row['ring rs'] / row['wire rs']:.2f}x"
                if row["ring rs"] is not None and row["wire rs"] > 0
                else "-"
            )
            cells = "".join(f"{_cell(row[c]):>11}" for c in COLUMNS)
            print(f"{name:<6}{n:>6}{cells}{ratio:>11}")
    if FLAGS.bytes_nproc:
        _bytes_table(FLAGS.bytes_nproc, FLAGS.bytes_replicate, FLAGS.bytes_outer_strategy)


if __name__ == "__main__":
    app.run(main)
