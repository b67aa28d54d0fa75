"""Workers of the pipeline's precision and math tests (``test_pipeline_math.py``).

The model, batches and one-process fp32 reference are ``helpers_pipeline``'s (the split MLP:
embed 5 -> 16, 8 residual blocks of width 16, head 16 -> 3; P=2: blocks 0-3 on stage 0,
4-7 on stage 1). Every run is P=2 x S=2, 1F1B, 4 microbatches, SGD momentum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

import helpers_pipeline as hp
import models

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ROWS = 8  # per data-parallel rank: 2 rows a microbatch


def loss32(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The MSE in fp32 (the output comes in the compute dtype)."""
    return F.mse_loss(output.float(), target)


def _state(strategy: str, policy: fs.MixedPrecisionPolicy | None, net=None):
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    stages = fs.pipeline.split(net if net is not None else hp.make_net(), hp.split_points(2))
    pipe = fs.Pipeline("1F1B", microbatches=hp.MICROBATCHES)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    return fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe, policy=policy)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return hp.dp_parts(step, ROWS, 2)[dist.get_rank() % 2]


def run_policy(strategy: str, dtype: torch.dtype) -> dict:
    """``hp.STEPS`` steps under ``MixedPrecisionPolicy(param_dtype=dtype)`` (fp32 masters and
    gradients; fp16 with its dynamic loss scale from 2^10, which this model's gradients
    never overflow; from the default 2^16 its first two steps are skipped): the whole
    model, metrics and the bytes sent under "pipeline"."""
    policy = fs.MixedPrecisionPolicy(param_dtype=dtype, loss_scale_init=2.0**10)  # fp16's
    state = _state(strategy, policy)
    metrics = []
    with fs.comm_stats() as stats:
        for step in range(hp.STEPS):
            state, m = fs.train_step(state, _batch(step), loss32)
            metrics.append((m["loss"], m["grad_norm"], m["nonfinite"], m.get("loss_scale")))
    return {
        "full": {n: t.cpu() for n, t in fs.full_params(state).items()},
        "metrics": metrics,
        "pipeline_bytes": stats.bytes_by_axis["pipeline"],
    }


class InfGrad(torch.autograd.Function):
    """The identity whose gradient is infinite: a nonfinite weight gradient in one stage,
    its input gradient (sent to the previous stage) untouched."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad * float("inf")


class Poisoned(models.Block):
    """A block whose ``fc.weight`` gets an infinite gradient while ``armed``."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = InfGrad.apply(self.fc.weight) if self.armed else self.fc.weight
        return x + torch.tanh(F.linear(self.norm(x), w, self.fc.bias))


def run_one_stage_inf(strategy: str) -> dict:
    """fp16 with loss scaling; step 0 trains, step 1 has an infinite gradient in stage 1
    only (``blocks.5.fc.weight``), step 2 trains again: every step's metrics and the whole
    model after each."""
    net = hp.make_net()
    net.blocks[5] = Poisoned(hp.WIDTH)
    net.blocks[5].load_state_dict(hp.make_net().blocks[5].state_dict())
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.float16, loss_scale_init=2.0**12)
    state = _state(strategy, policy, net)
    out: dict = {"metrics": [], "full": [], "steps": []}
    for step in range(3):
        net.blocks[5].armed = step == 1
        state, m = fs.train_step(state, _batch(step), loss32)
        out["metrics"].append(m)
        out["steps"].append(state.step)
        out["full"].append({n: t.cpu().clone() for n, t in fs.full_params(state).items()})
    out["stages"] = state.pipeline.mine
    return out


def run_cases(cases: list[tuple]) -> list[dict]:
    """Each ``(worker name, *args)`` of this module run in turn (:func:`hp.run_named`)."""
    return hp.run_named(globals(), cases)


# --- deterministic=True and HFSDP inside a stage -----------------------------------------------

CLIP = 1.0  # below every step's norm: the update reads the norm's bits
MESHES = {"S2": dict(shard=2), "R2": dict(replicate=2, shard=1)}


def reference_clipped(rows: int = ROWS, dp: int = 2) -> dict:
    """``hp.reference`` with the whole model's gradient clipped to norm ``CLIP`` first."""
    model = hp.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=hp.LR, momentum=hp.MOMENTUM)
    losses = []
    for step in range(hp.STEPS):
        opt.zero_grad()
        total = 0.0
        for x, y in hp.dp_parts(step, rows, dp):
            xs, ys = x.tensor_split(hp.MICROBATCHES), y.tensor_split(hp.MICROBATCHES)
            for xm, ym in zip(xs, ys, strict=True):
                loss = hp.loss_fn(model(xm), ym) / (dp * hp.MICROBATCHES)
                loss.backward()
                total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        losses.append(total)
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "loss": losses}


def run_layout(mesh: str, strategy: str, init_kw: dict) -> dict:
    """``hp.STEPS`` clipped steps on the P=2 mesh ``MESHES[mesh]`` with ``init_kw``
    (``deterministic=``, ``outer_strategy=``): the whole model and each step's metrics."""
    stages = fs.pipeline.split(hp.make_net(), hp.split_points(2))
    pipe = fs.Pipeline("1F1B", microbatches=hp.MICROBATCHES)
    sgd = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(CLIP), sgd)
    fs_mesh = fs.make_mesh(pipeline=2, device_type="cpu", **MESHES[mesh])
    state = fs.init(stages, opt, mesh=fs_mesh, strategy=strategy, pipeline=pipe, **init_kw)
    metrics = []
    for step in range(hp.STEPS):
        state, m = fs.train_step(state, _batch(step), hp.loss_fn)
        metrics.append((m["loss"], m["grad_norm"]))
    return {"full": {n: t.cpu() for n, t in fs.full_params(state).items()}, "metrics": metrics}


# --- ZeRO-3 gathering per microbatch ------------------------------------------------------------


VOCAB = 11  # the embedding's rows (EmbedNet)


class EmbedNet(hp.Net):
    """The pipeline tests' MLP with an embedding first (its backward saves the indices, not
    the weight) and 4 blocks: stage 0 embed + blocks 0-1 (or + block 0 of 4 stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hp.WIDTH)
        self.blocks = self.blocks[:4]


def _regather_batch(step: int, embed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not embed:
        return _batch(step)
    g = torch.Generator().manual_seed(2000 + 10 * step + dist.get_rank() % 2)
    return torch.randint(0, VOCAB, (ROWS,), generator=g), torch.randn(ROWS, hp.D_OUT, generator=g)


def regather_split(per_rank: int, embed: bool) -> list[str]:
    """The split points of :func:`run_regather`'s stages (2 per pipeline rank: 4 stages)."""
    if embed:
        return [f"blocks.{k}" for k in (1, 2, 3)] if per_rank == 2 else ["blocks.2"]
    return hp.split_points(2 * per_rank)


def regather_plan(schedule: str, per_rank: int, regather: bool, embed: bool, rank: int):
    """``fs.plan`` of :func:`run_regather`'s run for pipeline rank ``rank``, from a meta model
    and meta inputs."""
    with torch.device("meta"):
        torch.manual_seed(0)
        net = EmbedNet() if embed else hp.Net()
        inputs = torch.empty(ROWS, dtype=torch.long) if embed else torch.empty(ROWS, hp.D_IN)
    return fs.plan(
        net,
        world_size=4,
        strategy="optim_grads_params",
        optimizer="sgd_momentum",
        microbatches=hp.MICROBATCHES,
        device_type="cpu",
        pipeline=2,
        schedule=schedule,
        split=regather_split(per_rank, embed),
        pipeline_rank=rank,
        boundary=(ROWS, hp.WIDTH),
        regather=regather,
        inputs=inputs,
    )


def run_regather(schedule: str, per_rank: int, regather: bool, embed: bool = False) -> dict:
    """ZeRO-3 at P=2 x S=2 under ``fs.Pipeline(schedule, regather=regather)``: the whole
    model, metrics, and what steps 1 and 2 move and gather (step 0 also runs torch's shape
    inference through the stages); ``embed``: :class:`EmbedNet` on token batches, steps 0
    and 1 only."""
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    torch.manual_seed(0)
    net = EmbedNet() if embed else hp.make_net()
    stages = fs.pipeline.split(net, regather_split(per_rank, embed))
    pipe = fs.Pipeline(schedule, microbatches=hp.MICROBATCHES, regather=regather)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    state = fs.init(stages, opt, mesh=mesh, strategy="optim_grads_params", pipeline=pipe)
    state, m = fs.train_step(state, _regather_batch(0, embed), hp.loss_fn)
    metrics = [(m["loss"], m["grad_norm"])]
    with fs.comm_stats() as stats:
        for step in range(1, 2 if embed else hp.STEPS):
            state, m = fs.train_step(state, _regather_batch(step, embed), hp.loss_fn)
            metrics.append((m["loss"], m["grad_norm"]))
    return {
        "full": {n: t.cpu() for n, t in fs.full_params(state).items()},
        "metrics": metrics,
        "gathers": stats.calls["all_gather"],
        "gathered_bytes": stats.bytes["all_gather"],
        "buckets": len(state.layout.buckets),
        "stages": state.pipeline.mine,
        "pipeline_rank": mesh["pipeline"].get_local_rank(),
        "by_axis": {k: v for k, v in stats.bytes_by_axis.items() if v},
        "bytes": {k: v for k, v in stats.bytes.items() if v},
        "calls": {k: v for k, v in stats.calls.items() if v},
        "peak": stats.gathered_peak,
        "steady_steps": len(metrics) - 1,
    }


class RealBoom(models.Block):
    """A block that raises in its forward on real tensors while ``armed`` (its meta-device
    run, which sizes its stand-in, works)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and x.device.type != "meta":
            raise RuntimeError("boom: a stage's forward failed")
        return super().forward(x)


def run_first_step_failure() -> dict:
    """fp32, ZeRO-3: stage 1 raises in its forward on the very first step (while torch's
    schedule infers its shapes and strides through the stages' stand-ins): every rank raises
    naming it; the next step trains."""
    net = hp.make_net()
    net.blocks[5] = RealBoom(hp.WIDTH)
    net.blocks[5].load_state_dict(hp.make_net().blocks[5].state_dict())
    state = _state("optim_grads_params", None, net)
    net.blocks[5].armed = True
    try:
        fs.train_step(state, _batch(0), hp.loss_fn)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    net.blocks[5].armed = False
    state, m = fs.train_step(state, _batch(0), hp.loss_fn)
    return {"error_text": error, "step": state.step, "loss": m["loss"]}
