"""Donation: liveness per storage, keyed by the storage itself."""

from __future__ import annotations

import gc

import pytest
import torch

from funcshard.state import donation


def test_states_sharing_a_storage_share_its_token() -> None:
    a, b = torch.zeros(8), torch.ones(8)
    first = donation.liveness([a, b])
    second = donation.liveness([a[2:]])  # a view: the same storage
    assert second[0] is first[0]
    donation.consume(first, "train_step")
    with pytest.raises(donation.ConsumedStateError, match="consumed by train_step"):
        donation.check(second)


def test_a_donated_buffer_handed_on_gets_a_fresh_token() -> None:
    a = torch.zeros(8)
    old = donation.liveness([a])
    donation.consume(old, "offload_step")
    new = donation.liveness([a])  # the state the donation returned, on the same buffer
    assert new[0] is not old[0]
    donation.check(new)


def test_a_new_storage_never_inherits_a_collected_ones_token() -> None:
    """Keyed by ``id`` this failed: ids are reused once an object is collected."""
    consumed, ids = 0, []
    for _ in range(200):
        t = torch.zeros(16)
        ids.append(id(t))
        tokens = donation.liveness([t])
        consumed += tokens[0].consumed_by is not None
        donation.consume(tokens, "train_step")
        del t, tokens
        gc.collect(0)  # the youngest generation: a full collection of the suite's heap is slow
    assert len(set(ids)) < len(ids), "no id was reused: the case tested nothing"
    assert consumed == 0


def test_meta_and_empty_tensors_carry_no_token() -> None:
    (token,) = donation.liveness([torch.empty(4, device="meta"), torch.empty(0)])
    assert token.consumed_by is None


def opt_buffer_worker() -> dict:
    import funcshard as fs

    import models

    model = models.make_model()
    opt = fs.optim.sgd(0.1, momentum=0.9)
    state = fs.init(model, opt, mesh=fs.make_mesh(device_type="cpu"), strategy="optim")
    batch = models.local_batch(models.global_batch(0, 8), 0, 1)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    # a state that shares only the optimizer state's buffers (new masters)
    fresh = lambda ts: tuple(t.clone() if t is not None else None for t in ts)  # noqa: E731
    sharer = state.replace(master=fresh(state.master), compute=fresh(state.compute))
    fs.train_step(state, batch, models.make_loss_fn(model))
    try:
        _ = sharer.opt_state
    except fs.ConsumedStateError as e:
        return {"refused": str(e)}
    return {"refused": ""}


def test_a_state_sharing_only_optimizer_buffers_is_refused(pool1) -> None:
    """The optimizer state's per-bucket buffers carry tokens too (found by review: they were
    flattened as opaque leaves)."""
    (r,) = pool1.run(opt_buffer_worker)
    assert "consumed by train_step" in r["refused"], r
