"""The captured step's memory and graphs beside eager, per strategy (issue #55).

    python experiments/bench_compile.py                        # 2 CPU ranks, 8 and 16 layers
    python experiments/bench_compile.py --layers=2 --backend=inductor --nooverlap
    python experiments/bench_compile.py --model=mlp --backend=inductor --batch=64

With ``--model=mlp`` the model is a residual MLP of width ``--d_model`` (an input layer of 5
features, ``--layers`` blocks of LayerNorm, Linear and tanh, a head of 11 classes; rows of
``--batch`` a rank): activations of KB scale, so that the gradients a schedule holds show in
the peak (a GPT's MB-scale activations hid a 1.18x ZeRO-2 peak under inductor as 1.01x).

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
flags.DEFINE_enum("model", "gpt", ["gpt", "mlp"], "a GPT, or a residual MLP (docstring)")
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


class Block(torch.nn.Module):
    """``--model=mlp``'s block: x + tanh(Linear(LayerNorm(x)))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def mlp(dim: int, layers: int) -> torch.nn.Module:
    """``--model=mlp``: 5 features in, ``layers`` blocks of width ``dim``, 11 classes out."""
    blocks = [Block(dim) for _ in range(layers)]
    return torch.nn.Sequential(torch.nn.Linear(5, dim), *blocks, torch.nn.Linear(dim, 11))


def make_batches(cfg_: dict[str, Any], vocab: int, seq_len: int) -> list[dict]:
    """``--steps`` batches of this rank's ``--batch`` rows: tokens (a GPT's) or features and
    classes (the MLP's)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = []
    for _ in range(cfg_["steps"]):
        if cfg_["model"] == "mlp":
            x = torch.randn(cfg_["batch"], 5, generator=g)
            batches.append({"x": x, "y": torch.randint(0, 11, (cfg_["batch"],), generator=g)})
            continue
        tokens = torch.randint(0, vocab, (cfg_["batch"], seq_len + 1), generator=g)
        batches.append({"x": tokens[:, :-1], "y": tokens[:, 1:]})
    return batches


def run(cfg_: dict[str, Any], layers: int, strategy: str, captured: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab=256, seq_len=cfg_["seq_len"], n_layer=layers, n_head=4, d_model=cfg_["d_model"]
    )
    model = GPT(cfg) if cfg_["model"] == "gpt" else mlp(cfg_["d_model"], layers)
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
        return F.cross_entropy(logits.flatten(0, -2), batch["y"].flatten())

    batches = make_batches(cfg_, cfg.vocab, cfg.seq_len)

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
    names = ("model", "seq_len", "d_model", "backend", "overlap", "steps", "batch", "strategies")
    cfg = {name: getattr(FLAGS, name) for name in names}
    cfg["layers"] = [int(n) for n in FLAGS.layers]
    results = fs.launch(worker, cfg, nproc=FLAGS.nproc)[0]
    mb = lambda n: f"{n / 2**20:.2f} MB"  # noqa: E731
    for r in results:
        e, c = r["eager"], r["captured"]
        print(f"--- {FLAGS.model}, {r['layers']} layers, {r['strategy']}, backend {FLAGS.backend}")
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
