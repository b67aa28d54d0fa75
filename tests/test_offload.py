"""Optimizer CPU offload: placement, one source of truth, trajectories equal to no offload.

Every strategy x mesh {2, 2x2} x offload fraction {0, 0.3, 0.5, 1}: the trajectory (SGD with
momentum and AdamW, 2 microbatches) equals the one without offload. The offloaded CPU master is
the only master of its bucket; after a model-only load the first step starts from the loaded
weights (the Megatron Bridge #3949 bug, where stale CPU clones overwrote them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.layout.offload_choice import pick_offloaded
from funcshard.state import derive as derive_lib
from funcshard.step import update as offload_lib

import models

STEPS = 3
LOCAL_ROWS = 4
FRACTIONS = (0.0, 0.3, 0.5, 1.0)
OPTIMIZERS = {
    "sgd": lambda: fs.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
}
POLICIES = {
    "fp32": fs.MixedPrecisionPolicy(),
    "bf16": fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "fp16": fs.MixedPrecisionPolicy(param_dtype=torch.float16, loss_scale_init=2.0**8),
}
MESHES = {"2": (2, 1), "2x2": (2, 2)}
# One optimizer per mesh, mixed precision on one mesh: keeps the test short.
CASES = {"2": ("adamw", True), "2x2": ("sgd", False)}
MIXED_STRATEGIES = ("optim_grads", "optim_grads_params")  # gathered full / device shard


def _loss_fn(model, dtype: torch.dtype = torch.float32):
    """Cross entropy in fp32 on the model run in the compute dtype."""

    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"].to(dtype),))
        return torch.nn.functional.cross_entropy(logits.float(), batch["y"])

    return loss_fn


def _batch(step: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    return models.local_batch(models.global_batch(step, LOCAL_ROWS * world), rank, world)


def _run(
    mesh,
    strategy: str,
    opt_name: str,
    policy_name: str,
    fraction: float,
    bad_step: int | None = None,
) -> tuple[dict, list, list]:
    """Trains STEPS steps; returns full params, per-step metrics, and the layout's checks."""
    model = models.make_model(seed=3)
    state = fs.init(
        model,
        OPTIMIZERS[opt_name](),
        mesh=mesh,
        policy=POLICIES[policy_name],
        strategy=strategy,
        offload_fraction=fraction,
    )
    loss_fn = _loss_fn(model, POLICIES[policy_name].param_dtype or torch.float32)
    structure = fs.tree.structure(state)
    problems, history = [], []
    for step in range(STEPS):
        batch = _batch(step)
        if step == bad_step:
            batch = {"x": batch["x"].clone(), "y": batch["y"]}
            batch["x"][0, 0] = float("inf")
        before = {k: v.clone() for k, v in state.params.items()} if step == bad_step else None
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=2)
        history.append((metrics["loss"], metrics["nonfinite"], metrics.get("loss_scale")))
        if fs.tree.structure(state) != structure:
            problems.append(f"step {step}: the state's tree structure changed")
        if before is not None:
            if not metrics["nonfinite"]:
                problems.append(f"step {step}: an inf input gave finite gradients")
            changed = [n for n, p in state.params.items() if not torch.equal(p, before[n])]
            if changed:
                problems.append(f"step {step}: the skipped step changed {changed}")
        problems += _placement_problems(state)
    return fs.full_params(state), history, problems


def _placement_problems(state) -> list[str]:
    """One master per bucket, where its placement says, and compute derived from it."""
    layout, out = state.layout, []
    if len(state.master) != len(layout.buckets):
        out.append(f"{len(state.master)} masters for {len(layout.buckets)} buckets")
    mu = getattr(state.opt_state, "mu", None) or getattr(state.opt_state, "momentum", None)
    for bucket, m, c in zip(layout.buckets, state.master, state.compute, strict=True):
        if m.dtype != bucket.dtypes.master or m.numel() != bucket.numel:
            out.append(f"bucket {bucket.index}: master {m.dtype}[{m.numel()}]")
        if bucket.offload and m.device.type != "cpu":
            out.append(f"bucket {bucket.index}: offloaded master on {m.device}")
        if bucket.offload and mu is not None and mu[bucket.index].device.type != "cpu":
            out.append(f"bucket {bucket.index}: offloaded optimizer state on the device")
        if c is not None and c.dtype != bucket.dtypes.compute:
            out.append(f"bucket {bucket.index}: compute copy in {c.dtype}, a second master?")
    derived = derive_lib.derive_compute(layout, state.master)
    for bucket, c, d in zip(layout.buckets, state.compute, derived, strict=True):
        if (c is None) != (d is None) or (c is not None and not torch.equal(c, d)):
            out.append(f"bucket {bucket.index}: compute copy is not derived from the master")
    return out


def trajectories_worker(shard: int, replicate: int, opt_name: str, mixed: bool) -> dict:
    """fp32 ``opt_name`` at every fraction; with ``mixed`` also bf16 AdamW (blocked step +
    cast) and fp16 SGD (loss scaling, a skipped nonfinite step) at fraction 0.5."""
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    results: dict = {"errors": {}, "problems": [], "placement": {}}
    cases = [(opt_name, "fp32", FRACTIONS, None)]
    if mixed:
        cases += [("adamw", "bf16", (0.0, 0.5), None), ("sgd", "fp16", (0.0, 0.5), 1)]
    for strategy in fs.STRATEGIES:
        for opt_name, policy_name, fractions, bad_step in cases:
            if policy_name != "fp32" and strategy not in MIXED_STRATEGIES:
                continue
            ref = None
            for f in fractions:
                key = f"{strategy}/{opt_name}/{policy_name}/f={f}"
                params, history, problems = _run(mesh, strategy, opt_name, policy_name, f, bad_step)
                results["problems"] += [f"{key}: {p}" for p in problems]
                if ref is None:
                    ref = (params, history)
                    continue
                results["errors"][key] = models.max_rel_err(params, ref[0])
                # Losses agree to rounding: an all-reduce over more than two ranks sums in an
                # order that depends on the position in the (differently bucketed) buffer.
                results["errors"][key + "/loss"] = max(
                    abs(a[0] - b[0]) / abs(b[0]) if b[0] == b[0] else float(a[0] == a[0])
                    for a, b in zip(history, ref[1], strict=True)
                )
                if [h[1:] for h in history] != [h[1:] for h in ref[1]]:
                    results["problems"].append(f"{key}: metrics {history} != {ref[1]}")
    for f in FRACTIONS:
        model = models.make_model(seed=3)
        state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, offload_fraction=f)
        results["placement"][f] = (
            tuple(b.offload for b in state.layout.buckets),
            state.layout.achieved_offload_fraction(),
            max(s.shard_numel for s in state.layout.leaves)
            / sum(b.numel for b in state.layout.buckets),
            fs.describe(state),
        )
    return results


@pytest.mark.parametrize("mesh", list(MESHES))
def test_trajectories_equal_no_offload(request, mesh: str) -> None:
    shard, replicate = MESHES[mesh]
    pool = request.getfixturevalue(f"pool{shard * replicate}")
    opt_name, mixed = CASES[mesh]
    results = pool.run(trajectories_worker, shard, replicate, opt_name, mixed)
    for rank, r in enumerate(results):
        assert not r["problems"], f"rank {rank}: " + "\n".join(r["problems"])
        bad = {k: v for k, v in r["errors"].items() if not v < 1e-6}
        assert not bad, f"rank {rank}: relative error >= 1e-6 against offload_fraction=0: {bad}"
        assert len(r["errors"]) == 2 * (4 * 3 + len(MIXED_STRATEGIES) * 2 * mixed)
        # The split is the same on every rank, close to the request, and reported.
        assert r["placement"] == results[0]["placement"]
        for f, (_, achieved, biggest, text) in r["placement"].items():
            assert abs(achieved - f) <= biggest / 2 + 1e-9, (f, achieved)
            assert f"achieved={achieved:.3f}" in text
        assert not any(r["placement"][0.0][0]) and all(r["placement"][1.0][0])
        assert any(r["placement"][0.5][0]) and not all(r["placement"][0.5][0])


def test_pick_offloaded_is_close_and_deterministic() -> None:
    sizes = [400, 100, 300, 100, 50, 50, 0, 1000]
    for f in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        chosen = pick_offloaded(sizes, f)
        assert chosen == pick_offloaded(list(sizes), f)
        achieved = sum(sizes[i] for i in chosen) / sum(sizes)
        assert abs(achieved - f) <= 25 / sum(sizes) + 1e-12, (f, achieved, chosen)  # 50 / 2


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_blocked_step_and_cast_is_bitwise_the_unblocked_step(opt_name: str) -> None:
    opt = OPTIMIZERS[opt_name]()
    g = torch.Generator().manual_seed(0)
    numel = 1000 + 37  # a ragged last block
    master = torch.randn(numel, generator=g)
    ref_master = master.clone()
    ref_state = opt.init((ref_master,))
    state = opt.init((master,))
    for _ in range(3):
        grad = torch.randn(numel, generator=g)
        _, ref_state = opt.update((grad,), ref_state, (ref_master,), donate=True)
        out = torch.empty(numel, dtype=torch.bfloat16)
        state = offload_lib.step_and_cast(opt, state, master, grad, out, block=128)
        torch.testing.assert_close(master, ref_master, rtol=0, atol=0)
        torch.testing.assert_close(out, ref_master.to(torch.bfloat16), rtol=0, atol=0)
        for a, b in zip(fs.tree.leaves(state), fs.tree.leaves(ref_state), strict=True):
            assert (a == b) if not isinstance(a, torch.Tensor) else torch.equal(a, b)


def test_default_threads_splits_cores_between_local_ranks(monkeypatch) -> None:
    monkeypatch.delenv(offload_lib.THREADS_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cores = offload_lib.default_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert offload_lib.default_threads() == 1
    monkeypatch.setenv(offload_lib.THREADS_ENV, "3")
    assert offload_lib.default_threads() == 3
    before = torch.get_num_threads()
    with offload_lib.offload_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


# --- a model-only load, then a step: the loaded weights are what steps -----------------------
def _zero_loss_fn(model):
    def loss_fn(params, batch):
        x = batch["x"].to(torch.bfloat16)
        return 0.0 * fs.functional_call(model, params, (x,)).float().sum()

    return loss_fn


def _continue(state, model, steps: int) -> dict:
    """A zero-gradient step (must change nothing), then ``steps`` real steps."""
    state, _ = fs.train_step(state, _batch(0), _zero_loss_fn(model))
    after_zero = fs.full_params(state)
    loss_fn = _loss_fn(model, torch.bfloat16)
    for step in range(steps):
        state, _ = fs.train_step(state, _batch(step + 1), loss_fn, microbatches=2)
    return {"after_zero": after_zero, "final": fs.full_params(state)}


def _replace_masters(state, source) -> fs.TrainState:
    """What a model-only restore must do, done by hand: new masters, everything derived."""
    master = tuple(m.clone() for m in source.master)
    return state.replace(
        master=master,
        compute=derive_lib.derive_compute(state.layout, master),
        opt_state=state.optimizer.init(state.layout.per_bucket(master)),
        step=0,
    )


def model_only_load_worker(strategy: str, directory: str | None) -> dict:
    mesh = fs.make_mesh(shard=2, replicate=1, device_type="cpu")
    policy = POLICIES["bf16"]
    opt = fs.optim.adamw(1e-2, weight_decay=0.0)
    model = models.make_model(seed=3)
    other = models.make_model(seed=4)
    # The target: bf16 compute, fp32 masters, half the optimizer on the CPU, random init.
    state = fs.init(model, opt, mesh=mesh, policy=policy, strategy=strategy, offload_fraction=0.5)
    assert any(b.offload for b in state.layout.buckets)
    # The same weights, trained without offload from the start.
    plain = fs.init(other, opt, mesh=mesh, policy=policy, strategy=strategy)
    loaded_weights = fs.full_params(plain)
    if directory is None:
        loaded = _replace_masters(
            state,
            fs.init(other, opt, mesh=mesh, policy=policy, strategy=strategy, offload_fraction=0.5),
        )
    else:
        fs.save(directory, fs.init(other, opt, mesh=mesh, policy=policy, strategy=strategy))
        loaded = fs.restore(directory, like=state, model_only=True)
    errors = {"loaded": models.max_rel_err(fs.full_params(loaded), loaded_weights)}
    ours, theirs = _continue(loaded, model, 2), _continue(plain, model, 2)
    errors["after_zero_step"] = models.max_rel_err(ours["after_zero"], loaded_weights)
    errors["final"] = models.max_rel_err(ours["final"], theirs["final"])
    return errors


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_replaced_masters_are_what_steps(pool2, strategy: str) -> None:
    for errors in pool2.run(model_only_load_worker, strategy, None):
        assert all(v == 0.0 for v in errors.values()), errors


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_model_only_restore_then_step_keeps_loaded_weights(pool2, tmp_path, strategy) -> None:
    directory = str(tmp_path / "other_weights")
    for errors in pool2.run(model_only_load_worker, strategy, directory):
        assert all(v == 0.0 for v in errors.values()), errors


# --- CUDA: the overlapped path ------------------------------------------------------------------
def cuda_worker(fraction: float, strategy: str) -> dict:
    mesh = fs.make_mesh(shard=1, replicate=1, device_type="cuda")
    out = {}
    for f in (0.0, fraction):
        model = models.make_model(seed=3).cuda()
        state = fs.init(
            model,
            fs.optim.adamw(1e-2, weight_decay=0.1),
            mesh=mesh,
            policy=POLICIES["bf16"],
            strategy=strategy,
            offload_fraction=f,
        )
        loss_fn = _loss_fn(model, torch.bfloat16)
        for step in range(STEPS):
            batch = {k: v.cuda() for k, v in _batch(step).items()}
            state, _ = fs.train_step(state, batch, loss_fn, microbatches=2)
        problems = _placement_problems(state)
        pinned = all(
            m.is_pinned()
            for b, m in zip(state.layout.buckets, state.master, strict=True)
            if b.offload
        )
        out[f] = ({k: v.cpu() for k, v in fs.full_params(state).items()}, problems, pinned)
    return {
        "error": models.max_rel_err(out[fraction][0], out[0.0][0]),
        "problems": out[fraction][1],
        "pinned": out[fraction][2],
    }


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_cuda_offload_matches_device_step(strategy: str) -> None:
    [result] = fs.launch(cuda_worker, 0.5, strategy, nproc=1)
    assert not result["problems"], result["problems"]
    assert result["pinned"]
    # Offloaded buckets step with torch's CPU kernel, the others with its CUDA kernel: they may
    # differ by an ulp, which a bf16 rounding of the compute copy can amplify. A stream race
    # (a stale or half-copied bucket) is off by a whole step: lr 1e-2 on weights of ~0.1.
    assert result["error"] < 1e-3, result


def reuse_worker() -> dict:
    """A CPU step with a bf16 compute copy writes the new copy into the consumed one."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    state = fs.init(
        model,
        fs.optim.sgd(0.1),
        mesh=mesh,
        strategy="optim_grads_params",
        policy=policy,
        offload_fraction=1.0,
    )
    before = [c.data_ptr() for c in state.compute if c is not None]
    grads = tuple(torch.randn(b.numel) for b in state.layout.buckets)
    new = fs.offload_step(state, grads)
    after = [c.data_ptr() for c in new.compute if c is not None]
    derived = all(
        torch.equal(c, m.to(c.dtype)) for c, m in zip(new.compute, new.master, strict=True)
    )
    try:
        _ = state.compute
        stale_readable = True
    except fs.ConsumedStateError:
        stale_readable = False
    return {
        "reused": before == after and len(after) > 0,
        "derived": derived,
        "stale_readable": stale_readable,
    }


def test_cpu_step_rewrites_the_consumed_compute_copy(pool2) -> None:
    for r in pool2.run(reuse_worker):
        assert r == {"reused": True, "derived": True, "stale_readable": False}
