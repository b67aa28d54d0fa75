"""Gradient reduction through its public behaviour, on a 2x2 mesh (replicate x shard).

``fs.reduce_scatter_grads`` gives this rank's shard of the mean over every data-parallel rank
(reduce-scatter over "shard", then all-reduce over "replicate"), never added to the local
gradient, in ``main_grads_dtype``, with ``grad_comm_dtype`` on the wire; its input is left
alone. Inside ``train_step`` the reductions give the global mean loss and the L2 norm of the
averaged gradient, the same for one microbatch or several.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.comm.grads import ReplicateAxis

import models

SHAPES = {"w": (37, 4), "s": (), "b": (5,)}


def _grads(rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def scatter_worker(strategy: str, dtype: torch.dtype, policy: fs.MixedPrecisionPolicy) -> dict:
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = _grads(rank, dtype)
    kept = {n: g.clone() for n, g in grads.items()}
    with fs.comm_stats() as stats:
        out = fs.reduce_scatter_grads(grads, mesh, policy, strategy=strategy)
    mean = {
        n: torch.stack([_grads(r, dtype)[n].double() for r in range(world)]).mean(0) for n in SHAPES
    }
    expect = fs.shard(mean, mesh, strategy=strategy)
    return {
        "names": list(out),
        "dtypes": {str(v.dtype) for v in out.values()},
        "shapes": {n: tuple(v.shape) == tuple(expect[n].shape) for n, v in out.items()},
        "err": max(
            float((out[n].double() - expect[n]).abs().max()) if out[n].numel() else 0.0 for n in out
        ),
        "input_kept": all(torch.equal(grads[n], kept[n]) for n in grads),
        "bytes": dict(stats.bytes),
    }


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_reduce_scatter_grads_is_this_ranks_shard_of_the_mean_over_both_axes(pool4, strategy):
    for r in pool4.run(scatter_worker, strategy, torch.float32, fs.MixedPrecisionPolicy()):
        assert r["names"] == list(SHAPES) and all(r["shapes"].values()), r
        assert r["dtypes"] == {"torch.float32"} and r["err"] < 1e-6, r
        assert r["input_kept"]


def _wire_bytes(strategy: str, element_size: int) -> dict:
    """Full buffers per collective: the padded rank sections of the reduce-scatter (2 shards:
    w 19 rows of 4, s one row, b 3 rows), the local shard on the replicate all-reduce."""
    if strategy == "no_shard":
        return {"all_reduce": (37 * 4 + 1 + 5) * element_size}
    local = 19 * 4 + 1 + 3
    return {"reduce_scatter": 2 * local * element_size, "all_reduce": local * element_size}


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_the_wire_carries_grad_comm_dtype_and_returns_main_grads_dtype(pool4, strategy):
    bf16 = torch.bfloat16
    cases = [
        # policy, input dtype -> returned dtype, wire element size
        (fs.MixedPrecisionPolicy(), torch.float32, "torch.float32", 4),
        (fs.MixedPrecisionPolicy(grad_comm_dtype=bf16), torch.float32, "torch.float32", 2),
        (fs.MixedPrecisionPolicy(main_grads_dtype=None), bf16, "torch.bfloat16", 2),
        (fs.MixedPrecisionPolicy(main_grads_dtype=torch.float32), bf16, "torch.float32", 4),
    ]
    for policy, dtype, returned, size in cases:
        for r in pool4.run(scatter_worker, strategy, dtype, policy):
            assert r["dtypes"] == {returned}, (policy, r)
            assert r["bytes"] == _wire_bytes(strategy, size), (policy, r["bytes"])
            assert r["err"] < (5e-2 if size == 2 else 1e-6), (policy, r["err"])


def metrics_worker(strategy: str, microbatches: int) -> dict:
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_model(seed=6)
    batch = models.global_batch(0, 4 * world)
    reference = copy.deepcopy(model)
    loss = torch.nn.functional.cross_entropy(reference(batch["x"]), batch["y"])
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy)
    _, metrics = fs.train_step(
        state,
        models.local_batch(batch, rank, world),
        models.make_loss_fn(model),
        microbatches=microbatches,
    )
    return {
        "loss": (metrics["loss"], float(loss)),
        "grad_norm": (metrics["grad_norm"], float(norm)),
        "nonfinite": metrics["nonfinite"],
    }


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_step_loss_and_grad_norm_are_those_of_the_global_mean(pool4, strategy, microbatches):
    for r in pool4.run(metrics_worker, strategy, microbatches):
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5), r
        assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=1e-5), r
        assert r["nonfinite"] == 0


# --- replicate reductions started in the last backward ------------------------------------------
class _Recompute(torch.autograd.Function):
    """A reentrant activation checkpoint as libraries hand-write it (torch's own refuses the
    ``autograd.grad`` of train_step): forward without a graph; backward recomputes ``fn`` and
    backpropagates through it inside, reaching the params' gathers once more."""

    @staticmethod
    def forward(ctx, fn, x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class _HalfRecomputed(models.Block):
    """A unit whose ``fc`` is recomputed in backward by :class:`_Recompute` and whose ``norm``
    is not: its bucket gets a use forward did not count (the recomputation's) first, which
    makes it look final, then the counted one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _Recompute.apply(lambda h: torch.tanh(self.fc(h)), self.norm(x))


class _Inside(models.MLP):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_HalfRecomputed(37) for _ in range(3))


class _Behind(models.MLP):
    """Block 2 runs first, then blocks 0 and 1, then block 1's ``fc`` again under
    :class:`_Recompute`. Backward brings that use (forward did not count it) first: block 1's
    bucket looks final but waits for block 2's, whose gradient comes last; block 1's own use
    arrives while it waits. (ZeRO-2 only: under ZeRO-3 block 1's params are placeholders once
    it ran.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        first = self.blocks[2](h)
        h = self.blocks[1](self.blocks[0](h))
        h = h + _Recompute.apply(self.blocks[1].fc, h)
        return (self.head(h + first) * self.scale).float()


def _loss_fn(model: torch.nn.Module, kind: str):
    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        loss = torch.nn.functional.cross_entropy(logits, batch["y"])
        if kind == "twice":  # block 1's bucket enters the graph twice (forward counts both)
            loss = loss + 1e-2 * params["blocks.1.fc.weight"].square().sum()
        return loss

    return loss_fn


def _spy(calls: list):
    """``ReplicateAxis`` methods wrapped to note what backward issued and what was late."""
    rest, late = ReplicateAxis.rest, ReplicateAxis.late

    def noted_rest(self) -> list[int]:
        after = rest(self)
        calls.append(("started", sorted(set(self.order) - set(after))))
        return after

    def noted_late(self, bucket: int) -> None:
        calls.append(("late", bucket))
        late(self, bucket)

    return [
        mock.patch.object(ReplicateAxis, "rest", noted_rest),
        mock.patch.object(ReplicateAxis, "late", noted_late),
    ]


def overlap_worker(
    strategy: str,
    outer: str,
    deterministic: bool,
    microbatches: int,
    kind: str,
    wire: torch.dtype | None = None,
) -> dict:
    """Two steps with the replicate reductions started in backward, two from the same start
    with none started (each bucket reduced after backward, as before the overlap): bits,
    bytes and calls."""
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for overlap in (True, False):
        torch.manual_seed(5)
        model = {"inside": _Inside, "behind": _Behind}.get(kind, models.MLP)()
        state = fs.init(
            model,
            fs.optim.adamw(1e-2, weight_decay=0.1),
            mesh=mesh,
            strategy=strategy,
            outer_strategy=outer,
            deterministic=deterministic,
            policy=fs.MixedPrecisionPolicy(grad_comm_dtype=wire),
        )
        calls: list = []
        patches = (
            _spy(calls) if overlap else [mock.patch.object(ReplicateAxis, "start", lambda *_: None)]
        )
        metrics = []
        with contextlib.ExitStack() as stack, fs.comm_stats() as stats:
            for p in patches:
                stack.enter_context(p)
            for step in range(2):
                batch = models.local_batch(models.global_batch(step, 4 * world), rank, world)
                state, m = fs.train_step(state, batch, _loss_fn(model, kind), microbatches)
                metrics.append((m["loss"], m["grad_norm"]))
        runs[overlap] = {
            "tensors": [*state.master, *fs.tree.leaves(state.opt_state)],
            "metrics": metrics,
            "calls": calls,
            "comm": (dict(stats.bytes), dict(stats.calls), dict(stats.bytes_by_axis)),
        }
    early, late = runs[True], runs[False]
    pairs = zip(early["tensors"], late["tensors"], strict=True)
    return {
        "bitwise": all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in pairs
        ),
        "metrics": early["metrics"] == late["metrics"],
        "started": [c[1] for c in early["calls"] if c[0] == "started"],
        "late": [c[1] for c in early["calls"] if c[0] == "late"],
        "buckets": len(state.layout.buckets),
        "same_comm": early["comm"] == late["comm"],
        "replicate_bytes": (early["comm"][2]["replicate"], late["comm"][2]["replicate"]),
    }


OVERLAP_CASES = [
    (strategy, outer, deterministic, microbatches, "plain")
    for strategy in ("optim_grads", "optim_grads_params")
    for outer in ("no_shard", "optim")
    for deterministic in (False, True)
    for microbatches in (1, 2)
] + [
    (strategy, outer, deterministic, microbatches, kind)
    for kind, strategies in [
        ("twice", ("optim_grads", "optim_grads_params")),
        ("inside", ("optim_grads", "optim_grads_params")),
        ("behind", ("optim_grads",)),
    ]
    for strategy in strategies
    for outer in ("no_shard", "optim")
    for deterministic, microbatches in [(False, 1), (True, 1), (True, 2)]
]
# low-precision wires summed in fp32 (an all-to-all, then an all-gather issued at wait())
WIRE_CASES = [
    (strategy, outer, False, 2, wire)
    for strategy in ("optim_grads", "optim_grads_params")
    for outer in ("no_shard", "optim")
    for wire in (torch.bfloat16, torch.int8)
]


@pytest.mark.parametrize("strategy,outer,deterministic,microbatches,kind", OVERLAP_CASES)
def test_replicate_reductions_started_in_backward_change_no_bit(
    pool4, strategy, outer, deterministic, microbatches, kind
) -> None:
    """HSDP and HFSDP under ZeRO-2/3 issue a bucket's replicate reduction in the last
    microbatch's backward once its sum is final and its turn has come: params, optimizer
    state and metrics are the same bits as with every bucket reduced after backward, with the
    same bytes and calls on every axis. A bucket used twice in forward waits for both uses
    (under the deterministic rule with one microbatch its uses are summed first and it is
    reduced after backward). A use forward did not count (a recomputation's) sends its bucket
    after backward: "inside", it comes after the bucket was issued, whose reduction is
    dropped (one more on the wire); "behind", the bucket was waiting for its turn, and the
    buckets after it go on without it."""
    results = pool4.run(overlap_worker, strategy, outer, deterministic, microbatches, kind)
    for r in results:
        assert r["bitwise"] and r["metrics"], r
        assert len(r["started"]) == 2, r  # one ReplicateAxis per step
        assert bool(r["late"]) == (kind in ("inside", "behind")), r
        if kind == "plain":  # every bucket (the root's as backward ends: it comes last)
            assert all(len(s) == r["buckets"] for s in r["started"]), r
        elif kind == "twice" and deterministic and microbatches == 1:
            assert r["started"] == [[], []], r
        elif kind == "behind":  # block 1's bucket (2) after backward, the others in backward
            assert r["started"] == [[0, 1, 3], [0, 1, 3]], r
        else:
            assert all(s for s in r["started"]), r
        if kind == "inside":
            early_bytes, late_bytes = r["replicate_bytes"]
            assert early_bytes > late_bytes, r
        else:
            assert r["same_comm"], r


@pytest.mark.parametrize("strategy,outer,deterministic,microbatches,wire", WIRE_CASES)
def test_replicate_reductions_on_low_precision_wires_start_in_backward(
    pool4, strategy, outer, deterministic, microbatches, wire
) -> None:
    """The bf16 and int8 grad wires too: every bucket's replicate reduction issued in the last
    backward, and the same bits, bytes and calls as with each reduced after backward."""
    results = pool4.run(overlap_worker, strategy, outer, deterministic, microbatches, "plain", wire)
    for r in results:
        assert r["bitwise"] and r["metrics"] and r["same_comm"], r
        assert all(len(s) == r["buckets"] for s in r["started"]), r


class _FailingBackward(models.MLP):
    """Raises from backward when it reaches block 0's output (``fail`` set): blocks 2 and 1
    are done by then, their replicate reductions on the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.inp(x))
        if self.fail and h.requires_grad:
            h.register_hook(self._raise)
        for block in self.blocks[1:]:
            h = block(h)
        return (self.head(h) * self.scale).float()

    def _raise(self, grad: torch.Tensor) -> None:
        raise RuntimeError("disk full while logging activations")


def failing_backward_worker(strategy: str, outer: str, deterministic: bool) -> dict:
    """A step whose backward fails after replicate reductions went out, then the same step
    again on the same (unconsumed) state: as a state that never failed."""
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 4 * world), rank, world)
    states = []
    for fail in (True, False):
        torch.manual_seed(5)
        model = _FailingBackward()
        state = fs.init(
            model,
            fs.optim.adamw(1e-2),
            mesh=mesh,
            strategy=strategy,
            outer_strategy=outer,
            deterministic=deterministic,
        )
        loss_fn = models.make_loss_fn(model)
        error, replicate_bytes = None, 0
        if fail:
            model.fail = True
            with fs.comm_stats() as stats:
                try:
                    fs.train_step(state, batch, loss_fn)
                except RuntimeError as e:
                    error = str(e)
            replicate_bytes = stats.bytes_by_axis["replicate"]
            model.fail = False
        state, metrics = fs.train_step(state, batch, loss_fn)
        states.append(([*state.master, *fs.tree.leaves(state.opt_state)], metrics["loss"]))
        if fail:
            failed = {"error": error, "replicate_bytes": replicate_bytes}
    (after, loss_after), (fresh, loss_fresh) = states
    return {
        **failed,
        "bitwise": loss_after == loss_fresh
        and all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(after, fresh, strict=True)
        ),
    }


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_backward_failing_with_replicate_reductions_out_comes_back_and_leaves_the_state(
    pool4, strategy, outer, deterministic
) -> None:
    """Backward fails after blocks 2 and 1 issued their replicate reductions (the failed step
    put bytes on "replicate"): the error comes back unchanged, and the same step on the same
    state then gives the bits of a state that never failed, so no reduction of the failed
    step was left to pair with the next step's collectives."""
    for r in pool4.run(failing_backward_worker, strategy, outer, deterministic):
        assert r["error"] == "disk full while logging activations", r
        assert r["replicate_bytes"] > 0, r
        assert r["bitwise"], r
