"""``fs.check_replicas``: ranks that hold the same rows hold the same bits, or every rank raises
``fs.ReplicaMismatchError`` naming the leaf, the axis and the ranks on each side.

One bit flipped on one rank (a master row, a momentum row, a tensor group's replicated leaf)
after real steps must be found; agreeing replicas pass; the bytes are one hash per leaf per
rank of each group; ``check_replicas_every`` runs it inside ``train_step``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.state import replica_check

import helpers_tp
import models

ROWS = 12


def _flip_one_bit(t: torch.Tensor) -> None:
    """Flips the lowest mantissa bit of ``t``'s first element, in place (a wrong device)."""
    bits = t.reshape(-1)[:1].view(torch.int32)
    bits ^= 1


def _raised(fn) -> str | None:
    try:
        fn()
    except fs.ReplicaMismatchError as e:
        return str(e)
    return None


def hsdp_worker(strategy: str, shard: int, replicate: int, corrupt_rank: int, what: str) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = models.make_model(seed=3)
    opt = fs.optim.sgd(0.1, momentum=0.9)
    state = fs.init(model, opt, mesh=mesh, strategy=strategy)
    state, _ = models.train(state, model, range(2), rows=ROWS)
    with fs.comm_stats() as stats:
        fs.check_replicas(state)  # agreeing replicas: no error
    clean_bytes = stats.bytes["replica_check"]
    labels = len(replica_check.leaf_hashes(state))
    if dist.get_rank() == corrupt_rank:
        if what == "params":
            _flip_one_bit(state.params["inp.weight"])
        else:
            momentum = state.opt_state_by_name()
            leaf = next(
                by_name["inp.weight"] for by_name in _dicts(momentum) if "inp.weight" in by_name
            )
            _flip_one_bit(leaf)
    message = _raised(lambda: fs.check_replicas(state))
    state, metrics = models.train(state, model, range(2, 3), rows=ROWS)  # the group still works
    return {"message": message, "bytes": clean_bytes, "labels": labels}


def _dicts(tree):
    if isinstance(tree, dict) and tree and all(isinstance(v, torch.Tensor) for v in tree.values()):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _dicts(v)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            yield from _dicts(v)


@pytest.mark.parametrize(
    "strategy, shard, replicate, corrupt_rank, what",
    [
        ("optim_grads_params", 2, 2, 3, "params"),  # HSDP: ranks 1 and 3 hold shard 1
        ("optim", 2, 2, 0, "opt_state"),  # ZeRO-1 HSDP: the momentum rows of shard 0
        ("no_shard", 4, 1, 2, "params"),  # no_shard: every rank holds everything
    ],
)
def test_a_flipped_bit_is_named_on_every_rank(
    pool4, strategy, shard, replicate, corrupt_rank, what
):
    results = pool4.run(hsdp_worker, strategy, shard, replicate, corrupt_rank, what)
    messages = [r["message"] for r in results]
    assert all(m is not None for m in messages), messages  # every rank raised
    assert len(set(messages)) == 1, messages  # the same error everywhere
    message = messages[0]
    assert "inp.weight" in message and what in message
    if strategy == "no_shard":
        axis, ranks = "world", [0, 1, 2, 3]
    else:
        axis = "replicate"
        ranks = [corrupt_rank % 2, corrupt_rank % 2 + 2]  # mesh (replicate, shard): r * 2 + s
    assert f"over {axis!r}" in message, message
    partner = next(r for r in ranks if r != corrupt_rank)
    assert f"rank {corrupt_rank}:" in message or f", {corrupt_rank}:" in message, message
    assert str(partner) in message
    # one 8-byte hash per leaf per rank of the group, once, and the 4-byte flag
    group = len(ranks)
    assert results[0]["bytes"] == 8 * results[0]["labels"] * group + 4


def zero3_worker() -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=3)
    state = fs.init(model, fs.optim.adamw(1e-3), mesh=mesh, strategy="optim_grads_params")
    state, _ = models.train(state, model, range(1), rows=ROWS)
    with fs.comm_stats() as stats:
        fs.check_replicas(state)  # no two ranks hold the same rows: nothing to compare
    return {"bytes": sum(stats.bytes.values())}


def test_no_replicas_costs_nothing(pool2):
    assert [r["bytes"] for r in pool2.run(zero3_worker)] == [0, 0]


def tp_worker(corrupt: str) -> dict:
    mesh = helpers_tp.world_mesh(shard=2, replicate=1, tensor=2)
    model = helpers_tp.parallelize(helpers_tp.make_model(seed=5, layers=1), mesh)
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh)
    state, _ = helpers_tp.train(state, model, mesh, range(1), rows=8)
    fs.check_replicas(state)
    if dist.get_rank() == 1:  # tensor rank 1 of shard rank 0 (mesh shard x tensor)
        _flip_one_bit(state.params[corrupt])
    return {"message": _raised(lambda: fs.check_replicas(state))}


def test_tensor_groups_agree_on_replicated_leaves(pool4):
    results = pool4.run(tp_worker, "norm.weight")
    messages = [r["message"] for r in results]
    assert all(m is not None for m in messages), messages
    assert "norm.weight" in messages[0] and "over 'tensor'" in messages[0], messages[0]


def test_a_tensor_sharded_leaf_may_differ_across_the_tensor_group(pool4):
    # a colwise weight's local shards differ by design: only the replicate axis could compare
    # them (none here), so flipping a bit in one is not a tensor-group mismatch
    results = pool4.run(tp_worker, "layers.0.attn.q.weight")
    assert [r["message"] for r in results] == [None] * 4


def every_worker(every: int) -> dict:
    mesh = fs.make_mesh(shard=1, replicate=2, device_type="cpu")
    model = models.make_model(seed=3)
    state = fs.init(
        model, fs.optim.sgd(0.1), mesh=mesh, strategy="optim", check_replicas_every=every
    )
    state, _ = models.train(state, model, range(1), rows=ROWS)
    if dist.get_rank() == 1:
        _flip_one_bit(state.params["inp.weight"])
    steps = []
    try:
        for step in range(1, 4):
            state, _ = models.train(state, model, range(step, step + 1), rows=ROWS)
            steps.append(step)
    except fs.ReplicaMismatchError:
        return {"trained": steps, "raised": True}
    return {"trained": steps, "raised": False}


def test_check_replicas_every_runs_inside_train_step(pool2):
    # checked after steps 2, 4, ...: the step that ends on step 2 raises
    results = pool2.run(every_worker, 2)
    assert [r["raised"] for r in results] == [True, True]
    assert results[0]["trained"] == [1]
    results = pool2.run(every_worker, 0)  # never checked: the corruption trains on
    assert [r["raised"] for r in results] == [False, False]
