"""The backend the captured step (:mod:`funcshard.step.units.captured`) compiles with.

Its joint-graph pass (:mod:`funcshard.step.units.schedule`: ZeRO-3's params re-gathered in
backward, each bucket reduce-scattered as its backward ends) runs inside AOTAutograd, so a
backend that does not go through it (``compile="eager"``, a plain callable) is handed
AOTAutograd's graphs instead (:func:`joint_backend`); the per-unit regions
(:func:`funcshard.step.compiling.compiled_call`) keep the backend as given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from funcshard.step.compiling import Backend, CudaGraphs

__all__ = ["joint_backend", "through_aot_autograd"]


def through_aot_autograd(backend: Backend) -> bool:
    """Whether ``backend`` compiles AOTAutograd's forward and backward graphs (inductor, the
    ``aot_*`` and ``cudagraphs`` names, a callable made by ``aot_autograd``): only those run
    the captured step's joint-graph pass (:mod:`funcshard.step.units.schedule`)."""
    from torch._dynamo.backends.common import AotAutograd

    if isinstance(backend, CudaGraphs | AotAutograd):
        return True
    return isinstance(backend, str) and (
        backend in ("inductor", "cudagraphs") or backend.startswith("aot_")
    )


def joint_backend(backend: Backend) -> Backend:
    """The backend the captured step compiles with: ``backend`` where it goes through
    AOTAutograd (:func:`through_aot_autograd`); else (``compile="eager"``, another name whose
    compiler takes dynamo's graph, a plain callable) ``aot_autograd`` with aot_eager's
    settings and its compiler as the forward's and the backward's, so that the joint-graph
    pass (:mod:`funcshard.step.units.schedule`) runs for every backend: ZeRO-3's params
    re-gathered in backward, not saved, and each bucket reduce-scattered as its backward
    ends. Such a backend gets AOTAutograd's graphs, as a compiler given to ``aot_autograd``
    does: a forward and a backward graph of aten ops, params as inputs (no modules, not
    dynamo's graph). Named as ``backend`` (dynamo's errors name a backend by ``__name__``)."""
    if backend is None or through_aot_autograd(backend):
        return backend
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", None)
    compiler = _boxed(compiler, name or type(backend).__name__)
    wrapped = aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )
    wrapped.__name__ = compiler.__name__
    return wrapped


def _boxed(compiler: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``compiler``, except that a graph it hands back as it got it (the graph, its
    ``forward``: "eager"'s compiler) runs boxed, as aot_eager's does: AOTAutograd calls an
    unboxed one with the graph's inputs held by the call, so the backward kept every saved
    tensor to its end (compile="eager": 1.2x eager ZeRO-3's peak at 8 layers, 0.9x boxed)."""
    from torch._dynamo.backends.debugging import boxed_nop

    def compile_graph(gm: Any, example_inputs: list) -> Any:
        compiled = compiler(gm, example_inputs)
        if compiled is gm or getattr(compiled, "__self__", None) is gm:  # gm.forward
            return boxed_nop(gm, example_inputs)
        return compiled

    compile_graph.__name__ = compile_graph.__qualname__ = name
    return compile_graph
