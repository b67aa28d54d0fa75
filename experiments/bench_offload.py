"""CPU throughput of ``offload_step`` against torch's fused AdamW and the memory bandwidth.

For ``--leaves`` x ``--numel`` fp32 master params on the CPU (default 8 x 6.25M = 50M):

* copy bandwidth: ``dst.copy_(src)`` over one buffer of that size (bytes read + written);
* ``torch.optim.AdamW(fused=True)`` on the same leaves, and ``fs.offload_step`` on a state
  with every leaf offloaded (fp32 compute: the step alone); AdamW touches ~28 bytes per param
  (reads p, g, m, v; writes p, m, v);
* with a bf16 compute copy: two passes (the fused step, then a separate cast of the master
  into a preallocated bf16 buffer) against one blocked pass (fused step + cast per block, the
  master re-read from cache): ``offload_step`` itself, ``step_and_cast`` at several block
  sizes, and the bare kernel calls per block (no Python optimizer wrapper) for the floor;
* ``offload_step`` with moments stored fp32, bf16 (to nearest, and stochastically) and 8-bit
  (``--moments``), on the same elements as rows of 1024 (8-bit moments need 2-D leaves),
  bytes counted as stored.

Run:  python experiments/bench_offload.py --threads=2
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from absl import app, flags
from torch import nn

import funcshard as fs
from funcshard.distributed.launch import free_port, init_process_group
from funcshard.step import update as offload_lib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package
from experiments.timing import median_time  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("leaves", 8, "number of parameter leaves")
flags.DEFINE_integer("numel", 6_250_000, "elements per leaf")
flags.DEFINE_integer("threads", None, "CPU threads (torch.set_num_threads); default: all cores")
flags.DEFINE_integer("repeats", 5, "timed repetitions (the median is reported)")
flags.DEFINE_list(
    "moments",
    ["fp32", "bf16", "bf16 stochastic", "8-bit"],
    "moment storages to time (fp32, bf16, 'bf16 stochastic', 8-bit)",
)
flags.DEFINE_list("blocks", ["65536", "262144", "1048576", "4194304"], "block sizes to try")

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
ADAMW_BYTES = 28  # read p, g, m, v; write p, m, v (fp32)
CAST_BYTES = 2  # plus the bf16 copy written once


class Leaves(nn.Module):
    def __init__(self, leaves: int, numel: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(leaves))


class Matrices(nn.Module):
    """The same elements as rows of 1024 (2-D leaves take 8-bit moments in blocks of 256)."""

    def __init__(self, leaves: int, numel: int) -> None:
        super().__init__()
        rows = max(1, numel // 1024)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(rows, 1024)) for _ in range(leaves))


MOMENTS = {  # label: (adamw keywords, bytes per param moved: p r/w, g, mu r/w, nu r/w)
    "fp32": ({}, ADAMW_BYTES),
    "bf16": ({"mu_dtype": torch.bfloat16, "nu_dtype": torch.bfloat16}, 20),
    "bf16 stochastic": (
        {"mu_dtype": torch.bfloat16, "nu_dtype": torch.bfloat16, "stochastic_rounding": True},
        20,
    ),
    "8-bit": ({"mu_dtype": torch.int8, "nu_dtype": torch.uint8}, 16),
}


def _copy_bandwidth(numel: int, repeats: int) -> float:
    """Bytes per second read + written by ``dst.copy_(src)`` over ``numel`` fp32 elements."""
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return 8 * numel / median_time(lambda: dst.copy_(src), repeats)


def _fused_adamw_blocks(p, g, m, v, step, out, block: int) -> None:
    """The floor of the blocked pass: bare kernel calls, no optimizer wrapper."""
    for start in range(0, p.numel(), block):
        sl = slice(start, start + block)
        torch._fused_adamw_(
            [p[sl]],
            [g[sl]],
            [m[sl]],
            [v[sl]],
            [],
            [step],
            amsgrad=False,
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            weight_decay=WD,
            eps=EPS,
            maximize=False,
        )
        if out is not None:
            out[sl].copy_(p[sl])


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.threads:
        torch.set_num_threads(FLAGS.threads)
    threads = torch.get_num_threads()
    init_process_group(0, 1, free_port(), backend="gloo")
    mesh = fs.make_mesh(device_type="cpu")
    n_total = FLAGS.leaves * FLAGS.numel
    reps = FLAGS.repeats
    rows: list[tuple[str, float, int]] = []  # (name, seconds, bytes per param)

    bandwidth = _copy_bandwidth(n_total, reps)

    # torch.optim.AdamW(fused=True) on the same leaves.
    model = Leaves(FLAGS.leaves, FLAGS.numel)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch_opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True
    )
    t_torch = median_time(torch_opt.step, reps)
    rows.append(("torch AdamW(fused=True)", t_torch, ADAMW_BYTES))
    del torch_opt

    def offload_state(policy: fs.MixedPrecisionPolicy) -> fs.TrainState:
        return fs.init(
            model,
            fs.optim.adamw(LR, BETAS, EPS, WD),
            mesh=mesh,
            policy=policy,
            strategy="no_shard",
            offload_fraction=1.0,
        )

    def time_offload_step(state: fs.TrainState) -> tuple[float, fs.TrainState]:
        grads = tuple(torch.randn(b.numel) for b in state.layout.buckets)
        box = [state]

        def step() -> None:
            box[0] = fs.offload_step(box[0], grads, threads=threads)

        return median_time(step, reps), box[0]

    t_ours, state = time_offload_step(offload_state(fs.MixedPrecisionPolicy()))
    rows.append(("fs.offload_step (fp32 compute)", t_ours, ADAMW_BYTES))
    del state

    matrices = Matrices(FLAGS.leaves, FLAGS.numel)
    for label in FLAGS.moments:
        kw, nbytes = MOMENTS[label]
        opt = fs.optim.adamw(LR, BETAS, EPS, WD, **kw)
        state = fs.init(matrices, opt, mesh=mesh, strategy="no_shard", offload_fraction=1.0)
        t, state = time_offload_step(state)
        rows.append((f"fs.offload_step, {label} moments, rows of 1024", t, nbytes))
        del state

    # One pass vs two with a bf16 compute copy.
    t_single, state = time_offload_step(
        offload_state(fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    )
    rows.append(
        (
            f"fs.offload_step (bf16 copy, block {offload_lib.BLOCK_NUMEL})",
            t_single,
            ADAMW_BYTES + CAST_BYTES,
        )
    )
    del state
    p = torch.randn(n_total)
    g, m, v = torch.randn(n_total), torch.zeros(n_total), torch.zeros(n_total)
    out = torch.empty(n_total, dtype=torch.bfloat16)
    step = torch.tensor(1.0)

    def two_pass() -> None:
        _fused_adamw_blocks(p, g, m, v, step, None, n_total)
        out.copy_(p)

    t_two = median_time(two_pass, reps)
    rows.append(("two passes: fused AdamW, then cast", t_two, ADAMW_BYTES + CAST_BYTES))
    t_alloc = median_time(
        lambda: (_fused_adamw_blocks(p, g, m, v, step, None, n_total), p.to(torch.bfloat16)), reps
    )
    rows.append(("two passes, cast allocating (p.to)", t_alloc, ADAMW_BYTES + CAST_BYTES))
    opt = fs.optim.adamw(LR, BETAS, EPS, WD)
    opt_state = opt.init((p,))
    for block in (int(b) for b in FLAGS.blocks):
        t = median_time(lambda b=block: _fused_adamw_blocks(p, g, m, v, step, out, b), reps)
        rows.append((f"one pass, bare kernels, block {block}", t, ADAMW_BYTES + CAST_BYTES))
        holder = [opt_state]

        def blocked(b: int = block, holder: list = holder) -> None:
            holder[0] = offload_lib.step_and_cast(opt, holder[0], p, g, out, block=b)

        t = median_time(blocked, reps)
        rows.append((f"one pass, step_and_cast, block {block}", t, ADAMW_BYTES + CAST_BYTES))

    print(
        f"\n{FLAGS.leaves} leaves x {FLAGS.numel} = {n_total / 1e6:.1f}M fp32 params, "
        f"{threads} threads; copy bandwidth {bandwidth / 1e9:.2f} GB/s (read + write)\n"
    )
    print(f"{'variant':<48} {'ms':>8} {'Gparam/s':>9} {'GB/s':>7} {'of copy bw':>10}")
    for name, t, nbytes in rows:
        print(
            f"{name:<48} {t * 1e3:8.1f} {n_total / t / 1e9:9.3f} "
            f"{nbytes * n_total / t / 1e9:7.2f} {nbytes * n_total / t / bandwidth:10.2f}"
        )
    best_single = min(t for name, t, _ in rows if name.startswith("one pass"))
    print(f"\noffload_step / torch fused AdamW throughput: {t_torch / t_ours:.3f} (target >= 0.95)")
    print(
        f"offload_step vs copy bandwidth at {ADAMW_BYTES} B/param: "
        f"{ADAMW_BYTES * n_total / t_ours / bandwidth:.2f}"
    )
    print(f"one pass (offload_step, bf16) vs two passes: {t_two / t_single:.3f} (target >= 1.2)")
    print(
        f"best one pass vs two passes: {t_two / best_single:.3f}; "
        f"vs two passes with an allocating cast: {t_alloc / best_single:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
