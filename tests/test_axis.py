"""The model-parallel axis protocol (``funcshard/parallel/axis.py``): the one interface through
which every layer below the step meets a model-parallel axis.

The proof is a test-only axis: a recording one that splits nothing. A state built on it trains,
saves, restores, reports its full params and is planned for with the same bits as a state
without an axis, and every layer asked it only what the protocol names: an attribute of
``TensorParallel`` outside the protocol (its mesh, say) would raise here.
"""

from __future__ import annotations

import os

import torch

import funcshard as fs
from funcshard.parallel import expert_axis as expert_lib
from funcshard.parallel import tensor as tp_lib
from funcshard.parallel.axis import NO_AXIS, ModelAxis, NoAxis

import models

PROTOCOL = {
    name
    for name in dir(ModelAxis)
    if not name.startswith("_") and name not in dir(object) and name != "leaves"
} | {"leaves"}


class RecordingAxis(NoAxis):
    """Splits nothing, as :data:`NO_AXIS`; remembers which of its attributes were read."""

    def __init__(self) -> None:
        object.__setattr__(self, "asked", set())

    def __getattribute__(self, name: str):
        if not name.startswith("_") and name != "asked":
            object.__getattribute__(self, "asked").add(name)
            if name not in PROTOCOL:
                raise AttributeError(f"a layer asked the axis for {name!r}, outside the protocol")
        return object.__getattribute__(self, name)


def test_the_protocol_is_what_the_axes_implement() -> None:
    assert isinstance(NO_AXIS, ModelAxis)
    assert isinstance(RecordingAxis(), ModelAxis)
    for name in PROTOCOL:
        assert hasattr(tp_lib.TensorParallel, name) or name in ("leaves",), name


def _run(axis_of, directory: str) -> dict:
    """Two SGD-momentum steps of 2 microbatches on 37 rows, a save and a restore onto a fresh
    state, with the model's axis read by ``axis_of``."""
    real = expert_lib.read_axes  # what fs.init asks for the model's axes
    expert_lib.read_axes = lambda model, mesh, **kw: axis_of(real(model, mesh, **kw))
    try:
        model = models.make_model(n_blocks=2)
        mesh = fs.make_mesh(device_type="cpu")

        def fresh() -> fs.TrainState:
            opt = fs.optim.sgd(0.1, momentum=0.9)
            return fs.init(model, opt, mesh=mesh, strategy="optim_grads_params")

        state = fresh()
        axis = state.layout.tensor
        state, history = models.train(state, model, range(2), rows=37, microbatches=2)
        fs.save(directory, state)
        restored = fs.restore(directory, like=fresh())
        return {
            "axis": axis,
            "params": fs.full_params(state),
            "restored": fs.full_params(restored),
            "losses": [m["loss"] for m in history],
            "norms": [m["grad_norm"] for m in history],
        }
    finally:
        expert_lib.read_axes = real


def recording_worker(root: str) -> dict:
    plain = _run(lambda axis: axis, os.path.join(root, "plain"))
    recording = RecordingAxis()
    recorded = _run(lambda axis: recording, os.path.join(root, "recorded"))
    assert plain["axis"] is NO_AXIS and recorded["axis"] is recording
    same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    return {
        "same": same(plain["params"], recorded["params"])
        and same(plain["restored"], recorded["restored"])
        and same(recorded["params"], recorded["restored"])
        and plain["losses"] == recorded["losses"]
        and plain["norms"] == recorded["norms"],
        "asked": sorted(object.__getattribute__(recording, "asked")),
    }


def test_every_layer_asks_the_axis_only_through_the_protocol(pool2, tmp_path) -> None:
    for result in pool2.run(recording_worker, str(tmp_path)):
        assert result["same"], "a state on the test-only axis trained or restored other bits"
        # the forward's wrap, the norm, the full params, the batch rule and the checkpoint's
        # coordinates all went through it
        assert {"wrap", "counts", "sum_square", "full", "batch_check", "leaves"} <= set(
            result["asked"]
        ), result["asked"]


def test_the_axis_says_why_the_captured_step_cannot_trace_it() -> None:
    """compile= asks the axis, not the layout's tensor leaves: an expert axis names experts;
    a tensor-parallel one is captured (its DTensor params made in the graph)."""
    leaf = expert_lib.ExpertLeaf((4, 8, 8), (64, 8, 1))
    tensor_leaf = tp_lib.TensorLeaf(None, (8, 8), (8, 1))
    assert NO_AXIS.capture_refusal is None
    assert tp_lib.TensorParallel(None, {}).capture_refusal is None
    assert tp_lib.TensorParallel(None, {"w": tensor_leaf}).capture_refusal is None
    assert "expert parallel" in expert_lib.ExpertAxis(None, {"e": leaf}).capture_refusal
    assert expert_lib.ExpertAxis(None, {}).capture_refusal is None
