"""Workers of the pipeline's remaining compositions (``test_pipeline_math.py``'s last test):
AdamW with the whole model's gradient clipped, Muon, narrow and 8-bit moments, a CPU-offloaded
half of the optimizer, and the low-precision wires (``param_comm_dtype``, ``grad_comm_dtype``)
under a pipeline (P=2 x S=2, 1F1B, 4 microbatches, ``helpers_pipeline``'s split MLP).

Each optimizer case runs twice on the same 4 ranks and the same global batch of 16 rows: the
pipelined state, and a plain one (no pipeline, S=4, 2 microbatches of 2 rows: the same 8
chunks of the mean loss), with the same fs optimizer and strategy; the test holds the two
updates together. Each wire case runs the pipelined state alone (SGD momentum, as
``helpers_pipeline.reference``) and reports its bytes by axis for ``fs.plan``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.optim import matrices as muon_lib

import helpers_pipeline as hp

ROWS = 8  # per data-parallel rank at P=2 (dp=2): 16 rows a step
CLIP = 0.5  # below every step's norm: the update reads the whole model's norm
ADAM_LR, MUON_LR = 1e-2, 0.02


def _is_muon(name: str, shape: tuple) -> bool:
    return len(shape) == 2 and not name.startswith(("head", "embed"))


def optimizer(kind: str) -> fs.optim.Optimizer:
    """The case's optimizer: "adamw_clip", "muon" (Muon on the blocks' matrices, AdamW on
    the rest, clipped), "narrow" (bf16 first and second moments), "eight_bit" (int8 / uint8
    blockwise moments), "offload" (AdamW; ``offload_fraction=0.5`` in ``OPTIONS``)."""
    adamw = fs.optim.adamw(ADAM_LR, weight_decay=0.1)
    if kind == "adamw_clip":
        return fs.optim.chain(fs.optim.clip_by_global_norm(CLIP), adamw)
    if kind == "muon":
        muon = fs.optim.multi_transform(
            {"muon": fs.optim.muon(MUON_LR, weight_decay=0.1), "adamw": adamw},
            lambda name, shape: "muon" if _is_muon(name, shape) else "adamw",
        )
        return fs.optim.chain(fs.optim.clip_by_global_norm(CLIP), muon)
    if kind == "narrow":
        return fs.optim.adamw(ADAM_LR, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    if kind == "eight_bit":
        return fs.optim.adamw(ADAM_LR, mu_dtype=torch.int8, nu_dtype=torch.uint8)
    assert kind == "offload", kind
    return adamw


OPTIONS = {"offload": {"offload_fraction": 0.5}}


def ns_fp32(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch's Newton-Schulz iterating on the fp32 input (no bf16 cast of it), the result in
    bf16 as the exchange carries it: the pipelined and plain runs' gradients differ in the
    order of their sums (~1e-7); a bf16 input crossing a rounding there is amplified by the
    iteration (a^5 ~ 480 on small singular values) into whole-matrix differences."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.float().T if tall else update.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).contiguous().bfloat16()


def _train(state, batches: list) -> tuple:
    metrics = []
    for batch in batches:
        state, m = fs.train_step(state, batch, hp.loss_fn)
        metrics.append((m["loss"], m["grad_norm"], m["nonfinite"]))
    return state, metrics


def _plain_loss(net: torch.nn.Module):
    def loss(params, batch):
        return hp.loss_fn(fs.functional_call(net, params, (batch[0],)), batch[1])

    return loss


def run_optimizer(kind: str, strategy: str) -> dict:
    """``hp.STEPS`` steps of optimizer ``kind`` pipelined (P=2 x S=2) and plain (S=4): the
    whole model and metrics of each, and the share of the pipelined rank's optimizer
    stepped on the CPU (``offload_fraction``). Muon orthogonalizes with :func:`ns_fp32`."""
    kw = OPTIONS.get(kind, {})
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    stages = fs.pipeline.split(hp.make_net(), hp.split_points(2))
    pipe = fs.Pipeline("1F1B", microbatches=hp.MICROBATCHES)
    kept, muon_lib.newton_schulz = muon_lib.newton_schulz, ns_fp32
    try:
        state = fs.init(stages, optimizer(kind), mesh=mesh, strategy=strategy, pipeline=pipe, **kw)
        offloaded = state.layout.achieved_offload_fraction()
        dp = dist.get_rank() % 2
        piped, piped_m = _train(state, [hp.dp_parts(s, ROWS, 2)[dp] for s in range(hp.STEPS)])
        net = hp.make_net()
        plain = fs.init(
            net, optimizer(kind), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy, **kw
        )
        rank, rows = dist.get_rank(), ROWS // 2
        plain_batches = [hp.dp_parts(s, rows, 4)[rank] for s in range(hp.STEPS)]
        plain_m = []
        for batch in plain_batches:
            plain, m = fs.train_step(plain, batch, _plain_loss(net), microbatches=2)
            plain_m.append((m["loss"], m["grad_norm"], m["nonfinite"]))
    finally:
        muon_lib.newton_schulz = kept
    return {
        "full": {n: t.cpu() for n, t in fs.full_params(piped).items()},
        "plain": {n: t.cpu() for n, t in fs.full_params(plain).items()},
        "metrics": piped_m,
        "plain_metrics": plain_m,
        "offloaded": offloaded,
    }


def run_wire(strategy: str, param_wire: torch.dtype, grad_wire: torch.dtype) -> dict:
    """``hp.STEPS`` steps of SGD momentum (fp32 compute) at P=2 x S=2 with the params'
    all-gathers on ``param_wire`` and the gradients' reductions on ``grad_wire``: the whole
    model, metrics, and this rank's bytes by axis and pipeline rank (for ``fs.plan``)."""
    policy = fs.MixedPrecisionPolicy(param_comm_dtype=param_wire, grad_comm_dtype=grad_wire)
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    stages = fs.pipeline.split(hp.make_net(), hp.split_points(2))
    pipe = fs.Pipeline("1F1B", microbatches=hp.MICROBATCHES)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    state = fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe, policy=policy)
    dp = dist.get_rank() % 2
    with fs.comm_stats() as stats:
        state, metrics = _train(state, [hp.dp_parts(s, ROWS, 2)[dp] for s in range(hp.STEPS)])
    return {
        "full": {n: t.cpu() for n, t in fs.full_params(state).items()},
        "metrics": metrics,
        "by_axis": {k: v for k, v in stats.bytes_by_axis.items() if v},
        "pipeline_rank": mesh["pipeline"].get_local_rank(),
    }


def run_cases(cases: list[tuple]) -> list[dict]:
    """Each ``(worker name, *args)`` of this module run in turn (:func:`hp.run_named`)."""
    return hp.run_named(globals(), cases)


def reference_adamw_clip() -> dict[str, torch.Tensor]:
    """One process, plain torch: ``torch.optim.AdamW`` on the whole model after
    ``clip_grad_norm_(CLIP)``, the global batch's 8 chunks of 2 rows each weighted 1/8."""
    model = hp.make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.1)
    for step in range(hp.STEPS):
        opt.zero_grad()
        for x, y in hp.dp_parts(step, ROWS, 2):
            xs, ys = x.tensor_split(hp.MICROBATCHES), y.tensor_split(hp.MICROBATCHES)
            for xm, ym in zip(xs, ys, strict=True):
                (hp.loss_fn(model(xm), ym) / (2 * hp.MICROBATCHES)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
