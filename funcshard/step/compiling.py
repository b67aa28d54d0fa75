"""``fs.init(..., compile=...)``: what funcshard compiles of what it runs itself.

The region is each gather unit's module call (``torch.compile`` of ``nn.Module._call_impl``,
as ``module.compile()`` would compile it, with no hook inside: the unit's gather and release
run around the compiled call, :func:`funcshard.step.units.run._around`'s way). One compiled call
serves every unit, so identical blocks share one forward and one backward graph (the module
is a graph input); a module the user compiled in place keeps the user's compile. Left eager:
the gather's cast (none in fp32), the optimizer update (torch's fused AdamW kernel: faster
than an inductor-compiled AdamW on a rank's shard, and under 1% of the step either way;
docs/benchmarks.md) and the collectives (issued by the unit hooks,
outside the graph: tracing them as functional collectives into one graph per unit,
SimpleFSDP's shape, is left to do).

``compile`` does not combine with ``deterministic=True``: the bitwise contract rests on every
layout running the same eager kernels on the same chunk; a compiled unit's fusions are chosen
per graph by the compiler (and may change with its version or cache), so init refuses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Backend", "backend_of", "compiled_call", "compile_units", "unwrapped"]

Backend = str | Callable[..., Any] | None
"""A ``torch.compile`` backend (a name such as "inductor", or a callable), None: eager."""


def backend_of(compile: bool | str | Callable[..., Any] | None, *, deterministic: bool) -> Backend:
    """The backend ``fs.init``'s ``compile`` argument names: True = "inductor", False or None
    = eager, a string or callable = that ``torch.compile`` backend.

    Raises:
      TypeError: any other value.
      ValueError: a backend with ``deterministic=True``.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        backend: Backend = "inductor"
    elif isinstance(compile, str) and compile:
        backend = compile
    elif callable(compile):
        backend = compile
    else:
        raise TypeError(
            f"init: compile must be a bool, a torch.compile backend name or a backend "
            f"callable; got {compile!r}"
        )
    if deterministic:
        raise ValueError(
            f"init: compile={compile!r} does not combine with deterministic=True: the bitwise "
            "contract across layouts rests on the same eager kernels on every layout, and a "
            "compiled unit's fused kernels are the compiler's choice; pass one or the other"
        )
    return backend


@functools.cache
def _compiled_impl(backend: Backend) -> Callable[..., Any]:
    """``nn.Module._call_impl`` compiled once per backend (dynamo's cache is per code object
    anyway, guarded per module): called with the module first."""
    return torch.compile(nn.Module._call_impl, backend=backend)


def compiled_call(module: nn.Module, backend: Backend) -> Callable[..., Any] | None:
    """The compiled call of ``module``: the user's own (``module.compile()``) if any, else
    funcshard's with ``backend``; None when neither (the module runs eagerly)."""
    compiled = getattr(module, "_compiled_call_impl", None)  # set by module.compile()
    if compiled is not None or backend is None:
        return compiled
    return functools.partial(_compiled_impl(backend), module)


def compile_units(
    model: nn.Module, prefixes: Iterable[str], backend: Backend, stack: contextlib.ExitStack
) -> None:
    """ZeRO-0/1: each unit module of ``model`` not compiled by the user runs compiled with
    ``backend`` until ``stack`` closes (nothing to put around the call: no unit hooks)."""
    if backend is None:
        return
    for prefix in prefixes:
        module = model.get_submodule(prefix)
        if getattr(module, "_compiled_call_impl", None) is None:
            module._compiled_call_impl = compiled_call(module, backend)
            stack.callback(setattr, module, "_compiled_call_impl", None)


def unwrapped(model: Any) -> Any:
    """The plain model inside a ``torch.compile(model)`` wrapper (an ``OptimizedModule``, whose
    parameter names all start with ``_orig_mod.``); anything else (a module, a table of
    shapes) itself.

    funcshard names parameters, units, checkpoints and exports by the plain model's names, so
    that a state of the compiled model and one of the plain model are interchangeable; the
    wrapper stays what runs (``fs.functional_call(compiled, params, ...)`` swaps the params
    into the modules the two share, then calls the wrapper).
    """
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def compiled_around_units(model: nn.Module, prefixes: Iterable[str]) -> str | None:
    """The name of a module of ``model`` compiled as a whole that holds gather units
    (``model.compile()``, or a ``torch.compile(model)`` wrapper): "" for the model itself;
    None when no unit is inside a compiled region."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return ""
    prefixes = list(prefixes)
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is None or name in prefixes:
            continue
        if any(not name or p.startswith(name + ".") for p in prefixes):
            return name
    return None


def check_not_compiled_around_units(model: nn.Module, prefixes: Iterable[str], strategy) -> None:
    """Raises ValueError where a compiled region would hold gather units' hooks (ZeRO-2/3):
    dynamo would trace the unit's gather and release, and read its placeholders."""
    name = compiled_around_units(model, prefixes)
    if name is None:
        return
    what = "the model" if not name else f"module {name!r}"
    raise ValueError(
        f"{what} was compiled as a whole (model.compile() or torch.compile(model)), around "
        f"gather units; under {strategy} each unit gathers its params as it runs, outside the "
        "compiled region, so compile the units instead (for block in model.blocks: "
        "block.compile()), or pass compile=True to fs.init; a whole-model compile works "
        "under strategy='no_shard' and 'optim'"
    )
