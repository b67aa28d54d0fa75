"""``deterministic=True``: the same bits on every layout with the same number of chunks.

The global batch (36 rows, fresh random data every step) is split into G = 4 equal chunks by
every layout: 1 rank x 4 microbatches, 2 ranks x 2 under each strategy, 4 ranks x 1, the 2x2
mesh, and offloaded layouts. Four steps of clip + masked AdamW + warmup-cosine in fp32, one
thread per rank, on the uneven model (37-row leaves, a 0-d leaf); then every parameter, every
optimizer-state tensor and every metric must be ``torch.equal`` to the 1-rank run. A save on 2
ranks restored on 4 and continued must equal the straight run. Each building block has a test
that the ordinary path would fail (so the equality is not luck of the model).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.comm.wires import TreeWire
from funcshard.layout import determinism

import models
from helpers_determinism import (
    CHUNKS,
    CLIP,
    RECIPES,
    ROWS,
    STEPS,
    assert_bitwise,
    recipe,
    run,
    snapshot,
)


def _init(
    strategy: str,
    shard: int = -1,
    replicate: int = 1,
    fraction: float = 0.0,
    deterministic: bool = True,
    seed: int = 3,
    optimizer: str = "adamw",
    outer: str = "no_shard",
):
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    return fs.init(
        models.make_model(seed=seed),
        RECIPES[optimizer](),
        mesh=mesh,
        strategy=strategy,
        offload_fraction=fraction,
        deterministic=deterministic,
        outer_strategy=outer,
    )


def train_worker(
    strategy: str,
    shard: int = -1,
    replicate: int = 1,
    fraction: float = 0.0,
    deterministic: bool = True,
    penalty: bool = False,
    optimizer: str = "adamw",
    twice: bool = False,
    outer: str = "no_shard",
) -> dict:
    torch.set_num_threads(1)
    state = _init(
        strategy, shard, replicate, fraction, deterministic, optimizer=optimizer, outer=outer
    )
    state, metrics = run(state, range(STEPS), CHUNKS // dist.get_world_size(), penalty, twice)
    return {**snapshot(state), "metrics": metrics}


@pytest.fixture(scope="module")
def golden(pool1) -> dict:
    """The 1-rank run: 4 microbatches."""
    result = pool1.run(train_worker, "optim_grads_params")[0]
    assert sum(norm > CLIP for _, norm, _ in result["metrics"]) >= STEPS - 1, result["metrics"]
    return result


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_strategies_agree(pool1, golden, strategy: str) -> None:
    assert_bitwise(pool1.run(train_worker, strategy)[0], golden, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_two_microbatches(pool2, golden, strategy: str) -> None:
    for rank, result in enumerate(pool2.run(train_worker, strategy)):
        assert_bitwise(result, golden, f"{strategy} rank {rank}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_four_ranks_one_microbatch(pool4, golden, strategy: str) -> None:
    for rank, result in enumerate(pool4.run(train_worker, strategy)):
        assert_bitwise(result, golden, f"{strategy} rank {rank}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_2x2_mesh(pool4, golden, strategy: str) -> None:
    for rank, result in enumerate(pool4.run(train_worker, strategy, 2, 2)):
        assert_bitwise(result, golden, f"2x2 {strategy} rank {rank}")


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_hfsdp(pool4, golden, strategy: str) -> None:
    """HFSDP (masters and optimizer state over replicate x shard) gives HSDP's bits."""
    for rank, result in enumerate(pool4.run(train_worker, strategy, 2, 2, outer="optim")):
        assert_bitwise(result, golden, f"HFSDP {strategy} rank {rank}")


@pytest.mark.parametrize("strategy,fraction", [("optim_grads_params", 0.5), ("optim", 1.0)])
def test_offloaded(pool2, golden, strategy: str, fraction: float) -> None:
    for rank, result in enumerate(pool2.run(train_worker, strategy, -1, 1, fraction)):
        assert_bitwise(result, golden, f"{strategy} offload {fraction} rank {rank}")


def test_without_it_layouts_differ(pool4, golden) -> None:
    """The ordinary reductions do not give these bits: the equalities above are the mode's."""
    result = pool4.run(train_worker, "optim_grads_params", -1, 1, 0.0, False)[0]
    differ = [k for k, v in result["tensors"].items() if not torch.equal(v, golden["tensors"][k])]
    assert differ


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_param_read_by_name_beside_its_unit(pool1, pool4, strategy: str) -> None:
    """Its bucket enters the graph twice: its uses are summed before the ranks' parts, as
    autograd sums them under ZeRO-0."""
    want = pool1.run(train_worker, "no_shard", -1, 1, 0.0, True, True)[0]
    for rank, result in enumerate(pool4.run(train_worker, strategy, -1, 1, 0.0, True, True)):
        assert_bitwise(result, want, f"{strategy} with a penalty, rank {rank}")


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_bucket_used_three_times(pool1, pool2, pool4, strategy: str) -> None:
    """The model run twice plus the penalty: three uses of a block's bucket in one forward,
    summed as autograd sums them under ZeRO-0, before the ranks' parts (4 ranks x 1
    microbatch, and 2 x 2)."""
    want = pool1.run(train_worker, "no_shard", -1, 1, 0.0, True, True, twice=True)[0]
    for pool in (pool4, pool2):
        for rank, result in enumerate(
            pool.run(train_worker, strategy, -1, 1, 0.0, True, True, twice=True)
        ):
            assert_bitwise(result, want, f"{strategy} used three times, rank {rank}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_muon_too(pool1, pool2, pool4, strategy: str) -> None:
    """Muon's owners orthogonalize the same bits whatever the layout (half offloaded too;
    and under HFSDP, where each matrix has one owner in the whole world)."""
    want = pool1.run(train_worker, "no_shard", optimizer="muon")[0]
    for pool, fraction in ((pool4, 0.0), (pool2, 0.5)):
        for rank, result in enumerate(
            pool.run(train_worker, strategy, fraction=fraction, optimizer="muon")
        ):
            assert_bitwise(result, want, f"muon {strategy} offload {fraction} rank {rank}")
    if strategy == "no_shard":
        return
    hfsdp = pool4.run(train_worker, strategy, 2, 2, 0.5, optimizer="muon", outer="optim")
    for rank, result in enumerate(hfsdp):
        assert_bitwise(result, want, f"muon HFSDP {strategy} offload 0.5 rank {rank}")


# --- save on 2 ranks, restore on 4, continue == the straight run --------------------------------
def save_worker(directory: str, **layout) -> None:
    torch.set_num_threads(1)
    state = _init(layout.pop("strategy", "optim_grads_params"), **layout)
    state, _ = run(state, range(2), CHUNKS // dist.get_world_size())
    fs.save(directory, state)


def resume_worker(directory: str, strategy: str, **layout) -> dict:
    torch.set_num_threads(1)
    like = _init(strategy, seed=11, **layout)  # other weights: none may survive the restore
    state = fs.restore(directory, like=like)
    state, metrics = run(state, range(2, STEPS), CHUNKS // dist.get_world_size())
    return {**snapshot(state), "metrics": metrics}


def test_resume_on_another_layout_equals_the_straight_run(pool2, pool4, golden, tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    pool2.run(save_worker, directory, fraction=0.5)
    want = {**golden, "metrics": golden["metrics"][2:]}
    for rank, result in enumerate(pool4.run(resume_worker, directory, "optim")):
        assert_bitwise(result, want, f"resumed rank {rank}")


def test_resume_across_outer_strategies(pool2, pool4, golden, tmp_path) -> None:
    """Saved under HFSDP (2x2), restored under HSDP (2x2) and on 2 flat ranks; saved on 2
    flat ranks, restored under HFSDP: every continuation equals the straight run."""
    hfsdp = {"shard": 2, "replicate": 2, "outer": "optim"}
    want = {**golden, "metrics": golden["metrics"][2:]}
    pool4.run(save_worker, str(tmp_path / "hfsdp"), strategy="optim_grads", **hfsdp)
    for rank, result in enumerate(
        pool4.run(resume_worker, str(tmp_path / "hfsdp"), "optim", shard=2, replicate=2)
    ):
        assert_bitwise(result, want, f"HFSDP -> HSDP rank {rank}")
    for rank, result in enumerate(
        pool2.run(resume_worker, str(tmp_path / "hfsdp"), "optim_grads_params")
    ):
        assert_bitwise(result, want, f"HFSDP -> 2 flat ranks, rank {rank}")
    pool2.run(save_worker, str(tmp_path / "flat"), strategy="optim")
    for rank, result in enumerate(
        pool4.run(resume_worker, str(tmp_path / "flat"), "optim_grads_params", **hfsdp)
    ):
        assert_bitwise(result, want, f"2 flat ranks -> HFSDP rank {rank}")


class _Thin(torch.nn.Module):
    """Width 1: leaves of one row and a few columns, whose full views move with the padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = torch.nn.Linear(5, 1)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(1), torch.nn.Linear(1, 1), torch.nn.Tanh())
            for _ in range(3)
        )
        self.head = torch.nn.Linear(1, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def thin_worker(strategy: str) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Thin()
    state = fs.init(
        model, recipe(), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy, deterministic=True
    )
    loss_fn, metrics = models.make_loss_fn(model), []
    for step in range(2):
        batch = models.local_batch(models.global_batch(step, 48), rank, world)
        state, m = fs.train_step(state, batch, loss_fn, microbatches=8 // world)
        metrics.append((m["loss"], m["grad_norm"], m["nonfinite"]))
    return {**snapshot(state), "metrics": metrics}


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_leaves_thinner_than_the_shards(pool1, pool2, strategy: str) -> None:
    """CPU kernels give other bits at another alignment of the same values (a (6, 5) @ (5, 1)
    matmul whose weight starts 4 bytes further on), and a leaf's place in the full buffer
    depends on the padding, hence on the shard count: a deterministic layout aligns every
    leaf's shard to 32 elements. Without that the 2-rank runs differ from step 0's norm."""
    want = pool1.run(thin_worker, "no_shard")[0]
    for rank, result in enumerate(pool2.run(thin_worker, strategy)):
        assert_bitwise(result, want, f"{strategy} rank {rank}")


# --- the building blocks -------------------------------------------------------------------------
def test_pairwise_sum_is_a_fixed_tree() -> None:
    xs = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    assert float(determinism.pairwise_sum(xs)) == float((xs[0] + xs[1]) + (xs[2] + xs[3]))
    acc = determinism.PairwiseSum()
    for x in xs:
        acc.add([x.clone(), None])
    out = acc.result()
    assert torch.equal(out[0], determinism.pairwise_sum(xs)) and out[1] is None
    # a left fold gives other bits on these values: the tree is not an accident
    assert float(((xs[0] + xs[1]) + xs[2]) + xs[3]) != float(out[0])


@pytest.mark.parametrize("count", [1, 2, 4, 8, 16])
def test_a_tree_completed_entry_by_entry_is_the_whole_tree(count: int) -> None:
    """What the last microbatch of a deterministic ZeRO-2/3 step does per bucket as backward
    goes: ``total(i, last)`` equals ``add(last)`` then ``result()[i]`` bitwise, for every
    entry (one with no value in the last microbatch, one with none before)."""
    g = torch.Generator().manual_seed(count)
    values = [
        [torch.randn(257, generator=g) * torch.logspace(-7, 7, 257) for _ in range(3)]
        for _ in range(count)
    ]
    for step in values[:-1]:
        step[2] = None
    values[-1][1] = None
    whole, parts = determinism.PairwiseSum(), determinism.PairwiseSum()
    for step in values:
        whole.add([v.clone() if v is not None else None for v in step])
    for step in values[:-1]:
        parts.add([v.clone() if v is not None else None for v in step])
    want = whole.result()
    for i, last in enumerate(values[-1]):
        got = parts.total(i, last.clone() if last is not None else None)
        assert (got is None and want[i] is None) or torch.equal(got, want[i]), i
    if count >= 8:  # the tree's shape shows in these bits: a left fold gives others
        fold = values[0][0].clone()
        for step in values[1:]:
            fold += step[0]
        assert not torch.equal(fold, want[0])


def test_halving_sum_depends_on_values_only() -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 301, dtype=torch.float64) * torch.logspace(-8, 8, 301, dtype=torch.float64)
    whole = determinism.halving_sum(x)
    for rows in ((0, 19), (19, 37), (5, 6)):
        part = determinism.halving_sum(x[rows[0] : rows[1]].clone())
        assert torch.equal(part, whole[rows[0] : rows[1]])
    with torch.no_grad():
        torch.set_num_threads(2)
        assert torch.equal(determinism.halving_sum(x), whole)


def reduce_worker(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each rank's values and its reduced shard (tree order) and all-reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    full = torch.randn(world * n, generator=g) * torch.logspace(-6, 6, world * n)
    with fs.comm_stats() as stats:
        tree = TreeWire(full.dtype)
        shard = tree.start_reduce_scatter(full.clone(), dist.group.WORLD, axis="world").wait()
        every = tree.start_all_reduce(full[: 3 * n + 1].clone(), dist.group.WORLD, axis="world")
        every = every.wait()
    return [full], [
        shard,
        every,
        torch.tensor([stats.bytes["reduce_scatter"], stats.bytes["all_reduce"]]),
    ]


def test_tree_collectives_sum_in_rank_order(pool4) -> None:
    n = 50
    results = pool4.run(reduce_worker, n)
    values = [inputs[0] for inputs, _ in results]
    tree = determinism.pairwise_sum(values)
    for rank, (_, (shard, every, nbytes)) in enumerate(results):
        assert torch.equal(shard, tree[rank * n : (rank + 1) * n])
        assert torch.equal(every, tree[: 3 * n + 1])
        # counted as the collectives they replace: the reduce-scatter's input, the tensor
        assert nbytes.tolist() == [4 * n * 4, (3 * n + 1) * 4]
    ring = values[0] + values[1] + values[2] + values[3]  # another order, other bits
    assert not torch.equal(ring, tree)


def error_worker(what: str) -> str:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    try:
        if what == "comm":
            policy = fs.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)
            fs.init(model, recipe(), mesh=mesh, policy=policy, deterministic=True)
        elif what == "world":
            fs.init(model, recipe(), mesh=mesh, deterministic=True)
        else:
            state = fs.init(model, recipe(), mesh=mesh, deterministic=True)
            batch = models.local_batch(models.global_batch(0, ROWS), dist.get_rank(), 2)
            fs.train_step(state, batch, models.make_loss_fn(model), microbatches=3)
    except ValueError as e:
        return str(e)
    return "no error"


def test_errors_say_what_is_needed(pool2, pool3) -> None:
    assert "power of two" in pool3.run(error_worker, "world")[0]
    assert "2 * 3 = 6" in pool2.run(error_worker, "microbatches")[0]
    msg = pool2.run(error_worker, "comm")[0]
    assert "grad_comm_dtype" in msg and "parameter 'scale'" in msg


def comm_worker(strategy: str, shard: int, replicate: int, microbatches: int) -> tuple:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = models.make_model()
    state = fs.init(model, recipe(), mesh=mesh, strategy=strategy, deterministic=True)
    world = dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, ROWS), dist.get_rank(), world)
    with fs.comm_stats() as stats:
        fs.train_step(state, batch, models.make_loss_fn(model), microbatches)
    p = fs.plan(
        model,
        world_size=world,
        shard=shard,
        replicate=replicate,
        strategy=strategy,
        microbatches=microbatches,
        optimizer=recipe(),
        device_type="cpu",
        deterministic=True,
    )
    return (
        dict(stats.bytes),
        dict(stats.calls),
        {k: v for k, v in p.comm.items() if v},
        {k: v for k, v in p.calls.items() if v},
        len(state.layout.buckets),
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mesh,microbatches", [("4", 1), ("2x2", 2)])
def test_bytes_equal_the_plan(pool4, strategy: str, mesh: str, microbatches: int) -> None:
    """The same bytes as the ordinary collectives; ZeRO-2/3 reduce once for all microbatches."""
    shard, replicate = {"4": (4, 1), "2x2": (2, 2)}[mesh]
    for nbytes, calls, planned, planned_calls, buckets in pool4.run(
        comm_worker, strategy, shard, replicate, microbatches
    ):
        assert nbytes == planned and calls == planned_calls
        if strategy != "no_shard":  # one reduce-scatter per bucket and step
            assert calls["reduce_scatter"] == buckets
