"""Tensor parallel inside each pipeline stage: the tensor-parallel tests' Llama (4 layers,
torch's own TP plan on ``mesh["tensor"]``) split into 2 or 4 stages on ``fs.make_mesh(
pipeline=2, tensor=2)``, and the rank worker the test runs once.

Every rank of a tensor group passes the same batch (torch TP's rule); with 4 ranks the
data-parallel size is 1, so each rank passes the whole global batch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

import helpers_experts as he
import helpers_tp as tp

LAYERS, SEED, STEPS, ROWS, MICROBATCHES = 4, 3, 3, 8, 4
LR, MOMENTUM = 0.1, 0.9
SPLITS = {2: ["layers.2"], 4: ["layers.1", "layers.2", "layers.3"]}
# (schedule, stages, strategy)
CASES = (
    ("1F1B", 2, "optim_grads_params"),
    ("Interleaved1F1B", 4, "optim"),
    ("ZBVZeroBubble", 4, "optim_grads_params"),
)
BOUNDARY = (ROWS, tp.SEQ, tp.DIM)  # what a stage hands the next, a step (fp32)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, tp.VOCAB), target.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = tp.global_batch(step, ROWS)
    return b["x"], b["y"]


def reference(steps: int = STEPS) -> dict:
    """One plain process: params, losses and norms (``helpers_tp.reference_run``)."""
    model = tp.make_model(SEED, LAYERS)
    return tp.reference_run(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM), steps, ROWS
    )


def _state(schedule: str, nstages: int, strategy: str, seed: int = SEED):
    mesh = fs.make_mesh(pipeline=2, tensor=2, device_type="cpu")
    model = tp.parallelize(tp.make_model(seed, LAYERS), mesh)
    stages = fs.pipeline.split(model, SPLITS[nstages])
    pipe = fs.Pipeline(schedule, microbatches=MICROBATCHES)
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    state = fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe)
    return state, model, mesh


def _plan(model, schedule: str, nstages: int, strategy: str, rank: int, **kw) -> dict:
    """Pipeline rank ``rank``'s bytes by axis over the run's steps, by ``fs.plan`` (``kw``:
    ``tensor_plan=`` with a plain meta model)."""
    plan = fs.plan(
        model,
        **kw,
        world_size=4,
        tensor=2,
        pipeline=2,
        schedule=schedule,
        microbatches=MICROBATCHES,
        split=SPLITS[nstages],
        pipeline_rank=rank,
        boundary=BOUNDARY,
        strategy=strategy,
        optimizer="sgd_momentum",
        device_type="cpu",
    )
    return {axis: n * STEPS for axis, n in plan.comm_by_axis.items() if n}


def meta_plan(schedule: str, nstages: int, strategy: str, rank: int) -> dict:
    """:func:`_plan` of the plain model on the meta device with the TP plan."""
    with torch.device("meta"):
        model = tp.make_model(SEED, LAYERS)
    return _plan(model, schedule, nstages, strategy, rank, tensor_plan=tp.model_plan())


def run_case(schedule: str, nstages: int, strategy: str) -> dict:
    state, model, mesh = _state(schedule, nstages, strategy)
    metrics = []
    with fs.comm_stats() as stats:
        for step in range(STEPS):
            state, m = fs.train_step(state, batch(step), loss_fn)
            metrics.append((m["loss"], m["grad_norm"]))
    rank = mesh.get_local_rank("pipeline")
    out = {
        "full": {n: t.cpu() for n, t in fs.full_params(state).items()},
        "metrics": metrics,
        "bytes": {a: n for a, n in stats.bytes_by_axis.items() if n},
        "plan": _plan(model, schedule, nstages, strategy, rank),
        "stages": state.pipeline.mine,
    }
    if (schedule, nstages) == ("1F1B", 2):
        out["one_rank"] = fail_on_rank_3(state, model.layers[2], lambda s: batch(s), loss_fn)
    return out


def fail_on_rank_3(state, module: nn.Module, batch_of, loss) -> dict:
    """``module`` (in stage 1) raising in its forward on global rank 3 alone (one tensor or
    expert rank of its stage, before any of its collectives; by the values it is given, as a
    check of the data would) for one step: its stand-in must join the collectives its peers
    wait in. Then a step without the failure."""

    def boom(mod, args):
        if dist.get_rank() == 3 and bool(args[0].detach().abs().sum() > 0):
            raise RuntimeError("boom on one model-parallel rank")

    hook = module.register_forward_pre_hook(boom)
    try:
        fs.train_step(state, batch_of(STEPS), loss)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    finally:
        hook.remove()
    state, m = fs.train_step(state, batch_of(STEPS), loss)
    return {"error": error, "step": state.step, "loss": m["loss"]}


def _cpu(named: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in named.items()}


def run_checkpoint(root: str) -> dict:
    """A P=2 x T=2 state (1F1B, ZeRO-3) after one step, saved and restored onto the plain
    model (P=1, no tensor axis, S=4, ZeRO-2), which trains the second step; then a step in
    which tensor rank 1 passes another batch: every rank raises, naming it."""
    state, _, mesh = _state("1F1B", 2, "optim_grads_params")
    state, _ = fs.train_step(state, batch(0), loss_fn)
    fs.save(root, state)
    saved = _cpu(fs.full_params(state))
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    model = tp.make_model(SEED + 1, LAYERS)  # other weights: the restore must fill them
    mesh4 = fs.make_mesh(device_type="cpu")
    plain = fs.init(model, opt, mesh=mesh4, strategy="optim_grads")
    plain = fs.restore(root, like=plain)
    restored = _cpu(fs.full_params(plain))
    # the plain model's second step, on 4 data-parallel ranks of 2 rows
    x, y = batch(1)
    r = dist.get_rank()
    part = (x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2])
    plain, _ = fs.train_step(plain, part, _plain_loss(model))
    x, y = batch(1)
    if mesh.get_local_rank("tensor") == 1:
        x = x.flip(0)
    try:
        fs.train_step(state, (x, y), loss_fn)
        apart = "no error"
    except Exception as e:  # noqa: BLE001 (the text is what the test reads)
        apart = f"{type(e).__name__}: {e}"
    return {
        "saved": saved,
        "restored": restored,
        "step": plain.step,
        "resumed": _cpu(fs.full_params(plain)),
        "apart": apart,
    }


def _plain_loss(model):
    def fn(params, b):
        return loss_fn(fs.functional_call(model, params, (b[0],)), b[1])

    return fn


# --- expert parallel inside a stage -----------------------------------------------------------


class MoEBlock(nn.Module):
    """helpers_experts' MoE layer as a residual block: a router and top-1 experts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(he.DIM, he.EXPERTS, bias=False)
        self.experts = he.Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), -1)
        idx = probs.argmax(-1)
        return h + probs.gather(1, idx[:, None]) * self.experts(h, idx)


class MoEStack(nn.Module):
    """An embedding, MoE blocks in a ModuleList (split between them) and a head."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(he.D_IN, he.DIM), nn.Tanh())  # a stage cuts it whole
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(blocks))
        self.head = nn.Linear(he.DIM, he.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_moe(seed: int = 0, blocks: int = 2) -> MoEStack:
    torch.manual_seed(seed)
    return MoEStack(blocks)


EXPERT_SEED, EXPERT_ROWS = 5, 8  # rows per data-parallel rank (2 of them per pipeline rank)
EXPERT_CASES = (("1F1B", 2, "optim"), ("ZBVZeroBubble", 4, "optim_grads_params"))


def moe_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def moe_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = he.global_batch(step, 2 * EXPERT_ROWS)
    rows = slice(dp_rank * EXPERT_ROWS, (dp_rank + 1) * EXPERT_ROWS)
    return b["x"][rows], b["y"][rows]


def moe_reference(blocks: int, steps: int = STEPS) -> dict:
    """One plain process on both data-parallel ranks' batches, each microbatch's mean loss
    averaged (the pipelined step's mean)."""
    model = make_moe(EXPERT_SEED, blocks)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(2):
            x, y = moe_batch(step, r)
            parts = zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True)
            for xm, ym in parts:
                loss = moe_loss(model(xm), ym) / (2 * MICROBATCHES)
                loss.backward()
                total += float(loss.detach())
        norms.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
        losses.append(total)
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "losses": losses, "norms": norms}


def run_expert_case(schedule: str, nstages: int, strategy: str) -> dict:
    """P=2 x (S=2 = E=2): each block's experts Shard(0) on mesh["expert"], tokens sent to
    them by all-to-all inside the stage; every rank its own data-parallel rank."""
    mesh = fs.make_mesh(pipeline=2, shard=2, expert=2, device_type="cpu")
    model = make_moe(EXPERT_SEED, nstages)
    for block in model.blocks:
        he.place_experts(block, mesh["expert"])
    stages = fs.pipeline.split(model, [f"blocks.{k}" for k in range(1, nstages)])
    pipe = fs.Pipeline(schedule, microbatches=MICROBATCHES)
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    state = fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe)
    dp_rank, metrics = mesh.get_local_rank("expert"), []
    with fs.comm_stats() as stats:
        for step in range(STEPS):
            state, m = fs.train_step(state, moe_batch(step, dp_rank), moe_loss)
            metrics.append((m["loss"], m["grad_norm"]))
    plan = fs.plan(
        model,
        world_size=4,
        shard=2,
        expert=2,
        pipeline=2,
        schedule=schedule,
        microbatches=MICROBATCHES,
        split=[f"blocks.{k}" for k in range(1, nstages)],
        pipeline_rank=mesh.get_local_rank("pipeline"),
        boundary=(EXPERT_ROWS, he.DIM),
        strategy=strategy,
        optimizer="sgd_momentum",
        device_type="cpu",
    )
    out = {
        "full": {n: t.cpu() for n, t in fs.full_params(state).items()},
        "metrics": metrics,
        "bytes": {a: n for a, n in stats.bytes_by_axis.items() if n},
        "plan": {a: n * STEPS for a, n in plan.comm_by_axis.items() if n},
    }
    if schedule == "1F1B":
        out["one_rank"] = fail_on_rank_3(
            state, model.blocks[1], lambda s: moe_batch(s, dp_rank), moe_loss
        )
    return out


def expert_first_step_failure() -> dict:
    """P=2 x (S=2 = E=2), 1F1B: a MoE block (which the meta device cannot run: data-dependent
    routing, so no stage from it on has a meta output) raising on one expert rank in the
    very first step: its stand-in, the stage run again on zeros, joins the experts'
    all-to-all and is sized by its own output; every rank raises, then step 0 trains."""
    mesh = fs.make_mesh(pipeline=2, shard=2, expert=2, device_type="cpu")
    model = make_moe(EXPERT_SEED, 2)
    for block in model.blocks:
        he.place_experts(block, mesh["expert"])
    stages = fs.pipeline.split(model, ["blocks.1"])
    pipe = fs.Pipeline("1F1B", microbatches=MICROBATCHES)
    state = fs.init(stages, fs.optim.sgd(LR, momentum=MOMENTUM), mesh=mesh, pipeline=pipe)
    dp_rank = mesh.get_local_rank("expert")

    def boom(mod, args):
        if dist.get_rank() == 3 and bool(args[0].detach().abs().sum() > 0):
            raise RuntimeError("boom on one model-parallel rank")

    hook = model.blocks[1].register_forward_pre_hook(boom)
    try:
        fs.train_step(state, moe_batch(0, dp_rank), moe_loss)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    finally:
        hook.remove()
    state, m = fs.train_step(state, moe_batch(0, dp_rank), moe_loss)
    return {"error": error, "step": state.step, "loss": m["loss"]}


def run_all(root: str) -> dict:
    """Every case, the expert cases, then the checkpoint's: one pool call."""
    out: dict = {"cases": [], "expert": [], "seconds": []}
    for case in CASES:
        t = time.perf_counter()
        out["cases"].append(run_case(*case))
        out["seconds"].append(time.perf_counter() - t)
    for case in EXPERT_CASES:
        t = time.perf_counter()
        out["expert"].append(run_expert_case(*case))
        out["seconds"].append(time.perf_counter() - t)
    out["expert_first"] = expert_first_step_failure()
    t = time.perf_counter()
    out["checkpoint"] = run_checkpoint(root)
    out["seconds"].append(time.perf_counter() - t)
    return out
