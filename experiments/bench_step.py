"""Step time and memory of funcshard beside PyTorch FSDP2, same GPT, data, mesh and policy.

    python experiments/bench_step.py                      # 2 gloo CPU ranks, short
    python experiments/bench_step.py --steps=20 --d_model=768 --n_layer=8
    python experiments/bench_step.py --nproc=1 --policies=fp32   # also beside plain torch
    python experiments/bench_step.py --device=cuda --nproc=1 --policies=bf16 \
        --d_model=1536 --n_layer=24 --seq_len=1024 --vocab=32768 --batch=8   # ~0.73B, one GPU
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python experiments/bench_step.py --compile=inductor \
        --policies=fp32          # compiled blocks: funcshard, FSDP2, their eager runs, compile=

At world 1, plain torch runs beside them too: the unwrapped model, ``torch.optim.AdamW``
(fused), autocast for bf16, the same microbatches and the same gradient norm: the floor any
data-parallel library adds its overhead to (with ``--compile``, also ``torch.compile(model)``
as a whole: the compiled floor). A throughput table follows: tokens/s, model
TFLOP/s per rank (6 N + 12 L T d per token) and, on a GPU whose bf16 peak is known, MFU.

Each configuration builds both from one initial model and alternates their steps (funcshard,
FSDP2, FSDP2, funcshard, ...) so that both see the same machine load. ZeRO-3
(``optim_grads_params``) runs beside ``fully_shard(reshard_after_forward=True)``, ZeRO-2
(``optim_grads``) beside ``reshard_after_forward=False``; per block, then the root. Printed per
strategy and policy: median step time (wall, and CPU time of the rank's process, which a
machine shared with other jobs disturbs less), the ratio funcshard / FSDP2 (below 1: funcshard
is faster; the wall ratio is the median over steps of each funcshard step over the FSDP2 step
beside it), peak tensor bytes per rank (persistent state + the profiler's peak of CPU
allocations, the lowest of five steps' peaks), bytes communicated in one step (measured,
and predicted by ``fs.plan``), the last loss and the largest difference between the two loss
curves.

With ``--compile=BACKEND`` each configuration runs (alternated as above) funcshard and FSDP2
with every block compiled in place (``block.compile()``; FSDP2: compiled, then ``fully_shard``,
torchtitan's order), each beside its own eager run, and, with ``--compile_modes`` holding
"fs", an eager model given to ``fs.init(compile=BACKEND)``: a table of each runner's median
step, first step (the compile: reuse inductor's cache with ``TORCHINDUCTOR_CACHE_DIR``), peak
and the ratios between them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from absl import app, flags
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.fsdp import MixedPrecisionPolicy as FsdpPolicy
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig  # noqa: E402
from timing import peaks_above_start  # noqa: E402

import funcshard as fs  # noqa: E402
from funcshard.layout.policy import native_bf16_reason  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("nproc", 2, "Local ranks (gloo on CPU, NCCL with --device=cuda).")
flags.DEFINE_enum("device", "cpu", ["cpu", "cuda"], "Where params, grads and batches live.")
flags.DEFINE_integer("steps", 10, "Timed steps per framework and configuration.")
flags.DEFINE_integer("warmup", 1, "Untimed steps first.")
flags.DEFINE_integer("microbatches", 2, "Microbatches per step.")
flags.DEFINE_integer("batch", 4, "Sequences per rank per step.")
flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
flags.DEFINE_integer("vocab", 8192, "Vocabulary size.")
flags.DEFINE_integer("d_model", 512, "Model width.")
flags.DEFINE_integer("n_layer", 6, "Transformer blocks.")
flags.DEFINE_list("strategies", ["optim_grads_params", "optim_grads"], "funcshard strategies.")
flags.DEFINE_list("policies", ["fp32", "bf16"], "fp32 | bf16 (bf16 compute, fp32 master/wire).")
flags.DEFINE_integer("threads", 1, "Intra-op threads per rank.")
flags.DEFINE_bool(
    "deterministic",
    False,
    "Also run funcshard with deterministic=True beside "
    "the default (same data, alternated steps) and print its cost.",
)
flags.DEFINE_float(
    "offload_fraction",
    0.0,
    "funcshard's offload_fraction; above 0 on CUDA, FSDP2 "
    "runs with CPUOffloadPolicy(pin_memory=True) (it offloads all or nothing).",
)
flags.DEFINE_string(
    "trace_dir",
    None,
    "Write a torch.profiler trace (Chrome JSON, CPU and CUDA "
    "activity) and a table of the ops by self time of one step of each runner per "
    "configuration and rank here: on a GPU it shows the offload copies on their side "
    "streams beside the compute.",
)
flags.DEFINE_string(
    "compile",
    "",
    "torch.compile backend (inductor, aot_eager, ...): each block of both models compiled in "
    "place (block.compile, FSDP2 fully_shard per block after it), each beside its own eager "
    "run in the same alternation; empty: eager only.",
)
flags.DEFINE_list(
    "compile_modes",
    ["blocks", "fs"],
    "With --compile: blocks (the user compiles the blocks), fs (an eager model given "
    "to fs.init(compile=BACKEND): funcshard captures the step) and/or cuda_graphs (the same "
    "with cuda_graphs=True: inductor's CUDA graph trees; --device=cuda only).",
)
flags.DEFINE_bool(
    "bf16_anyway",
    False,
    "Run the bf16 rows on a CPU without native bf16 too "
    "(emulated bf16 matmuls: slow, and not what a bf16 CPU would show).",
)

RESHARD = {"optim_grads_params": True, "optim_grads": False}
LR = 3e-4


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int
    warmup: int
    microbatches: int
    batch: int
    seq_len: int
    vocab: int
    d_model: int
    n_layer: int
    strategies: tuple[str, ...]
    policies: tuple[str, ...]
    threads: int
    deterministic: bool = False
    device: str = "cpu"
    offload_fraction: float = 0.0
    trace_dir: str | None = None
    compile: str = ""
    compile_modes: tuple[str, ...] = ()


def _policies(name: str) -> tuple[fs.MixedPrecisionPolicy, FsdpPolicy | None]:
    if name == "fp32":
        return fs.MixedPrecisionPolicy(), None
    if name == "bf16":
        return (
            fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
            FsdpPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    raise ValueError(f"unknown policy {name!r}; expected fp32 or bf16")


def _batch(cfg: Config, step: int) -> dict[str, torch.Tensor]:
    """This rank's rows of the global batch of ``step`` (random tokens, next-token targets)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch * world, cfg.seq_len + 1), generator=g)
    rows = tokens[rank * cfg.batch : (rank + 1) * cfg.batch].to(cfg.device)
    return {"x": rows[:, :-1].contiguous(), "y": rows[:, 1:].contiguous()}


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class _FsdpComm:
    """Counts FSDP2's collective bytes with funcshard's accounting (full buffer per rank)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _FsdpComm:
        def wrap(name: str, kind: str, arg: int, key: str):
            original = getattr(dist, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                t = args[arg] if len(args) > arg else kwargs[key]
                self.bytes[kind] += t.numel() * t.element_size()
                return original(*args, **kwargs)

            self._saved[name] = original
            setattr(dist, name, counted)

        # FSDP2 calls the torch 2.13 names where they exist, the older ones before
        new = hasattr(dist, "all_gather_single")
        wrap(
            "all_gather_single" if new else "all_gather_into_tensor",
            "all_gather",
            0,
            "output_tensor",
        )
        wrap(
            "reduce_scatter_single" if new else "reduce_scatter_tensor",
            "reduce_scatter",
            1,
            "input",
        )
        wrap("all_reduce", "all_reduce", 0, "tensor")
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _peak_bytes(runner, batches, reps: int = 5) -> int:
    """Peak bytes of tensors in a step: the lowest of ``reps`` steps' peaks after a first one.

    CUDA: the caching allocator's peak of allocated bytes. CPU: what lives at the step's start
    (the state) plus the profiler's highest count of bytes allocated above that during the
    step; the first step runs inside the profiler too, so that frees of what it allocated are
    seen. On the CPU one step's peak moves from step to step (some frees land at varying points
    of the step, with Python's cycle collector off too); the lowest of ``reps`` steps is the
    step's own peak without that."""
    if runner.cfg.device == "cuda":
        runner.step(batches[0])
        torch.cuda.synchronize()
        peaks = []
        for i in range(reps):
            torch.cuda.reset_peak_memory_stats()
            runner.step(batches[1 + i % (len(batches) - 1)])
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        return min(peaks)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(batches[0])
        persistent = runner.persistent_bytes()
        for i in range(reps):
            with record_function(f"measured_step_{i}"):
                runner.step(batches[1 + i % (len(batches) - 1)])
    return persistent + min(peaks_above_start(prof, reps))


class _Funcshard:
    def __init__(
        self,
        model: GPT,
        mesh,
        strategy: str,
        policy: fs.MixedPrecisionPolicy,
        cfg: Config,
        deterministic: bool = False,
        outer_strategy: str = "no_shard",
        compile: str = "",
        cuda_graphs: bool = False,
        overlap: bool = True,
    ) -> None:
        self.model, self.cfg = model, cfg
        opt = fs.optim.adamw(LR, weight_decay=0.1)
        kw = {"compile": compile} if compile else {}
        if cuda_graphs:
            kw["cuda_graphs"] = True
        if not overlap:
            kw["overlap"] = False
        self.state = fs.init(
            model,
            opt,
            mesh=mesh,
            policy=policy,
            strategy=strategy,
            deterministic=deterministic,
            offload_fraction=cfg.offload_fraction,
            outer_strategy=outer_strategy,
            **kw,
        )

        def loss_fn(params, batch):
            return _ce(fs.functional_call(model, params, (batch["x"],)), batch["y"])

        self.loss_fn = loss_fn

    def step(self, batch) -> float:
        self.state, metrics = fs.train_step(
            self.state, batch, self.loss_fn, microbatches=self.cfg.microbatches
        )
        return metrics["loss"]

    def persistent_bytes(self) -> int:
        return _storage_bytes(fs.tree.leaves(self.state))


class _ModuleLoop:
    """A torch module stepped the usual way: microbatched backward (in ``autocast`` when set),
    the global grad norm (as funcshard computes it every step for its metrics), fused AdamW."""

    autocast: torch.dtype | None = None

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        self.cfg, self.model = cfg, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)

    def step(self, batch) -> float:
        M = self.cfg.microbatches
        total = torch.zeros((), dtype=torch.float64, device=self.cfg.device)
        for x, y in zip(
            torch.tensor_split(batch["x"], M), torch.tensor_split(batch["y"], M), strict=True
        ):
            with torch.autocast(
                self.cfg.device,
                dtype=self.autocast or torch.float32,
                enabled=self.autocast is not None,
            ):
                logits = self.model(x)
            loss = _ce(logits, y) / M
            loss.backward()
            total += loss.detach().double()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"), foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self.mean(total)

    def mean(self, total: torch.Tensor) -> float:
        return float(total)

    def persistent_bytes(self) -> int:
        states = [t for s in self.opt.state.values() for t in s.values()]
        return _storage_bytes([*self.model.parameters(), *states])


class _Fsdp2(_ModuleLoop):
    def __init__(
        self, model: GPT, mesh, strategy: str, policy: FsdpPolicy | None, cfg: Config
    ) -> None:
        kw = dict(mesh=mesh["shard"], reshard_after_forward=RESHARD[strategy])
        if policy is not None:
            kw["mp_policy"] = policy
        if cfg.offload_fraction > 0 and cfg.device == "cuda":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        model.to(cfg.device)
        for block in model.blocks:
            fully_shard(block, **kw)
        super().__init__(fully_shard(model, **kw), cfg)

    def mean(self, total: torch.Tensor) -> float:
        dist.all_reduce(total)
        return float(total) / dist.get_world_size()


class _Torch(_ModuleLoop):
    """Plain torch on one rank: no sharding, no wrapper; autocast for bf16 compute."""

    def __init__(self, model: GPT, policy_name: str, cfg: Config) -> None:
        super().__init__(model.to(cfg.device), cfg)
        self.autocast = torch.bfloat16 if policy_name == "bf16" else None


def _trace(cfg: Config, runner, batch, name: str) -> None:
    """One step under torch.profiler, exported as Chrome trace JSON (chrome://tracing,
    ui.perfetto.dev; with CUDA, kernels and copies per stream) and as a table of the ops by
    self time, grouped by input shapes (``NAME_rankR.txt``)."""
    activities = [ProfilerActivity.CPU]
    if cfg.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    os.makedirs(cfg.trace_dir, exist_ok=True)
    with profile(activities=activities, record_shapes=True) as prof:
        runner.step(batch)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
    path = os.path.join(cfg.trace_dir, f"{name}_rank{dist.get_rank()}")
    prof.export_chrome_trace(path + ".json")
    by = "self_cuda_time_total" if cfg.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages(group_by_input_shape=True).table(sort_by=by, row_limit=40)
    with open(path + ".txt", "w") as f:
        f.write(table)


def _flops_per_token(model: GPT) -> int:
    """Training FLOPs per token: 6 per matmul weight (forward + backward; the tied embedding
    counts once, as the head) plus 12 L T d for attention's scores and values (PaLM's count)."""
    cfg = model.cfg
    weights = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    return 6 * weights + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model


# Dense bf16 tensor-core peak FLOP/s, by device name (vendor datasheets).
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)


def _peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def _compile_blocks(model: GPT, backend: str) -> GPT:
    for block in model.blocks:
        block.compile(backend=backend)
    return model


def _compiled_runners(cfg: Config, model: GPT, mesh, strategy: str, fs_policy, fsdp_policy):
    """funcshard and FSDP2 from one initial model; with ``cfg.compile``, both with their blocks
    compiled in place (FSDP2: compiled, then ``fully_shard``, torchtitan's order), each beside
    its own eager run, and ("fs" mode) an eager model given to ``fs.init(compile=...)``."""
    if not cfg.compile:
        return {
            "funcshard": _Funcshard(model, mesh, strategy, fs_policy, cfg),
            "fsdp2": _Fsdp2(copy.deepcopy(model), mesh, strategy, fsdp_policy, cfg),
        }
    copies = [copy.deepcopy(model) for _ in range(4)]
    runners = {}
    if "blocks" in cfg.compile_modes:
        runners["funcshard"] = _Funcshard(
            _compile_blocks(copies[0], cfg.compile), mesh, strategy, fs_policy, cfg
        )
        runners["fsdp2"] = _Fsdp2(
            _compile_blocks(copies[1], cfg.compile), mesh, strategy, fsdp_policy, cfg
        )
    runners["funcshard_eager"] = _Funcshard(copies[2], mesh, strategy, fs_policy, cfg)
    runners["fsdp2_eager"] = _Fsdp2(copies[3], mesh, strategy, fsdp_policy, cfg)
    if "fs" in cfg.compile_modes:
        runners["fs_compile"] = _Funcshard(
            model, mesh, strategy, fs_policy, cfg, compile=cfg.compile
        )
    if "cuda_graphs" in cfg.compile_modes:  # the captured step replayed as CUDA graphs
        runners["fs_cuda_graphs"] = _Funcshard(
            copy.deepcopy(model),
            mesh,
            strategy,
            fs_policy,
            cfg,
            compile=cfg.compile,
            cuda_graphs=True,
        )
    if "blocks" not in cfg.compile_modes:  # the main table compares the eager pair
        runners["funcshard"] = runners.pop("funcshard_eager")
        runners["fsdp2"] = runners.pop("fsdp2_eager")
    return runners


def _run_pair(cfg: Config, mesh, strategy: str, policy_name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    gpt_cfg = GPTConfig(
        vocab=cfg.vocab,
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        n_head=8,
        d_model=cfg.d_model,
        tied=True,
    )
    model = GPT(gpt_cfg)
    fs_policy, fsdp_policy = _policies(policy_name)
    runners = _compiled_runners(cfg, model, mesh, strategy, fs_policy, fsdp_policy)
    if cfg.deterministic:
        runners["deterministic"] = _Funcshard(model, mesh, strategy, fs_policy, cfg, True)
    if dist.get_world_size() == 1:
        runners["torch"] = _Torch(copy.deepcopy(model), policy_name, cfg)
        if cfg.compile:  # torch.compile(model) as a whole: the compiled floor
            compiled = torch.compile(copy.deepcopy(model), backend=cfg.compile)
            runners["torch_compiled"] = _Torch(compiled, policy_name, cfg)
    sync = torch.cuda.synchronize if cfg.device == "cuda" else lambda: None
    times: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    losses: dict[str, list[float]] = {k: [] for k in runners}
    first: dict[str, float] = {}  # the first step: with --compile, the compile's time
    for step in range(cfg.warmup + cfg.steps):
        batch = _batch(cfg, step)
        order = list(runners) if step % 2 == 0 else list(reversed(runners))  # no one goes first
        for name in order:
            runner = runners[name]
            sync()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[name].append(runner.step(batch))
            sync()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if step == 0:
                first[name] = elapsed
            if step >= cfg.warmup:
                times[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    step = cfg.warmup + cfg.steps
    batches = [_batch(cfg, step), _batch(cfg, step + 1)]
    with fs.comm_stats() as stats:
        runners["funcshard"].step(batches[0])
    det_stats = None
    if cfg.deterministic:
        with fs.comm_stats() as det_stats:
            runners["deterministic"].step(batches[0])
    with _FsdpComm() as fsdp_comm:
        runners["fsdp2"].step(batches[0])
    peak = {k: _peak_bytes(r, batches) for k, r in runners.items()}
    if cfg.trace_dir:  # every runner's step (with --compile: each mode's)
        for name, runner in runners.items():
            _trace(cfg, runner, batches[0], f"{strategy}_{policy_name}_{name}")
    predicted = fs.plan(
        model,
        world_size=dist.get_world_size(),
        strategy=strategy,
        policy=fs_policy,
        microbatches=cfg.microbatches,
        optimizer="adamw",
        device_type=cfg.device,
    )
    comm_keys = ("all_gather", "reduce_scatter", "all_reduce")
    det = {}
    if det_stats is not None:
        det_plan = fs.plan(
            model,
            world_size=dist.get_world_size(),
            strategy=strategy,
            policy=fs_policy,
            microbatches=cfg.microbatches,
            optimizer="adamw",
            device_type=cfg.device,
            deterministic=True,
        )
        det = {
            "comm": sum(det_stats.bytes[k] for k in comm_keys),
            "plan": sum(det_plan.comm[k] for k in comm_keys),
            "metrics": det_stats.bytes["metrics"],
            "metrics_plan": det_plan.comm["metrics"],
            "default_metrics": stats.bytes["metrics"],
        }
    return {
        "deterministic": det,
        "strategy": strategy,
        "policy": policy_name,
        "params": sum(p.numel() for p in model.parameters()),
        "time": {k: statistics.median(v) for k, v in times.items()},
        "first": first,
        "steps": times,
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "loss": losses["funcshard"][-1],
        "loss_gap": {
            k: max(abs(a - b) for a, b in zip(losses["funcshard"], v, strict=True))
            for k, v in losses.items()
        },
        "flops_per_token": _flops_per_token(model),
        "peak": peak,
        "comm": {
            "funcshard": sum(stats.bytes[k] for k in comm_keys),
            "fsdp2": sum(fsdp_comm.bytes.values()),
            "plan": sum(predicted.comm[k] for k in comm_keys),
        },
    }


def worker(cfg: Config) -> list[dict[str, Any]]:
    torch.set_num_threads(cfg.threads)
    mesh = fs.make_mesh(device_type=cfg.device)
    return [_run_pair(cfg, mesh, s, p) for s in cfg.strategies for p in cfg.policies]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def main(argv: list[str]) -> None:
    del argv
    policies = tuple(FLAGS.policies)
    native, why = native_bf16_reason(FLAGS.device)
    skipped = "bf16" in policies and not native and not FLAGS.bf16_anyway
    if skipped:
        print(f"bf16 rows skipped: {why}")
        policies = tuple(p for p in policies if p != "bf16")
    cfg = Config(
        FLAGS.steps,
        FLAGS.warmup,
        FLAGS.microbatches,
        FLAGS.batch,
        FLAGS.seq_len,
        FLAGS.vocab,
        FLAGS.d_model,
        FLAGS.n_layer,
        tuple(FLAGS.strategies),
        policies,
        FLAGS.threads,
        FLAGS.deterministic,
        FLAGS.device,
        FLAGS.offload_fraction,
        FLAGS.trace_dir,
        FLAGS.compile,
        tuple(FLAGS.compile_modes),
    )
    results = fs.launch(worker, cfg, nproc=FLAGS.nproc) if policies else [[]]
    _print_table(cfg, results)
    if results[0]:
        _print_throughput(cfg, results)
    if cfg.deterministic and results[0]:
        _print_deterministic(cfg, results)
    if cfg.compile and results[0]:
        _print_compiled(cfg, results)
    for strategy in cfg.strategies if skipped else ():
        print(
            f"{strategy:<19}{'bf16':<7}skipped: no native bf16 on this CPU, pass "
            "--bf16_anyway to run"
        )


def _print_table(cfg: Config, results: list[list[dict[str, Any]]]) -> None:
    if not results[0]:  # every row skipped
        return
    first = results[0][0]
    where = (
        f"{FLAGS.nproc} x {torch.cuda.get_device_name()}, NCCL"
        if cfg.device == "cuda"
        else f"{FLAGS.nproc} gloo ranks"
    )
    print(
        f"GPT {first['params'] / 1e6:.1f}M params, {where}, batch "
        f"{cfg.batch}x{cfg.seq_len} per rank, {cfg.microbatches} microbatches, AdamW, "
        + (
            f"offload_fraction={cfg.offload_fraction} (FSDP2: "
            f"{'CPUOffloadPolicy(pin_memory=True)' if cfg.device == 'cuda' else 'none on CPU'}), "
            if cfg.offload_fraction
            else ""
        )
        + f"median of {cfg.steps} steps (slowest rank); FSDP2 also computes the grad norm"
    )
    head = (
        f"{'strategy':<19}{'policy':<7}{'fs s':>8}{'fsdp2 s':>9}{'ratio':>7}"
        f"{'fs cpu s':>9}{'fsdp2 cpu':>10}{'ratio':>7}"
        f"{'fs peak MB':>12}{'fsdp2 MB':>10}{'fs comm MB':>12}{'plan MB':>9}{'fsdp2 MB':>10}"
        f"{'fs loss':>9}{'max|dloss|':>12}"
    )
    print(head)
    for i, r in enumerate(results[0]):
        t = {k: max(rank[i]["time"][k] for rank in results) for k in ("funcshard", "fsdp2")}
        # each funcshard step over the FSDP2 step run right before or after it (slowest rank):
        # a machine load that drifts during the run cancels out of these ratios
        ratio = _per_step_ratio(results, i, "funcshard", "fsdp2")
        peak = {k: max(rank[i]["peak"][k] for rank in results) for k in ("funcshard", "fsdp2")}
        u = {k: max(rank[i]["cpu"][k] for rank in results) for k in ("funcshard", "fsdp2")}
        c = r["comm"]
        print(
            f"{r['strategy']:<19}{r['policy']:<7}{t['funcshard']:>8.3f}{t['fsdp2']:>9.3f}"
            f"{ratio:>7.2f}{u['funcshard']:>9.3f}{u['fsdp2']:>10.3f}"
            f"{u['funcshard'] / u['fsdp2']:>7.2f}{_mb(peak['funcshard']):>12}"
            f"{_mb(peak['fsdp2']):>10}{_mb(c['funcshard']):>12}{_mb(c['plan']):>9}"
            f"{_mb(c['fsdp2']):>10}{r['loss']:>9.4f}{r['loss_gap']['fsdp2']:>12.1e}"
        )


def _print_throughput(cfg: Config, results: list[list[dict[str, Any]]]) -> None:
    names = [
        k for k in ("funcshard", "deterministic", "fsdp2", "torch") if k in results[0][0]["time"]
    ]
    peak = _peak_flops(cfg.device)
    tokens = cfg.batch * cfg.seq_len * FLAGS.nproc  # per step, all ranks
    print(
        f"\nthroughput ({tokens} tokens per step; model TFLOP/s per rank = "
        f"{results[0][0]['flops_per_token'] / 1e9:.2f} GFLOP/token x tokens/s / ranks"
        + (f"; MFU against {peak / 1e12:.0f} TFLOP/s dense bf16)" if peak else ")")
    )
    head = f"{'strategy':<19}{'policy':<7}{'runner':<14}{'step s':>8}{'tokens/s':>10}{'TFLOP/s':>9}"
    head += f"{'MFU':>7}" if peak else ""
    head += f"{'fs / this':>10}{'max|dloss|':>12}" if "torch" in names else f"{'fs / this':>10}"
    print(head)
    for i, r in enumerate(results[0]):
        for name in names:
            t = max(rank[i]["time"][name] for rank in results)
            flops = r["flops_per_token"] * tokens / t / FLAGS.nproc
            line = (
                f"{r['strategy']:<19}{r['policy']:<7}{name:<14}{t:>8.3f}{tokens / t:>10.0f}"
                f"{flops / 1e12:>9.3f}"
            )
            line += f"{flops / peak:>7.1%}" if peak else ""
            line += f"{_per_step_ratio(results, i, 'funcshard', name):>10.3f}"
            if "torch" in names:
                line += f"{r['loss_gap'][name]:>12.1e}"
            print(line)


def _per_step_ratio(results, i: int, a: str, b: str) -> float:
    """Median over steps of runner a's step over runner b's step beside it (slowest rank)."""
    steps = {
        k: [max(s) for s in zip(*(rank[i]["steps"][k] for rank in results), strict=True)]
        for k in (a, b)
    }
    return statistics.median(x / y for x, y in zip(steps[a], steps[b], strict=True))


# (label, runner a, runner b): a's step over b's beside it, where both ran
COMPILE_RATIOS = (
    ("fs/fsdp2 blocks compiled", "funcshard", "fsdp2"),
    ("fs/fsdp2 eager", "funcshard_eager", "fsdp2_eager"),
    ("fs compiled/eager", "funcshard", "funcshard_eager"),
    ("fsdp2 compiled/eager", "fsdp2", "fsdp2_eager"),
    ("fs compile=/fsdp2 compiled", "fs_compile", "fsdp2"),
    ("fs compile=/fs eager", "fs_compile", "funcshard_eager"),
    ("fs compile=/fsdp2 eager", "fs_compile", "fsdp2_eager"),
    ("fs compile=/torch compiled", "fs_compile", "torch_compiled"),
    ("torch compiled/eager", "torch_compiled", "torch"),
    ("fs cuda_graphs/torch compiled", "fs_cuda_graphs", "torch_compiled"),
    ("fs cuda_graphs/compile=", "fs_cuda_graphs", "fs_compile"),
)


def _print_compiled(cfg: Config, results: list[list[dict[str, Any]]]) -> None:
    """Per strategy: each runner's median step (wall, and CPU time of the rank's process),
    first step (the compile) and peak; then the ratios of COMPILE_RATIOS: wall, the median over
    steps of one runner's step over the other's beside it; cpu, of the median CPU times (what
    a machine shared with other jobs disturbs less). Slowest rank."""
    print(f"\n--compile={cfg.compile} (modes {','.join(cfg.compile_modes)}), same run:")
    for i, r in enumerate(results[0]):
        names = list(r["time"])
        print(f"{r['strategy']} {r['policy']}")
        print(
            f"  {'runner':<17}{'step s':>8}{'cpu s':>8}{'first s':>9}{'peak MB':>9}"
            f"{'max|dloss|':>12}"
        )
        cpu = {n: max(rank[i]["cpu"][n] for rank in results) for n in names}
        for name in names:
            t = max(rank[i]["time"][name] for rank in results)
            first = max(rank[i]["first"][name] for rank in results)
            peak = max(rank[i]["peak"][name] for rank in results)
            print(
                f"  {name:<17}{t:>8.3f}{cpu[name]:>8.3f}{first:>9.1f}{_mb(peak):>9}"
                f"{r['loss_gap'][name]:>12.1e}"
            )
        print(f"  {'ratio':<28}{'wall':>7}{'cpu':>7}")
        blocks = "funcshard_eager" in names  # else "funcshard" / "fsdp2" ran eager
        eager = {} if blocks else {"funcshard_eager": "funcshard", "fsdp2_eager": "fsdp2"}
        for label, a, b in COMPILE_RATIOS:
            if not blocks and {a, b} & {"funcshard", "fsdp2"}:
                continue  # a ratio of the compiled blocks, which did not run
            a, b = eager.get(a, a), eager.get(b, b)
            if a in names and b in names:
                wall = _per_step_ratio(results, i, a, b)
                print(f"  {label:<28}{wall:>7.3f}{cpu[a] / cpu[b]:>7.3f}")


def _print_deterministic(cfg: Config, results: list[list[dict[str, Any]]]) -> None:
    print(f"\ndeterministic=True beside the default, same run ({cfg.microbatches} microbatches):")
    print(
        f"{'strategy':<19}{'policy':<7}{'default s':>10}{'det s':>8}{'ratio':>7}"
        f"{'default MB':>11}{'det MB':>8}{'plan MB':>9}{'metrics KB':>11}{'plan KB':>9}"
        f"{'peak MB':>9}{'det peak':>9}"
    )
    for i, r in enumerate(results[0]):
        t = {k: max(rank[i]["time"][k] for rank in results) for k in ("funcshard", "deterministic")}
        peak = {
            k: max(rank[i]["peak"][k] for rank in results) for k in ("funcshard", "deterministic")
        }
        d = r["deterministic"]
        print(
            f"{r['strategy']:<19}{r['policy']:<7}{t['funcshard']:>10.3f}"
            f"{t['deterministic']:>8.3f}"
            f"{_per_step_ratio(results, i, 'deterministic', 'funcshard'):>7.2f}"
            f"{_mb(r['comm']['funcshard']):>11}{_mb(d['comm']):>8}{_mb(d['plan']):>9}"
            f"{d['metrics'] / 1e3:>11.1f}{d['metrics_plan'] / 1e3:>9.1f}"
            f"{_mb(peak['funcshard']):>9}{_mb(peak['deterministic']):>9}"
        )


if __name__ == "__main__":
    app.run(main)
