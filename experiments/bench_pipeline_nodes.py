"""Two nodes on a slow link: pipeline parallel across them against ZeRO-3 across them.

    sudo python experiments/bench_pipeline_nodes.py                # 2 nodes x 2 ranks, 1gbit
    sudo python experiments/bench_pipeline_nodes.py --rate=100mbit --steps=3   # none: unshaped
    sudo python experiments/bench_pipeline_nodes.py --d_model=512 --batch=8 --seq_len=32

``experiments/nodes.py`` makes 2 network-namespace nodes whose links to the bridge are shaped
by ``tc tbf`` to ``--rate`` in each direction; one torchrun job per node (2 gloo ranks each,
gloo bound to the node's ``eth0``) builds both rows from one initial GPT of
``experiments/gpt.py`` (untied head, fp32, SGD with momentum, 1 thread per rank) and runs
their steps alternated, so both see the same link and load:

* PP: ``fs.make_mesh(pipeline=2)``: pipeline rank 0 (stage 0: the embeddings and the first
  half of the blocks) is node 0's 2 ranks, pipeline rank 1 node 1's; ZeRO-3 over the 2 ranks
  of each node (gathered once a step); ``--schedule`` over ``--microbatches``. Across the
  link go only the boundary's hidden states and their gradients;
* ZeRO-3: ``fs.make_mesh(shard=4)``, the shard axis across both nodes, one microbatch: every
  step gathers every parameter and reduce-scatters every gradient over the link.

A model whose gathers dominate: wide blocks (``--d_model``) over few tokens a step
(``--batch`` x ``--seq_len``). Printed per row: the median step time (the slowest rank),
the bytes that crossed node 0's link per step (its veth counters, rx + tx, headers
included), ``fs.comm_stats`` bytes per axis on rank 0, and the last loss (both rows train
the same model on the same batches); then PP / ZeRO-3 (the issue's goal: <= 0.5). Not run
by the tests (it needs root and minutes); ``--dry_run`` prints the plan of both rows only.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package

import funcshard as fs  # noqa: E402
from experiments.gpt import GPT, GPTConfig  # noqa: E402
from experiments.nodes import IFNAME, Nodes  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("rate", "1gbit", "Each node's link rate per direction (tc syntax); none.")
flags.DEFINE_integer("steps", 4, "Timed steps per row (after --warmup).", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "Untimed steps per row first.", lower_bound=0)
flags.DEFINE_string("schedule", "1F1B", "The pipeline's schedule (one stage per rank).")
flags.DEFINE_integer("microbatches", 2, "The pipeline's microbatches a step.", lower_bound=1)
flags.DEFINE_integer("batch", 4, "Global batch (sequences a step).", lower_bound=1)
flags.DEFINE_integer("seq_len", 16, "Tokens per sequence.", lower_bound=1)
flags.DEFINE_integer("n_layer", 4, "Blocks (split in the middle).", lower_bound=2)
flags.DEFINE_integer("d_model", 1024, "Width.", lower_bound=8)
flags.DEFINE_integer("n_head", 8, "Heads.", lower_bound=1)
flags.DEFINE_integer("vocab", 256, "Vocabulary.", lower_bound=2)
flags.DEFINE_integer("threads", 1, "torch threads per rank.", lower_bound=1)
flags.DEFINE_float("timeout", 900.0, "Seconds before the nodes are stopped.")
flags.DEFINE_bool("dry_run", False, "Print both rows' fs.plan bytes and exit (no nodes).")
flags.DEFINE_string("out", None, "Worker mode (set by the driver): rank 0 writes JSON here.")
FORWARDED = ("steps", "warmup", "schedule", "microbatches", "batch", "seq_len", "n_layer")
FORWARDED += ("d_model", "n_head", "vocab", "threads")
NODES, PER_NODE, WORLD = 2, 2, 4
LR, MOMENTUM = 1e-3, 0.9
PP, ZERO3 = "PP across nodes, ZeRO-3 in each", "ZeRO-3 across both nodes"


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab=FLAGS.vocab,
            seq_len=FLAGS.seq_len,
            n_layer=FLAGS.n_layer,
            n_head=FLAGS.n_head,
            d_model=FLAGS.d_model,
            tied=False,
        )
    )


def _split() -> list[str]:
    return [f"blocks.{FLAGS.n_layer // 2}"]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _link() -> int:
    """rx + tx bytes of this node's ``eth0`` (the veth; /proc/net is the namespace's)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == IFNAME:
                v = rest.split()
                return int(v[0]) + int(v[8])
    raise RuntimeError(f"bench_pipeline_nodes: no {IFNAME} here; run under the driver")


def _steppers(model: GPT) -> dict:
    """Each row's step(step) -> loss, from one initial model."""
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    pipe = fs.Pipeline(FLAGS.schedule, microbatches=FLAGS.microbatches)
    stages = fs.pipeline.split(copy.deepcopy(model), _split())
    pp_mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    box = {
        PP: fs.init(stages, opt, mesh=pp_mesh, strategy="optim_grads_params", pipeline=pipe),
        ZERO3: fs.init(
            copy.deepcopy(model), opt, mesh=fs.make_mesh(shard=WORLD, device_type="cpu")
        ),
    }
    rank = dist.get_rank()

    def zero3_loss(params, batch):
        return loss_fn(fs.functional_call(model, params, (batch[0],)), batch[1])

    def pp(step: int) -> float:  # each pipeline rank passes its data-parallel rank's rows
        x, y = (_rows(t, rank % PER_NODE, PER_NODE) for t in _batch(step))
        box[PP], metrics = fs.train_step(box[PP], (x, y), loss_fn)
        return metrics["loss"]

    def zero3(step: int) -> float:
        x, y = (_rows(t, rank, WORLD) for t in _batch(step))
        box[ZERO3], metrics = fs.train_step(box[ZERO3], (x, y), zero3_loss)
        return metrics["loss"]

    return {PP: pp, ZERO3: zero3}


def worker(out: str) -> None:
    fs.init_from_env("gloo")
    torch.set_num_threads(FLAGS.threads)
    steppers = _steppers(_model())
    times = {k: [] for k in steppers}
    link = {k: [] for k in steppers}
    axes, losses = {}, {}
    for step in range(FLAGS.warmup + FLAGS.steps):
        for name in steppers if step % 2 == 0 else reversed(steppers):
            dist.barrier()
            before, start = _link(), time.perf_counter()
            with fs.comm_stats() as stats:
                losses[name] = steppers[name](step)
            elapsed = time.perf_counter() - start
            dist.barrier()  # every rank's sends are over: the step's bytes are counted
            after = _link()
            axes[name] = {k: v for k, v in stats.bytes_by_axis.items() if v}
            if step >= FLAGS.warmup:
                times[name].append(elapsed)
                link[name].append(after - before)
    mine = {"node": int(os.environ.get("GROUP_RANK", 0)), "times": times, "link": link}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in _model().parameters())
        with open(out, "w") as f:
            json.dump({"ranks": gathered, "axes": axes, "losses": losses, "params": params}, f)
    dist.destroy_process_group()


def _plans() -> dict[str, dict[str, int]]:
    """fs.plan's bytes per axis for one rank of each row (the first pipeline rank for PP)."""
    with torch.device("meta"):
        model = _model()
    common = dict(world_size=WORLD, strategy="optim_grads_params", optimizer="sgd_momentum")
    pp = fs.plan(
        model,
        **common,
        microbatches=FLAGS.microbatches,
        device_type="cpu",
        pipeline=2,
        schedule=FLAGS.schedule,
        split=_split(),
        boundary=(FLAGS.batch // PER_NODE, FLAGS.seq_len, FLAGS.d_model),
    )
    zero3 = fs.plan(model, **common, device_type="cpu")
    return {PP: dict(pp.comm_by_axis), ZERO3: dict(zero3.comm_by_axis)}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def report(result: dict, load: tuple[float, float]) -> None:
    ranks, plans = result["ranks"], _plans()
    names = list(ranks[0]["times"])
    slowest = {
        k: [max(s) for s in zip(*(r["times"][k] for r in ranks), strict=True)] for k in names
    }
    node0 = next(r for r in ranks if r["node"] == 0)
    print(
        f"GPT {result['params'] / 1e6:.1f}M params ({FLAGS.n_layer} blocks, width {FLAGS.d_model},"
        f" untied), fp32, SGD momentum, {NODES} nodes x {PER_NODE} gloo ranks, link {FLAGS.rate} "
        f"(tc tbf, each way), global batch {FLAGS.batch} x {FLAGS.seq_len}, PP: "
        f"{FLAGS.schedule} x {FLAGS.microbatches} microbatches, {FLAGS.threads} thread(s) per "
        f"rank, median of {FLAGS.steps} steps (slowest rank), load average {load[0]:.1f} "
        f"before, {load[1]:.1f} after"
    )
    print(f"{'row':<34}{'step s':>8}{'link MB/step':>14}  comm_stats MB (rank 0) / plan's")
    for name in names:
        axes = result["axes"][name]
        counted = ", ".join(
            f"{k} {_mb(v)} / {_mb(plans[name].get(k, 0))}" for k, v in sorted(axes.items())
        )
        print(
            f"{name:<34}{statistics.median(slowest[name]):>8.3f}"
            f"{_mb(statistics.median(node0['link'][name])):>14}  {counted}"
        )
    ratio = statistics.median(a / b for a, b in zip(slowest[PP], slowest[ZERO3], strict=True))
    print(f"PP / ZeRO-3 step time: {ratio:.2f} (median over steps of each round's ratio)")
    print(f"last loss: PP {result['losses'][PP]:.6f}, ZeRO-3 {result['losses'][ZERO3]:.6f}")
    for name in names:
        print(f"{name:<34}steps s: {' '.join(f'{t:.3f}' for t in slowest[name])}")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.out:
        worker(FLAGS.out)
        return
    if FLAGS.dry_run:
        for name, axes in _plans().items():
            print(f"{name}: fs.plan bytes per axis {axes}")
        return
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="bench_pipeline_nodes-") as tmp,
        Nodes(NODES, rate=None if FLAGS.rate == "none" else FLAGS.rate) as nodes,
    ):
        out = os.path.join(tmp, "result.json")
        args = [f"--{k}={FLAGS[k].value}" for k in FORWARDED]
        run = nodes.torchrun(
            [__file__, f"--out={out}", *args], nproc_per_node=PER_NODE, log_dir=tmp
        )
        codes = run.wait(timeout=FLAGS.timeout)
        if any(codes) or not os.path.exists(out):
            sys.exit(f"bench_pipeline_nodes: nodes exited {codes}\n{run.tails()}")
        with open(out) as f:
            result = json.load(f)
    report(result, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    app.run(main)
