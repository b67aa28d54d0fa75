"""A captured step that raises on every rank, each rank compiled to its own shapes: every rank
comes back with the error, and the same step again trains as a state that never failed.

Each rank's inductor schedules its graphs by its own shapes' costs, so one rank may wait for a
reduce before reaching the op that raises while its peer raises before starting that reduce
(``funcshard.distributed.graph_ops.drain_failed_graph``; the ops alone:
``tests/test_graph_drain.py``)."""

from __future__ import annotations

import faulthandler

import torch
import torch.distributed as dist

import funcshard as fs

import models

FAIL = {"on": False}


@torch.library.custom_op("funcshard_tests::tap", mutates_args=())
def tap(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@tap.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("funcshard_tests::tap_backward", mutates_args=())
def tap_backward(g: torch.Tensor) -> torch.Tensor:
    if FAIL["on"]:
        raise RuntimeError("disk full while logging gradients")
    return g.clone()


@tap_backward.register_fake
def _(g: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(g)


tap.register_autograd(lambda ctx, g: torch.ops.funcshard_tests.tap_backward(g))  # noqa: ARG005


class Tapped(models.MLP):
    """Its backward raises at block 2's output (``FAIL``); nothing orders that op against the
    later blocks' reduces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            h = torch.ops.funcshard_tests.tap(h) if i == 2 else h
        return (self.head(h) * self.scale).float()


def failing_worker(
    rows: tuple[int, ...], strategy: str, grad_comm_dtype=None, overlap: bool = True
) -> dict:
    """Three steps with the second one failing first, beside the same three steps never
    failing (``grad_comm_dtype``: the gradients' wire, fp32 main grads). The never-failed
    steps 1 and 2 run first, on a copy of the state after step 0 and through the same
    compiled graphs (a second ``fs.init`` compiled them all again: 5 s a run); then the
    failing step and its retry on the state itself."""
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test, not CI
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Tapped(n_blocks=6, dim=256)
    state = fs.init(
        model,
        fs.optim.sgd(0.1, momentum=0.9),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy=strategy,
        compile="inductor",
        policy=fs.MixedPrecisionPolicy(grad_comm_dtype=grad_comm_dtype),
        overlap=overlap,
    )
    loss_fn = models.make_loss_fn(model)

    def batch(step: int) -> dict:
        g = models.global_batch(step, sum(rows))
        return {k: v.split(rows)[rank] for k, v in g.items()}

    state, metrics = fs.train_step(state, batch(0), loss_fn)
    first = metrics["loss"]
    never = fs.tree.map(lambda x: x.clone() if torch.is_tensor(x) else x, state)
    out = {False: {"losses": [first], "error": None}, True: {"losses": [first], "error": None}}
    for fail in (False, True):
        run = state if fail else never
        for step in (1, 2):
            if fail and step == 1:
                FAIL["on"] = True
                try:
                    fs.train_step(run, batch(step), loss_fn)
                except RuntimeError as e:
                    out[fail]["error"] = str(e)
                finally:
                    FAIL["on"] = False
            run, metrics = fs.train_step(run, batch(step), loss_fn)
            out[fail]["losses"].append(metrics["loss"])
        out[fail]["params"] = fs.full_params(run)
    faulthandler.cancel_dump_traceback_later()
    failed, never = out[True], out[False]
    return {
        "error": failed["error"],
        "losses": (failed["losses"], never["losses"]),
        "bitwise": all(torch.equal(failed["params"][n], p) for n, p in never["params"].items()),
    }


def test_a_step_raising_on_every_rank_in_differently_scheduled_graphs(pool2) -> None:
    """1 row on rank 0, 1024 on rank 1: the two ranks' backward graphs order the raising op
    and the reduces differently. Fails without the drain: one rank waits for a reduce its
    peer never starts, or the retried step's messages pair with the failed step's (gloo
    aborted a rank here). The model's size keeps ZeRO-3's two schedules apart (measured): at
    dim 37 (1 row against 4, 64, 148, 1024 or 8192) or with 4 blocks of 256 both ranks start
    the same gathers and reduces before the raising op; at 6 blocks of 256 rank 1 starts one
    gather and one reduce fewer. ZeRO-2's differ at 4 blocks of 256 and at dim 37 with 1 row
    against 8192 (not against 4)."""
    for strategy in ("optim_grads", "optim_grads_params"):
        for r in pool2.run(failing_worker, (1, 1024), strategy):
            assert "disk full while logging gradients" in (r["error"] or ""), r
            assert r["losses"][0] == r["losses"][1] and r["bitwise"], (strategy, r)


def test_a_narrow_gradient_wire_in_differently_scheduled_graphs(pool2) -> None:
    """bf16 on the gradients' wire, 1 row against 1024: each bucket's exchange is funcshard's
    by sends in the reduces' chain. Under ZeRO-3 it was torch's functional all-to-all, which
    each rank's inductor issued where its own costs said: one rank ran every gather before
    its first all-to-all while the other waited on an all-to-all after three, a deadlock with
    no failure at all; under ZeRO-2 a step raising on every rank left an all-to-all one rank
    had issued and its peer had not (gloo aborted a rank)."""
    for strategy in ("optim_grads", "optim_grads_params"):
        for r in pool2.run(failing_worker, (1, 1024), strategy, torch.bfloat16):
            assert "disk full while logging gradients" in (r["error"] or ""), r
            assert r["losses"][0] == r["losses"][1] and r["bitwise"], (strategy, r)


def overlap_off_worker(rows: tuple[int, ...]) -> dict:
    """ZeRO-3 under inductor with ``overlap=False`` (each gather and reduce by sends one op
    that blocks until done), 2 microbatches, one step; then the same step eagerly."""
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test, not CI
    rank = dist.get_rank()
    g = models.global_batch(0, sum(rows))
    batch = {k: v.split(list(rows))[rank] for k, v in g.items()}
    params = []
    for compile in ("inductor", False):
        torch.manual_seed(0)
        model = models.MLP()
        kw = {"strategy": "optim_grads_params", "compile": compile, "overlap": False}
        mesh = fs.make_mesh(device_type="cpu")
        state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, **kw)
        state, _ = fs.train_step(state, batch, models.make_loss_fn(model), microbatches=2)
        params.append(fs.full_params(state))
    faulthandler.cancel_dump_traceback_later()
    captured, eager = params
    return {n: float((captured[n] - p).abs().max() / p.abs().max()) for n, p in eager.items()}


def test_whole_collectives_keep_one_order_with_overlap_off(pool2) -> None:
    """2 rows against 8: with ``overlap=False`` each rank's inductor ordered a blocking
    gather and a blocking reduce by its own shapes, opposite ways, each rank waiting in its
    own (found by review at 2 against 30; a hang here, at both; without the chain, no hang
    at 8 against 6: microbatches of test_compile.py's 4 and 3 rows). Rank 1's microbatches are
    4 rows, as in test_compile.py's inductor tests: kernels inductor's cache has already.
    They are chained in the graph's order
    (``prefetch.chain_collectives``). Tolerance: fp32 sums in other orders, a few ulps of
    each update."""
    for diffs in pool2.run(overlap_off_worker, (2, 8)):
        assert max(diffs.values()) < 1e-5, diffs


def test_a_step_raising_with_overlap_off(pool2) -> None:
    """``overlap=False``, ZeRO-2, 1 row against 1024: the graphs' whole gathers and reduces are
    recorded first as the overlapped graphs' starts are (``prefetch.mark_collectives``,
    ``comm_order.place_mark``), and a rank that raised posts the ones it had not started.
    Without the record gloo aborted a rank (its peer's blocking reduce met nothing)."""
    for r in pool2.run(failing_worker, (1, 1024), "optim_grads", None, False):
        assert "disk full while logging gradients" in (r["error"] or ""), r
        assert r["losses"][0] == r["losses"][1] and r["bitwise"], r
