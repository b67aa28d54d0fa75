"""Tensor parallel x data parallel: a Llama-like model under torch's own TP plans
(``parallelize_module`` on ``mesh["tensor"]``) trains as the plain model in one process.

Every strategy on (shard 2 x tensor 2) and HSDP (replicate 2 x tensor 2), SGD with momentum
over several microbatches, fp32: TP changes the summation order of the forward and backward
matmuls only, so losses, norms and params agree to a few fp32 roundings per step (<= 1e-5
relative, as the issue asks; measured ~1e-7).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import funcshard as fs

import helpers_errors
import helpers_hf
import helpers_tp as tp
import models
from helpers_compile import counting_backend

STEPS = 2
ROWS = 8  # global batch: 4 per data-parallel rank at dp 2, 2 microbatches of 2
TOL = 1e-5
BATCH_ROWS = 2048  # a realistic global batch of the batch check (x 8 tokens)

# (shard, replicate, tensor)
MESHES = {"S2xT2": (2, 1, 2), "R2xT2": (1, 2, 2), "T4": (1, 1, 4)}


_errors = models.parity_errors


def sgd_worker(strategy: str, mesh_name: str, sequence_parallel: bool, kw: dict) -> dict:
    mesh = tp.world_mesh(*MESHES[mesh_name])
    model = tp.make_model(seed=3)
    ref = tp.reference_run(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), STEPS, ROWS
    )
    tp.parallelize(model, mesh, sequence_parallel=sequence_parallel)
    opt = fs.optim.sgd(0.1, momentum=0.9)
    state = fs.init(model, opt, mesh=mesh, strategy=strategy, **kw)
    state, history = tp.train(state, model, mesh, range(STEPS), rows=ROWS, microbatches=2)
    return _errors(state, history, ref)


@pytest.mark.parametrize(
    "mesh,strategy",
    [("S2xT2", s) for s in fs.STRATEGIES] + [("R2xT2", "optim"), ("R2xT2", "optim_grads_params")],
)
def test_every_strategy_equals_one_plain_process(pool4, strategy: str, mesh: str) -> None:
    for errors in pool4.run(sgd_worker, strategy, mesh, False, {}):
        assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_sequence_parallel_plan_on_four_tensor_ranks(pool4, strategy: str) -> None:
    """torchtitan's plan with SequenceParallel norms (replicated weights whose gradients torch
    leaves partial until it reduces them) and the embedding rowwise, T=4 (uneven rows)."""
    for errors in pool4.run(sgd_worker, strategy, "T4", True, {}):
        assert max(errors.values()) < TOL, errors


def adamw_worker(strategy: str, mesh_name: str, kw: dict) -> dict:
    """clip_by_global_norm + masked AdamW with a schedule: the norm is the full model's."""
    mesh = tp.world_mesh(*MESHES[mesh_name])
    model = tp.make_model(seed=4)

    def torch_opt(m):
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2)

    ref = tp.reference_run(model, torch_opt, STEPS, ROWS, clip=0.5)
    tp.parallelize(model, mesh)
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(0.5),
        fs.optim.adamw(1e-2, weight_decay=0.1, mask=fs.optim.decay_mask),
    )
    state = fs.init(model, opt, mesh=mesh, strategy=strategy, **kw)
    state, history = tp.train(state, model, mesh, range(STEPS), rows=ROWS, microbatches=2)
    return _errors(state, history, ref)


@pytest.mark.parametrize(
    "strategy,mesh,kw",
    [
        ("optim_grads_params", "S2xT2", {}),
        ("optim_grads", "S2xT2", {"offload_fraction": 0.5}),
        ("optim_grads_params", "R2xT2", {"outer_strategy": "optim"}),
    ],
    ids=["zero3", "zero2-offload", "hfsdp"],
)
def test_clip_and_adamw_equal_torch(pool4, strategy: str, mesh: str, kw: dict) -> None:
    """The clipped update depends on the global norm: counting a replicated norm weight once
    per tensor rank, or a split matrix once, would move every parameter."""
    for errors in pool4.run(adamw_worker, strategy, mesh, kw):
        assert max(errors.values()) < TOL, errors


def wire_worker() -> dict:
    """bf16 on both wires: each rank's contribution rounded once (relative 2^-9), summed in
    fp32; after 2 SGD steps the params differ from fp32's by far less than 1e-2. What crosses
    "shard" is half the fp32 run's bytes (gathers and reduce-scatters alike): the wires are
    applied to the local tensor-parallel shards, not skipped."""
    mesh = tp.world_mesh(2, 1, 2)
    model = tp.make_model(seed=3)
    ref = tp.reference_run(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), STEPS, ROWS
    )
    tp.parallelize(model, mesh)
    out, loss_fn = {}, tp.make_loss_fn(model)
    batch = tp.local_batch(tp.global_batch(0, ROWS), mesh)
    for wire in (None, torch.bfloat16):
        policy = fs.MixedPrecisionPolicy(grad_comm_dtype=wire, param_comm_dtype=wire)
        state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, policy=policy)
        with fs.comm_stats() as stats:
            fs.train_step(state, batch, loss_fn, microbatches=2)
        out[str(wire)] = {k: stats.bytes[k] for k in ("all_gather", "reduce_scatter")}
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, policy=policy)
    state, history = tp.train(state, model, mesh, range(STEPS), rows=ROWS, microbatches=2)
    out["errors"] = _errors(state, history, ref)
    return out


def test_low_precision_wires(pool4) -> None:
    for out in pool4.run(wire_worker):
        errors, fp32, bf16 = out["errors"], out["None"], out["torch.bfloat16"]
        assert 0 < errors["params"] < 1e-2, errors
        assert fp32["reduce_scatter"] > 0 and fp32["all_gather"] > 0, fp32
        assert bf16 == {k: v // 2 for k, v in fp32.items()}, (bf16, fp32)


def bits_worker(shard: int, replicate: int, microbatches: int, strategy: str) -> dict:
    # one thread on every layout: the pools' ranks may run other tests' thread counts (a pool
    # restarted after a failure has torch's default), and a matmul's last bits follow them
    torch.set_num_threads(1)
    mesh = tp.world_mesh(shard, replicate, 2)
    model = tp.make_model(seed=5)
    tp.parallelize(model, mesh)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(1e-2))
    state = fs.init(model, opt, mesh=mesh, strategy=strategy, deterministic=True)
    state, history = tp.train(state, model, mesh, range(STEPS), rows=8, microbatches=microbatches)
    metrics = [(m["loss"], m["grad_norm"]) for m in history]
    return {"params": fs.full_params(state), "metrics": metrics}


def test_deterministic_bitwise_across_data_parallel_layouts(pool2, pool4) -> None:
    """The same tensor degree, G = dp * microbatches = 4 chunks: S2xT2, R2xT2 (HSDP) and
    dp 1 x T2 give the same bits, params and metrics."""
    runs = {
        "S2xT2": pool4.run(bits_worker, 2, 1, 2, "optim_grads_params")[0],
        "R2xT2": pool4.run(bits_worker, 1, 2, 2, "optim")[0],
        "T2": pool2.run(bits_worker, 1, 1, 4, "optim_grads")[0],
    }
    first = runs["S2xT2"]
    for name, run in runs.items():
        assert run["metrics"] == first["metrics"], name
        for n, t in first["params"].items():
            assert torch.equal(run["params"][n], t), (name, n)


def dtensor_worker(strategy: str) -> list[str]:
    """What loss_fn and the model see: DTensors where the model had them."""
    mesh = tp.world_mesh(2, 1, 2)
    model = tp.make_model(seed=3)
    tp.parallelize(model, mesh)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy)
    seen = []
    inner = tp.make_loss_fn(model)

    def loss_fn(params, batch):
        q = params["layers.0.attn.q.weight"]
        seen.append(f"{type(q).__name__}{tuple(q.shape)}{getattr(q, 'placements', None)}")
        return inner(params, batch)

    batch = tp.local_batch(tp.global_batch(0, 8), mesh)
    fs.train_step(state, batch, loss_fn)
    return seen


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_loss_fn_gets_dtensors(pool4, strategy: str) -> None:
    for seen in pool4.run(dtensor_worker, strategy):
        assert seen == [f"DTensor({tp.DIM}, {tp.DIM})(Shard(dim=0),)"], seen


def errors_worker() -> dict:
    out = {}
    mesh = tp.world_mesh(2, 1, 2)
    # a DTensor on another mesh than mesh["tensor"]
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("tensor",))
    model = tp.parallelize(tp.make_model(), {"tensor": other})
    out["other_mesh"] = helpers_errors.error_text(
        lambda: fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    )
    # a tensor-parallel model on a mesh without a tensor axis
    flat = fs.make_mesh(shard=4, device_type="cpu")
    model = tp.parallelize(tp.make_model(), mesh)
    out["no_tensor_axis"] = helpers_errors.error_text(
        lambda: fs.init(model, fs.optim.sgd(0.1), mesh=flat)
    )
    # a placement funcshard cannot own: a partial sum
    partial = tp.make_model()
    weight = DTensor.from_local(partial.head.weight.detach(), mesh["tensor"], [Partial()])
    partial.head.weight = torch.nn.Parameter(weight)
    out["partial"] = helpers_errors.error_text(
        lambda: fs.init(partial, fs.optim.sgd(0.1), mesh=mesh)
    )
    # tensor ranks passing different batches: a realistic one split by the global rank (the
    # ranks' losses differ by ~2e-4 relative), then the same rows in another order on tensor
    # rank 1 of the second tensor group only (the same loss to rounding)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    batch = {k: v.chunk(4)[dist.get_rank()] for k, v in tp.global_batch(0, BATCH_ROWS).items()}
    out["batch"] = helpers_errors.error_text(
        lambda: fs.train_step(state, batch, tp.make_loss_fn(model))
    )
    state.check()  # not consumed: the error came before donation
    batch = tp.local_batch(tp.global_batch(0, BATCH_ROWS), mesh)
    if dist.get_rank() == 3:
        batch["y"] = batch["y"].flip(0)
    out["shuffled"] = helpers_errors.error_text(
        lambda: fs.train_step(state, batch, tp.make_loss_fn(model))
    )
    state.check()
    # a batch leaf that is not a tensor: named, before any collective
    out["not_a_tensor"] = helpers_errors.error_text(
        lambda: fs.train_step(state, {**batch, "n": 3}, tp.make_loss_fn(model))
    )
    state.check()
    # the check switched off: the shuffled batch steps (torch TP's rule is the caller's)
    unchecked = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, check_tensor_batch=False)
    out["unchecked"] = helpers_errors.error_text(
        lambda: fs.train_step(unchecked, batch, tp.make_loss_fn(model))
    )
    return out


def test_bad_input_is_named(pool4) -> None:
    outs = pool4.run(errors_worker)
    for out in outs:
        assert "ValueError" in out["other_mesh"] and "'layers.0.attn.q.weight'" in out["other_mesh"]
        assert "mesh['tensor']" in out["other_mesh"], out["other_mesh"]
        assert "no tensor axis" in out["no_tensor_axis"], out["no_tensor_axis"]
        assert "different batches" in out["batch"], out["batch"]
        assert "'x'" in out["batch"] and "'y'" in out["batch"], out["batch"]
        assert "same local batch" in out["shuffled"], out["shuffled"]
        assert "'head.weight'" in out["partial"] and "Partial" in out["partial"], out["partial"]
        assert out["not_a_tensor"] == (
            "TypeError: batch leaf 'n': expected a tensor with a batch dim, got 3"
        ), out["not_a_tensor"]
        assert out["unchecked"] is None, out["unchecked"]
    # the group that passed the same batch raises too; only the other one names leaf and ranks
    for out in outs[2:]:
        assert "different batches" in out["shuffled"] and "'y' on ranks [3]" in out["shuffled"]
        assert "'x'" not in out["shuffled"], out["shuffled"]
    for out in outs[:2]:
        assert "another tensor group" in out["shuffled"], out["shuffled"]


def loss_parallel_worker(strategy: str) -> dict:
    """torchtitan's loss parallelism: the head colwise with ``use_local_output=False`` hands
    back logits sharded on the vocabulary (a DTensor), cross-entropy runs on the shards under
    ``loss_parallel`` and the loss is a DTensor; the step runs inside the context (its
    backward must, torch's rule) and trains as the plain model in one process. A loss_fn that
    leaves the context before funcshard's backward is told so."""
    mesh = tp.world_mesh(2, 1, 2)
    model = tp.make_model(seed=3)
    ref = tp.reference_run(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), STEPS, ROWS
    )
    for layer in model.layers:
        parallelize_module(layer, mesh["tensor"], tp.LAYER_PLAN)
    parallelize_module(model, mesh["tensor"], {"head": ColwiseParallel(use_local_output=False)})
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)

    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    history = []
    with loss_parallel():
        for step in range(STEPS):
            batch = tp.local_batch(tp.global_batch(step, ROWS), mesh)
            state, metrics = fs.train_step(state, batch, loss_fn, microbatches=2)
            history.append(metrics)
    out = _errors(state, history, ref)

    def inside(params, batch):
        with loss_parallel():
            return loss_fn(params, batch)

    batch = tp.local_batch(tp.global_batch(0, ROWS), mesh)
    out["inside"] = helpers_errors.error_text(lambda: fs.train_step(state, batch, inside))
    state.check()  # not consumed
    return out


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_loss_parallel_dtensor_loss(pool4, strategy: str) -> None:
    for out in pool4.run(loss_parallel_worker, strategy):
        inside = out.pop("inside")
        assert max(out.values()) < TOL, out
        assert "ValueError" in inside and "with loss_parallel():" in inside, inside


HF_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def hf_worker(strategy: str) -> dict:
    """Hugging Face's LlamaForCausalLM (tiny config, 4 heads and 2 key-value heads: one per
    tensor rank) under a torchtitan-style plan, against the plain HF model in one process."""
    mesh = tp.world_mesh(2, 1, 2)
    model = helpers_hf.make_hf("llama", seed=2).train()
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, helpers_hf.VOCAB, (STEPS, 8, 7), generator=g)

    def loss_of(logits, tokens):
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )

    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(STEPS):
        loss = loss_of(plain(input_ids=ids[step]).logits, ids[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        plan = {k: styles[v]() for k, v in HF_PLAN.items()}
        parallelize_module(layer, mesh["tensor"], plan)
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)
    index, size = tp.dp_coords(mesh)

    def loss_fn(params, tokens):
        return loss_of(fs.functional_call(model, params, (), {"input_ids": tokens}).logits, tokens)

    losses = []
    for step in range(STEPS):
        state, metrics = fs.train_step(state, ids[step].chunk(size)[index], loss_fn, microbatches=2)
        losses.append(metrics["loss"])
    full = fs.full_params(state)
    ref = dict(plain.named_parameters())
    rel = lambda a, b: float((a - b).norm() / (b.norm() + 1e-12))
    return {
        "params": max(rel(full[n], ref[n].detach()) for n in ref),
        "loss": max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)),
    }


@pytest.mark.parametrize("strategy", ["optim_grads_params"])
def test_hugging_face_llama_under_a_tensor_parallel_plan(pool4, strategy: str) -> None:
    for errors in pool4.run(hf_worker, strategy):
        assert max(errors.values()) < TOL, errors


# per rank process (the session pool's), strategy: compiled_worker's eager run, the same for
# both ways of compiling (a run of STEPS steps on 4 ranks computed once)
_EAGER_RUNS: dict = {}


def compiled_worker(strategy: str, by_funcshard: bool) -> dict:
    """Blocks compiled in place (``layer.compile()``, torchtitan's way), or by funcshard
    (``fs.init(compile=...)``), on the tensor-parallel model: the eager run's losses and params
    (aot_eager keeps eager's kernels), and what the counting backend compiled after each step
    with dynamo's frames and graph breaks."""
    mesh = tp.world_mesh(2, 1, 2)
    runs, counts, collectives = {}, collections.Counter(), collections.Counter()
    for compiled in (False, True):
        if not compiled and strategy in _EAGER_RUNS:  # the other parametrization's, the same
            runs[compiled] = _EAGER_RUNS[strategy]
            continue
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = tp.parallelize(tp.make_model(seed=3), mesh)
        if compiled and not by_funcshard:
            for layer in model.layers:
                layer.compile(backend=counting_backend(counts))
        backend = counting_backend(counts, collectives) if compiled and by_funcshard else False
        opt = fs.optim.sgd(0.1, momentum=0.9)
        state = fs.init(model, opt, mesh=mesh, strategy=strategy, compile=backend)
        per_step, losses = [], []
        with fs.comm_stats() as stats:
            for step in range(STEPS):
                state, [metrics] = tp.train(state, model, mesh, [step], rows=8, microbatches=2)
                per_step.append(dict(counts))
                losses.append(metrics["loss"])
        runs[compiled] = (fs.full_params(state), losses, (dict(stats.bytes), dict(stats.calls)))
        if not compiled:
            _EAGER_RUNS[strategy] = runs[compiled]
    (eager, eager_losses, eager_comm), (comp, comp_losses, comp_comm) = runs[False], runs[True]
    rel = lambda a, b: float((a - b).norm() / (b.norm() + 1e-12))
    counters = torch._dynamo.utils.counters
    return {
        "params": max(rel(comp[n], eager[n]) for n in eager),
        "loss": max(abs(a - b) / b for a, b in zip(comp_losses, eager_losses, strict=True)),
        "per_step": per_step,
        "frames": dict(counters["frames"]),
        "graph_breaks": dict(counters["graph_break"]),
        "collectives": {k: n for k, n in collectives.items() if n},
        "comm": (eager_comm, comp_comm),
    }


@pytest.mark.parametrize("by_funcshard", [False, True], ids=["block.compile", "compile="])
def test_compiled_blocks_on_the_3d_mesh(pool4, by_funcshard: bool) -> None:
    """The compiled run matches eager, and the blocks did run compiled: every graph built in
    the first step (the user's compile: a forward and a backward graph per layer; funcshard's:
    one call for all units, identical layers sharing one graph), none rebuilt after it, no
    graph break, every frame dynamo met compiled."""
    graphs = 1 if by_funcshard else len(tp.make_model().layers)
    for out in pool4.run(compiled_worker, "optim_grads_params", by_funcshard):
        assert max(out["params"], out["loss"]) < TOL, out
        first, *later = out["per_step"]
        assert first == {"forward": graphs, "backward": graphs}, out["per_step"]
        assert all(counts == first for counts in later), out["per_step"]
        assert out["graph_breaks"] == {}, out["graph_breaks"]
        assert out["frames"]["total"] == out["frames"]["ok"] == graphs, out["frames"]
        if by_funcshard:  # the captured step: the DTensor params gathered inside the graphs
            found = out["collectives"]
            assert found[("forward", "all_gather_sections")] > 0, found  # the buckets', in place
            assert found[("backward", "all_gather_sections")] > 0, found
            assert found[("backward", "reduce_scatter_sections")] > 0, found  # gloo: by sends
            assert found.get(("forward", "saved_gathered"), 0) == 0, found
            eager_comm, comp_comm = out["comm"]
            assert comp_comm == eager_comm, out["comm"]  # bytes and calls per kind


def test_chunk_sizes_are_torchs_shard_placement() -> None:
    """funcshard places a shard (the plan's shapes, the checkpoint's offsets) by
    ``chunk_sizes``; torch's Shard places by ``torch.chunk``: they must agree, uneven too."""
    from funcshard.parallel.tensor import chunk_sizes

    for n in range(40):
        for size in (1, 2, 3, 4, 5, 8):
            pieces = [c.shape[0] for c in torch.arange(n).chunk(size)]
            assert chunk_sizes(n, size) == tuple(pieces + [0] * (size - len(pieces))), (n, size)


# --- 8-bit moments on rowwise weights -------------------------------------------------------

BETAS, EPS, LR8 = (0.9, 0.999), 1e-8, 1e-3
# One requantization of a value in a block of absmax A: int8 stores u = sqrt(x / A) to
# 0.5 / 127, so x = A u^2 moves by at most A (2u + 0.5/127) 0.5/127 <= A (1/127 + 1/(4 127^2));
# uint8 stores u = (x / A)^(1/4) to 0.5 / 255: at most A 4 (1 + 0.5/255)^3 0.5/255. A block lies
# inside its row, so A <= the row's absmax; a 1e-5 relative slack covers the fp32 roundings of
# the codec (a few ulps) and of the gradients (another summation order, ~1e-6).
MU_BOUND = 1 / 127 + 1 / (4 * 127**2)
NU_BOUND = 4 * (1 + 0.5 / 255) ** 3 * 0.5 / 255


def adam8():
    return fs.optim.adamw(LR8, BETAS, EPS, mu_dtype=torch.int8, nu_dtype=torch.uint8)


def _moments_of(state) -> dict:
    """This rank's rows of every 8-bit moment, decoded: ``(field, name) -> (global rows,
    global columns along dim 1 or None, fp32 values)``."""
    from funcshard.optim.moments import MomentFormat, decode_flat

    layout, by = state.layout, state.opt_state_by_name()
    out = {}
    for field in ("mu", "nu"):
        blocks = getattr(state.opt_state, field + "_scale").blocks
        for name, values in getattr(by, field).items():
            spec = layout.leaf(name)
            if blocks[spec.bucket] is None:
                continue
            fmt = MomentFormat(values.dtype, blocks[spec.bucket])
            got = decode_flat(fmt, values, getattr(by, field + "_scale")[name].reshape(-1))
            start, stop = spec.row_range(layout.shard_rank)
            cols = None
            if layout.tensor.sharded(name):
                d, lo, hi = layout.tensor.span(name)
                start, stop, cols = (
                    (start + lo, stop + lo, None) if d == 0 else (start, stop, (lo, hi))
                )
            out[(field, name)] = (start, stop, cols, got.cpu())
    return out


def moments8_worker(shard: int, tensor: int) -> dict:
    mesh = tp.world_mesh(shard, 1, tensor)
    model = tp.parallelize_wide(tp.make_wide(3), mesh)
    state = fs.init(model, adam8(), mesh=mesh, strategy="optim_grads_params")
    state, _ = tp.train(state, model, mesh, range(1), rows=ROWS)
    return _moments_of(state)


def _torch_adam_moments() -> dict:
    """torch's fp32 Adam moments of the plain model after the same step."""
    model = tp.make_wide(3)
    opt = torch.optim.Adam(model.parameters(), lr=LR8, betas=BETAS, eps=EPS)
    batch = tp.global_batch(0, ROWS)
    logits = model(batch["x"])
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, tp.VOCAB), batch["y"].reshape(-1)
    ).backward()
    opt.step()
    state = {n: opt.state[p] for n, p in model.named_parameters()}
    return {
        **{("mu", n): s["exp_avg"] for n, s in state.items()},
        **{("nu", n): s["exp_avg_sq"] for n, s in state.items()},
    }


@pytest.mark.parametrize("layout", [(2, 2), (1, 4)], ids=["S2xT2", "T4"])
def test_8bit_moments_of_rowwise_weights_are_the_plain_models(pool4, layout) -> None:
    """Every element of a stored 8-bit moment is within one quantization of torch's fp32
    moment, the bound taken from its own row of the FULL matrix: a block never crosses a row
    of the global weight, whatever the tensor degree (rows alternate 1x / 8x in magnitude, so
    a block across two rows codes the small one 8 times too coarsely)."""
    ref = _torch_adam_moments()
    seen = set()
    for got in pool4.run(moments8_worker, *layout):
        for (field, name), (start, stop, cols, values) in got.items():
            want = ref[(field, name)][start:stop]
            rowmax = want.abs().amax(dim=1, keepdim=True)  # over the global row
            if cols is not None:
                want = want[:, cols[0] : cols[1]]
            bound = rowmax * (MU_BOUND if field == "mu" else NU_BOUND) * (1 + 1e-5) + 1e-30
            excess = float(((values - want).abs() - bound).amax())
            assert excess <= 0, f"{field} {name} rows [{start}, {stop}): over by {excess}"
            seen.add(name)
    assert seen == {"up.weight", "down.weight", "gate.weight", "odd.weight"}, seen


def test_batch_fingerprint_sees_every_byte() -> None:
    """The batch check's fingerprint: equal for the same bytes however they are held (a
    strided view, another device's copy), different for one element changed by one unit, two
    rows swapped, the same bytes as another dtype or shape; every element size has a word."""
    from funcshard.parallel.batch import batch_fingerprint

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50_000, (2048, 8), generator=g)
    base = batch_fingerprint({"x": x}, cpu)[1]
    strided = torch.empty(2048, 16, dtype=x.dtype)[:, ::2]
    strided.copy_(x)
    assert torch.equal(batch_fingerprint({"x": strided}, cpu)[1], base)
    bumped, swapped = x.clone(), x.clone()
    bumped[1000, 3] += 1
    swapped[[7, 9]] = x[[9, 7]]
    for other in (bumped, swapped, x.view(torch.float64), x.reshape(1024, 16)):
        assert not torch.equal(batch_fingerprint({"x": other}, cpu)[1], base)
    leaves = {
        "bool": torch.rand(5, 3, generator=g) > 0.5,
        "bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "complex": torch.randn(5, 3, dtype=torch.complex128, generator=g),
    }
    paths, prints = batch_fingerprint(leaves, cpu)
    assert paths == ("bf16", "bool", "complex") and prints.shape == (3, 3), (paths, prints)


def test_batch_fingerprint_reads_bytes_without_widening() -> None:
    """A uint8 batch is read as int64 words of its own bytes, a chunk of weights at a time: no
    int64 copy of every element (a 4.6 MiB batch used to take +110 MiB, 21x a clone's time).
    Every single byte changed is seen, in the tail past the last whole word and past the
    first chunk too, and an unaligned view fingerprints as its aligned copy."""
    from funcshard.parallel.batch import _CHUNK, batch_fingerprint
    from funcshard.testing import PeakMemory

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    small = torch.randint(0, 256, (5, 7), dtype=torch.uint8, generator=g)  # 35 bytes
    base = batch_fingerprint({"x": small}, cpu)[1]
    for i in range(small.numel()):
        bumped = small.clone()
        bumped.view(-1)[i] += 1
        assert not torch.equal(batch_fingerprint({"x": bumped}, cpu)[1], base), i
    buf = torch.randint(0, 256, (36,), dtype=torch.uint8, generator=g)
    buf[1:].view(5, 7).copy_(small)
    assert torch.equal(batch_fingerprint({"x": buf[1:].view(5, 7)}, cpu)[1], base)
    big = torch.randint(0, 256, (4800, 1000), dtype=torch.uint8, generator=g)  # 4.6 MiB
    assert big.numel() > 8 * _CHUNK  # more than one chunk
    base = batch_fingerprint({"x": big}, cpu)[1]
    late = big.clone()
    late.view(-1)[8 * _CHUNK + 5] -= 1
    assert not torch.equal(batch_fingerprint({"x": late}, cpu)[1], base)
    with PeakMemory() as peak:  # in-process: blocks over 32 MiB are always fresh mappings
        batch_fingerprint({"x": big}, cpu)
    assert peak.extra < 8 * 2**20, f"{peak.extra / 2**20:.1f} MiB for a 4.6 MiB uint8 batch"
