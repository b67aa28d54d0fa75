"""What ``fs.check_replicas`` costs beside the step it guards.

HSDP replicas (a ``shard x replicate`` mesh of gloo CPU ranks, ``no_shard`` inside a replica by
default so that every rank's whole state is compared) train the bench GPT with AdamW; then the
median wall time of one ``fs.check_replicas(state)`` and of one ``fs.train_step`` are timed on
the same state, with the bytes each puts on the wire (``fs.comm_stats``). Printed: the state's
bytes per rank, the check's time and bytes, the step's, and check / step.

Run:  python experiments/bench_replicas.py --nproc=2 --replicate=2
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402
from timing import median_time  # noqa: E402

import funcshard as fs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("nproc", 2, "gloo ranks")
flags.DEFINE_integer("replicate", 2, "replicas (the rest is the shard axis)")
flags.DEFINE_string("strategy", "optim_grads_params", "strategy inside a replica")
flags.DEFINE_integer("d_model", 256, "GPT width")
flags.DEFINE_integer("n_layer", 4, "GPT blocks")
flags.DEFINE_integer("repeats", 5, "timed calls of each")


def _worker(strategy: str, replicate: int, d_model: int, n_layer: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=256, seq_len=32, n_layer=n_layer, d_model=d_model, n_head=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = fs.make_mesh(shard=dist.get_world_size() // replicate, replicate=replicate)
    box = [fs.init(model, fs.optim.adamw(1e-4), mesh=mesh, strategy=strategy)]
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = {"x": torch.randint(0, cfg.vocab, (4, cfg.seq_len + 1), generator=g)}

    def loss_fn(params, b):
        logits = fs.functional_call(model, params, (b["x"][:, :-1],))
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, cfg.vocab), b["x"][:, 1:].reshape(-1)
        )

    def step() -> None:
        box[0], _ = fs.train_step(box[0], batch, loss_fn)

    def check() -> None:
        fs.check_replicas(box[0])

    step_s, check_s = median_time(step, repeats), median_time(check, repeats)
    with fs.comm_stats() as step_stats:
        step()
    with fs.comm_stats() as check_stats:
        check()
    state = box[0]
    leaves = [*state.master, *fs.tree.leaves(state.opt_state)]
    return {
        "state_bytes": sum(t.numel() * t.element_size() for t in leaves if torch.is_tensor(t)),
        "check_s": check_s,
        "step_s": step_s,
        "check_bytes": sum(check_stats.bytes.values()),
        "step_bytes": sum(step_stats.bytes.values()),
    }


def main(argv: list[str]) -> None:
    del argv
    results = fs.launch(
        _worker,
        FLAGS.strategy,
        FLAGS.replicate,
        FLAGS.d_model,
        FLAGS.n_layer,
        FLAGS.repeats,
        nproc=FLAGS.nproc,
    )
    print(
        f"check_replicas beside train_step: {FLAGS.nproc} gloo ranks, replicate="
        f"{FLAGS.replicate}, {FLAGS.strategy}, GPT d_model={FLAGS.d_model} "
        f"n_layer={FLAGS.n_layer}, median of {FLAGS.repeats}"
    )
    print(
        f"{'rank':>4} {'state MB':>9} {'check ms':>9} {'check B':>8} {'step ms':>8} "
        f"{'step MB':>8} {'check/step':>10}"
    )
    for rank, r in enumerate(results):
        print(
            f"{rank:>4} {r['state_bytes'] / 1e6:9.1f} {r['check_s'] * 1e3:9.2f} "
            f"{r['check_bytes']:8d} {r['step_s'] * 1e3:8.1f} {r['step_bytes'] / 1e6:8.2f} "
            f"{r['check_s'] / r['step_s']:10.3f}"
        )


if __name__ == "__main__":
    app.run(main)
