"""Checkpoints carry the model's persistent buffers (``funcshard.state.buffers``).

A model with a router bias (DeepSeek-V3's, updated by the loop) and a BatchNorm (running
statistics updated by the forward, an int64 0-d counter) trains on 2 ranks; the loop changes
the bias; ``fs.save`` (and ``CheckpointManager``'s background save) writes; a FRESH model and
state under another strategy restore: every persistent buffer equals the saved model's, bit for
bit, and a non-persistent one keeps the fresh model's value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

EXPERTS = 4


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.router = nn.Linear(6, EXPERTS, bias=False)
        self.head = nn.Linear(6, 3)
        self.register_buffer("router_bias", torch.zeros(EXPERTS))
        self.register_buffer("derived", torch.full((2,), 7.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        gate = (self.router(h) + self.router_bias).softmax(-1).max(-1).values
        return self.head(h) * gate.unsqueeze(-1)


def _persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {n for n, _ in model.named_parameters()}
    return {n: t.clone() for n, t in model.state_dict().items() if n not in params}


def buffers_worker(directory: str, manager: bool) -> dict:
    rank = dist.get_rank()
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    torch.manual_seed(0)
    model = Routed()
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")

    def loss_fn(params, batch):
        return nn.functional.cross_entropy(fs.functional_call(model, params, (batch[0],)), batch[1])

    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        batch = (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
        state, _ = fs.train_step(state, batch, loss_fn)
        with torch.no_grad():  # the loop's bias update, the same on every rank
            model.router_bias.add_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    # BatchNorm's statistics differ per rank (each its own batch): make them agree, as a
    # synchronized BatchNorm would, so that one rank's write holds every rank's values
    for t in (model.norm.running_mean, model.norm.running_var):
        dist.all_reduce(t)
        t.div_(2)
    saved = _persistent(model)
    if manager:
        mgr = fs.CheckpointManager(directory)
        mgr.save(2, state)
        model.router_bias.add_(100.0)  # after save returned: the checkpoint holds the value before
        mgr.wait()
    else:
        fs.save(directory, state)

    torch.manual_seed(1)
    fresh = Routed()
    like = fs.init(fresh, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    restored = fs.restore(directory if not manager else f"{directory}/2", like=like)
    before, after = fs.full_params(state), fs.full_params(restored)
    params_equal = all(torch.equal(after[n], t) for n, t in before.items())
    return {
        "saved": saved,
        "restored": _persistent(fresh),
        "derived": fresh.derived.clone(),
        "params": params_equal,
    }


@pytest.mark.parametrize("manager", [False, True])
def test_buffers_saved_and_restored_into_a_fresh_model(pool2, tmp_path, manager: bool) -> None:
    for out in pool2.run(buffers_worker, str(tmp_path / "ckpt"), manager):
        assert out["params"]
        assert set(out["restored"]) == {
            "router_bias",
            "norm.running_mean",
            "norm.running_var",
            "norm.num_batches_tracked",
        }
        for name, value in out["saved"].items():
            assert torch.equal(out["restored"][name], value), name
            assert not torch.equal(value, Routed().state_dict()[name]), name  # it moved
        assert torch.equal(out["restored"]["router_bias"], torch.tensor([0.2, -0.4, 0.6, -0.8]))
        assert out["restored"]["norm.num_batches_tracked"].dtype == torch.int64
        assert torch.equal(out["derived"], torch.full((2,), 7.0))  # not persistent: not carried


def test_a_buffer_of_another_shape_is_named(pool2, tmp_path) -> None:
    with pytest.raises(Exception, match="buffers.router_bias: shape \\(4,\\) in the checkpoint"):
        pool2.run(mismatch_worker, str(tmp_path / "ckpt"))


def mismatch_worker(directory: str) -> None:
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    model = Routed()
    fs.save(directory, fs.init(model, fs.optim.sgd(0.1), mesh=mesh))
    other = Routed()
    other.router_bias = torch.zeros(EXPERTS + 1)
    fs.restore(directory, like=fs.init(other, fs.optim.sgd(0.1), mesh=mesh))


def values_worker() -> list:
    """The local tier's and a healing group's values (``state.values``) carry the buffers."""
    from funcshard.state.values import load_values, values

    mesh = fs.make_mesh(shard=2, device_type="cpu")
    model = Routed()
    model.router_bias.fill_(0.5)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    kept = values(state)
    kept["buffers"] = {n: t.clone() for n, t in kept["buffers"].items()}  # as the tier writes
    model.router_bias.fill_(-3.0)
    load_values(state, kept, by="test")
    return model.router_bias.tolist()


def test_values_carry_the_buffers(pool2) -> None:
    for bias in pool2.run(values_worker):
        assert bias == [0.5] * EXPERTS
