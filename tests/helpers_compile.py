"""A ``torch.compile`` backend that counts what it compiles, shared by the compile tests."""

from __future__ import annotations

import collections

import torch


def counting_backend(counts: collections.Counter, collectives: collections.Counter | None = None):
    """``aot_eager`` (AOTAutograd, graphs run as traced) counting forward/backward compiles in
    ``counts`` ("forward", "backward"); with ``collectives``, the functional collectives in
    each graph kind, keyed ("forward" or "backward", the op's name: "all_gather_into_tensor",
    "reduce_scatter_tensor", ...)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
            counts[kind] += 1
            if collectives is not None:
                for node in gm.graph.nodes:
                    target = node.target
                    if getattr(target, "namespace", None) == "_c10d_functional":
                        collectives[(kind, target._opname)] += 1
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
