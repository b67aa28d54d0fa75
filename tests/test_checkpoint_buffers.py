"""Checkpoints carry the model's persistent buffers (``funcshard.state.buffers``).

A model with a router bias (DeepSeek-V3's, updated by the loop) and a BatchNorm (running
statistics updated by the forward, an int64 0-d counter) trains on 2 ranks; the loop changes
the bias; ``fs.save`` (and ``CheckpointManager``'s background save) writes; a FRESH model and
state under another strategy restore: every persistent buffer equals the saved model's, bit for
bit, and a non-persistent one keeps the fresh model's value.
"""

from __future__ import annotations

import math
import re

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


def raised(fn, *args) -> str:
    """``Type: message`` of what ``fn(*args)`` raised on this rank ("" if nothing). These
    refusals come on every rank alike (a restore's after its agreement, an init's before any
    collective), so the pool's ranks stay in step and serve the next test; a pool call that
    raises has its ranks started afresh (a few seconds a test)."""
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_a_buffer_of_another_shape_is_named(pool2, tmp_path) -> None:
    match = r"buffers.router_bias: shape \(4,\) dtype float32 in the checkpoint, expected shape \(5"
    for error in pool2.run(raised, mismatch_worker, str(tmp_path / "ckpt")):
        assert re.search("CheckpointMismatchError(.|\n)*" + match, error), error


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


class Odd(nn.Module):
    """Buffers of the dtypes and shapes a model may hold beside float ones: torchtitan's
    complex64 ``freqs_cis``, uint16, float8, an empty one and one with a zero dim."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(4, 2)
        angles = torch.rand(3, 2, generator=g)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))
        self.register_buffer("counts", torch.randint(0, 60000, (5,), generator=g).to(torch.uint16))
        self.register_buffer("scales", torch.randn(4, generator=g).to(torch.float8_e4m3fn))
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("flat", torch.zeros(2, 0, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _bits(model: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    return {
        n: (t.dtype, tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()))
        for n, t in model.state_dict().items()
        if not n.startswith("lin.")
    }


def odd_worker(directory: str) -> dict:
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    saved = Odd(seed=0)
    fs.save(directory, fs.init(saved, fs.optim.sgd(0.1), mesh=mesh))
    fresh = Odd(seed=1)
    before = _bits(fresh)
    fs.restore(directory, like=fs.init(fresh, fs.optim.sgd(0.1), mesh=mesh))
    return {"saved": _bits(saved), "before": before, "restored": _bits(fresh)}


def test_complex_uint16_float8_and_empty_buffers_round_trip(pool2, tmp_path) -> None:
    import tensorstore as ts

    directory = str(tmp_path / "ckpt")
    for out in pool2.run(odd_worker, directory):
        assert out["restored"] == out["saved"]
        assert out["before"]["freqs_cis"] != out["saved"]["freqs_cis"]  # it was restored
        assert out["saved"]["freqs_cis"][0] == torch.complex64
    # stored in the dtypes Orbax and numpy read (zarr v2's names; ml_dtypes' for float8)
    for name, dtype in [("freqs_cis", "complex64"), ("counts", "uint16"), ("empty", "float32")]:
        spec = {"driver": "zarr", "kvstore": f"file://{directory}/buffers.{name}"}
        assert ts.open(spec).result().dtype.name == dtype, name
    spec = {"driver": "zarr", "kvstore": f"file://{directory}/buffers.scales"}
    assert ts.open(spec).result().dtype.name == "float8_e4m3fn"


def test_a_buffer_no_checkpoint_can_hold_is_refused_at_init(pool2) -> None:
    for error in pool2.run(raised, unsavable_worker):
        assert "buffer 'chalf' has dtype torch.complex32" in error, error


def unsavable_worker() -> None:
    model = Routed()
    model.register_buffer("chalf", torch.zeros(2, dtype=torch.complex32))
    fs.init(model, fs.optim.sgd(0.1), mesh=fs.make_mesh(shard=2, device_type="cpu"))


def other_buffers_worker(directory: str, case: str) -> list[float]:
    """Saves a Routed (with or without its buffers), then restores into one that differs."""
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    torch.manual_seed(0)
    saved = Routed()
    if case == "none":  # a checkpoint that carries no buffer at all
        saved = nn.Sequential(nn.Linear(4, 6))
    fs.save(directory, fs.init(saved, fs.optim.sgd(0.1), mesh=mesh))
    torch.manual_seed(0)
    other = Routed() if case != "none" else nn.Sequential(nn.Linear(4, 6))
    if case == "name":  # the checkpoint's router_bias, the model's expert_bias
        other.register_buffer("expert_bias", other.router_bias)
        del other.router_bias
    elif case == "dtype":
        other.router_bias = other.router_bias.double()
    elif case == "extra":
        other.register_buffer("extra", torch.ones(3))
    else:
        other.register_buffer("kept", torch.full((2,), 5.0))
    fs.restore(directory, like=fs.init(other, fs.optim.sgd(0.1), mesh=mesh))
    return other.kept.tolist()


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "name",
            r"buffers.expert_bias: missing from the checkpoint \(the model's buffer: shape "
            r"\(4,\) dtype float32\)(.|\n)*buffers.router_bias: in the checkpoint \(shape \(4,\) "
            r"dtype float32\) but not a persistent buffer of the model",
        ),
        (
            "dtype",
            r"buffers.router_bias: shape \(4,\) dtype float32 in the checkpoint, expected "
            r"shape \(4,\) dtype float64",
        ),
        ("extra", r"buffers.extra: missing from the checkpoint"),
    ],
)
def test_other_buffer_names_and_dtypes_are_named(pool2, tmp_path, case, message) -> None:
    for error in pool2.run(raised, other_buffers_worker, str(tmp_path / "ckpt"), case):
        assert re.search("CheckpointMismatchError(.|\n)*" + message, error), error


def test_a_checkpoint_without_buffers_keeps_the_models(pool2, tmp_path) -> None:
    for kept in pool2.run(other_buffers_worker, str(tmp_path / "ckpt"), "none"):
        assert kept == [5.0, 5.0]


def agree_worker(mode: str) -> dict:
    """Two ZeRO-3 steps on each rank's own batch (BatchNorm's statistics move apart), a
    nonfinite step, and a buffer corrupted on one rank, under ``fs.init(buffers=mode)``."""
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    torch.manual_seed(0)
    model = Routed()
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, buffers=mode)

    def loss_fn(params, batch):
        out = fs.functional_call(model, params, (batch[0],))
        return nn.functional.cross_entropy(out, batch[1]) * batch[2][0]

    g = torch.Generator().manual_seed(dist.get_rank())
    for scale in (1.0, 1.0):
        batch = (torch.randn(8, 4, generator=g) * 3, torch.randint(0, 3, (8,), generator=g))
        with fs.comm_stats() as stats:
            state, _ = fs.train_step(state, (*batch, torch.full((8,), scale)), loss_fn)
    after_two = _persistent(model)
    with torch.device("meta"):
        planned = fs.plan(
            Routed(), world_size=2, optimizer="adamw", device_type="cpu", buffers=mode
        )
    fs.check_replicas(state)  # agreeing (broadcast) or not compared (local): no error
    batch = (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
    state, metrics = fs.train_step(state, (*batch, torch.full((8,), float("nan"))), loss_fn)
    unmoved = _persistent(model)
    if dist.get_rank() == 1:
        model.norm.running_var[0] += 1.0
    try:
        fs.check_replicas(state)
        raised = ""
    except fs.ReplicaMismatchError as e:
        raised = str(e)
    return {
        "after_two": after_two,
        "skipped": metrics["nonfinite"],
        "unmoved": unmoved,
        "raised": raised,
        "comm": ({k: v for k, v in stats.bytes.items() if v}, dict(stats.bytes_by_axis)),
        "planned": ({k: v for k, v in planned.comm.items() if v}, planned.comm_by_axis),
    }


@pytest.mark.parametrize("mode", ["broadcast", "local"])
def test_buffers_agree_across_ranks_and_a_skipped_step_leaves_them(pool2, mode: str) -> None:
    first, second = pool2.run(agree_worker, mode)
    mean = "norm.running_mean"
    apart = (first["after_two"][mean] - second["after_two"][mean]).abs().max()
    if mode == "broadcast":  # DDP's rule: every rank holds the first rank's, as saved
        assert apart == 0
        assert "'buffers/norm.running_var' over 'world': rank" in first["raised"]
        assert first["raised"] == second["raised"]
    else:  # each rank's own statistics, not compared
        assert apart > 0.01
        assert first["raised"] == second["raised"] == ""
    for out in (first, second):
        # fs.plan counts the broadcast (persistent buffers' bytes, "world") as measured
        assert out["comm"][0] == out["planned"][0]
        assert out["comm"][1]["world"] == out["planned"][1]["world"]
        buffer_bytes = 4 * (EXPERTS + 6 + 6) + 8  # router bias, BatchNorm's stats, its counter
        assert out["planned"][0].get("buffers", 0) == (buffer_bytes if mode == "broadcast" else 0)
        assert out["skipped"] == 1
        for name, value in out["after_two"].items():  # the nonfinite step's forward undone
            assert torch.equal(out["unmoved"][name], value), name


class Unaligned(nn.Module):
    """Buffers whose bytes put BatchNorm's int64 counter at an offset of 60 (12 bytes of the
    model's own float32 buffer first), one shared by two modules, and one a view of another."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("odd", torch.zeros(3))
        self.inp = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)
        self.tied = nn.Module()
        self.tied.register_buffer("mean", self.norm.running_mean)  # the same tensor
        self.tied.register_buffer("half_var", self.norm.running_var[:3])  # a view of it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.inp(x))) + self.odd


def unaligned_worker() -> dict:
    torch.manual_seed(0)
    model = Unaligned()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=fs.make_mesh(shard=2, device_type="cpu"))

    def loss_fn(params, batch):
        return nn.functional.cross_entropy(fs.functional_call(model, params, (batch[0],)), batch[1])

    g = torch.Generator().manual_seed(dist.get_rank())
    batch = (torch.randn(8, 4, generator=g) * 3, torch.randint(0, 3, (8,), generator=g))
    state, _ = fs.train_step(state, batch, loss_fn)
    fs.check_replicas(state)
    return _persistent(model)


def test_buffers_of_mixed_dtypes_tied_and_views_are_broadcast(pool2) -> None:
    first, second = pool2.run(unaligned_worker)
    assert int(first["norm.num_batches_tracked"]) == 1
    for name, value in first.items():  # the first rank's, bit for bit
        assert torch.equal(second[name], value), name
    assert torch.equal(first["tied.mean"], first["norm.running_mean"])
    assert torch.equal(first["tied.half_var"], first["norm.running_var"][:3])


def unfilled_worker(directory: str) -> tuple[dict, dict]:
    mesh = fs.make_mesh(shard=2, device_type="cpu")
    torch.manual_seed(0)
    model = Routed()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    with torch.no_grad():
        model.router_bias.add_(1.5)
        model.norm.num_batches_tracked.add_(3)
    fs.save(directory, state)
    with torch.device("meta"):
        fresh = Routed()
    restored = fs.restore(directory, like=fs.init(fresh, fs.optim.sgd(0.1), mesh=mesh))
    got = _persistent(fresh)

    def loss_fn(params, batch):
        return fs.functional_call(fresh, params, (batch,)).square().mean()

    batch = torch.randn(4, 4)
    try:  # its non-persistent buffer, no checkpoint's to give, is still on meta
        fs.train_step(restored, batch, loss_fn)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    fresh.register_buffer("derived", torch.full((2,), 7.0), persistent=False)
    _, metrics = fs.train_step(restored, batch, loss_fn)
    return _persistent(model), got, refused, metrics["loss"]


def test_an_unfilled_state_restores_the_buffers(pool2, tmp_path) -> None:
    """A meta-device model's buffers (an unfilled ``like``) get the checkpoint's values, not a
    refusal naming every saved buffer as 'not a persistent buffer of the model'; its
    non-persistent buffer, left on meta, is named by the first step (not an error inside the
    forward), which trains once it is made."""
    for saved, restored, refused, loss in pool2.run(unfilled_worker, str(tmp_path / "ckpt")):
        assert "'derived'" in refused and "meta device" in refused, refused
        assert math.isfinite(loss), loss
        assert saved.keys() == restored.keys()
        for name, value in saved.items():
            assert restored[name].device.type == "cpu", name
            assert torch.equal(restored[name], value), name
