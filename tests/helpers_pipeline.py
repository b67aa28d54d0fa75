"""The pipeline tests' model, its one-process reference and the rank workers.

A tiny MLP: ``embed`` (5 -> 16), ``blocks`` (a ModuleList of residual blocks, 16 wide) and
``head`` (16 -> 3), split with ``fs.pipeline.split`` into 2, 4 or 8 stages. The reference
trains the plain model in one process on the concatenated global batch with the loss every
pipeline step averages: the mean over data-parallel ranks and microbatches of each
microbatch's mean loss (funcshard's weighting of uneven microbatches).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

import models

WIDTH, D_IN, D_OUT, BLOCKS = 16, 5, 3, 8
STEPS, MICROBATCHES = 3, 4
LR, MOMENTUM = 0.1, 0.9


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, WIDTH)
        self.blocks = nn.ModuleList(models.Block(WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def split_points(stages: int) -> list[str]:
    """Split points giving ``stages`` stages of equal block counts."""
    per = BLOCKS // stages
    return [f"blocks.{k * per}" for k in range(1, stages)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, D_IN, generator=g), torch.randn(rows, D_OUT, generator=g)


def dp_parts(step: int, rows: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each data-parallel rank's local batch: ``rows`` rows each, in rank order."""
    x, y = global_batch(step, rows * dp)
    return [(x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]) for r in range(dp)]


def reference(rows: int, dp: int, microbatches: int = MICROBATCHES, steps: int = STEPS) -> dict:
    """One process: params after ``steps`` steps, the loss and grad norm of each step."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in dp_parts(step, rows, dp):
            xs, ys = x.tensor_split(microbatches), y.tensor_split(microbatches)
            for xm, ym in zip(xs, ys, strict=True):
                loss = loss_fn(model(xm), ym) / (dp * microbatches)
                loss.backward()
                total += float(loss.detach())
        norms.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
        losses.append(total)
        opt.step()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "loss": losses,
        "grad_norm": norms,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run_case(
    schedule: str, pipeline: int, strategy: str, rows: int, per_rank: int, microbatches: int
) -> dict:
    """One pipelined run on this world; what every rank saw, for the test to compare."""
    mesh = fs.make_mesh(pipeline=pipeline, device_type="cpu")
    dp = dist.get_world_size() // pipeline
    dp_rank = dist.get_rank() % dp
    stages = fs.pipeline.split(make_net(), split_points(pipeline * per_rank))
    pipe = fs.Pipeline(schedule, microbatches=microbatches)
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    state = fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe)
    metrics = []
    with fs.comm_stats() as stats:
        for step in range(STEPS):
            state, m = fs.train_step(state, dp_parts(step, rows, dp)[dp_rank], loss_fn)
            metrics.append((m["loss"], m["grad_norm"]))
    return {
        "full": {n: t.cpu() for n, t in fs.full_params(state).items()},
        "metrics": metrics,
        "pipeline_bytes": stats.bytes_by_axis["pipeline"],
        "gathers": stats.calls["all_gather"],  # ZeRO-3: one per bucket a step
        "buckets": len(state.layout.buckets),
        "stages": state.pipeline.mine,
        "nstages": len(stages),
    }


def errors(out: dict, ref: dict) -> dict:
    """Relative errors of a run (``run_case``'s result) against ``reference``."""
    losses, norms = zip(*out["metrics"], strict=True)
    return {
        "names": list(out["full"]) == list(ref["params"]),
        "param": max(_rel(out["full"][n], ref["params"][n]) for n in ref["params"]),
        "loss": _rel(torch.tensor(losses), torch.tensor(ref["loss"])),
        "norm": _rel(torch.tensor(norms), torch.tensor(ref["grad_norm"])),
    }


def run_cases(cases: list[tuple]) -> list[dict]:
    out = []
    for case in cases:
        t = time.perf_counter()
        try:
            out.append(run_case(*case))
        except Exception as e:  # noqa: BLE001 (reported per case)
            out.append({"error": f"{type(e).__name__}: {e}"})
        out[-1]["seconds"] = time.perf_counter() - t
    return out


def run_named(namespace: dict, cases: list[tuple]) -> list[dict]:
    """Each ``(worker name, *args)`` looked up in ``namespace`` (a helper module's globals)
    and run in turn; an error reported per case, each case's seconds beside it."""
    out = []
    for name, *args in cases:
        t = time.perf_counter()
        try:
            out.append(namespace[name](*args))
        except Exception as e:  # noqa: BLE001 (reported per case)
            out.append({"error": f"{type(e).__name__}: {e}"})
        out[-1]["seconds"] = time.perf_counter() - t
    return out


def expected_bytes(
    stages: tuple[int, ...], nstages: int, pipeline: int, schedule: str, rows: int
) -> int:
    """What this rank sends over STEPS steps: per stage, its output to the next stage and the
    gradient of its input to the previous one, where that stage is on another rank (rows x
    WIDTH float32 a step each)."""
    pipe = fs.Pipeline(schedule, microbatches=MICROBATCHES)
    rank = {i: r for r in range(pipeline) for i in pipe.stages_of(r, pipeline, nstages)}
    per = rows * WIDTH * 4 * STEPS
    total = 0
    for i in stages:
        total += per * (i + 1 < nstages and rank[i + 1] != rank[i])
        total += per * (i > 0 and rank[i - 1] != rank[i])
    return total


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        raise RuntimeError("boom: a stage's backward failed")


class Boom(models.Block):
    """A block that raises in its forward while ``armed`` or on the ranks in ``forward_on``,
    in its backward on the ranks in ``backward_on``."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.armed = False
        self.forward_on: tuple[int, ...] = ()
        self.backward_on: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed or dist.get_rank() in self.forward_on:
            raise RuntimeError("boom: a stage's forward failed")
        y = super().forward(x)
        return _RaiseInBackward.apply(y) if dist.get_rank() in self.backward_on else y


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the text is what the test reads)
        return f"{type(e).__name__}: {e}"
    return "no error"


def run_refusals() -> dict:
    """Bad input on every rank of a P=2 x S=2 mesh (each raised before any collective), then
    a stage raising in its forward on one pipeline rank: every rank raises naming it, the
    state is not consumed, and the next step runs."""
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    pipe = fs.Pipeline("1F1B", microbatches=MICROBATCHES)
    out = {
        "names": mesh.mesh_dim_names,
        "pipeline_ranks": dist.get_process_group_ranks(mesh["pipeline"].get_group()),
        "count": _error(
            lambda: fs.init(
                fs.pipeline.split(make_net(), split_points(4)[:2]), opt, mesh=mesh, pipeline=pipe
            )
        ),
        "twice": _error(lambda: fs.init([make_net(), make_net()], opt, mesh=mesh, pipeline=pipe)),
        "microbatches": _error(
            lambda: fs.init(
                fs.pipeline.split(make_net(), split_points(2)),
                opt,
                mesh=mesh,
                pipeline=fs.Pipeline("1F1B", microbatches=1),
            )
        ),
        "no_pipeline": _error(lambda: fs.init(make_net(), opt, mesh=mesh)),
        "compile": _error(
            lambda: fs.init(
                fs.pipeline.split(make_net(), split_points(2)),
                opt,
                mesh=mesh,
                pipeline=pipe,
                compile=True,
            )
        ),
    }
    net = make_net()
    net.blocks[5] = Boom(WIDTH)
    net.blocks[5].register_buffer("seen", torch.zeros(2))  # a buffer in stage 1 only
    state = fs.init(fs.pipeline.split(net, split_points(2)), opt, mesh=mesh, pipeline=pipe)
    dp_rank = dist.get_rank() % 2
    out["uneven"] = _error(lambda: fs.train_step(state, dp_parts(0, 7, 2)[dp_rank], loss_fn))
    rows = 7 if dist.get_rank() == 3 else 8  # one rank alone (a last stage: its target)
    out["one_rank"] = _error(lambda: fs.train_step(state, dp_parts(0, rows, 2)[dp_rank], loss_fn))
    x, y = dp_parts(0, 8, 2)[dp_rank]
    out["target_rows"] = _error(lambda: fs.train_step(state, (x, y[:4]), loss_fn))
    rows = 16 if dist.get_rank() == 0 else 8  # valid alone, not beside the others' 8
    out["apart"] = _error(lambda: fs.train_step(state, dp_parts(0, rows, 2)[dp_rank], loss_fn))
    net.blocks[5].backward_on = (2,)  # in the backward of torch's shape inference (1st step)
    out["first_back"] = _error(lambda: fs.train_step(state, dp_parts(0, 8, 2)[dp_rank], loss_fn))
    net.blocks[5].backward_on = ()
    state, _ = fs.train_step(state, dp_parts(0, 8, 2)[dp_rank], loss_fn)
    net.blocks[5].armed = True
    out["boom"] = _error(lambda: fs.train_step(state, dp_parts(1, 8, 2)[dp_rank], loss_fn))
    net.blocks[5].armed = False
    net.blocks[5].backward_on = (2,)  # one rank of stage 1, in its backward
    out["back"] = _error(lambda: fs.train_step(state, dp_parts(1, 8, 2)[dp_rank], loss_fn))
    net.blocks[5].backward_on = ()
    out["step_after"] = state.step
    state, m = fs.train_step(state, dp_parts(1, 8, 2)[dp_rank], loss_fn)
    out["step_then"], out["loss_then"] = state.step, m["loss"]
    fs.check_replicas(state)  # stage 0's ranks compare nothing, and still take the agreement
    out["regather"] = _one_data_parallel_rank_under_regather(opt, mesh, dp_rank)
    return out


def _boom_at(net: Net, k: int) -> Boom:
    """Block ``k`` of ``net`` made a :class:`Boom` holding the block's values."""
    boom = Boom(WIDTH)
    boom.load_state_dict(net.blocks[k].state_dict())
    net.blocks[k] = boom
    return boom


def run_first_step_failures() -> dict:
    """P=2 x S=2, 1F1B: a stage raising in its forward on every input, the meta device's
    too (so no rank knows its output's shape), in a step that infers the stages' shapes:
    the first stage on both its ranks in the first step (its stand-in's guessed shape handed
    on to a stage that cannot take it), then the last stage on rank 2 alone. Every rank
    raises naming it, no hang; then the step trains as one process does (the shapes
    inferred again: the guessed ones are not kept). Then under ``regather=True`` (ZeRO-3),
    the last stage raising on rank 2 alone in such a step, in its forward, then in its
    backward: its stand-in, and its backward to the inputs alone (torch's shape inference),
    gather again what its peer's backward gathers (before, its peers waited)."""
    net = make_net()
    first, last = _boom_at(net, 1), _boom_at(net, 5)
    pipe = fs.Pipeline("1F1B", microbatches=MICROBATCHES)
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    state = fs.init(fs.pipeline.split(net, split_points(2)), opt, mesh=mesh, pipeline=pipe)
    batch = dp_parts(0, 8, 2)[dist.get_rank() % 2]
    first.armed = True
    out = {"first_every_rank": _error(lambda: fs.train_step(state, batch, loss_fn))}
    first.armed, last.forward_on = False, (2,)
    out["last_one_rank"] = _error(lambda: fs.train_step(state, batch, loss_fn))
    last.forward_on = ()
    state, m = fs.train_step(state, batch, loss_fn)
    full = {n: t.detach().cpu().clone() for n, t in fs.full_params(state).items()}
    pipe = fs.Pipeline("1F1B", microbatches=MICROBATCHES, regather=True)
    stages = fs.pipeline.split(net, split_points(2))
    again = fs.init(stages, opt, mesh=mesh, strategy="optim_grads_params", pipeline=pipe)
    last.forward_on = (2,)
    out["regather_forward"] = _error(lambda: fs.train_step(again, batch, loss_fn))
    last.forward_on, last.backward_on = (), (2,)
    out["regather_back"] = _error(lambda: fs.train_step(again, batch, loss_fn))
    last.backward_on = ()
    again, _ = fs.train_step(again, batch, loss_fn)
    return out | {"full": full, "metrics": [(m["loss"], m["grad_norm"])], "again": again.step}


class BiasOnly(nn.Module):
    """``x + b``: its backward saves nothing, so regather=True never gathers it again."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


def _one_data_parallel_rank_under_regather(opt, mesh, dp_rank: int) -> dict:
    """ZeRO-3 with regather=True: a stage raising on one data-parallel rank (rank 2) in its
    forward, then in its backward: its stand-in (and the rest of its backward) still make
    the per-microbatch gathers its peer (rank 3) makes, and no more (a bias-only block's
    bucket is not gathered again in backward), so every rank raises, no hang."""
    net = make_net()
    net.blocks[5] = Boom(WIDTH)
    net.blocks[6] = BiasOnly(WIDTH)  # a bucket the backward does not gather again
    pipe = fs.Pipeline("1F1B", microbatches=4, regather=True)
    stages = fs.pipeline.split(net, split_points(2))
    state = fs.init(stages, opt, mesh=mesh, strategy="optim_grads_params", pipeline=pipe)
    state, _ = fs.train_step(state, dp_parts(0, 8, 2)[dp_rank], loss_fn)
    out = {}
    for where in ("forward_on", "backward_on"):
        setattr(net.blocks[5], where, (2,))
        out[where] = _error(lambda: fs.train_step(state, dp_parts(1, 8, 2)[dp_rank], loss_fn))
        setattr(net.blocks[5], where, ())
    state, m = fs.train_step(state, dp_parts(1, 8, 2)[dp_rank], loss_fn)
    return out | {"step": state.step, "loss": m["loss"]}


# --- checkpoints of the whole model -----------------------------------------------------------

CKPT_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# where each strategy's checkpoint is restored: (P, schedule, stages per rank), or P=1 plain
CKPT_TARGETS = ((2, "1F1B", 1), (4, "Interleaved1F1B", 2), (2, "ZBVZeroBubble", 2), (4, "GPipe", 1))


def _ckpt_net(seed: int) -> Net:
    """The pipeline tests' net with two persistent buffers: one on the root (every stage
    keeps it) and one in block 5 (one stage's)."""
    net = make_net(seed)
    net.register_buffer("root_stat", torch.arange(3.0) + seed)
    net.blocks[5].register_buffer("stat", torch.full((2,), 7.0 + seed))
    return net


def _pipelined(
    pipeline: int, schedule: str, per_rank: int, strategy: str, seed: int, meta: bool = False
):
    mesh = fs.make_mesh(pipeline=pipeline, device_type="cpu")
    with torch.device("meta" if meta else "cpu"):
        net = _ckpt_net(seed)
    stages = fs.pipeline.split(net, split_points(pipeline * per_rank))
    pipe = fs.Pipeline(schedule, microbatches=MICROBATCHES)
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    return fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe), net


def _steps(state, pipeline: int, steps: range):
    dp = dist.get_world_size() // pipeline
    for step in steps:  # the global batch of 16 rows, whatever P
        state, _ = fs.train_step(state, dp_parts(step, 16 // dp, dp)[dist.get_rank() % dp], loss_fn)
    return state


def _cpu(named: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in named.items()}


def _stage_buffers(state) -> dict:
    """The buffers of this rank's stages."""
    run = state.pipeline
    return {n: b.clone() for i in run.mine for n, b in run.stages[i].named_buffers()}


def _buffers(net: nn.Module) -> dict:
    return {n: b.clone() for n, b in net.named_buffers()}


def run_checkpoints(root: str) -> dict:
    """Per strategy at P=2 x S=2 (1F1B, 2 stages): a step, ``fs.save``, then restores of it
    onto a plain state (P=1, S=4, another strategy) and onto a pipelined state of another P,
    split or schedule (``CKPT_TARGETS``), the first two of which train the second step (and
    the uninterrupted state too, where the layouts are the same). What every rank saw, for
    the test to compare."""
    out: dict = {"cases": []}
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    for k, strategy in enumerate(CKPT_STRATEGIES):
        path = f"{root}/{strategy}"
        state, _ = _pipelined(2, "1F1B", 1, strategy, 0)
        state = _steps(state, 2, range(1))
        fs.save(path, state)
        if k == 0:
            fs.export_safetensors(f"{root}/hf", state)
        saved = _cpu(fs.full_params(state))
        other = CKPT_STRATEGIES[(k + 1) % 4]
        plain_net = _ckpt_net(1)
        plain = fs.init(plain_net, opt, mesh=fs.make_mesh(device_type="cpu"), strategy=other)
        plain = fs.restore(path, like=plain)
        P, schedule, per_rank = CKPT_TARGETS[k]
        like, net = _pipelined(P, schedule, per_rank, other if k % 2 else strategy, 1)
        restored = fs.restore(path, like=like)
        case = {
            "saved": saved,
            "plain": _cpu(fs.full_params(plain)),
            "plain_buffers": _buffers(plain_net),
            "restored": _cpu(fs.full_params(restored)),
            "restored_buffers": _stage_buffers(restored),
            "restored_step": restored.step,
            "same_layout": (P, per_rank) == (2, 1) and k % 2 == 0,
        }
        if k < 2:  # the same layout, and another P, split and schedule
            case["resumed"] = _cpu(fs.full_params(_steps(restored, P, range(1, 2))))
        if case["same_layout"]:
            case["uninterrupted"] = _cpu(fs.full_params(_steps(state, 2, range(1, 2))))
        out["cases"].append(case)
    out["manager"] = _manager(f"{root}/manager")
    return out


def _manager(root: str) -> dict:
    """A CheckpointManager on a pipelined state (asynchronous save), restored at another P
    into a state of a meta-device model (no stage ever materialized before the restore)."""
    state, _ = _pipelined(2, "1F1B", 1, "optim_grads_params", 0)
    state = _steps(state, 2, range(1))
    with fs.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.wait()
        latest = mgr.latest_step()
        like, _ = _pipelined(4, "1F1B", 1, "optim", 1, meta=True)
        filled = like.filled
        restored = mgr.restore(like=like)
    return {
        "latest": latest,
        "filled": filled,
        "buffers": _stage_buffers(restored),
        "saved": _cpu(fs.full_params(state)),
        "restored": _cpu(fs.full_params(restored)),
    }
