"""A ``torch.compile`` backend that counts what it compiles, shared by the compile tests."""

from __future__ import annotations

import collections

import torch


def counting_backend(counts: collections.Counter):
    """``aot_eager`` (AOTAutograd, graphs run as traced) counting forward/backward compiles in
    ``counts`` ("forward", "backward")."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
            counts[kind] += 1
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
