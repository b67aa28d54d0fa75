"""Two nodes on a slow link: funcshard flat ZeRO-3, HSDP and HFSDP beside FSDP2 flat and HSDP.

    sudo python experiments/bench_nodes.py                 # 2 nodes x 2 ranks, 1gbit link
    sudo python experiments/bench_nodes.py --microbatches=2   # + FSDP2 HSDP all-reducing once
    sudo python experiments/bench_nodes.py --rate=100mbit --steps=3      # --rate=none: unshaped

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

Printed per row: median step time (slowest rank), bytes that crossed node 0's link per step
(its veth counters, rx + tx, headers included, read by the ranks before and after each step)
beside ``fs.plan(...).comm_by_axis["replicate"]`` and ``fs.comm_stats().bytes_by_axis
["replicate"]`` (per rank), and masters + optimizer state per rank (measured and planned).

Why 1gbit: HSDP all-reduces one fp32 gradient shard (23.1M / 2 x 4 B = 46 MB) per rank over
"replicate" each step; a 2-rank ring sends and receives that much, so node 0's link carries
2 ranks x 46 MB = 92 MB each way: 0.74 s at 1 Gbit/s, half of a step on an unshaped link
here (1.6 s, 4 ranks on 2 cores). At 100mbit it would be 7.4 s (flat ZeRO-3 far more), and the link
alone would set every time.
"""

from __future__ import annotations

import copy
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
FLAGS.set_default("microbatches", 1)  # FSDP2 would all-reduce every microbatch (see README)
FORWARDED = ("steps", "warmup", "microbatches", "batch", "seq_len", "vocab", "d_model")
FORWARDED += ("n_layer", "threads")
NODES, PER_NODE = 2, 2
ONCE = "FSDP2 HSDP, all-reduce once"


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

    def __init__(self, model: GPT, mesh, cfg: bs.Config, once: bool = False) -> None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        bs._ModuleLoop.__init__(self, fully_shard(model, mesh=mesh), cfg)
        if once:
            forwards = itertools.count(1)
            self.model.register_forward_pre_hook(
                lambda m, args: m.set_requires_all_reduce(next(forwards) % cfg.microbatches == 0)
            )


def _funcshard(model: GPT, mesh, cfg: bs.Config, outer: str = "no_shard") -> bs._Funcshard:
    policy = fs.MixedPrecisionPolicy()
    return bs._Funcshard(model, mesh, "optim_grads_params", policy, cfg, outer_strategy=outer)


def worker(cfg: bs.Config, out: str) -> None:
    fs.init_from_env("gloo")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab=cfg.vocab, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=8, d_model=cfg.d_model
        )
    )
    flat, hsdp = fs.make_mesh(shard=4), fs.make_mesh(shard=2, replicate=2)
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rows = {
        "funcshard flat ZeRO-3": _funcshard(copy.deepcopy(model), flat, cfg),
        "funcshard HSDP": _funcshard(copy.deepcopy(model), hsdp, cfg),
        "FSDP2 flat": bs._Fsdp2(copy.deepcopy(model), flat, "optim_grads_params", None, cfg),
        "FSDP2 HSDP": _Fsdp2Hsdp(copy.deepcopy(model), mesh2d, cfg),
    }
    if cfg.microbatches > 1:
        rows[ONCE] = _Fsdp2Hsdp(copy.deepcopy(model), mesh2d, cfg, once=True)
    rows["funcshard HFSDP"] = _funcshard(copy.deepcopy(model), hsdp, cfg, outer="optim")
    plan_kw = {
        "funcshard flat ZeRO-3": dict(shard=4),
        "funcshard HSDP": dict(replicate=2),
        "funcshard HFSDP": dict(replicate=2, outer_strategy="optim"),
    }
    times = {k: [] for k in rows}
    link = {k: [] for k in rows}
    measured = {}
    for step in range(cfg.warmup + cfg.steps):
        batch = bs._batch(cfg, step)
        order = list(rows) if step % 2 == 0 else list(reversed(rows))
        for name in order:
            stats = fs.comm_stats() if step == 0 and name in plan_kw else None
            dist.barrier()
            before, start = _link(), time.perf_counter()
            if stats is None:
                rows[name].step(batch)
            else:
                with stats as s:  # the untimed first step
                    rows[name].step(batch)
                measured[name] = s.bytes_by_axis["replicate"]
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


def report(cfg: bs.Config, r: dict, rate: str, load: tuple[float, float]) -> None:
    ranks = r["ranks"]
    names = list(ranks[0]["times"])
    slowest = {
        k: [max(s) for s in zip(*(x["times"][k] for x in ranks), strict=True)] for k in names
    }
    node0 = next(x for x in ranks if x["node"] == 0 and x["local_rank"] == 0)
    print(
        f"GPT {r['params'] / 1e6:.1f}M params, fp32, AdamW, {NODES} nodes x {PER_NODE} gloo "
        f"ranks, link {rate if rate != 'none' else 'unshaped'} (tc tbf, each way), "
        f"batch {cfg.batch}x{cfg.seq_len} per rank, "
        f"{cfg.microbatches} microbatch(es), {cfg.threads} thread(s) per rank, median of "
        f"{cfg.steps} steps (slowest rank), load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    print(
        f"{'row':<28}{'step s':>8}{'link MB/step':>14}{'per rank each way':>19}"
        f"{'plan repl MB':>14}{'measured repl MB':>18}{'state MB/rank':>15}{'plan':>8}"
    )
    for name in names:
        rx_tx = statistics.median(sum(s) for s in node0["link"][name])
        plan = r["plan"].get(name)
        state = max(x["state"][name] for x in ranks)
        print(
            f"{name:<28}{statistics.median(slowest[name]):>8.2f}{_mb(rx_tx):>14}"
            f"{_mb(rx_tx / 2 / PER_NODE):>19}"
            f"{_mb(plan['replicate']) if plan else '-':>14}"
            f"{_mb(r['measured'][name]) if plan else '-':>18}{_mb(state):>15}"
            f"{_mb(plan['state']) if plan else '-':>8}"
        )
    pairs = [("funcshard HSDP", "FSDP2 HSDP"), ("funcshard flat ZeRO-3", "FSDP2 flat")]
    pairs += [("funcshard HSDP", ONCE)] if ONCE in names else []
    pairs += [("funcshard HFSDP", "funcshard HSDP")]
    for a, b in pairs:
        ratio = statistics.median(x / y for x, y in zip(slowest[a], slowest[b], strict=True))
        print(f"{a} / {b}: {ratio:.2f}")
    print("(ratios: median over steps of each step over its peer's in the same round)")
    for name in names:
        print(f"{name:<28}steps s: {' '.join(f'{t:.2f}' for t in slowest[name])}")


def main(argv: list[str]) -> None:
    del argv
    cfg = _cfg()
    if FLAGS.out:
        worker(cfg, FLAGS.out)
        return
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="bench_nodes-") as tmp,
        Nodes(NODES, rate=None if FLAGS.rate == "none" else FLAGS.rate) as nodes,
    ):
        out = os.path.join(tmp, "result.json")
        args = [f"--{k}={FLAGS[k].value}" for k in FORWARDED]
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
