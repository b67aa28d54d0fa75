"""``fs.summed``: an aux tensor summed over the step's microbatches and data-parallel ranks.

A router (top-1 over 5 experts, uneven loads) counts its tokens per expert in ``loss_fn`` and
hands them back as ``fs.summed(counts)``. On 2 ranks with 2 microbatches, ``metrics["aux"]``
must hold the count of the plain one-process router over the GLOBAL batch (every microbatch of
every rank, each once), while a plain aux leaf stays the last microbatch's own. Under tensor
parallelism the two tensor ranks see the same tokens: the total counts them once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import funcshard as fs

EXPERTS, DIM, ROWS = 5, 6, 12  # ROWS per data-parallel rank


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.inp = nn.Linear(4, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.fc = nn.Linear(DIM, 8)
        self.out = nn.Linear(8, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        load = torch.bincount(self.router(h).argmax(-1), minlength=EXPERTS)
        return self.out(torch.tanh(self.fc(h))), load


def _batch(step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(70 + step)
    return {"x": torch.randn(rows, 4, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)}


def _global_load(params: dict, x: torch.Tensor) -> torch.Tensor:
    """The plain router's tokens per expert over ``x``, in one process."""
    h = nn.functional.linear(x, params["inp.weight"], params["inp.bias"])
    return torch.bincount((h @ params["router.weight"].T).argmax(-1), minlength=EXPERTS)


def summed_worker(strategy: str, tensor: int, deterministic: bool) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(shard=world // tensor, tensor=tensor, device_type="cpu")
    model = Routed()
    if tensor > 1:
        plan = {"fc": ColwiseParallel(), "out": RowwiseParallel()}
        parallelize_module(model, mesh["tensor"], plan)
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy, deterministic=deterministic
    )
    dp, dp_rank = world // tensor, rank // tensor  # the tensor ranks of a group share rows

    def loss_fn(params, batch):
        logits, load = fs.functional_call(model, params, (batch["x"],))
        loss = nn.functional.cross_entropy(logits, batch["y"])
        return loss, {"load": fs.summed(load), "last": load, "rows": fs.summed(torch.ones(1))}

    out = []
    for step in range(2):
        batch = _batch(step, ROWS * dp)
        expected = _global_load(fs.full_params(state), batch["x"])
        local = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        last = _global_load(fs.full_params(state), local["x"].tensor_split(2)[1])
        state, metrics = fs.train_step(state, local, loss_fn, microbatches=2)
        aux = metrics["aux"]
        out.append((aux["load"], expected, aux["last"], last, aux["rows"]))
    return out


@pytest.mark.parametrize(
    "strategy,tensor,deterministic",
    [
        ("no_shard", 1, False),
        ("optim_grads", 1, False),
        ("optim_grads_params", 1, False),
        ("optim_grads_params", 1, True),
        ("optim", 2, False),
    ],
)
def test_summed_aux_is_the_global_count(pool2, strategy, tensor, deterministic) -> None:
    for rank_out in pool2.run(summed_worker, strategy, tensor, deterministic):
        for load, expected, last, last_expected, rows in rank_out:
            assert load.dtype == torch.int64 and torch.equal(load, expected), (load, expected)
            assert int(load.sum()) == ROWS * 2 // tensor
            assert torch.equal(last, last_expected)  # a plain leaf: the last microbatch's
            # one per microbatch per data-parallel rank: 2 microbatches x (2 / tensor) ranks
            assert rows.tolist() == [2.0 * 2 / tensor]


def test_summed_takes_tensors_only() -> None:
    assert torch.equal(fs.summed(torch.tensor([1, 2])).value, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="fs.summed: expected a tensor, got int"):
        fs.summed(3)


def test_the_moe_gpt_balances_its_routers_from_the_load() -> None:
    """experiments/gpt.py: ``expert_load`` counts each block's tokens per expert (top_k per
    token), and ``balance_routers`` moves each block's bias by the rate against its load."""
    from experiments.gpt import GPT, GPTConfig, balance_routers, expert_load

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=16, seq_len=8, n_layer=2, d_model=16, n_head=2, experts=4, top_k=2)
    model = GPT(cfg)
    model(torch.randint(0, 16, (3, 8)))
    load = expert_load(model)
    assert load.shape == (2, 4) and load.sum(1).tolist() == [3 * 8 * 2] * 2
    given = torch.tensor([[10, 2, 6, 6], [0, 0, 1, 7]])
    balance_routers(model, given, 0.01)
    biases = [b.moe.router_bias for b in model.blocks]
    assert torch.equal(biases[0], torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert torch.equal(biases[1], torch.tensor([0.01, 0.01, 0.01, -0.01]))


def mismatch_worker(case: str = "shape") -> str:
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    model = Routed()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)

    def loss_fn(params, batch):  # a leaf whose shape follows the microbatch's rows
        logits, _ = fs.functional_call(model, params, (batch["x"],))
        loss = nn.functional.cross_entropy(logits, batch["y"])
        rows = batch["x"].shape[0]
        if case == "late":  # absent from the first microbatch (3 rows), then there
            return loss, ({"rows": fs.summed(torch.ones(1))} if rows == 2 else {})
        if case == "ranks":  # a count whose size follows the rank's data
            return loss, {"rows": fs.summed(torch.ones(dist.get_rank() + 1))}
        return loss, {"rows": fs.summed(torch.ones(rows))}

    try:
        fs.train_step(state, _batch(0, 5), loss_fn, microbatches=2)  # 3 rows, then 2
    except ValueError as e:
        return str(e)
    return "no error"


def test_summed_leaves_must_agree_across_microbatches(pool2) -> None:
    for message in pool2.run(mismatch_worker):
        assert "same fs.summed leaves" in message and "rows" in message, message


def test_a_summed_leaf_absent_from_the_first_microbatch_is_named(pool2) -> None:
    for message in pool2.run(mismatch_worker, "late"):
        said = "fs.summed leaf 'rows' is of shape (1,) in this microbatch's aux and absent in"
        assert f"{said} the first's" in message, message


def test_a_summed_leaf_of_another_shape_on_another_rank_is_named_on_every_rank(pool2) -> None:
    # before: gloo aborted a rank ("collective mismatch") in the all-reduce of the totals
    for message in pool2.run(mismatch_worker, "ranks"):
        said = "fs.summed leaf 'rows' differs across the data-parallel ranks"
        assert f"{said} (rank 0: of shape (1,); rank 1: of shape (2,))" in message, message


def test_a_loss_that_is_not_a_scalar_is_refused_with_its_shape() -> None:
    """A per-row loss left unreduced (a common slip) names its shape, not its values."""
    from funcshard.step.units.losses import loss_and_aux

    with pytest.raises(TypeError, match=r"got a tensor of shape \(4, 3\)"):
        loss_and_aux((torch.ones(4, 3), {"n": 1}))
    with pytest.raises(TypeError, match="got <class 'float'>"):
        loss_and_aux(1.0)
    loss, aux = loss_and_aux(torch.ones(1, 1))
    assert loss.shape == () and aux is None
