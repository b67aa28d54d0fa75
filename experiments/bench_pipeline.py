"""Pipeline parallel beside torch's own recipe and beside no pipeline: the GPT of
experiments/gpt.py (untied head) on 4 gloo CPU ranks, fp32, SGD with momentum.

    python experiments/bench_pipeline.py                      # P=2 x S=2, 1F1B, 8 microbatches
    python experiments/bench_pipeline.py --n_layer=8 --d_model=256 --steps=5

Three runs of the same model, global batch and optimizer:

* funcshard: ``fs.make_mesh(pipeline=2)`` (S=2 inside), ``fs.pipeline.split`` at the middle
  block, ``fs.Pipeline(schedule, microbatches)``, ZeRO-3 (gathered once a step);
* torch: torchtitan's recipe with torch's public APIs: each stage the model with the other
  modules removed, ``fully_shard`` on every block and the stage over the stage's
  data-parallel mesh with ``reshard_after_forward=False``, ``PipelineStage`` and torch's
  schedule class, ``torch.optim.SGD``;
* zero3: funcshard without a pipeline, ZeRO-3 over all 4 ranks (one microbatch).

Printed: median step time of each and the ratios; the bubble measured in the two pipelined
runs (per rank: the time torch's schedule waits on its receives and sends over the schedule's
time, ``torch.distributed.pipelining.schedules._wait_batch_p2p`` timed; the mean over ranks)
beside ``fs.plan``'s (from torch's order): with equal stages, and with each stage weighted by
its FLOPs (``inputs=``: the last stage runs the head, the first the embedding, which counts
no FLOP). Not a timed assertion: a table.
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
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402

import funcshard as fs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("schedule", "1F1B", "torch's schedule (single-stage: GPipe or 1F1B).")
flags.DEFINE_integer("microbatches", 8, "Microbatches a step.")
flags.DEFINE_integer("steps", 4, "Timed steps (after one warm-up step).")
flags.DEFINE_integer("batch", 32, "Global batch (sequences).")
flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
flags.DEFINE_integer("n_layer", 4, "Blocks (split in the middle).")
flags.DEFINE_integer("d_model", 128, "Width.")
flags.DEFINE_integer("n_head", 4, "Heads.")
flags.DEFINE_integer("vocab", 256, "Vocabulary.")
flags.DEFINE_integer("threads", 1, "torch threads per rank.")
flags.DEFINE_integer(
    "shard", 2, "Data-parallel ranks per stage (world = 2 x shard; 1: a core per rank here)."
)

P, LR, MOMENTUM = 2, 1e-3, 0.9


def _model(cfg: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(tied=False, **cfg))  # its forward runs what a stage holds


def _batch(step: int, rows: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg["vocab"], (rows, cfg["seq_len"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _Waits:
    """Times torch's schedule: its ``step`` and the p2p waits inside it (the bubble)."""

    def __init__(self, schedule_cls: type) -> None:
        from torch.distributed.pipelining import schedules

        self.wait = self.total = 0.0
        wait_fn, step_fn = schedules._wait_batch_p2p, schedule_cls.step

        def timed_wait(work):
            t = time.perf_counter()
            wait_fn(work)
            self.wait += time.perf_counter() - t

        def timed_step(sched, *args, **kwargs):
            t = time.perf_counter()
            try:
                return step_fn(sched, *args, **kwargs)
            finally:
                self.total += time.perf_counter() - t

        schedules._wait_batch_p2p = timed_wait
        schedule_cls.step = timed_step

    def reset(self) -> None:
        self.wait = self.total = 0.0


def _local(step: int, cfg: dict, dp: int, dp_rank: int):
    x, y = _batch(step, cfg["batch"], cfg)
    rows = x.shape[0] // dp
    return x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]


def _timed(step_fn, steps: int, waits: _Waits | None) -> dict:
    times, bubbles = [], []
    for step in range(steps + 1):
        if waits is not None:
            waits.reset()
        dist.barrier()
        t = time.perf_counter()
        step_fn(step)
        elapsed = time.perf_counter() - t
        if step:  # the first step warms up
            times.append(elapsed)
            if waits is not None:
                bubbles.append(waits.wait / waits.total)
    return {"time": statistics.median(times), "bubble": statistics.mean(bubbles or [0.0])}


def funcshard_worker(cfg: dict, run: dict) -> dict:
    torch.set_num_threads(run["threads"])
    model_cfg = {k: cfg[k] for k in ("vocab", "seq_len", "n_layer", "d_model", "n_head")}
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    if run["pipeline"]:
        from torch.distributed.pipelining import schedules

        waits = _Waits(getattr(schedules, fs.Pipeline(run["schedule"]).torch_class))
        mesh = fs.make_mesh(pipeline=P, device_type="cpu")
        stages = fs.pipeline.split(_model(model_cfg), [f"blocks.{cfg['n_layer'] // 2}"])
        pipe = fs.Pipeline(run["schedule"], microbatches=run["microbatches"])
        state = fs.init(stages, opt, mesh=mesh, strategy="optim_grads_params", pipeline=pipe)
        dp, call = run["world"] // P, loss_fn
    else:
        waits, mesh = None, fs.make_mesh(device_type="cpu")
        model = _model(model_cfg)
        state = fs.init(model, opt, mesh=mesh, strategy="optim_grads_params")
        dp = run["world"]

        def call(params, batch):
            return loss_fn(fs.functional_call(model, params, (batch[0],)), batch[1])

    dp_rank = dist.get_rank() % dp
    box = [state]

    def one(step: int) -> None:
        box[0], _ = fs.train_step(box[0], _local(step, cfg, dp, dp_rank), call)

    return _timed(one, run["steps"], waits)


def _torch_stage(model: GPT, stage: int, half: int) -> GPT:
    """torchtitan's manual split: the model with the other stage's modules removed."""
    m = copy.deepcopy(model)
    if stage == 0:
        m.blocks = nn.ModuleList(list(m.blocks)[:half])
        m.ln_f, m.head = nn.Identity(), nn.Identity()
    else:
        m.blocks = nn.ModuleList(list(m.blocks)[half:])
        m.tok_emb, m.pos_emb = nn.Identity(), nn.Identity()
    return m


def torch_worker(cfg: dict, run: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules

    torch.set_num_threads(run["threads"])
    model_cfg = {k: cfg[k] for k in ("vocab", "seq_len", "n_layer", "d_model", "n_head")}
    cls = getattr(schedules, fs.Pipeline(run["schedule"]).torch_class)
    waits = _Waits(cls)
    mesh = init_device_mesh("cpu", (P, run["world"] // P), mesh_dim_names=("pp", "dp"))
    p = mesh["pp"].get_local_rank()
    stage_mod = _torch_stage(_model(model_cfg), p, cfg["n_layer"] // 2)
    for block in stage_mod.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage_mod, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(stage_mod, p, P, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = cls(stage, run["microbatches"], loss_fn=loss_fn, scale_grads=True)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=LR, momentum=MOMENTUM)
    dp, dp_rank = run["world"] // P, mesh["dp"].get_local_rank()

    def one(step: int) -> None:
        x, y = _local(step, cfg, dp, dp_rank)
        opt.zero_grad()
        sched.step(*((x,) if p == 0 else ()), target=y if p == P - 1 else None)
        opt.step()

    return _timed(one, run["steps"], waits)


def _plans(cfg: dict, run: dict) -> dict[str, float]:
    """``fs.plan``'s bubble of this run, with equal stages and with each stage weighted by
    its FLOPs (``inputs=``: a data-parallel rank's tokens, on the meta device)."""
    with torch.device("meta"):
        meta = GPT(GPTConfig(tied=False, **{k: v for k, v in cfg.items() if k != "batch"}))
    rows = cfg["batch"] // (run["world"] // P)
    kw = dict(
        world_size=run["world"],
        strategy="optim_grads_params",
        optimizer="sgd_momentum",
        microbatches=run["microbatches"],
        device_type="cpu",
        pipeline=P,
        schedule=run["schedule"],
        split=[f"blocks.{cfg['n_layer'] // 2}"],
        boundary=(rows, cfg["seq_len"], cfg["d_model"]),
    )
    tokens = torch.empty(rows, cfg["seq_len"], dtype=torch.long, device="meta")
    flops = fs.plan(meta, **kw, inputs=tokens).pipeline
    if flops.bubble_model != "flops":  # the GPT runs on the meta device: it should not be
        raise RuntimeError(f"fs.plan kept equal stages: {flops.bubble_note}")
    return {"equal": fs.plan(meta, **kw).pipeline.bubble, "flops": flops.bubble}


def main(argv: list[str]) -> None:
    del argv
    cfg = {
        "vocab": FLAGS.vocab,
        "seq_len": FLAGS.seq_len,
        "n_layer": FLAGS.n_layer,
        "d_model": FLAGS.d_model,
        "n_head": FLAGS.n_head,
        "batch": FLAGS.batch,
    }
    run = {
        "schedule": FLAGS.schedule,
        "microbatches": FLAGS.microbatches,
        "steps": FLAGS.steps,
        "threads": FLAGS.threads,
        "world": P * FLAGS.shard,
    }
    plan = _plans(cfg, run)
    ours = fs.launch(funcshard_worker, cfg, {**run, "pipeline": True}, nproc=run["world"])
    theirs = fs.launch(torch_worker, cfg, run, nproc=run["world"])
    zero3 = fs.launch(funcshard_worker, cfg, {**run, "pipeline": False}, nproc=run["world"])
    t = {name: max(r["time"] for r in rs) for name, rs in (("ours", ours), ("torch", theirs))}
    t["zero3"] = max(r["time"] for r in zero3)
    bubble = {
        name: statistics.mean(r["bubble"] for r in rs)
        for name, rs in (("ours", ours), ("torch", theirs))
    }
    print(
        f"P={P} x S={run['world'] // P}, {FLAGS.schedule}, {FLAGS.microbatches} microbatches, "
        f"batch {FLAGS.batch} x {FLAGS.seq_len}, {cfg}, median of {FLAGS.steps} steps "
        f"(slowest rank), load average {os.getloadavg()[0]:.1f}"
    )
    _table(t, bubble, plan, run["world"])


def _table(t: dict, bubble: dict, plan: dict, world: int) -> None:
    """The step times, the bubbles measured and planned, and their ratios."""
    print(f"{'run':>28} {'step s':>8} {'bubble':>7}")
    print(f"{'funcshard PP + ZeRO-3':>28} {t['ours']:>8.3f} {bubble['ours']:>7.3f}")
    print(f"{'torch PP + fully_shard':>28} {t['torch']:>8.3f} {bubble['torch']:>7.3f}")
    print(f"{'funcshard ZeRO-3 x ' + str(world):>28} {t['zero3']:>8.3f}")
    print(f"{'fs.plan bubble, equal stages':>28} {'':>8} {plan['equal']:>7.3f}")
    print(f"{'fs.plan bubble, by FLOPs':>28} {'':>8} {plan['flops']:>7.3f}")
    print(
        f"funcshard / torch = {t['ours'] / t['torch']:.2f}; funcshard PP / ZeRO-3 = "
        f"{t['ours'] / t['zero3']:.2f}"
    )
    for model, name in (("flops", "by FLOPs"), ("equal", "equal stages")):
        print(
            f"measured bubble / plan's ({name}) = {bubble['ours'] / plan[model]:.2f} "
            f"(torch's run: {bubble['torch'] / plan[model]:.2f})"
        )


if __name__ == "__main__":
    app.run(main)
