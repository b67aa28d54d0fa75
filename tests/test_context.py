"""Context parallel (``fs.ContextParallel`` on ``fs.make_mesh(context=C)``): a tiny causal
transformer whose positions come from the batch (or a RoPE buffer) trains on sequences split
over the context group as one process trains it on the full sequences.

fp32, SGD with momentum 0.9, 3 steps of 2 microbatches: both algorithms, load balance on and
off, ZeRO-0/2/3 at C=2; C=4 and HSDP (R2 x C2) on 4 ranks; within 1e-5 (params, losses, grad
norms), and the bytes per mesh axis ("context": attention's exchange) equal ``fs.plan``'s.
Attention kept within each rank's own chunks fails the same parity (the test's teeth). The
bad inputs raise ValueError naming what is wrong on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funcshard as fs
from funcshard.parallel import context as context_lib

import helpers_context as hc
import models

TOL = 1e-5
STEPS, ROWS, LENGTH = 3, 8, 16


def _run(
    strategy: str,
    algorithm: str,
    balance: bool,
    *,
    context: int,
    replicate: int = 1,
    rope: bool = False,
) -> dict:
    mesh = fs.make_mesh(context=context, replicate=replicate, device_type="cpu")
    model, plain = hc.make_model(0, rope=rope), hc.make_model(0, rope=rope)
    cp = fs.ContextParallel(
        seq_dims=hc.SEQ_DIMS,
        algorithm=algorithm,
        load_balance=balance,
        buffers={"rope.table": 0} if rope else {},
    )
    opt = fs.optim.sgd(0.1, momentum=0.9)
    state = fs.init(model, opt, mesh=mesh, strategy=strategy, context=cp)
    ref = hc.reference_run(plain, STEPS, ROWS, LENGTH)
    groups = dist.get_world_size() // context
    with fs.comm_stats() as stats:
        state, history = hc.train(state, model, STEPS, ROWS, LENGTH, groups)
    errors = models.parity_errors(state, history, ref)
    planned = fs.plan(
        model,
        world_size=dist.get_world_size(),
        replicate=replicate,
        strategy=strategy,
        optimizer="sgd_momentum",
        microbatches=2,
        device_type="cpu",
        context=context,
        seq_len=LENGTH,
        batch_size=ROWS // groups,
        attention=(hc.LAYERS, hc.HEADS, hc.DIM // hc.HEADS),
        context_algorithm=algorithm,
    )
    return {
        **errors,
        "context_bytes": stats.bytes_by_axis["context"],
        "measured": {k: v for k, v in stats.bytes_by_axis.items() if v},
        "planned": {k: STEPS * v for k, v in planned.comm_by_axis.items() if v},
    }


def _local_attention(
    self,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """What context parallel would be without the exchange: each rank's chunks on their own."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)


CASES = {  # (strategy, algorithm, load_balance, rope), a few to a pool call
    "zero0": [
        ("no_shard", "all_to_all", True, False),
        ("no_shard", "all_to_all", False, False),
        ("no_shard", "ring", True, True),
    ],
    "zero3": [
        ("optim_grads_params", "all_to_all", True, False),
        ("optim_grads_params", "all_to_all", False, True),
        ("optim_grads_params", "ring", False, False),
    ],
    "zero2_zero3": [
        ("optim_grads", "ring", False, False),
        ("optim_grads_params", "ring", True, False),
    ],
}


def parity_worker_2(cases: list) -> dict:
    out = {}
    for strategy, algorithm, balance, rope in cases:
        key = f"{strategy}/{algorithm}/balance={balance}/rope={rope}"
        out[key] = _run(strategy, algorithm, balance, context=2, rope=rope)
    return out


def local_only_worker() -> dict:
    original = context_lib.ContextGroup.attention
    context_lib.ContextGroup.attention = _local_attention
    try:
        return {s: _run(s, "all_to_all", True, context=2) for s in ("no_shard", "optim_grads")}
    finally:
        context_lib.ContextGroup.attention = original


@pytest.mark.parametrize("cases", list(CASES))
def test_context_parallel_equals_one_process_on_full_sequences(pool2, cases: str) -> None:
    for results in pool2.run(parity_worker_2, CASES[cases]):
        for key, errors in results.items():
            assert max(errors[k] for k in ("params", "loss", "norm")) < TOL, (key, errors)
            assert errors["context_bytes"] > 0, (key, errors)
            assert errors["measured"] == errors["planned"], key  # every axis, "context" too


def test_attention_within_own_chunks_fails_the_parity(pool2) -> None:
    """The parity above has teeth: the same runs with each rank's attention kept within its
    own chunks (no exchange) are far from the one process."""
    for results in pool2.run(local_only_worker):
        for key, errors in results.items():
            assert max(errors[k] for k in ("params", "loss", "norm")) > 1e-3, (key, errors)
            assert errors["context_bytes"] == 0, (key, errors)


def parity_worker_4() -> dict:
    ranks = dist.get_process_group_ranks
    mesh = fs.make_mesh(context=2, replicate=2, device_type="cpu")
    me = dist.get_rank()
    layout = {
        "names": mesh.mesh_dim_names,
        "context": ranks(mesh["context"].get_group()),
        "shard": ranks(mesh["shard"].get_group()),
        "replicate": ranks(mesh["replicate"].get_group()),
        "me": me,
    }
    return {
        "layout": layout,
        "C4/ring": _run("optim_grads_params", "ring", True, context=4),
        "C4/all_to_all": _run("no_shard", "all_to_all", False, context=4),
        "R2C2/all_to_all": _run("optim_grads_params", "all_to_all", True, context=2, replicate=2),
    }


def test_four_ranks_and_hsdp_equal_one_process(pool4) -> None:
    for results in pool4.run(parity_worker_4):
        layout = results.pop("layout")
        me = layout["me"]
        # rank ((r * S + s) * C + c): a context group is C consecutive ranks, "shard" the
        # flattened shard_outer x context (here S=1: the context group itself)
        assert layout["names"] == ("replicate", "shard_outer", "context")
        assert layout["context"] == [me - me % 2, me - me % 2 + 1]
        assert layout["shard"] == layout["context"]
        assert layout["replicate"] == [me % 2, me % 2 + 2]
        for key, errors in results.items():
            assert max(errors[k] for k in ("params", "loss", "norm")) < TOL, (key, errors)
            assert errors["measured"] == errors["planned"], key


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def bad_input_worker() -> dict:
    mesh = fs.make_mesh(context=2, device_type="cpu")
    opt = fs.optim.sgd(0.1)

    def state_of(model, **cp):
        cp = fs.ContextParallel(seq_dims=hc.SEQ_DIMS, **cp)
        return fs.init(model, opt, mesh=mesh, strategy="no_shard", context=cp)

    model = hc.make_model(0)
    loss_fn = hc.make_loss_fn(model)
    batch = hc.global_batch(0, 2, LENGTH)
    out = {}
    state = state_of(model)
    odd = hc.global_batch(0, 2, 6)  # 6: divisible by C=2, not by 2C=4
    out["length"] = _error(lambda: fs.train_step(state, odd, loss_fn))
    state = state_of(model, load_balance=False)
    odd = hc.global_batch(0, 2, 5)
    out["length_unbalanced"] = _error(lambda: fs.train_step(state, odd, loss_fn))
    missing = {k: v for k, v in batch.items() if k != "positions"}
    out["missing"] = _error(lambda: fs.train_step(state, missing, loss_fn))
    one_head = hc.make_model(0, heads=1)
    state = state_of(one_head)
    out["heads"] = _error(lambda: fs.train_step(state, batch, hc.make_loss_fn(one_head)))

    def masked(params, mb):
        q = torch.ones(1, 2, LENGTH // 2, 8)
        mask = torch.ones(LENGTH // 2, LENGTH // 2, dtype=torch.bool)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum() * 0 + loss_fn(
            params, mb
        )

    state = state_of(model)
    out["mask"] = _error(lambda: fs.train_step(state, batch, masked))
    state, metrics = fs.train_step(state, batch, loss_fn)  # the state still steps
    out["after"] = metrics["loss"]
    return out


def test_bad_input_raises_on_every_rank(pool2) -> None:
    for out in pool2.run(bad_input_worker):
        assert "'tokens' has sequence length 6, not divisible by 2 x context = 4" in out["length"]
        assert "'tokens' has sequence length 5, not divisible by 2" in out["length_unbalanced"]
        assert "'positions' is missing from the batch" in out["missing"]
        assert "has 1 heads, not divisible by context=2" in out["heads"]
        assert "attn_mask" in out["mask"]
        assert out["after"] > 0


def test_flash_ring_exact_keeps_only_its_inputs_and_balances_flops(pool2) -> None:
    """The ring on its own: output and q, k, v gradients of both block kernels (torch's CPU
    flash kernel and the fp32 math one) against SDPA on the whole sequence; its node keeps for
    the backward only this rank's q, k, v, the output and the log-sum-exp (no block, nothing
    received), as does all_to_all's kernel on the head-split sequence: both what fs.plan's
    ``memory.attention`` predicts; and the causal head-tail split gives both ranks the same
    attention FLOPs (counted in the kernel calls, as ``ring.flops`` predicts), where the plain
    split does not."""
    results = pool2.run(hc.ring_worker)
    for out in results:
        for algorithm, (saved, planned) in out.pop("saved").items():
            assert saved == planned, (algorithm, saved, planned)  # fs.plan's memory.attention
        for key, case in out.items():
            assert case["error"] < 1e-5, (key, case)
            saved, expected = case["saved"]
            assert saved == expected, (key, case)
            counted, predicted = case["flops"]
            assert counted == predicted, (key, case)
    for key in results[0]:
        a, b = (out[key]["flops"][0] for out in results)
        if "causal=True/balanced=False" in key:
            assert max(a, b) > 1.5 * min(a, b), (key, a, b)  # the teeth: unbalanced differs
        else:
            assert abs(a - b) <= 0.05 * max(a, b), (key, a, b)


# bf16 compute (fp32 masters and merge): each bf16 rounding is within 2^-8 relative; a few
# chained through two layers' forward and backward bound the loss and gradient-norm errors,
# and the parameters move by lr-sized updates from fp32 masters.
BF16_TOL = 8 * 2.0**-8


def test_context_composes_with_bf16_offload_and_checkpoints(pool1, pool2, tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    results = pool2.run(hc.compose_worker_2, directory)
    restored = pool1.run(hc.restore_worker_1, directory)[0]
    for out in results:
        for key in ("bf16/ring", "bf16/all_to_all"):
            assert max(out[key].values()) < BF16_TOL, (key, out[key])
        assert max(out["offload/ring"].values()) < TOL, out["offload/ring"]
        for name, tensor in out["full"].items():
            assert torch.equal(restored[name], tensor), name  # bitwise at C=1


def test_context_composes_with_hfsdp_and_deterministic_layouts(pool4) -> None:
    for out in pool4.run(hc.compose_worker_4):
        assert out.pop("bitwise"), "deterministic=True: R2 x C2 and S2 x C2 params differ"
        for key, errors in out.items():
            assert max(errors.values()) < TOL, (key, errors)


def test_context_composes_with_the_tensor_axis(pool4) -> None:
    """context=2 x tensor=2: each tensor rank's heads attend over the whole sequence."""
    for out in pool4.run(hc.tensor_worker):
        for key, errors in out.items():
            assert max(errors.values()) < TOL, (key, errors)
