"""Train a small GPT with funcshard on a source whose loss floor is known.

    python experiments/train.py --nproc=2                       # 2 local ranks (gloo / NCCL)
    torchrun --nproc_per_node=2 experiments/train.py            # the same under torchrun
    python experiments/train.py --nproc=2 --data=input.txt      # char-level text, no floor
    python experiments/train.py --nproc=2 --context=2 --seq_len=64  # sequences split 2 ways
    python experiments/train.py --nproc=4 --pipeline=2 --notied      # 2 stages x ZeRO-3 over 2
    python experiments/train.py --nproc=4 --pipeline=2 --notied --tensor=2  # TP in each stage
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --max-restarts=3 \
        --rdzv-backend=c10d ... experiments/train.py --grad_chunks=4 --deterministic \
        --checkpoint_dir=ckpt --save_every=50 --resume     # elastic: docs/multi-node.md

Ends with ``final loss X nats/token, floor Y, gap Z%`` and writes ``metrics.jsonl`` and
``loss.png`` into ``--out_dir``.
"""

from __future__ import annotations

import time

STARTED = time.time()  # this process's start, for metrics.jsonl's start rows (before imports)

import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from absl import app, flags  # noqa: E402

import funcshard as fs  # noqa: E402
from experiments.gpt import GPTConfig  # noqa: E402
from experiments.trainer import (  # noqa: E402
    Config,
    microbatches_for,
    pipeline_stages,
    run,
    split_points,
)
from funcshard.layout.policy import native_bf16_reason  # noqa: E402
from funcshard.planner.pipeline import schedule_order  # noqa: E402

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "none": None,
}
MOMENT_DTYPES = {**DTYPES, "int8": torch.int8, "uint8": torch.uint8}
# the wires: the floating dtypes and the 8-bit blockwise formats (funcshard.comm.codec)
WIRE_DTYPES = {
    **DTYPES,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_HELP = " ('bf16', 'fp16', 'fp32', 'fp64' or their long names, or 'none')"

flags.DEFINE_integer("nproc", 1, "Local ranks to launch (ignored under torchrun).", lower_bound=1)
flags.DEFINE_integer("shard", -1, "Ranks per shard group; -1 = world size / replicate.")
flags.DEFINE_integer("replicate", 1, "Replicas (HSDP when > 1).", lower_bound=1)
flags.DEFINE_integer(
    "tensor",
    1,
    "Tensor-parallel ranks per group (innermost mesh axis): each block's attention heads and "
    "MLP split colwise / rowwise with torch's parallelize_module; its ranks share a batch.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "context",
    1,
    "Context-parallel ranks per group (fs.ContextParallel): each sequence split C ways "
    "(head-tail load balanced), attention over the whole sequence; its ranks share a batch.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "context_algorithm",
    "all_to_all",
    ["all_to_all", "ring"],
    "Context parallel's attention: all_to_all (Ulysses, heads divisible by C) or ring.",
)
flags.DEFINE_integer(
    "pipeline",
    1,
    "Pipeline ranks P (the outermost mesh axis, fs.Pipeline): the GPT split into stages by "
    "fs.pipeline.split at its blocks (P stages, 2P under the looped and V-shaped schedules), "
    "every other axis inside each pipeline rank (--tensor, --experts / --expert, "
    "--deterministic, --outer_strategy=optim too). Needs --notied (a tied head would be split "
    "from its embedding); refuses --context, --compile and --replica_groups.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "schedule",
    "1F1B",
    list(fs.pipeline.SCHEDULES),
    "torch's pipeline schedule under --pipeline (torch.distributed.pipelining's, by name).",
)
flags.DEFINE_enum("strategy", "optim_grads_params", list(fs.STRATEGIES), "What is sharded.")
flags.DEFINE_enum(
    "outer_strategy",
    "no_shard",
    [s.value for s in fs.OuterStrategy],
    'What is sharded over "replicate": optim = HFSDP (masters and optimizer over every rank).',
)
flags.DEFINE_string(
    "param_dtype",
    "auto",
    "Compute dtype of the gathered params; 'auto' = bf16 "
    "where the device computes bf16 natively, else fp32." + _DTYPE_HELP,
)
flags.DEFINE_string("main_params_dtype", "fp32", "Master weight dtype." + _DTYPE_HELP)
flags.DEFINE_string("main_grads_dtype", "fp32", "Gradient accumulation dtype." + _DTYPE_HELP)
flags.DEFINE_string(
    "grad_comm_dtype",
    "none",
    "Gradient dtype on the wire, summed in fp32 when narrower than main_grads_dtype; int8 / "
    "fp8: 8-bit blockwise." + _DTYPE_HELP,
)
flags.DEFINE_string(
    "param_comm_dtype",
    "none",
    "Param dtype on the all-gather wire ('none' = the compute dtype); int8 / fp8: 8-bit "
    "blockwise, decoded to the compute dtype on arrival." + _DTYPE_HELP,
)
flags.DEFINE_float(
    "offload_fraction",
    0.0,
    "Share of the optimizer stepped on the CPU.",
    lower_bound=0.0,
    upper_bound=1.0,
)
flags.DEFINE_bool(
    "deterministic",
    False,
    "Bitwise the same run on every world size, mesh, "
    "strategy and offload fraction with as many gradient chunks (world x "
    "microbatches, a power of two); under --pipeline, on every data-parallel layout of the "
    "same --pipeline, split, --schedule and microbatches (torch's schedule sums each rank's "
    "microbatches in its own order).",
)
flags.DEFINE_integer(
    "microbatches",
    1,
    "Microbatches per step (gradient accumulation); under --pipeline the schedule's, by default "
    "as many as stages.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "grad_chunks",
    0,
    "Gradient chunks per step G, kept whatever the world size: microbatches = G / world "
    "(for elastic runs; with --deterministic the bits do not depend on the world). "
    "0 = world x --microbatches.",
    lower_bound=0,
)
flags.DEFINE_integer("batch_size", 64, "Global batch size (sequences per step).", lower_bound=1)
flags.DEFINE_integer("seq_len", 32, "Tokens per sequence fed to the model.", lower_bound=3)
flags.DEFINE_integer("steps", 500, "Optimizer steps.", lower_bound=1)
flags.DEFINE_integer(
    "stop_at",
    0,
    "Stop after this step as if interrupted (the schedule still "
    "spans --steps); 0 = run to --steps.",
    lower_bound=0,
)
flags.DEFINE_float(
    "lr", 1e-2, "Peak AdamW learning rate (warmup, then cosine to lr/10).", lower_bound=0.0
)
flags.DEFINE_integer("warmup", 25, "Linear warmup steps.", lower_bound=1)
flags.DEFINE_float("weight_decay", 0.1, "AdamW decoupled weight decay.", lower_bound=0.0)
flags.DEFINE_bool("decay_mask", True, "Decay only matrices and embeddings (not biases, norms).")
flags.DEFINE_enum(
    "optimizer",
    "adamw",
    ["adamw", "muon"],
    "adamw, or muon for the blocks' "
    "matrices (owner-computes) with AdamW for embeddings, norms, biases.",
)
flags.DEFINE_float(
    "muon_lr", 0.02, "Peak Muon learning rate (same warmup and cosine shape).", lower_bound=0.0
)
flags.DEFINE_string(
    "mu_dtype",
    "none",
    "Stored dtype of the first moment (AdamW mu, Muon momentum); 'none' = the master "
    "dtype. bf16/fp16, or int8 (8-bit blockwise).",
)
flags.DEFINE_string(
    "nu_dtype",
    "none",
    "Stored dtype of AdamW's second moment; 'none' = the master dtype. bf16/fp16, or uint8 "
    "(8-bit blockwise).",
)
flags.DEFINE_bool("stochastic_rounding", False, "Round bf16 moments stochastically.")
flags.DEFINE_float(
    "clip", 1.0, "Clip the global gradient norm to this; 0 = no clipping.", lower_bound=0.0
)
flags.DEFINE_integer("n_layer", 2, "Transformer blocks.", lower_bound=1)
flags.DEFINE_integer("n_head", 4, "Attention heads.", lower_bound=1)
flags.DEFINE_integer("d_model", 64, "Model width.", lower_bound=1)
flags.DEFINE_bool("tied", True, "Tie the output head to the token embedding.")
flags.DEFINE_integer(
    "experts", 0, "Experts per block (a mixture-of-experts GPT); 0: dense MLPs.", lower_bound=0
)
flags.DEFINE_integer(
    "expert",
    1,
    "Expert-parallel ranks (with --experts): the experts of each block split over them "
    "(fs.ExpertParallel, tokens by all-to-all), carved out of --shard.",
    lower_bound=1,
)
flags.DEFINE_integer("top_k", 2, "Experts each token is routed to (with --experts).", lower_bound=1)
flags.DEFINE_float(
    "router_bias_rate",
    1e-3,
    "With --experts: DeepSeek-V3's router bias update per step, from the step's global load.",
    lower_bound=0.0,
)
flags.DEFINE_integer("vocab", 16, "Vocabulary of the synthetic Markov source.", lower_bound=2)
flags.DEFINE_float(
    "concentration", 0.1, "Dirichlet concentration of the Markov rows.", lower_bound=1e-6
)
flags.DEFINE_string("data", "", "Text file to train on char-level instead (no known floor).")
flags.DEFINE_integer(
    "eval_batches", 16, "Held-out global batches for the final loss.", lower_bound=1
)
flags.DEFINE_string("checkpoint_dir", "", "Root of numbered checkpoints (fs.CheckpointManager).")
flags.DEFINE_integer(
    "save_every", 0, "Save every N steps and at the end; 0 = never.", lower_bound=0
)
flags.DEFINE_bool(
    "resume",
    False,
    "Continue from the latest complete checkpoint in --checkpoint_dir, on whatever world "
    "this start has; start afresh where there is none (so an elastic run passes it always).",
)
flags.DEFINE_integer("seed", 0, "Seeds the initial weights and the data order.")
flags.DEFINE_float(
    "collective_timeout",
    0.0,
    "Seconds a collective may wait for a peer before it fails (under torchrun: a node cut "
    "off without its processes dying is found this way); 0 = torch's default (30 min).",
    lower_bound=0.0,
)
flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"], "Where the shards live.")
flags.DEFINE_integer("threads", 0, "CPU threads per rank; 0 = cores / local ranks.", lower_bound=0)
flags.DEFINE_string(
    "compile",
    "",
    "Compile each transformer block in place (block.compile) with this torch.compile backend: "
    "inductor, aot_eager, ...; empty: eager. The first step's time (the compile) is logged, "
    "with each graph's compile time; metrics.jsonl has every step's wall time (step_s); "
    "inductor's cache serves a second run.",
)
flags.DEFINE_enum(
    "compile_by",
    "blocks",
    ["blocks", "fs"],
    "With --compile: blocks (each block compiled in place, torchtitan's way) or fs "
    "(fs.init(compile=): the microbatch's gathers, forward and reduce-scatters captured).",
)
flags.DEFINE_integer(
    "replica_groups",
    0,
    "Replica groups of a fault-tolerant run (each its own torchrun job, joined by a torchft "
    "lighthouse: docs/fault-tolerance.md); 0 = none.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "replica_group", 0, "This job's group, 0 .. --replica_groups - 1.", lower_bound=0
)
flags.DEFINE_string("lighthouse", "", "The torchft lighthouse's address; '' = TORCHFT_LIGHTHOUSE.")
flags.DEFINE_float("ft_timeout", 30.0, "Seconds a quorum, commit or heal may take.", lower_bound=0)
flags.DEFINE_string("out_dir", "out/train", "Where metrics.jsonl and loss.png go.")
flags.DEFINE_integer(
    "log_every", 0, "Log every N steps off a terminal; 0 = 20 lines a run.", lower_bound=0
)

FLAGS = flags.FLAGS
for _name in ("main_params_dtype", "main_grads_dtype"):
    flags.register_validator(
        _name, lambda v: v.lower() in DTYPES, message=f"--{_name}: expected one of {sorted(DTYPES)}"
    )
for _name in ("grad_comm_dtype", "param_comm_dtype"):
    flags.register_validator(
        _name,
        lambda v: v.lower() in WIRE_DTYPES,
        message=f"--{_name}: expected one of {sorted(WIRE_DTYPES)}",
    )
for _name in ("mu_dtype", "nu_dtype"):
    flags.register_validator(
        _name,
        lambda v: v.lower() in MOMENT_DTYPES,
        message=f"--{_name}: expected one of {sorted(MOMENT_DTYPES)}",
    )
flags.register_validator(
    "param_dtype",
    lambda v: v.lower() in DTYPES or v.lower() == "auto",
    message=f"--param_dtype: expected auto or one of {sorted(DTYPES)}",
)
flags.register_validator(
    "data", lambda v: not v or os.path.isfile(v), message="--data: no such file"
)
flags.register_multi_flags_validator(
    ["checkpoint_dir", "save_every", "resume"],
    lambda f: f["checkpoint_dir"] or not (f["save_every"] or f["resume"]),
    message="--save_every and --resume need --checkpoint_dir",
)
flags.register_multi_flags_validator(
    ["grad_chunks", "microbatches"],
    lambda f: not (f["grad_chunks"] and f["microbatches"] != 1),
    message="--grad_chunks sets the microbatches (G / world): leave --microbatches out",
)


flags.register_multi_flags_validator(
    ["replica_group", "replica_groups", "outer_strategy"],
    lambda f: (
        not f["replica_groups"]
        or (f["replica_group"] < f["replica_groups"] and f["outer_strategy"] == "no_shard")
    ),
    message="--replica_group must be < --replica_groups, and replica groups need "
    "--outer_strategy=no_shard",
)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _fail(message: str) -> None:
    raise SystemExit(f"FATAL Flags error: {message}")


def _check_world(world: int) -> None:
    """Flag checks that need the world size; exit before any rank starts."""
    tensor, context, pipeline = FLAGS.tensor, FLAGS.context, FLAGS.pipeline
    others = FLAGS.replicate * tensor * context * pipeline  # every axis but "shard"
    if FLAGS.shard != -1 and FLAGS.shard * others != world:
        _fail(
            f"--shard={FLAGS.shard} x --replicate={FLAGS.replicate} x --tensor={tensor} x "
            f"--context={context} x --pipeline={pipeline} must equal the world size {world} "
            "(--nproc or torchrun's WORLD_SIZE)"
        )
    if FLAGS.shard == -1 and world % others:
        _fail(
            f"--replicate={FLAGS.replicate} x --tensor={tensor} x --context={context} x "
            f"--pipeline={pipeline} does not divide the world size {world}"
        )
    if pipeline > 1:
        _check_pipeline(FLAGS.shard if FLAGS.shard != -1 else world // others)
    if context > 1:
        if FLAGS.seq_len % (2 * context):
            _fail(f"--seq_len={FLAGS.seq_len} must be divisible by 2 x --context={context}")
        if FLAGS.context_algorithm == "all_to_all" and FLAGS.n_head % context:
            _fail(f"--n_head={FLAGS.n_head} must be divisible by --context={context} (all_to_all)")
        if tensor > 1 or FLAGS.experts or FLAGS.compile or FLAGS.deterministic:
            _fail("--context with --tensor, --experts, --compile or --deterministic: not yet")
    if FLAGS.n_head % tensor:
        _fail(f"--n_head={FLAGS.n_head} must be divisible by --tensor={tensor} (heads split)")
    dp_world = world // (tensor * context * pipeline)  # a tensor or context group, and the
    try:  # pipeline ranks, share a batch
        given = Config(
            grad_chunks=FLAGS.grad_chunks,
            microbatches=_microbatches(),
            batch_size=FLAGS.batch_size,
        )
        microbatches = microbatches_for(given, dp_world)
    except ValueError as e:
        _fail(str(e))
    if pipeline > 1:
        _check_schedule(microbatches)
    if FLAGS.batch_size % (dp_world * microbatches):
        _fail(
            f"--batch_size={FLAGS.batch_size} must be divisible by the data-parallel size "
            f"{dp_world} x --microbatches={microbatches}"
        )
    if FLAGS.experts and FLAGS.top_k > FLAGS.experts:
        _fail(f"--top_k={FLAGS.top_k} exceeds --experts={FLAGS.experts}")
    if FLAGS.expert > 1 and not FLAGS.experts:
        _fail(f"--expert={FLAGS.expert} splits experts: pass --experts=N (an MoE GPT)")
    if FLAGS.experts % FLAGS.expert:
        _fail(f"--expert={FLAGS.expert} must divide --experts={FLAGS.experts}")
    shard = FLAGS.shard if FLAGS.shard != -1 else world // others
    if shard % FLAGS.expert:
        _fail(f"--expert={FLAGS.expert} must divide the shard size {shard} (carved out of it)")
    if FLAGS.experts and tensor > 1:
        _fail("--experts with --tensor: the tensor plan splits dense MLPs (fc, out) only")
    if FLAGS.d_model % FLAGS.n_head:
        _fail(f"--d_model={FLAGS.d_model} must be divisible by --n_head={FLAGS.n_head}")
    if _use_cuda() and not _under_torchrun() and world > torch.cuda.device_count():
        _fail(
            f"--nproc={world}: NCCL runs one process per GPU and there are "
            f"{torch.cuda.device_count()}"
        )


def _check_pipeline(shard: int) -> None:
    """--pipeline's own checks, before any rank starts: the blocks per stage, and what it
    does not combine with (each refusal says why).

    Under a pipeline every other axis lives inside each pipeline rank (``fs.make_mesh(
    pipeline=, replicate=, shard=, expert=, tensor=)``): --tensor (the blocks' TP plan on
    each stage), --experts / --expert (the MoE blocks, experts split inside a stage),
    --deterministic and --outer_strategy=optim (HFSDP, where --replicate or the shard size
    ``shard`` is 1) run as ``fs.init(stages, ..., pipeline=)`` runs them. Refused: a tied
    head; --context, --compile and --replica_groups, which fs.init does not take under a
    pipeline; HFSDP on replicated and sharded ranks, which fs.init refuses too.
    """
    if FLAGS.tied:
        _fail(
            f"--pipeline={FLAGS.pipeline} with --tied: the output head tied to the token "
            "embedding would be split from it (the first stage holds the embedding, the last "
            "the head); pass --notied (an untied head, its own weights)"
        )
    why = {
        "--context": "the context axis inside a pipeline stage is not built (fs.init refuses "
        "a mesh with a 'context' axis under a pipeline)",
        "--compile": "fs.init(compile=) is refused under a pipeline, and blocks compiled in "
        "place under torch's schedules (each stage run on the meta device and through "
        "torch.func.functional_call) are not tested",
        "--replica_groups": "fs.init(fault_tolerance=) is refused under a pipeline (a "
        "replica group's live recovery of a pipelined state is not built)",
    }
    given = {
        "--context": FLAGS.context > 1,
        "--compile": bool(FLAGS.compile),
        "--replica_groups": FLAGS.replica_groups > 0,
    }
    for flag, on in given.items():
        if on:
            _fail(f"--pipeline={FLAGS.pipeline} with {flag}: not supported, {why[flag]}")
    sharded = shard // FLAGS.expert  # the mesh's "shard" axis (--expert is carved out of it)
    if FLAGS.outer_strategy == "optim" and FLAGS.replicate > 1 and sharded > 1:
        _fail(
            f"--pipeline={FLAGS.pipeline} with --outer_strategy=optim on --replicate="
            f"{FLAGS.replicate} x shard size {sharded}: not supported (HFSDP's master-order "
            "groups come from the whole mesh's grid, which the pipeline axis in front of it "
            "mixes up, where both --replicate and the shard size are above 1; fs.init "
            "refuses it)"
        )
    try:
        model = GPTConfig(n_layer=FLAGS.n_layer)
        split_points(Config(pipeline=FLAGS.pipeline, schedule=FLAGS.schedule, model=model))
    except ValueError as e:
        _fail(str(e))


def _check_schedule(microbatches: int) -> None:
    """The microbatches torch's schedule takes for its stages (its own check, as fs.init's)."""
    stages = pipeline_stages(Config(pipeline=FLAGS.pipeline, schedule=FLAGS.schedule))
    try:
        schedule_order(FLAGS.schedule, FLAGS.pipeline, microbatches, stages // FLAGS.pipeline)
    except ValueError as e:
        _fail(
            f"--pipeline={FLAGS.pipeline} --schedule={FLAGS.schedule} with {microbatches} "
            f"microbatch(es) a step (--microbatches / --grad_chunks): {e}"
        )


def _microbatches() -> int:
    """--microbatches, or under --pipeline when it is not given, as many as stages."""
    if FLAGS.pipeline > 1 and not FLAGS["microbatches"].present and not FLAGS.grad_chunks:
        return pipeline_stages(Config(pipeline=FLAGS.pipeline, schedule=FLAGS.schedule))
    return FLAGS.microbatches


def _from_flags(cls, **given):
    """``cls`` (a dataclass) with each field from the flag of its name, unless given."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in given and f.name in FLAGS]
    return cls(**given, **{n: FLAGS[n].value for n in names})


def _use_cuda() -> bool:
    return FLAGS.device == "cuda" or (FLAGS.device == "auto" and torch.cuda.is_available())


def _param_dtype() -> torch.dtype | None:
    """``--param_dtype``, with ``auto`` resolved on this machine's device; says which and why."""
    given = FLAGS.param_dtype.lower()
    if given != "auto":
        return DTYPES[given]
    native, why = native_bf16_reason("cuda" if _use_cuda() else "cpu")
    dtype = torch.bfloat16 if native else torch.float32
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            f"--param_dtype=auto: {str(dtype).removeprefix('torch.')} compute ({why})", flush=True
        )
    return dtype


def _config() -> Config:
    dtypes = {n: DTYPES[FLAGS[n].value.lower()] for n in ("main_params_dtype", "main_grads_dtype")}
    for n in ("grad_comm_dtype", "param_comm_dtype"):
        dtypes[n] = WIRE_DTYPES[FLAGS[n].value.lower()]
    dtypes["param_dtype"] = _param_dtype()
    return _from_flags(
        Config,
        microbatches=_microbatches(),
        model=_from_flags(GPTConfig),
        policy=fs.MixedPrecisionPolicy(**dtypes),
        mu_dtype=MOMENT_DTYPES[FLAGS.mu_dtype.lower()],
        nu_dtype=MOMENT_DTYPES[FLAGS.nu_dtype.lower()],
    )


def _torchrun_main(cfg: Config) -> None:
    backend = None if cfg.device != "cpu" and torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=FLAGS.collective_timeout) if FLAGS.collective_timeout else None
    fs.init_from_env(backend, timeout=timeout)  # every torchrun round: restarts, nodes lost, back
    try:
        run(cfg, started=STARTED)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else FLAGS.nproc
    _check_world(world)
    cfg = _config()
    if FLAGS.device == "cpu" and not _under_torchrun():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # fs.launch then picks gloo for the ranks
    if _under_torchrun():
        _torchrun_main(cfg)
    else:
        fs.launch(run, cfg, nproc=world)


if __name__ == "__main__":
    app.run(main)
