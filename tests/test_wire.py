"""Low-precision wires summed in fp32, 8-bit blockwise formats, and ``param_comm_dtype``.

* The formats: each block (<= 256 consecutive elements of one row) decodes as an independent
  reference quantizer says, bit for bit; blocks never cross a row.
* The bf16 wire's error stays within one rounding out and one back at 2, 3 and 4 ranks (the
  ring collectives of bf16 that ``grad_comm_dtype`` used to run exceed it from 3 ranks on).
* ``fs.reduce_scatter_grads`` and ``fs.train_step`` with each wire land within the error of
  rounding each contribution once (times the roundings a mesh chains), on 37 uneven rows over
  2, 3 and 4 ranks and several microbatches, and visibly off the fp32 result.
* ``param_comm_dtype``: the params a step computes with are the masters through the wire,
  bit for bit, on every strategy; the masters stay exact; ``deterministic=True`` keeps its
  bitwise contract with it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.comm import codec as wire
from funcshard.planner.plan import transformer_shapes

import helpers_determinism as det
import models

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
INT8, FP8 = torch.int8, torch.float8_e4m3fn
WIRES = {"bf16": BF16, "fp16": FP16, "int8": INT8, "fp8": FP8}
# per rounding of x (in a block of absmax A): |error| <= REL * |x| + ABS * A
ERROR = {
    FP32: (0.0, 0.0),
    BF16: (2.0**-8, 0.0),
    FP16: (2.0**-11, 2.0**-24),
    INT8: (0.0, 1.0 / 254),
    FP8: (2.0**-4, 2.0**-10 / 448),
}


# --- the formats -----------------------------------------------------------------------------
def _round24(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``x`` rounded to fp32's 24-bit significand with no bound on the exponent: what an
    fp32 operation gives where fp32's range does not cut in (rounding an fp64 quotient or
    product of fp32 values once more to 24 bits is the correctly rounded fp32 result)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(mantissa.float().double(), exponent)


def reference_roundtrip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent of funcshard.comm.codec: each row of ``x`` (rows, row_numel) in blocks of 256
    (the last shorter), each block scaled by its absmax; a one-element row is exact. The
    scales are computed in fp64, each step rounded as fp32 would with an unbounded exponent:
    ``top / absmax`` is finite for the tiny blocks too, and only a result lands in fp32's
    range (its subnormals). ``top / absmax`` rounds as torch's ``scalar / tensor`` does:
    the reciprocal, then the product."""
    top = 127.0 if dtype == INT8 else 448.0
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        if x.shape[1] == 1:
            out[r] = x[r]
            continue
        for j in range(0, x.shape[1], 256):
            block = x[r, j : j + 256].double()
            s = block.abs().max()
            inv = _round24(_round24(1.0 / s) * top) if s > 0 else torch.zeros_like(s)
            q = (block * inv).float()
            q = q.round().clamp(-top, top) if dtype == INT8 else q.clamp(-top, top)
            decoded = _round24(q.to(dtype).double() * _round24(s / top))
            out[r, j : j + 256] = decoded.float()
    return out


SEGMENTS = [(3, 600), (5, 1), (4, 37), (2, 512), (3, 64), (2, 256)]


def _segment_data(lead: int = 2) -> torch.Tensor:
    n = sum(r * w for r, w in SEGMENTS)
    g = torch.Generator().manual_seed(0)
    return torch.randn(lead, n, generator=g) * torch.logspace(-4, 2, n)


def test_blocks_never_cross_a_row() -> None:
    layout = wire.Blocks(SEGMENTS)
    # 600: 256 + 256 + 88; one-element rows; 37 and 64: one block a row; 512 and 256: 256s
    assert layout.count == 3 * 3 + 5 + 4 + 2 * 2 + 3 + 2
    assert layout.numel == sum(r * w for r, w in SEGMENTS)
    assert layout.nbytes == 4 * layout.count + layout.numel - 5  # one-element rows: no byte


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_8bit_blocks_decode_as_the_reference_quantizer(dtype) -> None:
    x = _segment_data()
    layout = wire.Blocks(SEGMENTS)
    packed = torch.empty(2, layout.nbytes, dtype=torch.uint8)
    wire.encode(x, dtype, layout, packed)
    got = wire.decode(packed, dtype, layout, torch.empty_like(x))
    at, want = 0, []
    for rows, width in SEGMENTS:
        seg = x[:, at : at + rows * width].reshape(2 * rows, width)
        want.append(reference_roundtrip(seg, dtype).view(2, -1))
        at += rows * width
    assert torch.equal(got, torch.cat(want, dim=1))
    assert not torch.equal(got, x)
    # a row's bits depend on that row alone: change another row, nothing else moves
    y = x.clone()
    y[:, :600] *= 1000.0
    wire.encode(y, dtype, layout, packed)
    again = wire.decode(packed, dtype, layout, torch.empty_like(x))
    assert torch.equal(again[:, 600:], got[:, 600:])
    assert torch.equal(again[:, 600:1200], reference_roundtrip(y[:, 600:1200], dtype))


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_tiny_and_subnormal_blocks_keep_the_formats_error(dtype) -> None:
    """A block's error is the format's relative to its absmax at any magnitude: fp32's
    ``top / absmax`` overflows below absmax ~1e-36 (every element then arrived as +-absmax,
    a zero as NaN or -absmax). Blocks of absmax 3e-38, 1e-40 and 1e-45 (subnormal), an
    all-zero block and a normal one; the bits are the reference's."""
    g = torch.Generator().manual_seed(1)
    absmax = torch.tensor([3e-38, 1e-40, 1e-45, 0.0, 1.0, 1e-20])
    x = torch.randn(len(absmax), 300, generator=g)
    x[:, ::7] = 0.0
    x = x / x.abs().amax(1, keepdim=True) * absmax.unsqueeze(1)
    layout = wire.Blocks([(len(absmax), 300)])
    got = wire.roundtrip(x.flatten(), dtype, layout).view_as(x)
    assert got.isfinite().all()
    assert torch.equal(got, reference_roundtrip(x, dtype))
    assert torch.equal(got[x == 0], torch.zeros_like(got[x == 0]))  # +0 (and -0) alone
    assert (got[3] == 0).all()
    # the format's error, plus fp32's own: 4 roundings of 2^-24 relative to at most the
    # absmax (scale factors, products), and the result's rounding to a multiple of 2^-149
    rel, absolute = ERROR[dtype]
    block_a = torch.stack([x[:, :256].abs().amax(1), x[:, 256:].abs().amax(1)], 1)
    a_of = torch.cat([block_a[:, :1].expand(-1, 256), block_a[:, 1:].expand(-1, 44)], 1)
    bound = rel * x.abs() + (absolute + 4 * 2.0**-24) * a_of + 2.0**-150
    assert ((got.double() - x.double()).abs() <= bound.double()).all()
    assert ((got - x).abs() > 0.1 * absolute * a_of).any()  # it did quantize


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("parts", [2, 3, 4, 7])
def test_split_pieces_keep_the_blocks(dtype, parts: int) -> None:
    """The all-reduce cuts a section into parts on block boundaries: each part's own blocks
    are the whole section's, so the parts decode to the same bits."""
    x = _segment_data(1)[0]
    layout = wire.Blocks(SEGMENTS)
    whole = wire.roundtrip(x, dtype, layout)
    pieces = layout.split(parts)
    assert sum(p.numel for _, p in pieces) == layout.numel
    got = torch.cat([wire.roundtrip(x[a : a + p.numel], dtype, p) for a, p in pieces])
    assert torch.equal(got, whole)


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_a_nonfinite_block_comes_back_nonfinite(dtype) -> None:
    x = torch.randn(1000)
    x[3], x[700] = float("inf"), float("nan")
    y = wire.roundtrip(x, dtype, wire.Blocks([(1, 1000)]))
    assert not y[:256].isfinite().any() and not y[512:768].isfinite().any()
    assert y[256:512].isfinite().all() and y[768:].isfinite().all()


def test_policy_takes_8bit_wires_only_for_communication() -> None:
    P = fs.MixedPrecisionPolicy
    P(grad_comm_dtype=INT8, param_comm_dtype=FP8)
    P(grad_comm_dtype=FP8, param_comm_dtype=INT8)
    with pytest.raises(TypeError, match="param_dtype"):
        P(param_dtype=INT8)
    with pytest.raises(TypeError, match="param_comm_dtype"):
        P(param_comm_dtype=torch.int32)


# --- the bf16 wire: flat in the world size -----------------------------------------------------
def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double() if dtype not in wire.EIGHT_BIT else reference_roundtrip(x, dtype)


def flat_worker(strategy: str, dtype: torch.dtype) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(device_type="cpu")
    rows = 96 * world
    grads = [
        torch.randn(rows, 64, generator=torch.Generator().manual_seed(r)) for r in range(world)
    ]
    mean = torch.stack([g.double() for g in grads]).mean(0)
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=dtype)
    got = fs.reduce_scatter_grads({"g": grads[rank]}, mesh, policy, strategy=strategy)["g"]
    ours = torch.zeros_like(mean)
    if strategy == "no_shard":
        ours = got.double()
    else:
        ours[rank * 96 : (rank + 1) * 96] = got.double()
        dist.all_reduce(ours)
    out = torch.stack([_rounded((g / world).float(), dtype) for g in grads]).sum(0)
    back = _rounded(out.float(), dtype)
    rel = lambda y: float((y - mean).norm() / mean.norm())  # noqa: E731
    return {"ours": rel(ours), "out": rel(out), "out+back": rel(back)}


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_bf16_wire_error_is_within_one_rounding_out_and_one_back(pool_of, strategy) -> None:
    """Each rank's contribution is rounded to bf16 once and the sum runs in fp32: at every
    world size the error of the mean is at most that of rounding once going out and once
    coming back (a reduce-scatter: once out). A ring summing in bf16 rounds every partial sum
    and exceeds it from 3 ranks on."""
    errors = {}
    for world in (2, 3, 4):
        r = pool_of(world).run(flat_worker, strategy, BF16)[0]
        errors[world] = r
        assert r["ours"] <= r["out+back"] * 1.001, (world, r)
        if strategy != "no_shard":
            assert r["ours"] <= r["out"] * 1.001, (world, r)
    spread = [r["ours"] for r in errors.values()]
    assert max(spread) <= 1.1 * min(spread), errors  # flat in N


# --- reduce_scatter_grads: within the rounding of each contribution ---------------------------
SHAPES = {"w": (37, 300), "m": (37, 4), "r": (6, 512), "b": (5,), "s": ()}


def _rank_grads(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return {n: torch.randn(s, generator=g) * (1 + 10 * rank) for n, s in SHAPES.items()}


def _block_absmax(t: torch.Tensor) -> torch.Tensor:
    """Per element, the absmax of its wire block (<= 256 elements of its row)."""
    rows = t.reshape(t.shape[0] if t.dim() else 1, -1).abs().double()
    width = rows.shape[1]
    pad = -width % 256
    blocks = torch.nn.functional.pad(rows, (0, pad)).view(rows.shape[0], -1, 256)
    amax = blocks.amax(-1, keepdim=True).expand_as(blocks).reshape(rows.shape[0], -1)
    return amax[:, :width].reshape(t.shape)


def _bound(contributions: list[torch.Tensor], dtype: torch.dtype, roundings: int) -> torch.Tensor:
    """What ``roundings`` roundings of partial sums of ``contributions`` may move an element:
    a partial sum's magnitude and block absmax are at most the sums of its members'."""
    rel, absolute = ERROR[dtype]
    total = sum(rel * c.abs().double() + absolute * _block_absmax(c) for c in contributions)
    slack = 1e-6 * sum(c.abs().double() for c in contributions) + 1e-9
    return roundings * total + slack


def scatter_worker(strategy: str, shard: int, replicate: int, dtype: torch.dtype) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    world = dist.get_world_size()
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=dtype)
    out = fs.reduce_scatter_grads(_rank_grads(dist.get_rank()), mesh, policy, strategy=strategy)
    every = [_rank_grads(r) for r in range(world)]
    sharded = fs.Strategy.parse(strategy).shards_optim
    roundings = (1 if replicate == 1 else 3) if sharded else 2
    worst, reached = 0.0, 0.0
    for name in SHAPES:
        parts = [g[name] / world for g in every]
        mean = sum(p.double() for p in parts)
        expect = fs.shard({name: mean}, mesh, strategy=strategy)[name]
        bound = fs.shard({name: _bound(parts, dtype, roundings)}, mesh, strategy=strategy)[name]
        err = (out[name].double() - expect).abs()
        if err.numel():
            worst = max(worst, float((err / bound).max()))
            reached = max(reached, float(err.max() / bound.max()))
    return {"worst": worst, "reached": reached, "dtype": str(out["w"].dtype)}


CASES = [("optim_grads_params", 2, 1), ("optim", 3, 1), ("optim_grads", 4, 1)]
CASES += [("optim_grads_params", 2, 2), ("no_shard", 3, 1), ("no_shard", 2, 2)]


@pytest.mark.parametrize("wire_name", list(WIRES))
@pytest.mark.parametrize("strategy,shard,replicate", CASES)
def test_reduce_scatter_grads_within_one_rounding_per_contribution(
    pool_of, wire_name: str, strategy: str, shard: int, replicate: int
) -> None:
    """Every element of the reduced mean is within the rounding of each rank's contribution
    (a reduce-scatter over "shard": once; an all-reduce: and once coming back; HSDP: the
    shard-reduced partial sums once more, going over "replicate"); 8-bit: the block's absmax
    / 254 (int8) or e4m3's precision (fp8). It also is visibly off fp32 (the wire is used)."""
    dtype = WIRES[wire_name]
    pool = pool_of(shard * replicate)
    for r in pool.run(scatter_worker, strategy, shard, replicate, dtype):
        assert r["dtype"] == "torch.float32", r
        assert r["worst"] <= 1.0, r
        assert r["reached"] > 0.01, r  # an fp32 sum alone would sit far below the bound


# --- train_step: one SGD step against the exact mean gradient ---------------------------------
def _exact_grads(model, batch, microbatches: int) -> list[dict[str, torch.Tensor]]:
    """This rank's gradient of each microbatch (scaled by 1/M), in fp64 from a plain copy."""
    out = []
    for mb in _split(batch, microbatches):
        ref = copy.deepcopy(model).double()
        loss = torch.nn.functional.cross_entropy(ref(mb["x"].double()).double(), mb["y"])
        grads = torch.autograd.grad(loss / microbatches, list(ref.parameters()))
        out.append({n: g for (n, _), g in zip(ref.named_parameters(), grads, strict=True)})
    return out


def _split(batch: dict, microbatches: int) -> list[dict]:
    parts = {k: torch.tensor_split(v, microbatches) for k, v in batch.items()}
    return [{k: v[i] for k, v in parts.items()} for i in range(microbatches)]


def step_worker(
    strategy: str, shard: int, replicate: int, dtype: torch.dtype, microbatches: int, outer: str
) -> dict:
    torch.set_num_threads(1)
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_model(seed=3)
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=dtype)
    state = fs.init(
        model,
        fs.optim.sgd(1.0),
        mesh=mesh,
        policy=policy,
        strategy=strategy,
        outer_strategy=outer,
    )
    batch = models.global_batch(0, 12 * world)
    state, metrics = fs.train_step(
        state, models.local_batch(batch, rank, world), models.make_loss_fn(model), microbatches
    )
    params = fs.full_params(state)
    contributions = [
        {n: g / world for n, g in mb.items()}
        for r in range(world)
        for mb in _exact_grads(model, models.local_batch(batch, r, world), microbatches)
    ]
    sharded = fs.Strategy.parse(strategy).shards_optim
    # HSDP: out over "shard", out over "replicate", back; HFSDP reduce-scatters over both
    roundings = (1 if replicate == 1 else 2 if outer == "optim" else 3) if sharded else 2
    worst, reached = 0.0, 0.0
    for name, p0 in model.named_parameters():
        parts = [c[name] for c in contributions]
        exact = p0.detach().double() - sum(parts)
        bound = _bound(parts, dtype, roundings) + 2.0**-23 * exact.abs()  # + the update's rounding
        err = (params[name].double() - exact).abs()
        worst = max(worst, float((err / bound).max()))
        reached = max(reached, float(err.max() / bound.max()))
    return {"worst": worst, "reached": reached, "nonfinite": metrics["nonfinite"]}


@pytest.mark.parametrize("wire_name", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize(
    "strategy,shard,replicate,microbatches,outer",
    [
        ("optim_grads_params", 2, 1, 3, "no_shard"),
        ("optim_grads", 3, 1, 2, "no_shard"),
        ("optim", 4, 1, 2, "no_shard"),
        ("no_shard", 2, 1, 2, "no_shard"),
        ("optim_grads_params", 2, 2, 2, "no_shard"),
        ("optim_grads_params", 2, 2, 2, "optim"),
        ("optim", 2, 2, 1, "optim"),
    ],
)
def test_train_step_within_one_rounding_per_contribution(
    pool_of, wire_name, strategy, shard, replicate, microbatches, outer
) -> None:
    """One SGD step (lr 1) on the uneven model (37 rows over 2, 3 and 4 ranks) lands within
    the rounding of every rank's every microbatch gradient of the exact update (HFSDP: its
    reduce-scatter over "replicate" rounds the shard-reduced part once more, no way back)."""
    pool = pool_of(shard * replicate)
    args = (strategy, shard, replicate, WIRES[wire_name], microbatches, outer)
    for r in pool.run(step_worker, *args):
        assert r["nonfinite"] == 0 and r["worst"] <= 1.0, r
        assert r["reached"] > 0.01, r


def nonfinite_worker(dtype: torch.dtype, strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=3)
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=dtype, param_comm_dtype=dtype)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, strategy=strategy)
    before = fs.full_params(state)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    if dist.get_rank() == 1:
        batch["x"][0, 0] = float("inf")
    state, metrics = fs.train_step(state, batch, models.make_loss_fn(model))
    after = fs.full_params(state)
    return {
        "nonfinite": metrics["nonfinite"],
        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
    }


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
@pytest.mark.parametrize("wire_name", ["int8", "fp8"])
def test_a_nonfinite_gradient_survives_the_8bit_wire(pool2, wire_name: str, strategy) -> None:
    for r in pool2.run(nonfinite_worker, WIRES[wire_name], strategy):
        assert r == {"nonfinite": 1, "unchanged": True}, r


# --- param_comm_dtype -------------------------------------------------------------------------
def seen_worker(
    strategy: str, shard: int, replicate: int, param_dtype, dtype, outer: str = "no_shard"
) -> dict:
    """The params loss_fn computes with, the masters (full_params) and the initial weights."""
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = models.make_model(seed=3)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = fs.MixedPrecisionPolicy(param_dtype=param_dtype, param_comm_dtype=dtype)
    state = fs.init(
        model,
        fs.optim.sgd(0.1),
        mesh=mesh,
        policy=policy,
        strategy=strategy,
        outer_strategy=outer,
    )
    seen = {}
    base = models.make_loss_fn(model)

    def loss_fn(params, batch):
        seen.update({n: params[n].detach().clone() for n in weights})
        return base(params, batch)

    world = dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 4 * world), dist.get_rank(), world)
    masters = fs.full_params(state)
    fs.train_step(state, batch, loss_fn)
    return {"seen": seen, "masters": masters, "weights": weights}


def _through_wire(x: torch.Tensor, compute: torch.dtype, dtype) -> torch.Tensor:
    c = x.to(compute)
    if dtype in wire.EIGHT_BIT:
        rows = c.reshape(c.shape[0] if c.dim() else 1, -1)
        return reference_roundtrip(rows, dtype).to(compute).view(x.shape)
    return c.to(dtype).to(compute)


@pytest.mark.parametrize("wire_name", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize(
    "strategy,shard,replicate,param_dtype,outer",
    [
        ("optim_grads_params", 3, 1, None, "no_shard"),
        ("optim_grads_params", 2, 2, BF16, "no_shard"),
        ("optim_grads", 4, 1, BF16, "no_shard"),
        ("optim", 2, 1, None, "no_shard"),
        ("no_shard", 2, 1, None, "no_shard"),
        ("optim_grads_params", 1, 2, None, "no_shard"),
        # HFSDP: the masters packed once by their owners, over "replicate" and then "shard"
        ("optim_grads_params", 2, 2, None, "optim"),
        ("optim_grads_params", 2, 2, BF16, "optim"),
        ("optim_grads", 2, 2, BF16, "optim"),
        ("optim", 2, 2, None, "optim"),
        ("optim_grads_params", 1, 4, None, "optim"),
        ("optim_grads", 3, 1, None, "optim"),
    ],
)
def test_params_compute_through_the_wire_and_masters_stay_exact(
    pool_of, wire_name, strategy, shard, replicate, param_dtype, outer
) -> None:
    """Every param loss_fn sees is its master through ``param_comm_dtype`` (quantized on the
    sending rank per row-local block, decoded to the compute dtype), bit for bit as the
    reference quantizer gives it, with one shard too, and under HFSDP (the masters packed
    where they are updated, the bytes gathered over both axes); the masters are the
    weights, exact."""
    dtype = WIRES[wire_name]
    compute = param_dtype or FP32
    pool = pool_of(shard * replicate)
    for r in pool.run(seen_worker, strategy, shard, replicate, param_dtype, dtype, outer):
        for n, w in r["weights"].items():
            assert torch.equal(r["masters"][n], w), n
            want = _through_wire(w, compute, dtype)
            assert r["seen"][n].dtype == compute and torch.equal(r["seen"][n], want), n
        moved = any(not torch.equal(r["seen"][n], w.to(compute)) for n, w in r["weights"].items())
        assert moved == (dtype != compute)  # a wire of the compute dtype is no wire


# --- deterministic=True keeps its bits with a param wire ---------------------------------------
def det_worker(
    strategy: str,
    shard: int,
    replicate: int,
    dtype,
    fraction: float = 0.0,
    outer: str = "no_shard",
) -> dict:
    torch.set_num_threads(1)
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    policy = fs.MixedPrecisionPolicy(param_comm_dtype=dtype)
    state = fs.init(
        models.make_model(seed=3),
        det.recipe(),
        mesh=mesh,
        policy=policy,
        strategy=strategy,
        offload_fraction=fraction,
        deterministic=True,
        outer_strategy=outer,
    )
    state, metrics = det.run(state, range(2), det.CHUNKS // dist.get_world_size())
    return {**det.snapshot(state), "metrics": metrics}


@pytest.mark.parametrize("wire_name", ["int8", "fp8", "bf16"])
def test_deterministic_layouts_agree_with_a_param_wire(pool1, pool2, pool4, wire_name) -> None:
    dtype = WIRES[wire_name]
    want = pool1.run(det_worker, "optim_grads_params", -1, 1, dtype)[0]
    plain = pool1.run(det_worker, "optim_grads_params", -1, 1, None)[0]
    assert any(not torch.equal(v, plain["tensors"][k]) for k, v in want["tensors"].items())
    runs = [
        (pool2, ("optim_grads_params", -1, 1)),
        (pool2, ("optim", -1, 1)),
        (pool2, ("no_shard", -1, 1)),
        (pool4, ("optim_grads_params", 2, 2)),
        (pool4, ("optim_grads", -1, 1)),
        (pool2, ("optim_grads_params", -1, 1, dtype, 0.5)),
        (pool2, ("optim", -1, 1, dtype, 1.0)),
        # HFSDP: masters packed once by their owners, gathered over "replicate" then "shard"
        (pool4, ("optim_grads_params", 2, 2, dtype, 0.0, "optim")),
        (pool4, ("optim_grads", 2, 2, dtype, 0.5, "optim")),
        (pool4, ("optim", 2, 2, dtype, 0.0, "optim")),
        (pool4, ("optim_grads_params", 1, 4, dtype, 0.0, "optim")),
    ]
    for pool, args in runs:
        args = args if len(args) > 3 else (*args, dtype)
        for rank, result in enumerate(pool.run(det_worker, *args)):
            det.assert_bitwise(result, want, f"{args} rank {rank}")


def refuse_worker(dtype) -> str:
    mesh = fs.make_mesh(device_type="cpu")
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=dtype)
    try:
        fs.init(
            models.make_model(), fs.optim.sgd(0.1), mesh=mesh, policy=policy, deterministic=True
        )
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("wire_name", ["bf16", "int8", "fp8"])
def test_deterministic_refuses_a_low_precision_grad_wire(pool1, wire_name) -> None:
    assert "grad_comm_dtype" in pool1.run(refuse_worker, WIRES[wire_name])[0]


# --- bytes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim", "no_shard"])
def test_8bit_wires_move_a_quarter_of_fp32_plus_the_scales(strategy: str) -> None:
    """On rows of 256 and more (a Llama-shaped model) an 8-bit wire moves 1 + 4/256 bytes an
    element: <= 0.27x fp32 for the gradients (both axes) and the param gathers."""
    shapes = transformer_shapes(n_layers=2, dim=256, ffn_dim=1024, n_heads=4, n_kv_heads=4)
    kw = dict(world_size=8, replicate=2, strategy=strategy, optimizer="sgd", device_type="cpu")
    fp32 = fs.plan(shapes, **kw)
    for dtype in (INT8, FP8):
        policy = fs.MixedPrecisionPolicy(grad_comm_dtype=dtype, param_comm_dtype=dtype)
        p = fs.plan(shapes, policy=policy, **kw)
        for kind in ("reduce_scatter", "all_reduce", "all_gather"):
            if fp32.comm[kind]:
                assert 0.25 * fp32.comm[kind] < p.comm[kind] <= 0.27 * fp32.comm[kind], kind
