"""Workers of the pipeline tests beyond the tests' plain net: torchtitan's ModuleDict of
blocks (its gather units, its parity), the local tier of ``CheckpointManager`` and a DCP copy
of a pipelined checkpoint, restored across P."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.utils.checkpoint as activation
from torch import nn

import funcshard as fs
from funcshard.checkpoint.cli import convert

import helpers_pipeline as hp
import models


class TitanNet(nn.Module):
    """The tests' net with its blocks in a ModuleDict keyed "0", "1", ... (torchtitan's): the
    same parameters, names and initial values as ``hp.make_net``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(hp.D_IN, hp.WIDTH)
        self.blocks = nn.ModuleDict({str(k): models.Block(hp.WIDTH) for k in range(hp.BLOCKS)})
        self.head = nn.Linear(hp.WIDTH, hp.D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks.values():
            h = block(h)
        return self.head(h)


def _titan(seed: int = 0, meta: bool = False) -> TitanNet:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return TitanNet()


def _state(pipeline: int, strategy: str, meta: bool = False):
    mesh = fs.make_mesh(pipeline=pipeline, device_type="cpu")
    stages = fs.pipeline.split(_titan(meta=meta), hp.split_points(pipeline))
    pipe = fs.Pipeline("1F1B", microbatches=hp.MICROBATCHES)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    return fs.init(stages, opt, mesh=mesh, strategy=strategy, pipeline=pipe)


class Blocks(nn.Module):
    """Identical blocks only: any split giving each rank as many blocks gives it masters of the
    same shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(models.Block(hp.WIDTH) for _ in range(hp.BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _blocks_state(schedule: str, stages: int):
    torch.manual_seed(0)
    split = fs.pipeline.split(Blocks(), hp.split_points(stages))
    pipe = fs.Pipeline(schedule, microbatches=hp.MICROBATCHES)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    return fs.init(split, opt, mesh=mesh, strategy="optim_grads_params", pipeline=pipe)


def _another_split(root: str, kw: dict) -> str:
    """A tier step of blocks 0-3 | 4-7 (1F1B) offered to a state of blocks 0,1,4,5 | 2,3,6,7
    (Interleaved1F1B): the same masters' shapes on every rank, other parameters. What the
    restore said (no persistent step: nothing to fall back to)."""
    state = _blocks_state("1F1B", 2)
    with fs.CheckpointManager(f"{root}/blocks", local_dir=f"{root}/blocks{{node}}", **kw) as mgr:
        mgr.save(1, state)
        mgr.wait()
    with fs.CheckpointManager(f"{root}/blocks", local_dir=f"{root}/blocks{{node}}", **kw) as mgr:
        like = _blocks_state("Interleaved1F1B", 4)
        try:
            mgr.restore(like=like)
        except FileNotFoundError as e:
            return f"FileNotFoundError: {e}"
    return "restored"


def _value_check(module: nn.Module, x: torch.Tensor) -> None:
    """What the meta device cannot run (a value read, as data-dependent routing reads one):
    notes the input's largest magnitude and raises on a nonzero input on the ranks in
    ``module.raise_on`` (a check that zeros pass), or on one above 1e30."""
    amax = float(x.detach().abs().amax())  # .item(): no meta kernel
    module.seen.append(amax)
    if amax > 1e30 or (amax > 0 and dist.get_rank() in module.raise_on):
        raise RuntimeError("no_meta: a stage's forward failed")
    if amax == 0 and module.reject_zeros:
        raise RuntimeError("no_meta: an all-zero input")


class ValueChecked:
    """A module mixin checking its input's values (:func:`_value_check`) before its own
    forward."""

    seen: list[float]
    raise_on: tuple[int, ...] = ()
    reject_zeros = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _value_check(self, x)
        return super().forward(x)


class NoMeta(ValueChecked, models.Block):
    pass


class NoMetaLinear(ValueChecked, nn.Linear):
    pass


def _no_meta_stage(regather: bool = False) -> dict:
    """Stages the meta device cannot run at P=2 x S=2, ZeRO-3 (each begins with a value
    check): stage 0's raising on rank 0 alone in the very first forward (torch's shape
    inference, on the real microbatch): every rank raises naming it (its stand-in sized by
    the stage run on zeros; under ``regather`` its gathers saved as a real forward's), never
    a hang; the step then trains. Stage 1's first input in torch's shape inference is zeros
    (torch makes it with torch.empty); its check rejects zeros, so it runs again there on a
    standard normal."""
    net = hp.make_net()
    net.embed, net.blocks[4] = NoMetaLinear(hp.D_IN, hp.WIDTH), NoMeta(hp.WIDTH)
    net.embed.seen, net.blocks[4].seen = [], []
    net.embed.raise_on, net.blocks[4].reject_zeros = (0,), True
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    pipe = fs.Pipeline("1F1B", microbatches=hp.MICROBATCHES, regather=regather)
    state = fs.init(fs.pipeline.split(net, hp.split_points(2)), opt, mesh=mesh, pipeline=pipe)
    batch = hp.dp_parts(0, 8, 2)[dist.get_rank() % 2]
    out = {"error": hp._error(lambda: fs.train_step(state, batch, hp.loss_fn))}
    net.embed.raise_on = ()
    state, m = fs.train_step(state, batch, hp.loss_fn)
    out["step"], out["loss"], out["first_seen"] = state.step, m["loss"], net.blocks[4].seen[:2]
    return out


def _raise_under_zero_bubble() -> dict:
    """ZBVZeroBubble at P=2 (4 stages), block 5 raising in its forward on step 1 on every rank
    of its stage: every rank raises naming it (the stand-in's zero gradients dense: torch's
    weight backward adds into them in place); then in its backward on one rank alone (the
    stage hands back zero input gradients, its weight backward skipped): every rank raises
    naming it; the next step trains. And a stage returning a
    dict: ValueError on every rank at the step, before any collective."""
    net = hp.make_net()
    net.blocks[5] = hp.Boom(hp.WIDTH)
    pipe = fs.Pipeline("ZBVZeroBubble", microbatches=hp.MICROBATCHES)
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    state = fs.init(fs.pipeline.split(net, hp.split_points(4)), opt, mesh=mesh, pipeline=pipe)
    batch = lambda step: hp.dp_parts(step, 8, 2)[dist.get_rank() % 2]  # noqa: E731
    state, _ = fs.train_step(state, batch(0), hp.loss_fn)
    net.blocks[5].armed = True
    out = {"zbv": hp._error(lambda: fs.train_step(state, batch(1), hp.loss_fn))}
    net.blocks[5].armed = False
    net.blocks[5].backward_on = (3,)  # one rank, in the input backward torch splits off
    out["zbv_back"] = hp._error(lambda: fs.train_step(state, batch(1), hp.loss_fn))
    net.blocks[5].backward_on = ()
    state, m = fs.train_step(state, batch(1), hp.loss_fn)
    out["zbv_step"], out["zbv_loss"] = state.step, m["loss"]
    dicts = fs.pipeline.split(hp.make_net(), hp.split_points(2))
    dicts[0].forward = lambda x: {"h": nn.Module.__call__(dicts[0].embed, x)}
    state = fs.init(dicts, opt, mesh=mesh, pipeline=fs.Pipeline("1F1B", microbatches=4))
    out["dict"] = hp._error(lambda: fs.train_step(state, batch(0), hp.loss_fn))
    return out


def _cpu(named: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in named.items()}


def run_titan_and_tiers(root: str, rows: int) -> dict:
    """At P=2 x S=2: a ModuleDict model trained under ZeRO-3 (``rows`` rows per data-parallel
    rank, 3 steps); its state saved by a CheckpointManager with a local tier only (step 3 is
    no multiple of ``persistent_every``) and restored by a new manager (the tier serves the
    same layout; another split falls back to the persistent root); ``fs.save``d,
    converted to DCP by rank 0 and restored ``model_only`` at P=4."""
    state = _state(2, "optim_grads_params")
    out = {"units": list(state.layout.units)}
    dp_rank = dist.get_rank() % 2
    with fs.comm_stats() as stats:
        for step in range(hp.STEPS):
            state, _ = fs.train_step(state, hp.dp_parts(step, rows, 2)[dp_rank], hp.loss_fn)
    out["full"], out["gathers"] = _cpu(fs.full_params(state)), stats.calls["all_gather"]
    out["buckets"] = len(state.layout.buckets)
    local, kw = os.path.join(root, "local{node}"), dict(persistent_every=10, ranks_per_node=2)
    with fs.CheckpointManager(f"{root}/mgr", local_dir=local, **kw) as mgr:
        mgr.save(hp.STEPS, state)
        mgr.wait()
    with fs.CheckpointManager(f"{root}/mgr", local_dir=local, **kw) as mgr:
        out["root_steps"] = (
            sorted(os.listdir(f"{root}/mgr")) if os.path.isdir(f"{root}/mgr") else []
        )
        restored = mgr.restore(like=_state(2, "optim_grads_params", meta=True))
    out["tier"] = _cpu(fs.full_params(restored))
    out["another_split"] = _another_split(root, kw)
    out["zero_bubble"] = _raise_under_zero_bubble()
    out["no_meta"] = [_no_meta_stage(), _no_meta_stage(regather=True)]
    fs.save(f"{root}/saved", state)
    if dist.get_rank() == 0:
        convert(f"{root}/saved", f"{root}/dcp", "dcp")
    dist.barrier()
    out["dcp"] = _cpu(
        fs.full_params(fs.restore(f"{root}/dcp", like=_state(4, "no_shard"), model_only=True))
    )
    return out


# --- buffers the forward updates, under a pipeline ----------------------------------------------


class Head(nn.Module):
    """The head with a fixed persistent table (a registered constant) and a non-persistent
    buffer (derived: never written), both read by its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(hp.WIDTH, hp.D_OUT)
        self.register_buffer("table", torch.linspace(-1.0, 1.0, hp.D_OUT))
        self.register_buffer("scale", torch.full((hp.D_OUT,), 0.5), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h) + self.table * self.scale


class NormNet(nn.Module):
    """A BatchNorm1d (train mode: running statistics and counter updated by each forward) in
    the first stage and in the last (under activation checkpointing: its recomputation in
    backward updates them again, in one process too; the last stage runs each microbatch's
    forward and backward in one process's order), 4 blocks between, the fixed table in
    the head, and on the root, which every stage keeps, a fixed buffer and a counter its
    forward updates in place (every stage runs the root's forward: each counts the
    microbatches)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(hp.D_IN, hp.WIDTH)
        self.norm0 = nn.BatchNorm1d(hp.WIDTH)
        self.blocks = nn.ModuleList(models.Block(hp.WIDTH) for _ in range(4))
        self.norm1 = nn.BatchNorm1d(hp.WIDTH)
        self.head = Head()
        self.register_buffer("root_stat", torch.arange(3.0))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.norm0(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.head(activation.checkpoint(self.norm1, h, use_reentrant=False))


def norm_net(seed: int = 0, meta: bool = False) -> NormNet:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return NormNet()


def norm_reference(steps: int) -> list[dict]:
    """One process on the global batch (16 rows, 4 microbatches per data-parallel part of 8
    rows), SGD momentum fp32; the buffers after each step those the first data-parallel rank's
    microbatches left (``buffers="broadcast"``: its values go to every rank after a step)."""
    model = norm_net()
    opt = torch.optim.SGD(model.parameters(), lr=hp.LR, momentum=hp.MOMENTUM)
    out = []
    for step in range(steps):
        opt.zero_grad()
        for dp_rank, (x, y) in enumerate(hp.dp_parts(step, 8, 2)):
            xs, ys = x.tensor_split(hp.MICROBATCHES), y.tensor_split(hp.MICROBATCHES)
            for xm, ym in zip(xs, ys, strict=True):
                (hp.loss_fn(model(xm), ym) / (2 * hp.MICROBATCHES)).backward()
            if dp_rank == 0:
                first = {n: b.clone() for n, b in model.named_buffers()}
        model.load_state_dict(first, strict=False)
        opt.step()
        out.append({"params": _cpu(dict(model.named_parameters())), "buffers": first})
    return out


def _norm_state(schedule: str, per_rank: int, seed: int = 0, meta: bool = False):
    points = ["blocks.2"] if per_rank == 1 else ["blocks.1", "blocks.2", "blocks.3"]
    stages = fs.pipeline.split(norm_net(seed, meta), points)
    pipe = fs.Pipeline(schedule, microbatches=hp.MICROBATCHES)
    opt = fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    mesh = fs.make_mesh(pipeline=2, device_type="cpu")
    return fs.init(stages, opt, mesh=mesh, strategy="optim_grads_params", pipeline=pipe)


def _stage_buffers(state) -> dict:
    """``{"stage:name": buffer}`` of this rank's stages (a meta one as the string "meta"),
    and under "shared" the root buffers its stages hold as one tensor."""
    run = state.pipeline
    out = {
        f"{i}:{n}": "meta" if b.is_meta else b.clone()
        for i in run.mine
        for n, b in run.stages[i].named_buffers()
    }
    first, *rest = (run.stages[i] for i in run.mine)
    out["shared"] = [
        n for n in ("root_stat", "calls") for s in rest if s.get_buffer(n) is first.get_buffer(n)
    ]
    return out


def run_trained_buffers(root: str) -> dict:
    """P=2 x S=2 (InterleavedZeroBubble: 4 stages, two a rank; ZeRO-3) on :class:`NormNet`: 2
    steps, ``fs.save``; the whole-model views (``full_params``, ``export_safetensors``);
    restored onto a plain state (S=4), saved from it and restored from that into a meta-device
    model's stages under ZBVZeroBubble (rank 0 holds the first and the last); restored onto
    the same layout, one step more beside the uninterrupted run's."""
    with fs.comm_stats() as stats:
        state = hp._steps(_norm_state("InterleavedZeroBubble", 2), 2, range(2))
    out = {"trained": _stage_buffers(state), "buffer_bytes": stats.bytes["buffers"]}
    out["planned"] = fs.plan(
        norm_net(meta=True),
        world_size=4,
        strategy="optim_grads_params",
        optimizer="sgd_momentum",
        microbatches=hp.MICROBATCHES,
        pipeline=2,
        schedule="InterleavedZeroBubble",
        split=["blocks.1", "blocks.2", "blocks.3"],
        pipeline_rank=dist.get_rank() // 2,
        device_type="cpu",
    ).comm["buffers"]
    fs.save(f"{root}/pp", state)
    fs.export_safetensors(f"{root}/hf", state)
    out["full_names"] = sorted(fs.full_params(state))
    net, opt = norm_net(1), fs.optim.sgd(hp.LR, momentum=hp.MOMENTUM)
    plain = fs.init(net, opt, mesh=fs.make_mesh(device_type="cpu"), strategy="optim")
    plain = fs.restore(f"{root}/pp", like=plain)
    out["plain"] = {n: b.clone() for n, b in net.named_buffers()}
    fs.save(f"{root}/plain", plain)
    meta = fs.restore(f"{root}/plain", like=_norm_state("ZBVZeroBubble", 2, 1, meta=True))
    out["meta"] = _stage_buffers(meta)
    resumed = fs.restore(f"{root}/pp", like=_norm_state("InterleavedZeroBubble", 2, seed=1))
    resumed = hp._steps(resumed, 2, range(2, 3))
    state = hp._steps(state, 2, range(2, 3))
    out["resumed"] = (_stage_buffers(resumed), _cpu(fs.full_params(resumed)))
    out["uninterrupted"] = (_stage_buffers(state), _cpu(fs.full_params(state)))
    return out


def run_checkpoints_and_buffers(root: str) -> dict:
    """``hp.run_checkpoints`` and :func:`run_trained_buffers`, in one call of the pool."""
    return hp.run_checkpoints(root) | {"trained_buffers": run_trained_buffers(f"{root}/norm")}
