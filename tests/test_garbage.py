"""A step leaves nothing of its own to Python's cycle collector: no tensor, no funcshard object.

ZeRO-2/3's run objects refer to each other (a unit to its run); whatever tensor they still hold
when the step returns lives on until the cycle collector happens to run: a step's gradient
accumulators (a rank's shard of the model) did, so a rank's peak memory moved by that much
from one step to the next. A closed run lets go of what it holds and of the references that
made the cycles. Each case runs a step with the collector off, then collects what the step
left and lists the tensors and funcshard objects among it.
"""

from __future__ import annotations

import gc

import pytest
import torch

import funcshard as fs

import models

ROWS = 12


def _aot_eager():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
    )


CASES = {
    "no_shard": {"strategy": "no_shard"},
    "optim": {"strategy": "optim"},
    "optim_grads": {"strategy": "optim_grads"},
    "optim_grads_params": {"strategy": "optim_grads_params"},
    "zero3_deterministic": {"strategy": "optim_grads_params", "deterministic": True},
    "zero3_offload": {"strategy": "optim_grads_params", "offload_fraction": 0.5},
    "zero3_compile": {"strategy": "optim_grads_params", "compile": "aot_eager"},
    "zero3_hsdp": {"strategy": "optim_grads_params", "shard": 1, "replicate": 2},
}


def garbage_worker(case: str) -> list[str]:
    """The tensors (shape, dtype) and funcshard objects (type) the cycle collector finds after
    one step of ``case``."""
    kw = dict(CASES[case])
    if kw.get("compile") == "aot_eager":
        kw["compile"] = _aot_eager()
    mesh = fs.make_mesh(kw.pop("shard", 2), kw.pop("replicate", 1), device_type="cpu")
    model = models.make_model(seed=2)
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, **kw)
    state, _ = models.train(state, model, [0], rows=ROWS, microbatches=2)
    gc.collect()
    gc.disable()
    # what existed before the step (held, so that no id is reused): an object that an earlier
    # case in this worker left for the collector and that the step only let go of is not
    # the step's own
    before = gc.get_objects()
    existed = {id(o) for o in before}
    try:
        state, _ = models.train(state, model, [1], rows=ROWS, microbatches=2)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        new = [o for o in gc.garbage if id(o) not in existed]
        left = [f"{tuple(o.shape)} {o.dtype}" for o in new if isinstance(o, torch.Tensor)]
        ours = {type(o).__qualname__ for o in new if "funcshard" in type(o).__module__}
        left += sorted(ours)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        del before
        gc.enable()
    return left


@pytest.mark.parametrize("case", CASES)
def test_a_step_leaves_nothing_to_the_cycle_collector(pool2, case: str) -> None:
    for left in pool2.run(garbage_worker, case):
        assert left == [], left
