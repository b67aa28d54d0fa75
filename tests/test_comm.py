"""Bytes on the wire equal the per-strategy formula; ZeRO-3 keeps at most two units gathered."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

import helpers_muon
import models

BF16 = torch.bfloat16


def expected_bytes(layout, microbatches: int) -> dict:
    """The formula of docs/strategies.md, per rank and step (groups of one rank move nothing)."""
    S, W = layout.shard_size, layout.dp_size
    R = W // S if layout.strategy != "no_shard" else W
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for b in layout.buckets:
        padded = b.numel * S  # full padded numel of the bucket
        w = torch.empty((), dtype=b.dtypes.comm).element_size()
        c = torch.empty((), dtype=b.dtypes.compute).element_size()
        if R > 1:
            out["all_reduce"] += b.numel * w
        if S == 1:
            continue
        if layout.strategy == "optim":
            out["reduce_scatter"] += padded * w
            out["all_gather"] += padded * c
        elif layout.strategy == "optim_grads":
            out["reduce_scatter"] += microbatches * padded * w
            out["all_gather"] += padded * c
        else:  # optim_grads_params: gather in forward and again in backward
            out["reduce_scatter"] += microbatches * padded * w
            out["all_gather"] += 2 * microbatches * padded * c
    return out


def comm_worker(strategy: str, shard: int, replicate: int, microbatches: int) -> tuple:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = models.make_model()
    policy = fs.MixedPrecisionPolicy(param_dtype=BF16, grad_comm_dtype=BF16)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, strategy=strategy)
    world = dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 6 * world), dist.get_rank(), world)
    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, batch, models.make_loss_fn(model), microbatches)
    measured = {k: stats.bytes[k] for k in ("all_gather", "reduce_scatter", "all_reduce")}
    return measured, expected_bytes(state.layout, microbatches)


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
@pytest.mark.parametrize("mesh", ["3", "2x2"])
def test_bytes_communicated_equal_the_formula(request, strategy: str, mesh: str) -> None:
    shard, replicate = {"3": (3, 1), "2x2": (2, 2)}[mesh]
    pool = request.getfixturevalue(f"pool{shard * replicate}")
    for measured, expected in pool.run(comm_worker, strategy, shard, replicate, 3):
        assert measured == expected
        assert sum(measured.values()) > 0


class Deep(nn.Module):
    def __init__(self, n_blocks: int = 8, dim: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(3, dim)
        self.blocks = nn.ModuleList(models.Block(dim) for _ in range(n_blocks))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def gathered_worker() -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    torch.manual_seed(0)
    model = Deep()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy="optim_grads_params")
    layout = state.layout
    full_bytes = {b.unit: b.numel * layout.shard_size * 4 for b in layout.buckets}
    after_forward = []

    def loss_fn(params, x):
        y = fs.functional_call(model, params, (x,))
        after_forward.append(stats.gathered_live)  # nothing may stay gathered for backward
        return y.square().mean()

    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, torch.randn(4, 3), loss_fn)
    return {
        "peak": stats.gathered_peak,
        "bound": 2 * full_bytes[1] + full_bytes[0],
        "one_unit": full_bytes[1],
        "after_forward": after_forward,
        "gathers": stats.calls["all_gather"],
        "units": len(layout.units),
        "live_at_end": stats.gathered_live,
    }


def test_zero3_gathered_bytes_stay_within_two_units_plus_root(pool2) -> None:
    r = pool2.run(gathered_worker)[0]
    assert r["units"] == 9
    assert r["one_unit"] < r["peak"] <= r["bound"], r
    assert r["after_forward"] == [0], "full params kept alive between forward and backward"
    assert r["gathers"] == 2 * r["units"], "backward must re-gather every unit"
    assert r["live_at_end"] == 0


class Probed(Deep):
    """``Deep`` that calls ``probe`` when backward reaches the first block's input."""

    def __init__(self, probe) -> None:
        super().__init__()
        self.probe = probe

    def forward(self, x):
        h = self.inp(x)
        if h.requires_grad:
            h.register_hook(lambda g: self.probe())
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def reduce_in_backward_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    torch.manual_seed(0)
    seen = []
    model = Probed(lambda: seen.append(stats.calls["reduce_scatter"]))
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy)

    def loss_fn(params, x):
        return fs.functional_call(model, params, (x,)).square().mean()

    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, torch.randn(4, 3), loss_fn)
    return {
        "before_first_block": seen,
        "total": stats.calls["reduce_scatter"],
        "units": len(state.layout.units),
    }


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_gradients_leave_for_the_wire_during_backward(pool2, strategy: str) -> None:
    """Each block's reduce-scatter starts as soon as backward is done with the block: by the
    time backward reaches the first block, the seven after it are already on the wire."""
    r = pool2.run(reduce_in_backward_worker, strategy)[0]
    assert r["total"] == r["units"], r  # one reduce-scatter per unit and microbatch
    assert len(r["before_first_block"]) == 1 and r["before_first_block"][0] >= 7, r


def replicate_in_backward_worker(strategy: str, outer: str) -> dict:
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    torch.manual_seed(0)
    seen = []
    model = Probed(lambda: seen.append(stats.bytes_by_axis["replicate"]))
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy, outer_strategy=outer)
    layout = state.layout

    def loss_fn(params, x):
        return fs.functional_call(model, params, (x,)).square().mean()

    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, torch.randn(4, 3), loss_fn)
    # what each bucket's replicate reduction puts on the wire: its inner shard, fp32
    wire = collections.Counter()
    for bucket in layout.inner.buckets:
        wire[bucket.unit] += 4 * bucket.numel
    return {
        "before_first_block": seen,
        "last_unit": wire[len(layout.units) - 1],
        "root": wire[0],
        "total": stats.bytes_by_axis["replicate"],
        "all": sum(wire.values()),
    }


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_replicate_reductions_leave_during_backward(pool4, strategy: str, outer: str) -> None:
    """On 2 replicas x 2 shards (HSDP, and HFSDP: ``outer="optim"``), a bucket's reduction
    over "replicate" (the slow link between nodes) starts as soon as its sum is final: by the
    time backward reaches the first block, the last block's is already on the wire, and
    nothing of the root's (its gradient comes last)."""
    for r in pool4.run(replicate_in_backward_worker, strategy, outer):
        # one reduction per bucket (HFSDP: and the updated params' all-gather, as many bytes)
        assert r["total"] == r["all"] * (2 if outer == "optim" else 1), r
        [before] = r["before_first_block"]
        assert r["last_unit"] <= before <= r["all"] - r["root"], r


# --- fs.optim.muon: the owner-computes exchange ------------------------------------------------
def muon_comm_worker(strategy: str, fraction: float, replicate: int = 1) -> dict:
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    model = models.make_model(seed=3, d_in=helpers_muon.D_IN)
    state = fs.init(
        model, helpers_muon.ours(), mesh=mesh, strategy=strategy, offload_fraction=fraction
    )
    loss_fn = models.make_loss_fn(model)
    world = dist.get_world_size()
    rows = helpers_muon.LOCAL_ROWS * world
    batch = models.local_batch(
        models.global_batch(0, rows, d_in=helpers_muon.D_IN), dist.get_rank(), world
    )
    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, batch, loss_fn)
    return {"bytes": stats.bytes["muon"], "calls": stats.calls["muon"]}


@pytest.mark.parametrize(
    "world,strategy,fraction,replicate",
    [
        (2, "optim_grads_params", 0.0, 1),
        (3, "optim", 0.5, 1),
        (2, "no_shard", 0.0, 1),
        (4, "optim_grads_params", 0.0, 2),
    ],
)
def test_muon_exchange_bytes_equal_the_plan(
    request, world: int, strategy: str, fraction: float, replicate: int
) -> None:
    """The exchange counted under "muon" equals fs.plan's prediction (the busiest rank's bytes
    and calls), and only rows move: on one replica every Muon element leaves its rank once to
    the owner and once back, in bf16 (summed over ranks: 2 * 2 bytes * the Muon numel). The
    replicas (every rank under no_shard) share the matrices out and all-gather the results."""
    results = request.getfixturevalue(f"pool{world}").run(
        muon_comm_worker, strategy, fraction, replicate
    )
    model = models.make_model(seed=3, d_in=helpers_muon.D_IN)
    p = fs.plan(
        model,
        world_size=world,
        replicate=replicate,
        strategy=strategy,
        offload_fraction=fraction,
        optimizer=helpers_muon.ours(),
        device_type="cpu",
    )
    assert max(r["bytes"] for r in results) == p.comm["muon"]
    assert max(r["calls"] for r in results) == p.calls["muon"]
    if strategy == "no_shard":  # one all-gather per step, nothing else
        assert all(r["calls"] == 1 for r in results), results
        return
    if replicate > 1:
        return
    # only rows move: each rank sends its rows once and the owners' results once, in bf16
    rows_numel = sum(
        math.prod(p_.shape)
        for n, p_ in model.named_parameters()
        if helpers_muon.is_muon(n, tuple(p_.shape))
    )
    assert sum(r["bytes"] for r in results) == 2 * 2 * rows_numel
    assert p.memory.muon_owner > 0


# --- bytes per mesh axis ------------------------------------------------------------------------
def by_axis_worker(
    strategy: str, replicate: int, microbatches: int, deterministic: bool, muon: bool, outer: str
) -> dict:
    mesh = fs.make_mesh(replicate=replicate, device_type="cpu")
    if muon:
        model = models.make_model(seed=3, d_in=helpers_muon.D_IN)
        opt, d_in = helpers_muon.ours(), helpers_muon.D_IN
    else:
        model, opt, d_in = models.make_model(), fs.optim.sgd(0.1, momentum=0.9), 5
    state = fs.init(
        model,
        opt,
        mesh=mesh,
        strategy=strategy,
        deterministic=deterministic,
        outer_strategy=outer,
    )
    world = dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 4 * world, d_in=d_in), dist.get_rank(), world)
    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, batch, models.make_loss_fn(model), microbatches)
    return {"by_axis": dict(stats.bytes_by_axis), "bytes": dict(stats.bytes)}


# Muon's cases split the root by rule: its first layer's weight (a Muon matrix) is a bucket of
# its own that saves nothing for backward (the input needs no gradient); under ZeRO-3 it is
# re-gathered with the rest of the root, as fs.plan counts.
BY_AXIS_CASES = [
    (strategy, *case)
    for strategy in fs.STRATEGIES
    for case in [
        (2, 1, 2, False, False, "no_shard"),
        (3, 1, 1, False, False, "no_shard"),
        (4, 2, 2, False, False, "no_shard"),
        (4, 2, 2, True, False, "no_shard"),
        (4, 4, 1, False, False, "no_shard"),
        (4, 2, 1, False, True, "no_shard"),
        # HFSDP (outer_strategy="optim"): every inner strategy but no_shard
        (4, 2, 2, False, False, "optim"),
        (4, 2, 2, True, False, "optim"),
        (6, 3, 1, False, False, "optim"),
        (4, 2, 1, False, True, "optim"),
    ]
    if not (case[5] == "optim" and strategy == "no_shard")
]


@pytest.mark.parametrize(
    "strategy,world,replicate,microbatches,deterministic,muon,outer", BY_AXIS_CASES
)
def test_bytes_by_axis_equal_the_plan(
    request, strategy, world, replicate, microbatches, deterministic, muon, outer
) -> None:
    """What crosses each mesh axis (the "replicate" one is the slow link between nodes)
    equals fs.plan's comm_by_axis, and the axes add up to the kinds."""
    results = request.getfixturevalue(f"pool{world}").run(
        by_axis_worker, strategy, replicate, microbatches, deterministic, muon, outer
    )
    model = models.make_model(seed=3, d_in=helpers_muon.D_IN) if muon else models.make_model()
    p = fs.plan(
        model,
        world_size=world,
        replicate=replicate,
        strategy=strategy,
        microbatches=microbatches,
        optimizer=helpers_muon.ours() if muon else "sgd_momentum",
        device_type="cpu",
        deterministic=deterministic,
        outer_strategy=outer,
    )
    for r in results:
        assert sum(r["by_axis"].values()) == sum(r["bytes"].values()), r
    measured = {axis: max(r["by_axis"].get(axis, 0) for r in results) for axis in p.comm_by_axis}
    assert measured == p.comm_by_axis, (measured, p.comm_by_axis)
    if replicate == 1 or not fs.Strategy.parse(strategy).shards_optim:
        assert p.comm_by_axis["replicate"] == 0
    else:
        assert p.comm_by_axis["replicate"] > 0


# --- low-precision and 8-bit wires (grad_comm_dtype, param_comm_dtype) -------------------------
def wire_worker(
    strategy: str,
    shard: int,
    replicate: int,
    grad_wire,
    param_wire,
    outer: str = "no_shard",
    compute=BF16,
) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = models.make_model()
    policy = fs.MixedPrecisionPolicy(
        param_dtype=compute, grad_comm_dtype=grad_wire, param_comm_dtype=param_wire
    )
    state = fs.init(
        model,
        fs.optim.sgd(0.1),
        mesh=mesh,
        policy=policy,
        strategy=strategy,
        outer_strategy=outer,
    )
    world = dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 4 * world), dist.get_rank(), world)
    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, batch, models.make_loss_fn(model), 2)
    return {"bytes": dict(stats.bytes), "by_axis": dict(stats.bytes_by_axis)}


WIRE_CASES = [
    (strategy, *case, *(() if len(case) == 6 else (BF16,)))  # compute dtype: bf16 unless given
    for strategy in fs.STRATEGIES
    for case in [
        (3, 1, torch.int8, torch.int8, "no_shard"),
        (2, 2, torch.float8_e4m3fn, BF16, "no_shard"),
        (2, 2, BF16, torch.float8_e4m3fn, "no_shard"),
        (1, 4, torch.int8, torch.float8_e4m3fn, "no_shard"),
        # HFSDP: the reduce-scatter over "replicate" into the masters on the same wires
        (2, 2, torch.int8, None, "optim"),
        (2, 2, BF16, None, "optim"),
        # HFSDP: the masters packed once, gathered over "replicate" and again over "shard"
        (2, 2, torch.int8, torch.int8, "optim"),
        (2, 2, None, torch.float8_e4m3fn, "optim"),
        (1, 4, BF16, torch.int8, "optim"),
        (2, 2, None, BF16, "optim", None),  # fp32 compute, a bf16 param wire
    ]
    if not (case[4] == "optim" and strategy == "no_shard")
]


@pytest.mark.parametrize("strategy,shard,replicate,grad_wire,param_wire,outer,compute", WIRE_CASES)
def test_wire_bytes_equal_the_plan(
    request, strategy, shard, replicate, grad_wire, param_wire, outer, compute
):
    """Every kind and every axis of a step with low-precision and 8-bit wires (their scales
    included, and the all-reduce's parts padded to the largest) equals fs.plan's prediction;
    8-bit gradient bytes are well under half of fp32's on this model of short rows (5 and 37
    wide: a 4-byte scale per row) and many 1-D params (exact, 4 bytes); test_wire checks the
    quarter on long rows."""
    results = request.getfixturevalue(f"pool{shard * replicate}").run(
        wire_worker, strategy, shard, replicate, grad_wire, param_wire, outer, compute
    )
    kw = dict(world_size=shard * replicate, replicate=replicate, strategy=strategy)
    kw |= dict(outer_strategy=outer)
    kw |= dict(microbatches=2, optimizer="sgd", device_type="cpu")
    policy = fs.MixedPrecisionPolicy(
        param_dtype=compute, grad_comm_dtype=grad_wire, param_comm_dtype=param_wire
    )
    p = fs.plan(models.make_model(), policy=policy, **kw)
    for r in results:
        measured = {k: v for k, v in r["bytes"].items() if v}
        assert measured == {k: v for k, v in p.comm.items() if v}, (measured, p.comm)
        assert {k: v for k, v in r["by_axis"].items() if v} == {
            k: v for k, v in p.comm_by_axis.items() if v
        }
    plain = fs.MixedPrecisionPolicy(param_dtype=compute)
    fp32 = fs.plan(models.make_model(), policy=plain, **kw)
    grads = lambda q: q.comm["reduce_scatter"] + q.comm["all_reduce"]  # noqa: E731
    if grad_wire == torch.int8 or grad_wire == torch.float8_e4m3fn:
        assert 0.25 * grads(fp32) < grads(p) < 0.45 * grads(fp32)


def pieces_worker(shard: int, replicate: int, by_sends: bool) -> list[str]:
    """``all_gather_pieces`` against each piece cut out of a plain all-gather's result, over
    the shard group (a subgroup where replicate > 1): pieces empty, small (travelling
    together) and large, three gathers in flight at once, waited for in reverse order; then
    one dropped unwaited. ``by_sends``: gloo's way (sends to each piece's place), else the
    all-gather and placement NCCL takes. Returns failures."""
    from funcshard.distributed import ops

    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    group = mesh["shard"].get_group()
    rank = dist.get_rank()
    cases = [
        [0, 3, 1, 20000, 0, 5, 7, 70000, 2],  # small runs between large pieces, empty pieces
        [17],
        [5, 0, 9],
    ]
    chosen, ops.gathers_by_sends = ops.gathers_by_sends, lambda device, group: by_sends
    try:
        pending, expected = [], []
        for i, sizes in enumerate(cases):
            dtype = (torch.float32, torch.bfloat16, torch.float64)[i]
            local = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(rank * 10 + i))
            local = local.to(dtype)
            every = [torch.empty_like(local) for _ in range(shard)]
            dist.all_gather(every, local, group=group)
            starts = itertools.accumulate(sizes, initial=0)
            pieces = [t[o : o + n] for o, n in zip(starts, sizes, strict=False) for t in every]
            expected.append(torch.cat(pieces))  # piece by piece, its ranks adjacent
            pending.append(ops.all_gather_pieces(local, sizes, group, axis="shard", async_op=True))
        failures = []
        for i in reversed(range(len(cases))):
            got = pending[i].wait()
            if not torch.equal(got, expected[i]):
                failures.append(f"case {i} on rank {rank}")
        # a gather dropped unwaited on every rank (a step that failed with a prefetch in
        # flight) leaves the next one exact
        local = torch.full((sum(cases[0]),), float(dist.get_rank(group)))
        ops.all_gather_pieces(local, cases[0], group, axis="shard", async_op=True)
        got = ops.all_gather_pieces(local, cases[0], group, axis="shard")
        for start, n in zip(itertools.accumulate(cases[0], initial=0), cases[0], strict=False):
            want = torch.arange(shard, dtype=torch.float32).repeat_interleave(n)
            if not torch.equal(got[shard * start : shard * (start + n)], want):
                failures.append(f"after a dropped gather, piece at {start} on rank {rank}")
    finally:
        ops.gathers_by_sends = chosen
    return failures


@pytest.mark.parametrize("by_sends", [True, False], ids=["sends", "all_gather"])
@pytest.mark.parametrize("shard,replicate", [(2, 1), (3, 1), (2, 2)])
def test_all_gather_pieces_equals_all_gather_then_permutation(
    pool_of, shard, replicate, by_sends
) -> None:
    for failures in pool_of(shard * replicate).run(pieces_worker, shard, replicate, by_sends):
        assert failures == []


def test_nested_comm_stats_blocks_close_each_their_own():
    """Two blocks that counted the same bytes compare equal (a dataclass): leaving the inner
    one closes the inner one, not the outer, and the outer then closes cleanly."""
    from funcshard.distributed.ops import active

    with fs.comm_stats() as outer:
        with fs.comm_stats() as inner:
            assert inner == outer and active() == (outer, inner)
        assert len(active()) == 1 and active()[0] is outer
    assert active() == ()


def reduce_by_sends_worker(shard: int, replicate: int) -> list[str]:
    """``reduce_by_sends`` of every rank's buffer against ``sum_by_rank`` of the sections the
    plain all-gather gives, bitwise, in fp32, bf16 and fp16 (values that round differently
    in another order), over the shard group; the input untouched. Returns failures."""
    from funcshard.distributed import graph_ops

    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    group = mesh["shard"].get_group()
    rank, failures = dist.get_rank(group), []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        seed = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(shard * 1001, generator=seed) * torch.logspace(-3, 3, shard * 1001)
        x = x.to(dtype)
        before = x.clone()
        every = [torch.empty_like(x) for _ in range(shard)]
        dist.all_gather(every, x, group=group)
        want = graph_ops.sum_by_rank(torch.stack([t.view(shard, -1)[rank] for t in every]))
        for _ in range(2):  # the second call reuses nothing of the first
            got = graph_ops.reduce_by_sends(x, group)
            if got.dtype != dtype or not torch.equal(got, want):
                failures.append(
                    f"{dtype} on rank {rank}: {(got.float() - want.float()).abs().max()}"
                )
        if not torch.equal(x, before):
            failures.append(f"{dtype}: the input changed on rank {rank}")
    return failures


@pytest.mark.parametrize("shard,replicate", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_reduce_by_sends_adds_in_rank_order(pool_of, shard, replicate) -> None:
    """The captured step's reduce (sections received one at a time, the first two added in
    one pass into a received buffer) gives the eager wire's sum bit for bit at 2-4 ranks."""
    for failures in pool_of(shard * replicate).run(reduce_by_sends_worker, shard, replicate):
        assert failures == []
