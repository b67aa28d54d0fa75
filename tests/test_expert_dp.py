"""The expert axis inside the data-parallel engine: a mixture-of-experts model whose experts are
``Shard(0)`` DTensors on ``mesh["expert"]`` (``fs.make_mesh(..., expert=E)``) trains as the
plain model in one process on the concatenated global batch.

fp32, SGD with momentum, 2 microbatches, top-1 routing with uneven tokens per expert: every
strategy on (S4, E2), (S4, E4) and (R2, S2, E2) within 1e-5 (params, losses, grad norms). An
expert's gradient averaged over every data-parallel rank (a divide by R x S / E would be off
by E), the norm counting each expert once, checkpoints global across E and into the plain
model, the all-to-all counted on "expert", and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import funcshard as fs
from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed.dims import MeshDims
from funcshard.planner.experts import Routing

import helpers_experts as moe
import models
from helpers_errors import error_text

STEPS = 2
ROWS = 16  # 4 a rank, 2 microbatches of 2
TOL = 1e-5

# (shard, replicate, expert) on 4 ranks
MESHES = {"S4E2": (4, 1, 2), "S4E4": (4, 1, 4), "R2S2E2": (2, 2, 2)}


_errors = models.parity_errors


def _ep_state(mesh_name: str, strategy: str, seed: int = 3, **kw):
    shard, replicate, expert = MESHES[mesh_name]
    mesh = fs.make_mesh(shard=shard, replicate=replicate, expert=expert, device_type="cpu")
    model = moe.make_model(seed)
    plain = moe.make_model(seed)
    moe.place_experts(model, mesh["expert"])
    opt = fs.optim.sgd(0.1, momentum=0.9)
    return fs.init(model, opt, mesh=mesh, strategy=strategy, **kw), model, plain, mesh


def sgd_worker(mesh_name: str, strategy: str, kw: dict) -> dict:
    state, model, plain, _ = _ep_state(mesh_name, strategy, **kw)
    ref = moe.reference_run(plain, STEPS, ROWS)
    state, history = moe.train(state, model, range(STEPS), rows=ROWS)
    return _errors(state, history, ref)


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_strategy_equals_one_plain_process(pool4, mesh: str, strategy: str) -> None:
    for errors in pool4.run(sgd_worker, mesh, strategy, {}):
        assert max(errors.values()) < TOL, errors


COMPOSED = [
    ("R2S2E2", "optim_grads_params", {"outer_strategy": "optim"}),
    ("R2S2E2", "optim", {"outer_strategy": "optim"}),
    ("S4E2", "optim_grads_params", {"offload_fraction": 0.5}),
    ("R2S2E2", "optim_grads", {"offload_fraction": 1.0}),
]


@pytest.mark.parametrize("case", COMPOSED, ids=str)
def test_hfsdp_and_offload_equal_one_plain_process(pool4, case) -> None:
    for errors in pool4.run(sgd_worker, *case):
        assert max(errors.values()) < TOL, errors


def routing_worker() -> tuple:
    mesh = fs.make_mesh(shard=4, expert=2, device_type="cpu")
    model = moe.place_experts(moe.make_model(3), mesh["expert"])
    plain = moe.make_model(3)
    x = moe.global_batch(0, ROWS)["x"]
    idx = torch.softmax(plain.router(torch.tanh(plain.embed(x))), -1).argmax(-1)
    local = tuple(model.experts.w1.to_local().shape)
    return local, torch.bincount(idx, minlength=moe.EXPERTS).tolist()


def test_routing_is_uneven_and_experts_are_sharded(pool4) -> None:
    """What the parity above stands on: the batch leaves the experts uneven loads, and each
    expert rank holds only its experts in the forward."""
    for local, counts in pool4.run(routing_worker):
        assert local == (moe.EXPERTS // 2, moe.DIM, moe.HIDDEN)
        assert len(set(counts)) > 1, counts


def mesh_worker(shard: int, replicate: int, expert: int) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, expert=expert, device_type="cpu")
    dp = mesh_lib.data_parallel(mesh)
    ranks = dist.get_process_group_ranks
    return {
        "names": mesh.mesh_dim_names,
        "expert": ranks(mesh["expert"].get_group()),
        "shard": ranks(mesh_lib.axis_group(dp, "shard")),
        "replicate": ranks(mesh_lib.axis_group(dp, "replicate")),
        "dp": tuple(dp.shape),
        "again": fs.make_mesh(shard=shard, replicate=replicate, expert=expert, device_type="cpu")
        is mesh,
    }


@pytest.mark.parametrize("shard, replicate, expert", [(4, 1, 2), (4, 1, 4), (2, 2, 2)])
def test_the_expert_axis_is_innermost_within_shard(pool4, shard, replicate, expert) -> None:
    for rank, r in enumerate(pool4.run(mesh_worker, shard, replicate, expert)):
        assert r["names"] == ("replicate", "shard_outer", "expert")
        first = rank - rank % expert  # shard rank s = s_outer * E + e: E consecutive ranks
        assert r["expert"] == list(range(first, first + expert))
        first = rank - rank % shard
        assert r["shard"] == list(range(first, first + shard))
        assert r["replicate"] == list(range(rank % shard, 4, shard))
        assert r["dp"] == (replicate, shard) and r["again"]


def test_expert_one_is_the_mesh_without_it(pool4) -> None:
    for r in pool4.run(axes_worker):
        assert r == (("replicate", "shard"), (1, 4))


def axes_worker() -> tuple:
    mesh = fs.make_mesh(shard=4, expert=1, device_type="cpu")
    return mesh.mesh_dim_names, tuple(mesh.shape)


def test_mesh_dims_refuse_an_expert_degree_that_does_not_divide_shard() -> None:
    with pytest.raises(ValueError, match=r"expert=3 must be >= 1 and divide shard=4"):
        MeshDims.resolve(4, shard=4, expert=3, who="make_mesh")
    with pytest.raises(ValueError, match="expert=0"):
        MeshDims.resolve(4, expert=0)
    with pytest.raises(ValueError, match="expert=2 must divide shard=3"):
        MeshDims(1, 3, 1, 2)
    dims = MeshDims.resolve(8, shard=4, replicate=2, expert=2)
    assert dims.shape == (2, 2, 2) and dims.expert_dp_size == 4 and dims.dp_size == 8


def _state_on(mesh_name: str | None, seed: int):
    """A fresh state of the MoE on ``mesh_name``, or of the plain model on shard 4."""
    if mesh_name is not None:
        return _ep_state(mesh_name, "optim_grads_params", seed=seed)[:2]
    model = moe.make_model(seed)
    mesh = fs.make_mesh(shard=4, device_type="cpu")
    opt = fs.optim.sgd(0.1, momentum=0.9)
    return fs.init(model, opt, mesh=mesh, strategy="optim_grads_params"), model


def checkpoint_worker(root: str) -> dict:
    state, model = _state_on("S4E2", seed=3)
    state, _ = moe.train(state, model, range(1), rows=ROWS)
    saved = fs.full_params(state)
    fs.save(f"{root}/e2", state)
    state, _ = moe.train(state, model, range(1, 2), rows=ROWS)
    on = {"E2": fs.full_params(state)}
    restored, after = {}, {}
    for name, mesh_name in (("E4", "S4E4"), ("plain", None), ("R2S2E2", "R2S2E2")):
        fresh, model = _state_on(mesh_name, seed=11)
        fresh = fs.restore(f"{root}/e2", like=fresh)
        restored[name] = fs.full_params(fresh)
        fresh, _ = moe.train(fresh, model, range(1, 2), rows=ROWS)
        after[name] = fs.full_params(fresh)
        if name == "plain":  # and back from the plain model onto E4
            fs.save(f"{root}/plain", fresh)
            back, model = _state_on("S4E4", seed=12)
            after["plain->E4"] = fs.full_params(fs.restore(f"{root}/plain", like=back))
    rel = lambda a, b: max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b)
    return {
        "restored_bitwise": all(
            torch.equal(r[n], saved[n]) for r in restored.values() for n in saved
        ),
        "shapes": {n: tuple(t.shape) for n, t in restored["E4"].items()},
        "trains_on": max(rel(after[k], on["E2"]) for k in ("E4", "plain", "R2S2E2")),
        "plain_back_bitwise": all(
            torch.equal(after["plain->E4"][n], after["plain"][n]) for n in saved
        ),
    }


def test_checkpoints_are_global_and_restore_onto_any_expert_degree(pool4, tmp_path) -> None:
    """E2 -> E4, -> the plain model (and back onto E4), -> R2 x S2 x E2: the restored params
    are the saved ones bit for bit, experts as (num_experts, ...), and each trains on as the
    run that never stopped (momentum restored; the sums' order differs across E)."""
    for r in pool4.run(checkpoint_worker, str(tmp_path)):
        assert r["restored_bitwise"] and r["plain_back_bitwise"], r
        assert r["shapes"]["experts.w1"] == (moe.EXPERTS, moe.DIM, moe.HIDDEN)
        assert r["trains_on"] < 1e-6, r


def _init(model, mesh):
    return fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy="optim_grads_params")


def bad_input_worker() -> dict:
    mesh = fs.make_mesh(shard=4, expert=2, device_type="cpu")
    other = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "expert"))  # other pairs
    errors = {"E3": error_text(lambda: fs.make_mesh(shard=4, expert=3, device_type="cpu"))}
    model = moe.place_experts(moe.make_model(), other["expert"])
    errors["other_mesh"] = error_text(lambda: _init(model, mesh))
    model = moe.place_experts(moe.make_model(), mesh["expert"])
    errors["no_expert_axis"] = error_text(lambda: _init(model, fs.make_mesh(device_type="cpu")))
    model = moe.make_model()
    w = torch.randn(3, moe.DIM, moe.HIDDEN)  # 3 experts on 2 expert ranks
    model.experts.w1 = nn.Parameter(distribute_tensor(w, mesh["expert"], [Shard(0)]))
    errors["uneven_experts"] = error_text(lambda: _init(model, mesh))
    model = moe.make_model()
    w = model.experts.w1.data
    model.experts.w1 = nn.Parameter(distribute_tensor(w, mesh["expert"], [Replicate()]))
    errors["replicated"] = error_text(lambda: _init(model, mesh))
    return errors


def test_bad_input_is_named(pool4) -> None:
    errors = pool4.run(bad_input_worker)[0]
    assert (
        "ValueError" in errors["E3"]
        and "expert=3 must be >= 1 and divide shard=4" in (errors["E3"])
    )
    for key in ("other_mesh", "no_expert_axis"):
        assert errors[key].startswith("ValueError: parameter 'experts.w1'"), errors[key]
        assert "expected experts on mesh['expert']" in errors[key], errors[key]
    assert (
        "expert=2 must divide the number of experts (dim 0 of (3, 8, 12))"
        in (errors["uneven_experts"])
    )
    assert "experts stacked on dim 0 as Shard(0)" in errors["replicated"], errors["replicated"]


def bytes_worker(mesh_name: str, strategy: str, kw: dict) -> dict:
    shard, replicate, expert = MESHES[mesh_name]
    state, model, _, _ = _ep_state(mesh_name, strategy, **kw)
    p = fs.plan(
        model,
        world_size=4,
        shard=shard,
        replicate=replicate,
        expert=expert,
        routing=Routing(rows=ROWS // 4, width=moe.DIM),
        strategy=strategy,
        optimizer=fs.optim.sgd(0.1, momentum=0.9),
        microbatches=2,
        device_type="cpu",
        **kw,
    )
    with fs.comm_stats() as stats:
        state, _ = moe.train(state, model, range(1), rows=ROWS)
    return {"plan": p, "by_axis": dict(stats.bytes_by_axis), "bytes": dict(stats.bytes)}


BYTES_CASES = [("S4E2", s, {}) for s in fs.STRATEGIES] + [
    ("S4E4", "optim_grads_params", {}),
    ("R2S2E2", "optim_grads_params", {}),
    ("R2S2E2", "optim_grads_params", {"outer_strategy": "optim"}),
    ("S4E2", "optim_grads_params", {"deterministic": True}),
    ("S4E2", "no_shard", {"deterministic": True}),
    ("R2S2E2", "optim", {"deterministic": True, "outer_strategy": "optim"}),
]


@pytest.mark.parametrize("case", BYTES_CASES, ids=str)
def test_bytes_equal_the_plan(pool4, case) -> None:
    """Per axis, every data-parallel collective as ``fs.plan(..., expert=E)`` predicts it (the
    experts' gathers and reductions on "shard" / "replicate"); the all-to-all's bytes on
    "expert", whose per-rank share follows the routing, summed over the ranks as the plan's
    balanced routing sums them."""
    results = pool4.run(bytes_worker, *case)
    p = results[0]["plan"]
    measured = {a: max(r["by_axis"].get(a, 0) for r in results) for a in p.comm_by_axis}
    measured["expert"] = sum(r["by_axis"].get("expert", 0) for r in results) // 4
    assert measured == p.comm_by_axis, (measured, p.comm_by_axis)
    assert p.comm["all_to_all"] == 4 * (ROWS // 4) * moe.DIM * 4 > 0
    total = sum(r["bytes"].get("all_to_all", 0) for r in results)
    assert total == 4 * p.comm["all_to_all"]


def held_grads_worker(mesh_name: str, strategy: str) -> dict:
    """The gradients held at the end of each microbatch's backward (before the expert
    buckets' reductions start): the accumulator's reduced shards and the expert buckets'
    unreduced sections, beside ``fs.plan``'s ``memory.grads``."""
    from funcshard.step.units import reducer

    shard, replicate, expert = MESHES[mesh_name]
    state, model, _, _ = _ep_state(mesh_name, strategy)
    held = []
    drain = reducer.ExpertsAfter.drain

    def measured_drain(self) -> None:
        tensors = [*self._sections.acc, *self.reducing.acc]
        held.append(sum(t.numel() * t.element_size() for t in tensors if t is not None))
        drain(self)

    reducer.ExpertsAfter.drain = measured_drain
    try:
        moe.train(state, model, range(1), rows=ROWS)
    finally:
        reducer.ExpertsAfter.drain = drain
    p = fs.plan(
        model,
        world_size=4,
        shard=shard,
        replicate=replicate,
        expert=expert,
        strategy=strategy,
        optimizer=fs.optim.sgd(0.1, momentum=0.9),
        microbatches=2,
        device_type="cpu",
    )
    return {"held": held, "planned": p.memory.grads}


@pytest.mark.parametrize("mesh", ["S4E2", "R2S2E2"])
def test_the_plan_counts_the_expert_sections_held_to_the_end_of_backward(pool4, mesh) -> None:
    """Under ZeRO-2/3 an expert bucket's unreduced sections (S / E times its shard) wait for
    the end of backward beside the accumulator: ``fs.plan``'s ``memory.grads`` is the most
    a rank holds then (the last microbatch of a rank whose experts got tokens; one whose
    experts got none holds no sections until it reduces zeros)."""
    results = pool4.run(held_grads_worker, mesh, "optim_grads_params")
    planned = results[0]["planned"]
    assert max(max(r["held"]) for r in results) == planned, results
    assert all(len(r["held"]) == 2 and max(r["held"]) <= planned for r in results), results


def traffic_worker(mesh_name: str, strategy: str, kw: dict) -> dict:
    state, model, _, _ = _ep_state(mesh_name, strategy, **kw)
    expert_rows = {n: tuple(state.params[n].shape) for n in ("experts.w1", "experts.w2")}
    with fs.comm_stats() as stats:
        state, _ = moe.train(state, model, range(1), rows=ROWS)
    return {"by_axis": dict(stats.bytes_by_axis), "rows": expert_rows}


def _planned(params, strategy: str, kw: dict):
    sgd = fs.optim.sgd(0.1, momentum=0.9)
    return fs.plan(
        params, world_size=4, shard=4, strategy=strategy, optimizer=sgd, microbatches=2, **kw
    )


TRAFFIC_CASES = [
    ("S4E2", "optim_grads_params", {}),
    ("S4E4", "optim_grads_params", {}),
    ("S4E2", "optim_grads", {}),
]


@pytest.mark.parametrize("case", TRAFFIC_CASES, ids=str)
def test_expert_traffic_is_divided_by_the_expert_degree(pool4, case) -> None:
    """The experts' own gathers and reductions over "shard" move 1/E of what the same model
    moves without expert parallelism (measured; nothing when S = E), the dense part unchanged
    (planned for the dense parameters alone); each rank holds 1/S of every expert's master
    rows, as without."""
    mesh_name, strategy, kw = case
    expert = MESHES[mesh_name][2]
    results = pool4.run(traffic_worker, *case)
    measured = max(r["by_axis"].get("shard", 0) for r in results)
    plain = moe.make_model(3)
    dense = {n: tuple(p.shape) for n, p in plain.named_parameters() if not n.startswith("experts")}
    whole = _planned(plain, strategy, kw).comm_by_axis["shard"]
    dense_part = _planned(dense, strategy, kw).comm_by_axis["shard"]
    experts_part = whole - dense_part
    assert experts_part > 0 and experts_part % expert == 0, (whole, dense_part)
    # S / E = 1 (S4E4): each rank holds its experts whole, and nothing moves for them
    expected = experts_part // expert if MESHES[mesh_name][0] > expert else 0
    assert measured - dense_part == expected, (measured, whole, dense_part)
    for r in results:  # 4 experts over S=4 shard ranks: one expert's rows each
        assert r["rows"] == {
            "experts.w1": (1, moe.DIM, moe.HIDDEN),
            "experts.w2": (1, moe.HIDDEN, moe.DIM),
        }


def replicas_worker(mesh_name: str, strategy: str) -> dict:
    state, model, _, _ = _ep_state(mesh_name, strategy)
    state, _ = moe.train(state, model, range(1), rows=ROWS)
    clean = error_text(lambda: fs.check_replicas(state))  # experts differ across "expert"
    if dist.get_rank() == 0:
        w = state.params["experts.w1"].view(-1)
        w[0] = w[0] + 1.0
    return {"clean": clean, "flipped": error_text(lambda: fs.check_replicas(state))}


@pytest.mark.parametrize("mesh, strategy", [("S4E2", "no_shard"), ("R2S2E2", "optim")])
def test_check_replicas_compares_experts_among_their_holders(pool4, mesh, strategy) -> None:
    """``fs.check_replicas`` compares an expert leaf among the ranks of its expert index (the
    others hold other experts), and names one that drifted."""
    for rank, r in enumerate(pool4.run(replicas_worker, mesh, strategy)):
        assert r["clean"] is None, r["clean"]
        if rank in (0, 2):  # rank 0's expert index's holders, on both meshes
            assert "experts.w1" in r["flipped"], (rank, r["flipped"])


def deterministic_worker(mesh_name: str, strategy: str, kw: dict) -> dict:
    state, model, _, _ = _ep_state(mesh_name, strategy, deterministic=True, **kw)
    state, history = moe.train(state, model, range(STEPS), rows=ROWS)
    full = {n: t.clone() for n, t in fs.full_params(state).items()}
    return {"params": full, "metrics": [(m["loss"], m["grad_norm"]) for m in history]}


DETERMINISTIC = [
    ("S4E2", "optim_grads_params", {}),
    ("S4E2", "no_shard", {}),
    ("S4E2", "optim", {}),
    ("R2S2E2", "optim_grads", {}),
    ("R2S2E2", "optim_grads_params", {"outer_strategy": "optim"}),
]


def test_deterministic_is_bitwise_across_layouts_of_one_expert_degree(pool4) -> None:
    """``deterministic=True`` with the experts on mesh["expert"] (E = 2): the same bits of
    params, losses and grad norms on every data-parallel layout and strategy of 4 ranks."""
    runs = {str(case): pool4.run(deterministic_worker, *case)[0] for case in DETERMINISTIC}
    first = next(iter(runs.values()))
    for name, run in runs.items():
        assert run["metrics"] == first["metrics"], (name, run["metrics"], first["metrics"])
        for n, t in first["params"].items():
            assert torch.equal(run["params"][n], t), (name, n)


def tensor_worker(strategy: str, kw: dict) -> dict:
    """Experts on mesh["expert"], the head split over mesh["tensor"] (colwise, its output
    gathered): a tensor group's ranks share their batch, as torch's tensor parallel asks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = fs.make_mesh(shard=2, tensor=2, expert=2, device_type="cpu")
    model, plain = moe.make_model(3), moe.make_model(3)
    moe.place_experts(model, mesh["expert"])
    parallelize_module(model, mesh["tensor"], {"head": ColwiseParallel(output_layouts=Replicate())})
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy, **kw)
    ref = moe.reference_run(plain, STEPS, ROWS)
    loss_fn, history = moe.make_loss_fn(model), []
    for step in range(STEPS):
        batch = {
            k: v.chunk(2)[dist.get_rank() // 2] for k, v in moe.global_batch(step, ROWS).items()
        }
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=2)
        history.append(metrics)
    return _errors(state, history, ref)


@pytest.mark.parametrize(
    "strategy, kw", [("optim", {}), ("optim_grads_params", {}), ("no_shard", {})], ids=str
)
def test_experts_beside_a_tensor_parallel_layer_equal_one_plain_process(pool4, strategy, kw):
    """A 4-D mesh (S2 x E2 x T2): dense layers tensor-parallel, experts expert-parallel."""
    for errors in pool4.run(tensor_worker, strategy, kw):
        assert max(errors.values()) < TOL, errors


# A bf16 gradient wire rounds each rank's contribution once (relative 2^-9 = 2e-3 an element);
# the parameters move by lr x gradient over 2 steps, so their error relative to the weights
# stays far below that, and the loss and norm (of gradients rounded once) within ~2e-3.
WIRE_TOL = 1e-2


def test_a_bf16_gradient_wire_stays_within_its_rounding(pool4) -> None:
    kw = {"policy": fs.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)}
    for errors in pool4.run(sgd_worker, "R2S2E2", "optim_grads_params", kw):
        assert max(errors.values()) < WIRE_TOL, errors


def narrow_worker(kw: dict, mu_dtype) -> dict:
    mesh = fs.make_mesh(shard=4, expert=2, device_type="cpu")
    model, plain = moe.make_model(3), moe.make_model(3)
    moe.place_experts(model, mesh["expert"])
    opt = fs.optim.sgd(0.1, momentum=0.9, mu_dtype=mu_dtype)
    state = fs.init(model, opt, mesh=mesh, strategy="optim_grads_params", **kw)
    ref = moe.reference_run(plain, STEPS, ROWS)
    state, history = moe.train(state, model, range(STEPS), rows=ROWS)
    return _errors(state, history, ref)


# An 8-bit blockwise gradient wire rounds each element to 1/254 of its block's largest
# (relative 4e-3 at the block's maximum); a bf16 momentum (SGD's buffer) rounds it by 2^-9
# each step. Params move by lr x gradient over 2 steps and norms see one rounding: both stay
# within a few 1e-3, and 2e-2 leaves margin on any CPU (the rounding is the format's).
NARROW_TOL = 2e-2


@pytest.mark.parametrize(
    "kw, mu_dtype",
    [
        ({"policy": fs.MixedPrecisionPolicy(grad_comm_dtype=torch.int8)}, None),
        ({}, torch.bfloat16),
    ],
    ids=["int8-gradient-wire", "bf16-momentum"],
)
def test_an_8bit_wire_and_a_narrow_momentum_stay_within_their_rounding(pool4, kw, mu_dtype):
    for errors in pool4.run(narrow_worker, kw, mu_dtype):
        assert max(errors.values()) < NARROW_TOL, errors


def hfsdp_rows_worker() -> dict:
    state, _, _, _ = _ep_state("R2S2E2", "optim_grads_params", outer_strategy="optim")
    return {n: tuple(state.params[n].shape) for n in ("experts.w1", "experts.w2")}


def test_hfsdp_holds_one_rs_th_of_the_expert_rows(pool4) -> None:
    """Under HFSDP an expert leaf's masters are spread over R x S / E ranks of its expert
    index, 2 local experts over 2: 1/(S x R) of the 4 experts' rows each."""
    for rows in pool4.run(hfsdp_rows_worker):
        assert rows == {
            "experts.w1": (1, moe.DIM, moe.HIDDEN),
            "experts.w2": (1, moe.HIDDEN, moe.DIM),
        }
