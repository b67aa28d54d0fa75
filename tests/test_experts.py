"""``fs.ExpertParallel``: experts stacked on dim 0, sharded over the expert mesh, tokens routed
by all-to-all. Each rank routes its own tokens (uneven over the experts, some experts getting
none); outputs and every expert's gradient equal the unparallelized module's over all ranks'
tokens (fp32: the same products and sums, so to rounding of the sum over ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import funcshard as fs

NUM_EXPERTS, DIM, HIDDEN = 8, 6, 10


class GroupedExperts(nn.Module):
    """torchtitan's convention: ``forward(x, num_tokens_per_expert)``, x sorted by expert."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(NUM_EXPERTS, DIM, HIDDEN, generator=g) * 0.3)
        self.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, DIM, generator=g) * 0.3)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        pieces = torch.split(x, counts.tolist())
        return torch.cat([torch.relu(p @ w1[e]) @ w2[e] for e, p in enumerate(pieces)])


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens sorted by expert, their counts (expert 3 gets none from anyone,
    expert 0 none from odd ranks) and the gradient of its outputs."""
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 5, (NUM_EXPERTS,), generator=g)
    counts[3] = 0
    if rank % 2:
        counts[0] = 0
    n = int(counts.sum())
    return torch.randn(n, DIM, generator=g), counts, torch.randn(n, DIM, generator=g)


def ep_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("expert",))
    x, counts, grad = _tokens(rank)
    plain = GroupedExperts()
    ep = parallelize_module(GroupedExperts(), mesh, fs.ExpertParallel())
    xin = x.clone().requires_grad_()
    with fs.comm_stats() as stats:
        out = ep(xin, counts)
        (out * grad).sum().backward()
    # the reference: the plain module on every rank's tokens
    ref_out = plain(x, counts)
    total = sum((plain(*_tokens(r)[:2]) * _tokens(r)[2]).sum() for r in range(world))
    total.backward()
    local = NUM_EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    return {
        "out": (out - ref_out).abs().max().item(),
        "w1": (ep.w1.grad.to_local() - plain.w1.grad[mine]).abs().max().item(),
        "w2": (ep.w2.grad.to_local() - plain.w2.grad[mine]).abs().max().item(),
        "x_grad": xin.grad.shape == x.shape,
        "local_shape": tuple(ep.w1.to_local().shape),
        "bytes": stats.bytes_by_axis["expert"],
    }


@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_equals_the_plain_module(pool_of, n) -> None:
    for result in pool_of(n).run(ep_worker):
        assert result["local_shape"] == (NUM_EXPERTS // n, DIM, HIDDEN)
        # the same products, but a matmul of more rows (every rank's tokens of an expert)
        # blocks its sums otherwise, and the weights' gradients sum the ranks' tokens in
        # another order: fp32 rounding of sums of a few dozen O(1) terms, a few ulps (1e-7)
        assert result["out"] < 1e-6, result
        assert result["w1"] < 1e-5 and result["w2"] < 1e-5, result
        assert result["x_grad"] and result["bytes"] > 0, result


class CutOffExperts(GroupedExperts):
    """Returns ``torch.zeros_like(x)`` when it gets no rows, as many experts modules do: an
    output cut off from autograd on a rank whose experts got no token."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return super().forward(x, counts) if x.shape[0] else torch.zeros_like(x)


def cut_off_worker() -> dict:
    """Every token of both ranks to expert 0 (rank 0's): rank 1's experts get no row."""
    import datetime

    from torch.distributed.device_mesh import DeviceMesh

    # the hang guard: the all-to-alls of this group give up after a minute
    group = dist.new_group(timeout=datetime.timedelta(seconds=60))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("expert",))
    ep = parallelize_module(CutOffExperts(), mesh, fs.ExpertParallel())
    rows = 3
    x = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    counts[0] = rows
    xin = x.clone().requires_grad_()
    with fs.comm_stats() as stats:
        try:
            (ep(xin, counts) + xin).sum().backward()
        except RuntimeError as e:
            return {"error": str(e)[:300]}
    # the reference: the plain module on every rank's tokens (the same counts on each)
    plain = GroupedExperts()
    xs = [torch.randn(rows, DIM, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    xs = [t.requires_grad_() for t in xs]
    sum((plain(t, counts) + t).sum() for t in xs).backward()
    received = rows * dist.get_world_size() if dist.get_rank() == 0 else 0
    return {
        "x_grad": (xin.grad - xs[dist.get_rank()].grad).abs().max().item(),
        "bytes": stats.bytes_by_axis["expert"],
        # the counts, then each row's DIM floats: sent out and back, forward and backward
        "expected": 8 * NUM_EXPERTS + 2 * 4 * DIM * (rows + received),
    }


def test_an_expert_output_cut_off_from_autograd_does_not_hang_the_backward(pool2) -> None:
    """Rank 1's experts get no token and return ``zeros_like(x)``: it still runs the two
    backward all-to-alls rank 0 waits in (within the hang guard's minute), the input
    gradients are the plain module's, and each rank counts every byte it sends, rank 1 its
    backward send too."""
    for result in pool2.run(cut_off_worker):
        assert "error" not in result, result
        assert result["x_grad"] < 1e-6, result
        assert result["bytes"] == result["expected"], result


def bad_worker() -> str:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("expert",))
    experts = GroupedExperts()
    experts.w1 = nn.Parameter(torch.zeros(NUM_EXPERTS + 1, DIM, HIDDEN))
    try:
        parallelize_module(experts, mesh, fs.ExpertParallel())
    except ValueError as e:
        return str(e)
    return "accepted"


def test_experts_that_do_not_split_are_named(pool2) -> None:
    for message in pool2.run(bad_worker):
        assert "'w1'" in message and "multiple of the expert mesh's 2 ranks" in message


class ListedExperts(nn.Module):
    """Experts as a ModuleList (not stacked): each Linear's dim 0 is its output features."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(NUM_EXPERTS))


class SharedScale(GroupedExperts):
    """A scale every expert shares, inside the experts module."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))


def refusals_worker() -> dict:
    import transformers

    world = dist.get_world_size()
    expert = init_device_mesh("cpu", (world,), mesh_dim_names=("expert",))
    tensor = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
    config = transformers.Qwen3MoeConfig(
        hidden_size=DIM, moe_intermediate_size=4, num_experts=NUM_EXPERTS, num_experts_per_tok=2
    )
    cases = {
        "tensor_mesh": (GroupedExperts(), tensor),
        "module_list": (ListedExperts(), expert),
        "shared": (SharedScale(), expert),
        "transformers": (
            transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config),
            expert,
        ),
    }
    errors = {}
    for key, (module, mesh) in cases.items():
        try:
            parallelize_module(module, mesh, fs.ExpertParallel())
            errors[key] = "accepted"
        except ValueError as e:
            errors[key] = str(e)
    return errors


def test_what_is_not_stacked_experts_on_the_expert_mesh_is_refused_by_name(pool2) -> None:
    """A mesh other than mesh["expert"], a ModuleList of experts, a weight shared by every
    expert inside the module, and transformers' experts signature: each a ValueError at
    parallelize_module that names the module or parameter and says what was expected."""
    errors = pool2.run(refusals_worker)[0]
    assert "expected the 1-D expert mesh" in errors["tensor_mesh"], errors
    assert "('tensor',)" in errors["tensor_mesh"], errors
    assert "'experts.0.weight' belongs to a submodule" in errors["module_list"], errors
    assert "ModuleList" in errors["module_list"], errors
    assert f"'scale' of shape ({DIM},)" in errors["shared"], errors
    assert f"other parameters stack {NUM_EXPERTS}" in errors["shared"], errors
    message = errors["transformers"]
    assert "Qwen3MoeExperts" in message and "top_k_index" in message, errors
    assert "apply_expert_parallelism" in message and "router" not in message, errors


def router_worker() -> str:
    """Rank 1's router picks expert NUM_EXPERTS (out of range); rank 0's is fine."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("expert",))
    experts = parallelize_module(GroupedExperts(), mesh, fs.ExpertParallel())
    idx = torch.tensor([0, 1, NUM_EXPERTS if dist.get_rank() == 1 else 2])
    counts = torch.bincount(idx, minlength=NUM_EXPERTS)
    try:
        experts(torch.zeros(3, DIM), counts)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_router_index_out_of_range_is_refused_on_every_rank(pool2) -> None:
    """The offending rank names its counts; its peers, which would otherwise wait in the
    all-to-all of the rows, learn of it at the counts' exchange and raise too."""
    first, second = pool2.run(router_worker)
    assert "another expert rank's" in first, first
    assert f"for the module's {NUM_EXPERTS} experts" in second, second
    assert "router index out of range" in second, second


def moe_gpt_worker(strategy: str) -> float:
    """The MoE GPT of experiments/gpt.py trained as a dense model (every expert gathered)
    beside one plain process on the global batch: the largest parameter difference."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from experiments.gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=16, seq_len=8, n_layer=2, d_model=16, n_head=2, experts=4, top_k=2)
    torch.manual_seed(0)
    model, ref = GPT(cfg), GPT(cfg)
    ref.load_state_dict(model.state_dict())
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def loss_of(m, params, tokens):
        logits = fs.functional_call(m, params, (tokens[:, :-1],)) if params else m(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 16), tokens[:, 1:].reshape(-1))

    for step in range(2):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 16, (6 * world, 9), generator=g)
        state, _ = fs.train_step(
            state, tokens.chunk(world)[rank], lambda p, b: loss_of(model, p, b), microbatches=2
        )
        opt.zero_grad()
        loss_of(ref, None, tokens).backward()
        opt.step()
    full = fs.full_params(state)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_the_moe_gpt_trains_as_a_dense_model(pool2, strategy) -> None:
    for err in pool2.run(moe_gpt_worker, strategy):
        assert err < 1e-5, err


class RoutedMoE(nn.Module):
    """A router (dense, top-1: uneven loads), the experts behind ``fs.ExpertParallel``'s
    convention, a head: what ``fs.init`` takes with the experts on ``mesh["expert"]``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.inp = nn.Linear(4, DIM)
        self.router = nn.Linear(DIM, NUM_EXPERTS, bias=False)
        self.experts = GroupedExperts()
        self.head = nn.Linear(DIM, 3)
        with torch.no_grad():
            for p in (*self.inp.parameters(), self.router.weight, *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        choice = self.router(h).argmax(-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=NUM_EXPERTS)
        y = self.experts(h[order], counts)
        return self.head(torch.empty_like(y).index_copy(0, order, y) + h)


def ep_train_worker(strategy: str, shard: int, replicate: int, expert: int) -> dict:
    """Two SGD-momentum steps of 2 microbatches with fs.ExpertParallel on mesh["expert"],
    beside the plain model on the global batch in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(shard=shard, replicate=replicate, expert=expert, device_type="cpu")
    model, ref = RoutedMoE(), RoutedMoE()
    parallelize_module(model.experts, mesh["expert"], fs.ExpertParallel())
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def loss_of(m, params, batch):
        logits = fs.functional_call(m, params, (batch["x"],)) if params else m(batch["x"])
        return nn.functional.cross_entropy(logits, batch["y"])

    losses = []
    with fs.comm_stats() as stats:
        for step in range(2):
            g = torch.Generator().manual_seed(50 + step)
            batch = {"x": torch.randn(8 * world, 4, generator=g)}
            batch["y"] = torch.randint(0, 3, (8 * world,), generator=g)
            local = {k: v.chunk(world)[rank] for k, v in batch.items()}
            state, metrics = fs.train_step(
                state, local, lambda p, b: loss_of(model, p, b), microbatches=2
            )
            losses.append(metrics["loss"])
            opt.zero_grad()
            loss = loss_of(ref, None, batch)
            loss.backward()
            opt.step()
            losses[-1] -= loss.item()
    full = fs.full_params(state)
    err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    planned = fs.plan(
        model,
        world_size=world,
        shard=shard,
        replicate=replicate,
        expert=expert,
        strategy=strategy,
        microbatches=2,
        routing=fs.Routing(rows=8, width=DIM),  # rows a step (a rank routes 8, top-1)
    )
    return {
        "err": err,
        "loss": max(abs(v) for v in losses),
        "a2a": stats.bytes_by_axis["expert"],
        "calls": stats.calls["all_to_all"],
        "planned": (2 * planned.comm_by_axis["expert"], 2 * planned.calls["all_to_all"]),
    }


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_expert_parallel_trains_through_fs_init_as_one_process(pool4, strategy) -> None:
    """...and its all-to-alls, the rows and the counts' exchange, as ``fs.plan`` predicts
    them: each rank's calls, and its bytes summed over the ranks as the plan's balanced
    routing sums them (every rank routes 8 rows a step)."""
    for mesh in ((4, 1, 2), (2, 2, 2)):
        results = pool4.run(ep_train_worker, strategy, *mesh)
        for result in results:
            assert result["err"] < 1e-5 and result["loss"] < 1e-5, (mesh, result)
            assert result["calls"] == result["planned"][1], (mesh, result)
        measured = sum(r["a2a"] for r in results)
        assert measured == 4 * results[0]["planned"][0] > 0, (mesh, results)


class CheckpointedMoE(RoutedMoE):
    """The experts (in the root unit) recomputed in backward: activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        choice = self.router(h).argmax(-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=NUM_EXPERTS)
        y = checkpoint(self.experts, h[order], counts, use_reentrant=False)
        return self.head(torch.empty_like(y).index_copy(0, order, y) + h)


def recompute_worker() -> str:
    mesh = fs.make_mesh(shard=2, expert=2, device_type="cpu")
    model = CheckpointedMoE()
    parallelize_module(model.experts, mesh["expert"], fs.ExpertParallel())
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy="optim_grads_params")
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randint(0, 3, (8,), generator=g)}

    def loss_fn(params, b):
        logits = fs.functional_call(model, params, (b["x"],))
        return nn.functional.cross_entropy(logits, b["y"])

    try:
        fs.train_step(state, batch, loss_fn)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


def test_experts_recomputed_outside_the_units_name_the_parameter(pool2) -> None:
    """Under ZeRO-3 the root's experts recomputed in backward hold placeholders: the dispatch
    reads the number of experts fixed at parallelize_module (not the placeholders' shape, which
    made it a wrong-pointing "bad num_tokens_per_expert"), and the experts' own read of their
    weights names the parameter."""
    for message in pool2.run(recompute_worker):
        assert "UnitParamsError" in message and "'experts.w1'" in message, message
