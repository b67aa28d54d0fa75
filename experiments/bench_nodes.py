"""Two nodes on a slow link: funcshard flat ZeRO-3, HSDP and HFSDP beside FSDP2 flat and HSDP.

    sudo python experiments/bench_nodes.py                 # 2 nodes x 2 ranks, 1gbit link
    sudo python experiments/bench_nodes.py --microbatches=2   # + FSDP2 HSDP all-reducing once
    sudo python experiments/bench_nodes.py --rate=100mbit --steps=3      # --rate=none: unshaped
    sudo python experiments/bench_nodes.py --noflat --fsdp2_reduce_bf16 \
        --wires=HSDP:bf16,HSDP:int8,HFSDP:int8                # the low-precision wires
    sudo python experiments/bench_nodes.py --compile_rows     # + captured ZeRO-3, overlap on/off

``experiments/nodes.py`` makes 2 network-namespace nodes whose links to the bridge are shaped
by ``tc tbf`` to ``--rate`` in each direction; one torchrun job per node (2 gloo ranks each,
gloo bound to the node's ``eth0``) builds every row from one initial GPT of bench_step.py
(23.1M params, fp32, AdamW, 1 thread per rank) and runs their steps alternated, so every
row sees the same link and load:

* funcshard flat ZeRO-3: ``make_mesh(shard=4)``, the shard axis spans both nodes;
* funcshard HSDP: ``make_mesh(shard=2, replicate=2)``, ZeRO-3 in a node, replicas across;
* funcshard HFSDP: the HSDP mesh with ``outer_strategy="optim"`` (masters and AdamW state
  sharded over both nodes too);
* FSDP2 flat: ``fully_shard`` per block, then the root, on 4 ranks;
* FSDP2 HSDP: the same on ``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``;
  with ``--microbatches`` > 1 also "all-reduce once" (``set_requires_all_reduce(False)``
  before all but the last microbatch: FSDP2 otherwise all-reduces in each, funcshard once).
* with ``--fsdp2_reduce_bf16``: FSDP2 HSDP with ``MixedPrecisionPolicy(reduce_dtype=
  torch.bfloat16)`` (fp32 params and compute; gradients reduce-scattered and all-reduced in
  bf16, FSDP2's usual setting across nodes), and its "all-reduce once" beside it;
* with ``--wires``: funcshard rows with low-precision wires, each ``MESH:GRAD[:PARAM]``
  (MESH: flat, HSDP or HFSDP; GRAD / PARAM: ``grad_comm_dtype`` / ``param_comm_dtype``, one
  of fp32, bf16, fp8, int8): "HSDP:int8" is the HSDP row with an int8 gradient wire (reduced
  in fp32). ``--noflat`` leaves the two flat rows out.

Printed per row: median step time (slowest rank), bytes that crossed node 0's link per step
(its veth counters, rx + tx, headers included, read by the ranks before and after each step)
beside ``fs.plan(...).comm_by_axis["replicate"]`` and ``fs.comm_stats().bytes_by_axis
["replicate"]`` (per rank), masters + optimizer state per rank (measured and planned), and
the last step's loss (every row starts from the same model and sees the same batches).

Why 1gbit: HSDP all-reduces one fp32 gradient shard (23.1M / 2 x 4 B = 46 MB) per rank over
"replicate" each step; a 2-rank ring sends and receives that much, so node 0's link carries
2 ranks x 46 MB = 92 MB each way: 0.74 s at 1 Gbit/s, about half of a step on an unshaped
link here (docs/benchmarks.md). At 100mbit it would be 7.4 s (flat ZeRO-3 far more), and the link
alone would set every time.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from absl import app, flags
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import funcshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package
from experiments import bench_step as bs  # noqa: E402  (its model flags, batch and runners)
from experiments.gpt import GPT, GPTConfig  # noqa: E402
from experiments.nodes import IFNAME, Nodes  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("rate", "1gbit", "Each node's link rate per direction (tc syntax); none.")
flags.DEFINE_float("timeout", 900.0, "Seconds before the nodes are stopped.")
flags.DEFINE_string("out", None, "Worker mode (set by the driver): rank 0 writes JSON here.")
FLAGS.set_default("steps", 5)
FLAGS.set_default("microbatches", 1)  # FSDP2 would all-reduce every microbatch (docs/benchmarks.md)
FORWARDED = ("steps", "warmup", "microbatches", "batch", "seq_len", "vocab", "d_model")
FORWARDED += ("n_layer", "threads")
flags.DEFINE_bool("flat", True, "Run the flat rows (funcshard flat ZeRO-3, FSDP2 flat).")
flags.DEFINE_bool(
    "fsdp2_reduce_bf16",
    False,
    "Add FSDP2 HSDP with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) (and its "
    "all-reduce-once row with --microbatches > 1).",
)
flags.DEFINE_list(
    "wires",
    [],
    "funcshard rows with low-precision wires: MESH:GRAD[:PARAM], MESH one of flat, HSDP, "
    "HFSDP; GRAD (grad_comm_dtype) and PARAM (param_comm_dtype) one of fp32, bf16, fp8, int8.",
)
flags.DEFINE_bool(
    "compile_rows",
    False,
    "Add funcshard flat ZeRO-3 captured (compile=inductor) with overlap on (its gathers one "
    "bucket ahead) and off (each gather where its params are first read), alternated.",
)
FORWARDED += ("flat", "fsdp2_reduce_bf16", "wires", "compile_rows")
NODES, PER_NODE = 2, 2
BF16 = " reduce bf16"  # the suffixes of FSDP2's rows with reduce_dtype=torch.bfloat16
ONCE = ", all-reduce once"  # and with set_requires_all_reduce(False) before the last microbatch
WIRES = {"fp32": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
MESHES = {  # a wire row's mesh: (fs.make_mesh kwargs, outer_strategy)
    "flat": (dict(shard=4), "no_shard"),
    "HSDP": (dict(shard=2, replicate=2), "no_shard"),
    "HFSDP": (dict(shard=2, replicate=2), "optim"),
}
NAMES = {"flat": "funcshard flat ZeRO-3", "HSDP": "funcshard HSDP", "HFSDP": "funcshard HFSDP"}


@dataclasses.dataclass(frozen=True, slots=True)
class Wire:
    """One ``--wires`` entry: a funcshard row on ``mesh`` with these wires."""

    mesh: str
    grad: str
    param: str = "fp32"

    def __post_init__(self) -> None:
        if self.mesh not in MESHES:
            raise ValueError(f"--wires: mesh {self.mesh!r} is not one of {list(MESHES)}")
        for what, w in (("grad", self.grad), ("param", self.param)):
            if w not in WIRES:
                raise ValueError(f"--wires: {what} wire {w!r} is not one of {list(WIRES)}")

    @classmethod
    def parse(cls, spec: str) -> Wire:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"--wires: {spec!r} is not MESH:GRAD or MESH:GRAD:PARAM")
        return cls(*parts)

    @property
    def name(self) -> str:
        param = f" param {self.param}" if self.param != "fp32" else ""
        return f"{NAMES[self.mesh]} grad {self.grad}{param}"

    def policy(self) -> fs.MixedPrecisionPolicy:
        return fs.MixedPrecisionPolicy(
            grad_comm_dtype=WIRES[self.grad], param_comm_dtype=WIRES[self.param]
        )

    def plan_kw(self) -> dict:
        mesh, outer = MESHES[self.mesh]
        return dict(**mesh, outer_strategy=outer, policy=self.policy())


def _valid_wires(specs: list[str]) -> bool:
    try:
        [Wire.parse(x) for x in specs]
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


flags.register_validator("wires", _valid_wires)


def _link() -> tuple[int, int]:
    """(rx, tx) bytes of this node's ``eth0`` (the veth; /proc/net is the namespace's)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == IFNAME:
                v = rest.split()
                return int(v[0]), int(v[8])
    raise RuntimeError(f"bench_nodes: no {IFNAME} here; run under nodes.py (the driver)")


class _Fsdp2Hsdp(bs._Fsdp2):
    """FSDP2 HSDP: ``fully_shard`` per block, then the root, on a 2-D mesh. ``once``: the
    replicas all-reduce only in the last microbatch's backward (``set_requires_all_reduce``),
    as FSDP2 documents for gradient accumulation; by default they do in every microbatch's."""

    def __init__(
        self, model: GPT, mesh, cfg: bs.Config, once: bool = False, reduce_bf16: bool = False
    ) -> None:
        kw = dict(mesh=mesh)
        if reduce_bf16:
            kw["mp_policy"] = bs.FsdpPolicy(reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, **kw)
        bs._ModuleLoop.__init__(self, fully_shard(model, **kw), cfg)
        if once:
            forwards = itertools.count(1)
            self.model.register_forward_pre_hook(
                lambda m, args: m.set_requires_all_reduce(next(forwards) % cfg.microbatches == 0)
            )


def _funcshard(
    model: GPT,
    mesh,
    cfg: bs.Config,
    outer: str = "no_shard",
    policy: fs.MixedPrecisionPolicy | None = None,
) -> bs._Funcshard:
    policy = policy or fs.MixedPrecisionPolicy()
    return bs._Funcshard(model, mesh, "optim_grads_params", policy, cfg, outer_strategy=outer)


def worker(
    cfg: bs.Config, out: str, flat: bool, reduce_bf16: bool, wires: list[Wire], compiled: bool
) -> None:
    fs.init_from_env("gloo")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab=cfg.vocab, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=8, d_model=cfg.d_model
        )
    )
    flat_mesh, hsdp = fs.make_mesh(shard=4), fs.make_mesh(shard=2, replicate=2)
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    meshes = {"flat": flat_mesh, "HSDP": hsdp, "HFSDP": hsdp}
    rows = {}
    if flat:
        rows["funcshard flat ZeRO-3"] = _funcshard(copy.deepcopy(model), flat_mesh, cfg)
    rows["funcshard HSDP"] = _funcshard(copy.deepcopy(model), hsdp, cfg)
    if flat:
        rows["FSDP2 flat"] = bs._Fsdp2(
            copy.deepcopy(model), flat_mesh, "optim_grads_params", None, cfg
        )
    for bf16 in (False, True) if reduce_bf16 else (False,):
        for once in (False, True) if cfg.microbatches > 1 else (False,):
            name = "FSDP2 HSDP" + (BF16 if bf16 else "") + (ONCE if once else "")
            rows[name] = _Fsdp2Hsdp(copy.deepcopy(model), mesh2d, cfg, once, bf16)
    rows["funcshard HFSDP"] = _funcshard(copy.deepcopy(model), hsdp, cfg, outer="optim")
    for overlap in (True, False) if compiled else ():
        rows[f"funcshard flat ZeRO-3 compile=, overlap {'on' if overlap else 'off'}"] = (
            bs._Funcshard(
                copy.deepcopy(model),
                flat_mesh,
                "optim_grads_params",
                fs.MixedPrecisionPolicy(),
                cfg,
                compile="inductor",
                overlap=overlap,
            )
        )
    plan_kw = {
        "funcshard flat ZeRO-3": dict(shard=4),
        "funcshard HSDP": dict(replicate=2),
        "funcshard HFSDP": dict(replicate=2, outer_strategy="optim"),
    }
    for w in wires:
        _, outer = MESHES[w.mesh]
        rows[w.name] = _funcshard(copy.deepcopy(model), meshes[w.mesh], cfg, outer, w.policy())
        plan_kw[w.name] = w.plan_kw()
    plan_kw = {k: v for k, v in plan_kw.items() if k in rows}
    times = {k: [] for k in rows}
    link = {k: [] for k in rows}
    losses = {k: [] for k in rows}
    measured = {}
    for step in range(cfg.warmup + cfg.steps):
        batch = bs._batch(cfg, step)
        order = list(rows) if step % 2 == 0 else list(reversed(rows))
        for name in order:
            stats = fs.comm_stats() if step == 0 and name in plan_kw else None
            dist.barrier()
            before, start = _link(), time.perf_counter()
            if stats is None:
                loss = rows[name].step(batch)
            else:
                with stats as s:  # the untimed first step
                    loss = rows[name].step(batch)
                measured[name] = s.bytes_by_axis["replicate"]
            losses[name].append(float(loss))
            elapsed = time.perf_counter() - start
            dist.barrier()  # every rank's collectives are over: the step's bytes are counted
            after = _link()
            if step >= cfg.warmup:
                times[name].append(elapsed)
                link[name].append([a - b for a, b in zip(after, before, strict=True)])
    plans = {
        name: fs.plan(model, world_size=4, microbatches=cfg.microbatches, device_type="cpu", **kw)
        for name, kw in plan_kw.items()
    }
    mine = {
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "times": times,
        "link": link,
        "state": {k: r.persistent_bytes() for k, r in rows.items()},
        "losses": losses,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        result = {
            "params": sum(p.numel() for p in model.parameters()),
            "ranks": gathered,
            "measured": measured,
            "plan": {
                k: {
                    "replicate": p.comm_by_axis["replicate"],
                    "state": p.memory.master + p.memory.opt_state,
                }
                for k, p in plans.items()
            },
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _cfg() -> bs.Config:
    return bs.Config(
        *(FLAGS[k].value for k in ("steps", "warmup", "microbatches", "batch", "seq_len")),
        *(FLAGS[k].value for k in ("vocab", "d_model", "n_layer")),
        strategies=("optim_grads_params",),
        policies=("fp32",),
        threads=FLAGS.threads,
    )


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _peer_label(name: str) -> str:
    """An FSDP2 HSDP row's settings in a few letters: fp32 / bf16 reduce, all-reduce once."""
    label = "bf16" if BF16 in name else "fp32"
    return label + (" once" if ONCE in name else "")


def report(cfg: bs.Config, r: dict, rate: str, load: tuple[float, float]) -> None:
    ranks = r["ranks"]
    names = list(ranks[0]["times"])
    slowest = {
        k: [max(s) for s in zip(*(x["times"][k] for x in ranks), strict=True)] for k in names
    }
    node0 = next(x for x in ranks if x["node"] == 0 and x["local_rank"] == 0)
    width = max(28, *(len(n) + 2 for n in names))
    print(
        f"GPT {r['params'] / 1e6:.1f}M params, fp32, AdamW, {NODES} nodes x {PER_NODE} gloo "
        f"ranks, link {rate if rate != 'none' else 'unshaped'} (tc tbf, each way), "
        f"batch {cfg.batch}x{cfg.seq_len} per rank, "
        f"{cfg.microbatches} microbatch(es), {cfg.threads} thread(s) per rank, median of "
        f"{cfg.steps} steps (slowest rank), load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    print(
        f"{'row':<{width}}{'step s':>8}{'link MB/step':>14}{'per rank each way':>19}"
        f"{'plan repl MB':>14}{'measured repl MB':>18}{'state MB/rank':>15}{'plan':>8}"
        f"{'last loss':>11}"
    )
    for name in names:
        rx_tx = statistics.median(sum(s) for s in node0["link"][name])
        plan = r["plan"].get(name)
        state = max(x["state"][name] for x in ranks)
        print(
            f"{name:<{width}}{statistics.median(slowest[name]):>8.2f}{_mb(rx_tx):>14}"
            f"{_mb(rx_tx / 2 / PER_NODE):>19}"
            f"{_mb(plan['replicate']) if plan else '-':>14}"
            f"{_mb(r['measured'][name]) if plan else '-':>18}{_mb(state):>15}"
            f"{_mb(plan['state']) if plan else '-':>8}{node0['losses'][name][-1]:>11.5f}"
        )

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(slowest[a], slowest[b], strict=True))

    peers = [n for n in names if n.startswith("FSDP2 HSDP")]
    mine = [n for n in names if n.startswith(("funcshard HSDP", "funcshard HFSDP"))]
    labels = [_peer_label(b) for b in peers]
    print(f"\nstep / the step of FSDP2 HSDP with: {', '.join(labels)} (a column each)")
    print(f"{'row':<{width}}" + "".join(f"{x:>12}" for x in labels))
    for a in mine:
        print(f"{a:<{width}}" + "".join(f"{ratio(a, b):>12.2f}" for b in peers))
    pairs = [("funcshard flat ZeRO-3", "FSDP2 flat")] if "FSDP2 flat" in names else []
    pairs += [("funcshard HFSDP", "funcshard HSDP")]
    on, off = (f"funcshard flat ZeRO-3 compile=, overlap {x}" for x in ("on", "off"))
    pairs += [(on, off)] if on in names else []
    for a, b in pairs:
        print(f"{a} / {b}: {ratio(a, b):.2f}")
    print("(ratios: median over steps of each step over its peer's in the same round)")
    for name in names:
        print(f"{name:<{width}}steps s: {' '.join(f'{t:.2f}' for t in slowest[name])}")


def _forward(name: str) -> str:
    """``--name=value`` as absl parses it back (lists joined by commas, bools as words)."""
    value = FLAGS[name].value
    if isinstance(value, list):
        value = ",".join(value)
    return f"--{name}={value}"


def main(argv: list[str]) -> None:
    del argv
    cfg = _cfg()
    if FLAGS.out:
        wires = [Wire.parse(x) for x in FLAGS.wires]
        worker(cfg, FLAGS.out, FLAGS.flat, FLAGS.fsdp2_reduce_bf16, wires, FLAGS.compile_rows)
        return
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="bench_nodes-") as tmp,
        Nodes(NODES, rate=None if FLAGS.rate == "none" else FLAGS.rate) as nodes,
    ):
        out = os.path.join(tmp, "result.json")
        args = [_forward(k) for k in FORWARDED]
        run = nodes.torchrun(
            [__file__, f"--out={out}", *args], nproc_per_node=PER_NODE, log_dir=tmp
        )
        codes = run.wait(timeout=FLAGS.timeout)
        if any(codes) or not os.path.exists(out):
            sys.exit(f"bench_nodes: nodes exited {codes}\n{run.tails()}")
        total = nodes.counters(0)
        with open(out) as f:
            result = json.load(f)
    report(cfg, result, FLAGS.rate, (load_before, os.getloadavg()[0]))
    whole = f"rx {_mb(total.rx_bytes)} MB, tx {_mb(total.tx_bytes)} MB"
    print(f"node 0's link over the whole job (setup and rendezvous too): {whole}")


if __name__ == "__main__":
    app.run(main)
