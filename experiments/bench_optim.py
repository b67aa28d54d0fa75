"""The LLM recipe's optimizer step beside plain fused AdamW and torch's own recipe.

On one CPU rank, for a GPT-shaped set of fp32 leaves (matrices, embeddings, biases, norms):

* torch: ``AdamW(fused=True)`` alone, and ``clip_grad_norm_`` + ``AdamW(fused=True)`` with two
  param groups (decay on matrices only), the recipe as torch users write it;
* funcshard: ``fs.offload_step`` with plain ``fs.optim.adamw`` and with
  ``chain(clip_by_global_norm, adamw(mask=decay_mask))``, the clip active on every step. Both
  include the global-norm pass that ``train_step`` always makes (for ``metrics["grad_norm"]``);
  the clip itself is folded into the fused kernel, so the chain adds no pass over memory.
* funcshard with moments stored narrow (``adamw(mu_dtype=, nu_dtype=)``): bf16 (rounded to
  nearest, and stochastically), and 8-bit blockwise (int8 mu, uint8 nu); with the optimizer
  state's bytes per parameter, measured on the state and predicted by ``fs.plan``.

Run:  python experiments/bench_optim.py --threads=1
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from absl import app, flags
from torch import nn

import funcshard as fs
from funcshard.distributed.launch import free_port, init_process_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package
from experiments.timing import median_time  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("d_model", 1024, "model width")
flags.DEFINE_integer("layers", 4, "blocks (12 d^2 params each, plus biases and norms)")
flags.DEFINE_integer("vocab", 8192, "embedding rows")
flags.DEFINE_integer("threads", 1, "CPU threads (torch.set_num_threads)")
flags.DEFINE_integer("repeats", 7, "timed repetitions (the median is reported)")
flags.DEFINE_list(
    "moments",
    ["fp32", "bf16", "bf16 stochastic", "8-bit"],
    "moment storages to time (fp32, bf16, 'bf16 stochastic', 8-bit)",
)

LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1e-3  # the clip is always active


class GPTLeaves(nn.Module):
    """The parameter shapes of a GPT block stack (no forward: only the optimizer runs)."""

    def __init__(self, d: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, d))
        shapes = [
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
            (d,),
            (d,),
            (d,),
            (d,),
        ]
        self.blocks = nn.ModuleList(
            nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes) for _ in range(layers)
        )
        self.ln_f = nn.Parameter(torch.ones(d))


def main(argv: list[str]) -> None:
    del argv
    torch.set_num_threads(FLAGS.threads)
    init_process_group(0, 1, free_port(), backend="gloo")
    mesh = fs.make_mesh(device_type="cpu")
    model = GPTLeaves(FLAGS.d_model, FLAGS.layers, FLAGS.vocab)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    rows: list[tuple[str, float]] = []

    plain = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    rows.append(("torch AdamW(fused) (plain)", median_time(plain.step, FLAGS.repeats)))
    del plain
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    recipe = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)

    def torch_recipe() -> None:
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        recipe.step()

    rows.append(
        ("torch clip_grad_norm_ + AdamW(fused), 2 groups", median_time(torch_recipe, FLAGS.repeats))
    )

    def fs_step(opt: fs.optim.Optimizer) -> float:
        box = [fs.init(model, opt, mesh=mesh, strategy="no_shard")]
        grads = tuple(torch.randn(b.numel) for b in box[0].layout.buckets)

        def step() -> None:
            box[0] = fs.offload_step(box[0], grads)

        return median_time(step, FLAGS.repeats)

    rows.append(("fs adamw (plain)", fs_step(fs.optim.adamw(LR, BETAS, EPS, WD))))
    rows.append(
        (
            "fs chain(clip, adamw(mask=decay_mask))",
            fs_step(
                fs.optim.chain(
                    fs.optim.clip_by_global_norm(CLIP),
                    fs.optim.adamw(LR, BETAS, EPS, WD, mask=fs.optim.decay_mask),
                )
            ),
        )
    )

    state_bytes: dict[str, tuple[float, float]] = {}
    narrow = {
        "fp32": {},
        "bf16": {"mu_dtype": torch.bfloat16, "nu_dtype": torch.bfloat16},
        "bf16 stochastic": {
            "mu_dtype": torch.bfloat16,
            "nu_dtype": torch.bfloat16,
            "stochastic_rounding": True,
        },
        "8-bit": {"mu_dtype": torch.int8, "nu_dtype": torch.uint8},
    }
    for label, kw in narrow.items():
        if label not in FLAGS.moments:
            continue
        opt = fs.optim.adamw(LR, BETAS, EPS, WD, **kw)
        name = f"fs adamw, {label} moments"
        rows.append((name, fs_step(opt)))
        state = fs.init(model, opt, mesh=mesh, strategy="no_shard")
        measured = sum(
            t.numel() * t.element_size()
            for t in fs.tree.leaves(state.opt_state)
            if isinstance(t, torch.Tensor)
        )
        predicted = fs.plan(model, world_size=1, strategy="no_shard", optimizer=opt)
        state_bytes[name] = (measured / n, predicted.memory.opt_state / n)
        del state

    base = dict(rows)
    print(
        f"\n{n / 1e6:.1f}M fp32 params in {len(params)} leaves, {FLAGS.threads} thread(s), "
        f"median of {FLAGS.repeats}"
    )
    print(
        f"{'step':<50} {'ms':>8} {'vs fs plain':>12} {'vs torch recipe':>16} "
        f"{'state B/param (measured, plan)':>31}"
    )
    for name, t in rows:
        sb = state_bytes.get(name)
        print(
            f"{name:<50} {t * 1e3:8.1f} {t / base['fs adamw (plain)']:12.3f} "
            f"{t / base['torch clip_grad_norm_ + AdamW(fused), 2 groups']:16.3f} "
            + (f"{sb[0]:15.3f} {sb[1]:15.3f}" if sb else "")
        )


if __name__ == "__main__":
    app.run(main)
