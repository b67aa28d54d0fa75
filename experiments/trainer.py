"""The training loop behind ``experiments/train.py``: one function, ``run(cfg)``, on every rank.

The loss is the mean cross-entropy of predicting token ``t`` from tokens ``< t`` for ``t >= 2``:
under the default Markov source those predictions have the chain's entropy rate as their exact
floor (tokens 0 and 1 have no full context, so they are inputs only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from absl import logging

import funcshard as fs
from experiments import data as data_lib
from experiments.gpt import (
    GPT,
    GPTConfig,
    GroupedExperts,
    MoE,
    balance_routers,
    expert_load,
    tensor_plan,
)
from experiments.timing import compile_times
from funcshard.distributed.mesh import local_device

__all__ = [
    "Config",
    "run",
    "lr_schedule",
    "final_line",
    "microbatches_for",
    "pipeline_stages",
    "split_points",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run depends on (picklable: it travels to the spawned ranks)."""

    shard: int = -1
    replicate: int = 1
    tensor: int = 1  # tensor-parallel ranks per group (each block split by gpt.tensor_plan)
    expert: int = 1  # expert-parallel ranks per group, out of "shard" (fs.ExpertParallel)
    context: int = 1  # context-parallel ranks per group: each sequence split C ways
    context_algorithm: str = "all_to_all"  # or "ring" (fs.ContextParallel)
    pipeline: int = 1  # pipeline ranks P (the outermost axis): the GPT split into stages
    schedule: str = "1F1B"  # torch's pipeline schedule by name (fs.Pipeline), with pipeline > 1
    strategy: str = "optim_grads_params"
    outer_strategy: str = "no_shard"  # "optim": HFSDP (the optimizer sharded over replicas too)
    policy: fs.MixedPrecisionPolicy = dataclasses.field(
        default_factory=lambda: fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    offload_fraction: float = 0.0
    deterministic: bool = False  # the same bits on every layout with as many gradient chunks
    compile: str = ""  # a torch.compile backend for each block, compiled in place; "": eager
    compile_by: str = "blocks"  # or "fs": fs.init(compile=) captures the step instead
    microbatches: int = 1
    grad_chunks: int = 0  # G per step, whatever the world (microbatches = G / world); 0: unset
    batch_size: int = 64
    steps: int = 500
    stop_at: int = 0
    lr: float = 1e-2
    warmup: int = 25
    weight_decay: float = 0.1
    decay_mask: bool = True  # decay matrices and embeddings only (fs.optim.decay_mask)
    clip: float = 1.0  # clip_by_global_norm threshold; 0 = no clipping
    optimizer: str = "adamw"  # "adamw", or "muon" (the blocks' matrices; AdamW for the rest)
    muon_lr: float = 0.02  # Muon's peak learning rate (same warmup and cosine shape)
    # moment storage (fs.optim.adamw mu_dtype / nu_dtype; Muon's momentum takes mu_dtype)
    mu_dtype: torch.dtype | None = None
    nu_dtype: torch.dtype | None = None
    stochastic_rounding: bool = False  # bf16 moments rounded stochastically
    router_bias_rate: float = 1e-3  # MoE: DeepSeek-V3's bias update speed (gamma); 0: none
    # the model; its vocab is the Markov source's (a text file's own vocab replaces it)
    model: GPTConfig = dataclasses.field(default_factory=lambda: GPTConfig(vocab=16, seq_len=32))
    concentration: float = 0.1
    data: str = ""
    eval_batches: int = 16
    checkpoint_dir: str = ""
    save_every: int = 0
    resume: bool = False
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    out_dir: str = "out/train"
    log_every: int = 0
    # live fault tolerance (fs.FaultTolerance): this job is replica group replica_group of
    # replica_groups, joined by the torchft lighthouse at `lighthouse` ("": TORCHFT_LIGHTHOUSE)
    replica_group: int = 0
    replica_groups: int = 0  # 0: no fault tolerance
    lighthouse: str = ""
    ft_timeout: float = 30.0


def microbatches_for(cfg: Config, world: int) -> int:
    """Microbatches per step on ``world`` data-parallel ranks: ``cfg.grad_chunks / world`` when
    G is set (so a world that grows or shrinks keeps G, hence the bits), else
    ``cfg.microbatches``.

    Raises:
      ValueError: G is not a multiple of ``world``, or the batch does not split into G equal
        chunks (the message names the numbers).
    """
    g = cfg.grad_chunks
    if not g:
        return cfg.microbatches
    if g % world:
        raise ValueError(
            f"--grad_chunks={g} gradient chunks per step do not split over {world} data-parallel "
            f"ranks (world size {world}): G must be a multiple of every world size the run takes"
        )
    if cfg.batch_size % g:
        raise ValueError(
            f"--batch_size={cfg.batch_size} does not split into --grad_chunks={g} equal chunks"
        )
    return g // world


def pipeline_stages(cfg: Config) -> int:
    """The stages of ``cfg``'s pipeline: P for the single-stage schedules (GPipe, 1F1B), two
    per rank for the looped and V-shaped ones (fs.Pipeline's placement)."""
    if cfg.pipeline == 1:
        return 1
    return cfg.pipeline * (1 if fs.Pipeline(cfg.schedule).placement == "single" else 2)


def split_points(cfg: Config) -> list[str]:
    """Where each stage after the first begins: the blocks split as evenly as they go (the
    first stage also holds the embeddings, the last the final norm and head).

    Raises:
      ValueError: fewer blocks than stages (naming both).
    """
    stages, n = pipeline_stages(cfg), cfg.model.n_layer
    if n < stages:
        raise ValueError(
            f"--n_layer={n}: a pipeline of {stages} stages ({cfg.schedule} on --pipeline="
            f"{cfg.pipeline}) needs at least one block per stage"
        )
    return [f"blocks.{i * n // stages}" for i in range(1, stages)]


def lr_schedule(cfg: Config):
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to a tenth of ``cfg.lr``."""
    return fs.optim.warmup_cosine(
        cfg.lr, warmup=cfg.warmup, total=max(cfg.steps, cfg.warmup + 1), final=cfg.lr / 10
    )


def is_hidden_matrix(name: str, shape: tuple) -> bool:
    """Muon's share of the model: the blocks' 2-D weights (not embeddings, head, norms)."""
    return len(shape) == 2 and name.startswith("blocks.")


def make_optimizer(cfg: Config) -> fs.optim.Optimizer:
    """The LLM recipe: AdamW (betas 0.9, 0.95) with the schedule, decay mask and clip; with
    ``optimizer="muon"``, Muon on the blocks' matrices and that AdamW on the rest."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {cfg.optimizer!r}")
    opt = fs.optim.adamw(
        lr=lr_schedule(cfg),
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
        mask=fs.optim.decay_mask if cfg.decay_mask else None,
        mu_dtype=cfg.mu_dtype,
        nu_dtype=cfg.nu_dtype,
        stochastic_rounding=cfg.stochastic_rounding,
    )
    if cfg.optimizer == "muon":
        muon_lr = fs.optim.warmup_cosine(
            cfg.muon_lr,
            warmup=cfg.warmup,
            total=max(cfg.steps, cfg.warmup + 1),
            final=cfg.muon_lr / 10,
        )
        opt = fs.optim.multi_transform(
            {
                "muon": fs.optim.muon(
                    muon_lr, weight_decay=cfg.weight_decay, mu_dtype=cfg.mu_dtype
                ),
                "adamw": opt,
            },
            lambda name, shape: "muon" if is_hidden_matrix(name, shape) else "adamw",
        )
    return fs.optim.chain(fs.optim.clip_by_global_norm(cfg.clip), opt) if cfg.clip else opt


def fault_tolerance(cfg: Config) -> fs.FaultTolerance | None:
    """The run's ``fs.FaultTolerance`` (None without replica groups)."""
    if not cfg.replica_groups:
        return None
    return fs.FaultTolerance(
        replica_id=str(cfg.replica_group),
        lighthouse=cfg.lighthouse or None,
        timeout=cfg.ft_timeout,
    )


def make_source(cfg: Config) -> data_lib.MarkovSource | data_lib.TextSource:
    if cfg.data:
        return data_lib.TextSource.from_file(cfg.data, seed=cfg.seed)
    return data_lib.make_markov(cfg.model.vocab, cfg.concentration, seed=cfg.seed)


def final_line(loss: float, floor: float | None) -> str:
    """The run's last line: the loss against the source's entropy rate."""
    if floor is None:
        return f"final loss {loss:.4f} nats/token, floor unknown (text data), gap n/a"
    gap = 100 * (loss / floor - 1)
    return f"final loss {loss:.4f} nats/token, floor {floor:.4f}, gap {gap:.2f}%"


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting tokens[:, 2:] (logits come from tokens[:, :-1])."""
    return F.cross_entropy(logits[:, 1:].float().flatten(0, 1), tokens[:, 2:].flatten())


SEQ_DIMS = {"tokens": 1, "labels": 1, "positions": 1}  # context parallel's sequence leaves


def _context_parallel(cfg: Config) -> fs.ContextParallel | None:
    if cfg.context == 1:
        return None
    return fs.ContextParallel(seq_dims=SEQ_DIMS, algorithm=cfg.context_algorithm)


def _context_batch(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sequence leaves context parallel splits: the model's input tokens, their labels
    (the first ignored, as :func:`_loss` skips it) and the positions."""
    labels = x[:, 1:].clone()
    labels[:, 0] = -100
    positions = torch.arange(x.shape[1] - 1, device=x.device).expand(x.shape[0], -1)
    return {"tokens": x[:, :-1], "labels": labels, "positions": positions.contiguous()}


def _context_loss(model: GPT, params, batch: dict, cfg: Config) -> torch.Tensor:
    """:func:`_loss` on this rank's part of the sequences: its summed cross-entropy over the
    global token count / C, so that the mean over the context group is the global mean."""
    logits = fs.functional_call(model, params, (batch["tokens"], batch["positions"]))
    labels = batch["labels"]
    total = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    counted = labels.shape[0] * (cfg.model.seq_len - 1)  # the rows' tokens, the first skipped
    return total * cfg.context / counted


class Progress:
    """Rank 0's view of the run: a ``\\r`` bar on a terminal, absl log lines otherwise."""

    def __init__(
        self, start: int, total: int, tokens_per_step: int, every: int, world: int
    ) -> None:
        self.start, self.total, self.tokens_per_step = start, total, tokens_per_step
        self.world = world
        self.every = every or max(1, (total - start) // 20)
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float) -> float:
        """Reports step ``step`` (1-based count of finished steps); returns tokens/s so far."""
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        tps = done * self.tokens_per_step / max(elapsed, 1e-9)
        eta = elapsed / max(done, 1) * (self.total - step)
        line = (
            f"step {step}/{self.total}  loss {loss:.4f}  world {self.world}  "
            f"{tps / 1e3:.1f}k tok/s  "
            f"ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        )
        if self.tty:
            sys.stderr.write("\r" + line + " " * 4)
            sys.stderr.flush()
            if step == self.total:
                sys.stderr.write("\n")
        elif step % self.every == 0 or step == self.total:
            logging.info(line)
        return tps


class StageLoads:
    """Under a pipeline, the step's tokens per expert of every MoE block, summed over the
    world: what the plain run's ``loss_fn`` hands back as ``fs.summed(expert_load(model))``
    (the pipeline's ``loss_fn`` sees the last stage's output only).

    A forward hook keeps each block's load of every call on this rank. torch's schedule runs
    each stage once more before its first step's microbatches (its shape inference), so the
    step's are each block's last ``microbatches`` calls; a block of another pipeline rank's
    stage has none here and counts zeros. The world's sum (one all-reduce of
    ``blocks x experts`` int64, outside ``fs.comm_stats``) counts each block on the
    data-parallel ranks of its own pipeline rank: every token of the global batch once.
    """

    def __init__(self, model: GPT) -> None:
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.calls: dict[MoE, list[torch.Tensor]] = {m: [] for m in self.moes}
        for m in self.moes:
            m.register_forward_hook(self._record)

    def _record(self, module: MoE, args: Any, output: Any) -> None:
        self.calls[module].append(module.last_load)

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def total(self, microbatches: int, device: torch.device) -> torch.Tensor:
        """The step's global load ``(blocks, experts)``: a collective over every rank."""
        rows = []
        for m in self.moes:
            calls = self.calls[m][-microbatches:]
            rows.append(sum(calls) if calls else torch.zeros_like(m.router_bias, dtype=torch.int64))
        load = torch.stack([r.cpu() for r in rows]).to(device)
        dist.all_reduce(load)
        return load


def share_router_bias(model: GPT, stages: list, pipe: fs.Pipeline, mesh) -> None:
    """After a restore under a pipeline, every rank's MoE routers' bias from the pipeline rank
    whose stage holds the block: ``fs.restore`` fills a rank's own stages' buffers only, and
    :func:`evaluate` runs the whole model on every rank (the steps' global loads then keep
    them equal). One all-reduce over "pipeline": each block's bias and zeros elsewhere."""
    axis = mesh["pipeline"]
    mine = pipe.stages_of(axis.get_local_rank(), axis.size(), len(stages))
    owned = {m for i in mine for m in stages[i].modules() if isinstance(m, MoE)}
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    bias = torch.stack([m.router_bias if m in owned else 0 * m.router_bias for m in moes])
    dist.all_reduce(bias, group=axis.get_group())
    with torch.no_grad():
        for m, b in zip(moes, bias, strict=True):
            m.router_bias.copy_(b)


def _init_logging(rank: int) -> None:
    """Spawned ranks never parse flags: turn absl's INFO lines on for rank 0 only."""
    logging.use_absl_handler()
    logging.set_verbosity(logging.INFO if rank == 0 else logging.WARNING)


def _set_threads(cfg: Config, device: torch.device) -> None:
    if device.type != "cpu":
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))


def _load_rows(path: Path, before: int) -> list[dict[str, Any]]:
    """The step and start rows of an earlier run's metrics.jsonl, up to the step a resumed run
    starts at (the steps after it are replayed)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", r.get("start", before + 1)) <= before]


def evaluate(
    model: GPT,
    state: fs.TrainState,
    source,
    cfg: Config,
    device: torch.device,
    microbatches: int = 1,
) -> float:
    """Mean loss of the master weights on ``cfg.eval_batches`` held-out global batches.

    Each data-parallel rank takes its rows as in training (a tensor or context group's ranks,
    and the pipeline ranks, the same rows: each computes them with the whole model); the
    losses of one rank per data-parallel rank, in its order, make the mean. With
    ``cfg.deterministic`` each cuts its rows into ``microbatches`` chunks (the training
    step's G chunks) and every rank sums the same (batches, G) losses: the result is the same
    bits on every world with the same G, as the training metrics are.
    """
    params = fs.full_params(state)  # collective: every rank gathers the full model
    params.update(model.named_buffers())  # the router's bias
    if cfg.tensor > 1 or cfg.expert > 1:  # full tensors go to the plain model (a meta copy)
        with torch.device("meta"):
            model = GPT(model.cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    group, per_stage = cfg.tensor * cfg.context, world // cfg.pipeline
    dp_rank, dp_world = rank % per_stage // group, per_stage // group
    chunks = microbatches if cfg.deterministic else 1
    losses = torch.zeros(cfg.eval_batches, chunks, dtype=torch.float64, device=device)
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x = source.batch(
                i,
                batch_size=cfg.batch_size,
                seq_len=cfg.model.seq_len,
                rank=dp_rank,
                world=dp_world,
                stream=data_lib.EVAL,
            ).to(device)
            for m, part in enumerate(x.chunk(chunks)):
                logits = torch.func.functional_call(model, params, (part[:, :-1],))
                losses[i, m] = _loss(logits, part)
    gathered = [torch.empty_like(losses) for _ in range(world)]
    dist.all_gather(gathered, losses)
    # pipeline rank 0's, tensor / context rank 0's: each data-parallel rank's losses once;
    # every chunk holds as many tokens: the mean of the chunks' means is the mean
    return float(torch.cat(gathered[:per_stage:group], dim=1).mean())


def _plot(rows: list[dict[str, Any]], floor: float | None, final: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="train loss")
    if rows:
        ax.scatter([rows[-1]["step"]], [final], color="C1", zorder=3, label="held-out loss")
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"entropy rate {floor:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    cfg: Config,
    *,
    started: float | None = None,
    after_step: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Trains on every rank of the initialized process group; rank 0 writes ``cfg.out_dir``.

    With ``cfg.resume`` it continues from the latest checkpoint in ``cfg.checkpoint_dir``, if
    there is one, on the world it finds (``cfg.grad_chunks`` keeps G across worlds). Each start
    adds a row ``{"start", "world", "microbatches", "time", "joined", "restore_s"}`` to
    metrics.jsonl, each step a row with its ``world``, ``time`` (Unix seconds), ``step_s`` (the
    step's wall time: the first one of a process compiles the blocks under ``cfg.compile``), and
    rank 0's bytes communicated in that step per collective kind (``comm``) and mesh axis
    (``comm_by_axis``), as ``fs.comm_stats`` counts them and ``fs.plan`` predicts them.

    Args:
      cfg: the run.
      started: when the process started (Unix seconds), for the start row; default now.
      after_step: called on every rank after each step (and its save is issued) with the
        number of steps done and the world size: a pause point for a scheduler or a test.

    Returns:
      {"final_loss", "floor", "steps", "start_step", "world"} (the same on every rank).
    """
    joined = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    # the data-parallel index and size: the ranks of a tensor group (consecutive) share a batch,
    # as do those of a context group (each keeps its part of every sequence)
    # and every pipeline rank (the outermost axis) passes its data-parallel rank's batch
    group, per_stage = cfg.tensor * cfg.context, world // cfg.pipeline
    dp_rank, dp_world = rank % per_stage // group, per_stage // group
    microbatches = microbatches_for(cfg, dp_world)
    _init_logging(rank)
    device_type = None if cfg.device == "auto" else cfg.device
    mesh = fs.make_mesh(
        pipeline=cfg.pipeline,
        shard=cfg.shard,
        replicate=cfg.replicate,
        tensor=cfg.tensor,
        expert=cfg.expert,
        context=cfg.context,
        device_type=device_type,
    )
    device = local_device(mesh)
    _set_threads(cfg, device)

    source = make_source(cfg)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(dataclasses.replace(cfg.model, vocab=source.vocab)).to(device)
    if cfg.tensor > 1 or cfg.expert > 1:  # DTensor's import (most of a second) only then
        from torch.distributed.tensor.parallel import parallelize_module
    if cfg.tensor > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tensor"], tensor_plan())
    if cfg.expert > 1:  # each block's experts over mesh["expert"], tokens by all-to-all
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                parallelize_module(module, mesh["expert"], fs.ExpertParallel())
    by_fs = cfg.compile and cfg.compile_by == "fs"
    for block in model.blocks if cfg.compile and not by_fs else ():  # torchtitan's way
        block.compile(backend=cfg.compile)
    opt = make_optimizer(cfg)
    pipe = None if cfg.pipeline == 1 else fs.Pipeline(cfg.schedule, microbatches=microbatches)
    stages = None if pipe is None else fs.pipeline.split(model, split_points(cfg))
    state = fs.init(
        model if pipe is None else stages,
        opt,
        mesh=mesh,
        policy=cfg.policy,
        strategy=cfg.strategy,
        outer_strategy=cfg.outer_strategy,
        offload_fraction=cfg.offload_fraction,
        deterministic=cfg.deterministic,
        fault_tolerance=fault_tolerance(cfg),
        compile=cfg.compile if by_fs else False,
        context=_context_parallel(cfg),
        pipeline=pipe,
    )

    mgr = fs.CheckpointManager(cfg.checkpoint_dir, max_to_keep=3) if cfg.checkpoint_dir else None
    t0 = time.perf_counter()
    # a group that healed from a live peer in fs.init reads no checkpoint (all groups lost:
    # every one restarts at step 0 and restores the same latest step)
    if cfg.resume and mgr is not None and mgr.latest_step() is not None and state.step == 0:
        state = mgr.restore(mgr.latest_step(), like=state)
        if pipe is not None and cfg.model.experts:
            share_router_bias(model, stages, pipe, mesh)
    restore_s = time.perf_counter() - t0
    start = state.step
    saves = mgr is not None and cfg.replica_group == 0  # one group saves (each holds the state)

    out = Path(cfg.out_dir) / (f"group{cfg.replica_group}" if cfg.replica_groups else "")
    rows = _load_rows(out / "metrics.jsonl", start) if start else []
    n_params = sum(p.numel() for p in model.parameters())
    log = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "metrics.jsonl", "w")  # noqa: SIM115 - closed at the end of the run
        rows.append(
            {
                "start": start,
                "world": world,
                "microbatches": microbatches,
                "time": started or joined,
                "joined": joined,
                "restore_s": restore_s,
            }
        )
        log.writelines(json.dumps(row) + "\n" for row in rows)
        logging.info(
            "%s; model %d params; %d ranks x %d microbatches, strategy %s, mesh %s%s",
            data_lib.describe(source),
            n_params,
            world,
            microbatches,
            cfg.strategy,
            tuple(mesh.shape),
            f"; resumed at step {start} (restore {restore_s:.2f} s)" if start else "",
        )

    def loss_fn(params, batch):
        if cfg.context > 1:
            return _context_loss(model, params, batch, cfg)
        x = batch["x"]
        loss = _loss(fs.functional_call(model, params, (x[:, :-1],)), x)
        if not cfg.model.experts:
            return loss
        return loss, {"load": fs.summed(expert_load(model))}  # the step's, over every rank

    loads = None
    if pipe is not None:  # on the last stage: (its logits, the microbatch's tokens)
        loss_fn = _loss  # noqa: F811
        loads = StageLoads(model) if cfg.model.experts else None  # the routers' load

    schedule = lr_schedule(cfg)
    end = min(cfg.stop_at or cfg.steps, cfg.steps)
    progress = Progress(start, end, cfg.batch_size * (cfg.model.seq_len - 1), cfg.log_every, world)
    # with replica groups the data is a function of the committed step: a step that is not
    # committed is retried on the same batch, a step in which the group healed (its state
    # is then the peers', at their step) gives the batch of the new step; group g takes rows
    # g * world + rank of the groups' global batch
    groups = max(cfg.replica_groups, 1)
    # the data-parallel rows of the whole run: every group's, a tensor group sharing its rows
    row_rank, row_world = cfg.replica_group * dp_world + dp_rank, groups * dp_world
    committed = (lambda: state.step) if cfg.replica_groups else None  # noqa: B023 - the latest
    for step in range(start, end) if committed is None else iter(committed, end):
        x = source.batch(
            step,
            batch_size=cfg.batch_size,
            seq_len=cfg.model.seq_len,
            rank=row_rank,
            world=row_world,
        ).to(device)
        t_step = time.perf_counter()
        try:
            with fs.comm_stats() as stats:  # this rank's bytes per collective kind and mesh axis
                batch = _context_batch(x) if cfg.context > 1 else {"x": x}
                batch = (x[:, :-1], x) if pipe is not None else batch  # (inputs, target)
                if loads is not None:
                    loads.reset()
                state, metrics = fs.train_step(state, batch, loss_fn, microbatches=microbatches)
        except TimeoutError:  # too few replica groups for a quorum yet: the state is unchanged
            if committed is None:
                raise
            logging.warning("step %d: no quorum of replica groups yet; asking again", step)
            continue
        step_s = time.perf_counter() - t_step  # the process's first step compiles (--compile)
        if loads is not None:  # under a pipeline: the step's load of every stage's blocks
            metrics["aux"] = {"load": loads.total(microbatches, device)}
        if cfg.model.experts and metrics.get("committed", 1) and "aux" in metrics:
            balance_routers(model, metrics["aux"]["load"], cfg.router_bias_rate)
        if step == start and rank == 0 and cfg.compile:
            what = "the captured step" if by_fs else "the blocks"
            logging.info("first step %.2f s (compiling %s: %s)", step_s, what, cfg.compile)
            logging.info("compile time: %s", compile_times())
        if (
            saves
            and metrics.get("committed", 1)
            and cfg.save_every
            and (state.step % cfg.save_every == 0 or state.step == end)
        ):
            mgr.save(state.step, state)
        if log is not None:
            row = {
                "step": state.step,
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "nonfinite": metrics["nonfinite"],
                "lr": schedule(step),
                "tokens_per_s": progress.update(state.step, metrics["loss"]),
                "world": world,
                "time": time.time(),
                "step_s": step_s,
                "comm": {k: v for k, v in stats.bytes.items() if v},
                "comm_by_axis": {k: v for k, v in stats.bytes_by_axis.items() if v},
            }
            row.update({k: metrics[k] for k in ("committed", "replicas", "healed") if k in metrics})
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
        if after_step is not None:
            after_step(state.step, world)
    if mgr is not None:  # its last save written, its staging buffers and exit hook released
        mgr.close()

    final = evaluate(model, state, source, cfg, device, microbatches)
    if log is not None:
        summary = {
            "final_loss": final,
            "floor": source.floor,
            "steps": state.step,
            "gap_pct": None if source.floor is None else 100 * (final / source.floor - 1),
        }
        log.write(json.dumps(summary) + "\n")
        log.close()
        _plot([r for r in rows if "step" in r], source.floor, final, out / "loss.png")
        print(final_line(final, source.floor), flush=True)
    return {
        "final_loss": final,
        "floor": source.floor,
        "steps": state.step,
        "start_step": start,
        "world": world,
    }
