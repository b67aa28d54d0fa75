"""The captured step's memory and graphs beside eager, per strategy (issue #55).

    python experiments/bench_compile.py                        # 2 CPU ranks, 8 and 16 layers
    python experiments/bench_compile.py --layers=2 --backend=inductor --nooverlap

For each layer count and strategy (ZeRO-2, ZeRO-3), a GPT of width 128 in fp32 trains
``--steps`` steps of SGD with momentum eagerly and under ``fs.init(compile=BACKEND)`` (the
captured step), from one initial model. Printed per run: the peak of tensor bytes a step
holds above what it held at its start (torch's profiler, CPU allocations; the lowest of the
steps after the first: forward, backward and the update, whose SGD is in place), the step's
median wall time, the bytes per collective (``fs.comm_stats``) and, for the captured run,
what its graphs hold: the all-gathers and reduce-scatters of the forward and the backward
graph, in order, and how many tensors the forward saves for backward. Also the largest
relative difference of the params after the steps (captured against eager) among the leaves
whose norm is above rounding, and the largest absolute difference of those that stay at zero
up to rounding (``parity.ROUNDING``: each block's key bias, whose gradient is 0 in exact
math). With ``--backend=inductor`` the captured run gets the name (its graphs are not
recorded), so that ``fs.init(overlap=...)`` applies inductor's collective reordering passes, or not.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from absl import app, flags
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402
from parity import ROUNDING, params_difference  # noqa: E402
from timing import peaks_above_start  # noqa: E402

import funcshard as fs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["8", "16"], "layer counts")
flags.DEFINE_list("strategies", ["optim_grads_params", "optim_grads"], "ZeRO-3 / ZeRO-2")
flags.DEFINE_string("backend", "aot_eager", "torch.compile backend of the captured run")
flags.DEFINE_bool("overlap", True, "fs.init(overlap=): inductor's passes that reorder comms")
flags.DEFINE_integer("steps", 4, "steps per run (the first compiles)")
flags.DEFINE_integer("nproc", 2, "ranks")
flags.DEFINE_integer("d_model", 128, "width")
flags.DEFINE_integer("seq_len", 64, "tokens per row")
flags.DEFINE_integer("batch", 4, "rows per rank")

# torch's functional collectives, and funcshard's gather in place on gloo (graph_ops)
COLLECTIVES = ("_c10d_functional", "funcshard")


def recording_backend(backend: str, graphs: list) -> Any:
    """``backend`` (inductor or aot_eager) with the graphs it gets recorded: per graph, its
    kind, its collectives in order and (forward) how many tensors it saves for backward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def record(kind: str, gm: torch.fx.GraphModule) -> None:
        ops = [
            n.target._opname
            for n in gm.graph.nodes
            if getattr(n.target, "namespace", None) in COLLECTIVES
            and "wait" not in n.target._opname
        ]
        out = next(iter(reversed(gm.graph.nodes)))
        saved = len([a for a in out.args[0] if isinstance(a, torch.fx.Node)])
        graphs.append({"kind": kind, "collectives": ops, "outputs": saved})

    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(kind):
            def compile_graph(gm, example_inputs, **kw):
                record(kind, gm)
                return compile_fx_inner(gm, example_inputs, **kw)

            return compile_graph

        def compiled(gm, example_inputs):
            return compile_fx(gm, example_inputs, inner_compile=inner("graph"))

        return compiled
    from torch._dynamo.backends.debugging import boxed_nop

    def nop(kind):
        def compile_graph(gm, example_inputs):
            record(kind, gm)
            return boxed_nop(gm, example_inputs)  # aot_eager's: frees each value after its use

        return compile_graph

    return aot_autograd(
        fw_compiler=nop("forward"),
        bw_compiler=nop("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )


def step_peaks(step, batches) -> tuple[int, float]:
    """The lowest peak above its start of the steps after the first, and their median wall."""
    walls = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(batches[0])
        for i, batch in enumerate(batches[1:]):
            with record_function(f"measured_step_{i}"):
                t = time.perf_counter()
                step(batch)
                walls.append(time.perf_counter() - t)
    return min(peaks_above_start(prof, len(batches) - 1)), statistics.median(walls)


def run(cfg_: dict[str, Any], layers: int, strategy: str, captured: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab=256, seq_len=cfg_["seq_len"], n_layer=layers, n_head=4, d_model=cfg_["d_model"]
    )
    model = GPT(cfg)
    graphs: list = []
    kw: dict[str, Any] = {}
    if captured:
        backend = cfg_["backend"]  # inductor by name: funcshard's overlap passes apply
        kw["compile"] = backend if backend == "inductor" else recording_backend(backend, graphs)
        kw["overlap"] = cfg_["overlap"]
    state = fs.init(
        model,
        fs.optim.sgd(1e-2, momentum=0.9),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy=strategy,
        **kw,
    )

    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    g = torch.Generator().manual_seed(dist.get_rank())
    batches = []
    for _ in range(cfg_["steps"]):
        tokens = torch.randint(0, cfg.vocab, (cfg_["batch"], cfg.seq_len + 1), generator=g)
        batches.append({"x": tokens[:, :-1], "y": tokens[:, 1:]})

    def step(batch):
        nonlocal state
        state, _ = fs.train_step(state, batch, loss_fn)

    with fs.comm_stats() as stats:
        peak, wall = step_peaks(step, batches)
    return {
        "peak": peak,
        "wall": wall,
        "bytes": dict(stats.bytes),
        "gathered_peak": stats.gathered_peak,
        "graphs": graphs,
        "params": fs.full_params(state),
    }


def worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for layers in cfg["layers"]:
        for strategy in cfg["strategies"]:
            eager, captured = run(cfg, layers, strategy, False), run(cfg, layers, strategy, True)
            err = params_difference(eager["params"], captured["params"])
            for r in (eager, captured):
                del r["params"]
            out.append(
                {
                    "layers": layers,
                    "strategy": strategy,
                    "eager": eager,
                    "captured": captured,
                    "err": err,
                }
            )
    return out


def main(argv: list[str]) -> None:
    del argv
    names = ("seq_len", "d_model", "backend", "overlap", "steps", "batch", "strategies")
    cfg = {name: getattr(FLAGS, name) for name in names}
    cfg["layers"] = [int(n) for n in FLAGS.layers]
    results = fs.launch(worker, cfg, nproc=FLAGS.nproc)[0]
    mb = lambda n: f"{n / 2**20:.2f} MB"  # noqa: E731
    for r in results:
        e, c = r["eager"], r["captured"]
        print(f"--- {r['layers']} layers, {r['strategy']}, backend {FLAGS.backend}")
        print(
            f"  peak above step start: eager {mb(e['peak'])}, captured {mb(c['peak'])}, "
            f"ratio {c['peak'] / e['peak']:.3f}"
        )
        print(f"  wall: eager {e['wall'] * 1e3:.1f} ms, captured {c['wall'] * 1e3:.1f} ms")
        print(f"  bytes: eager {e['bytes']}, captured {c['bytes']}")
        print(f"  gathered_peak: eager {e['gathered_peak']}, captured {c['gathered_peak']}")
        for g in c["graphs"]:
            ops = g["collectives"]
            print(
                f"  {g['kind']} graph: {len(ops)} collectives {ops[:6]}..., outputs {g['outputs']}"
            )
        (rel, name), (tiny, tiny_name) = r["err"]["relative"], r["err"]["rounding"]
        print(f"  params, largest relative difference: {rel:.2e} ({name})")
        if tiny_name:
            print(
                f"  params at zero up to rounding (norm < {ROUNDING:g}): largest absolute "
                f"difference {tiny:.2e} ({tiny_name})"
            )


if __name__ == "__main__":
    app.run(main)
