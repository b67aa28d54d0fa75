"""The optimizer update of a captured step: torch's fused AdamW kernel beside AdamW's rule
compiled by inductor, on one flat fp32 shard (what ``fs.init(compile=...)`` leaves eager).

Run:  python experiments/bench_update.py --numel=11500000   # a rank's shard of the 23M GPT
"""

from __future__ import annotations

import os
import sys

import torch
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import median_time  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("numel", 11_500_000, "Elements of the shard.")
flags.DEFINE_integer("repeats", 20, "Timed updates per way.")
flags.DEFINE_integer("threads", 1, "Intra-op threads.")
flags.DEFINE_string("backend", "inductor", "torch.compile backend of the compiled update.")

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1


def _compiled_rule(p, g, m, v, step: torch.Tensor) -> None:
    """torch.optim.AdamW's rule (decoupled decay, bias correction, eps after the root)."""
    b1, b2 = BETAS
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    c1, c2 = 1 - b1**step, 1 - b2**step
    p.addcdiv_(m / c1, (v / c2).sqrt().add_(EPS), value=-LR)


def main(argv: list[str]) -> None:
    del argv
    torch.set_num_threads(FLAGS.threads)
    n = FLAGS.numel
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0)
    fused = median_time(
        lambda: torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            [step],
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            weight_decay=WD,
            eps=EPS,
            amsgrad=False,
            maximize=False,
        ),
        FLAGS.repeats,
    )
    compiled_fn = torch.compile(_compiled_rule, backend=FLAGS.backend)
    compiled_fn(p, g, m, v, step)  # the compile
    compiled = median_time(lambda: compiled_fn(p, g, m, v, step), FLAGS.repeats)
    print(f"AdamW update of {n / 1e6:.1f}M fp32 elements, {FLAGS.threads} thread(s), median:")
    print(f"  fused kernel (torch._fused_adamw_)  {fused * 1e3:8.2f} ms")
    print(f"  compiled rule ({FLAGS.backend})        {compiled * 1e3:8.2f} ms")
    print(f"  compiled / fused                     {compiled / fused:8.2f}")


if __name__ == "__main__":
    app.run(main)
