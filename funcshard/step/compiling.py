"""``fs.init(..., compile=...)``: what funcshard compiles of what it runs itself.

Under ZeRO-2/3 the microbatch is captured whole (:mod:`funcshard.step.units.captured`): each
bucket's all-gather (torch's functional collectives), the forward of ``loss_fn`` (blocks the
user compiled in place are inlined into it), and in backward each bucket's reduce-scatter, in
one forward and one backward graph (param wires, narrow and 8-bit gradient wires and HFSDP
included); a backend that does not go through AOTAutograd (``"eager"``, a plain callable)
compiles AOTAutograd's forward and backward graphs there, aten ops, not dynamo's graph
(:mod:`funcshard.step.units.backend`), so that its joint pass runs. A layout the capture
cannot express (:func:`capture_refusal`: a tensor-parallel model) runs v4's regions
instead, with a warning at ``fs.init`` naming why: each gather
unit's module call compiled (``torch.compile`` of ``nn.Module._call_impl``, as
``module.compile()`` would compile it), the unit's gather and release around the compiled
call (:func:`funcshard.step.units.run._around`), one compiled call serving every unit. Under
ZeRO-0/1 the units' module calls are compiled the same way. Left eager: the optimizer update
(torch's fused kernels; docs/benchmarks.md measures an inductor-compiled AdamW beside them).

``cuda_graphs=True`` (:class:`CudaGraphs`) compiles the same regions with inductor's
``mode="reduce-overhead"`` (CUDA graph trees: static input buffers, graphs replayed); a CPU
mesh raises ValueError.

``compile`` does not combine with ``deterministic=True``: the bitwise contract rests on every
layout running the same eager kernels on the same chunk; a compiled unit's fusions are chosen
per graph by the compiler (and may change with its version or cache), so init refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from funcshard.step.digest import callable_digest, qualified_name

__all__ = [
    "Backend",
    "CudaGraphs",
    "backend_of",
    "by_inductor",
    "capture_refusal",
    "check_units",
    "compile_fn",
    "compile_settings",
    "compiled_call",
    "compile_units",
    "model_of",
    "overlap_config",
    "overlaps",
    "unwrapped",
]


@dataclasses.dataclass(frozen=True)
class CudaGraphs:
    """``cuda_graphs=True``: inductor with ``mode="reduce-overhead"`` (CUDA graph trees)."""

    backend: str = "inductor"


Backend = str | Callable[..., Any] | CudaGraphs | None
"""A ``torch.compile`` backend (a name such as "inductor", or a callable), :class:`CudaGraphs`
(inductor replaying CUDA graphs), None: eager."""


# torch 2.13's torch.compile(isolate_recompiles=); earlier torch (pyproject allows 2.11) lacks it
_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def compile_fn(
    fn: Callable[..., Any],
    backend: Backend,
    *,
    constants: str | None = None,
    check: Callable[[Any, list], None] | None = None,
    on_compiled: Callable[[Any], Callable[[], None]] | None = None,
) -> Callable[..., Any]:
    """``torch.compile(fn)`` with ``backend`` (``CudaGraphs``: inductor's reduce-overhead).

    ``constants``: the name of a variable ``fn`` closes over that holds an immutable tree of
    Python constants (a layout's plan): dynamo's guards on its values are dropped, since
    nothing can change them (thousands of int comparisons per call otherwise), and the
    compile's entries are its own (``isolate_recompiles``, where torch has it), and so is
    its code object (:func:`_own_code`). ``check``:
    called with each graph dynamo captures and its example inputs before the backend gets it
    (what it raises reaches the caller). ``on_compiled``: called as each graph is compiled (after
    ``check``), it returns what to call each time that graph runs."""
    kw: dict[str, Any] = {}
    if constants is not None:
        fn = _own_code(fn)
    if constants is not None and _ISOLATES:
        # one code object serves every plan: each compile keeps its own entries, so that
        # dropping the plan's guards cannot hand one plan's graphs to another (nor do many
        # states in one process exhaust one shared recompile limit); without isolation
        # (earlier torch) the guards stay
        kw["isolate_recompiles"] = True
        names = (constants, f"L[{constants!r}]")  # a closure's variable, a local
        kw["options"] = {
            "guard_filter_fn": lambda entries: [
                not any(e.name == n or e.name.startswith(n + "[") for n in names) for e in entries
            ]
        }
    if isinstance(backend, CudaGraphs):
        # mode="reduce-overhead" is these options (torch refuses a mode beside options)
        kw["options"] = {**kw.get("options", {}), "triton.cudagraphs": True}
        backend = backend.backend
    if check is not None or on_compiled is not None:
        backend = _checked(backend, check, on_compiled)
    return torch.compile(fn, backend=backend, **kw)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (its name numbered): dynamo keeps what it learns
    of a frame by its code (automatic dynamic: a size or int seen to change is made symbolic
    in the next compile), so that one code serving two plans (two states of other sizes in
    one process) compiled the second with symbolic sizes, its plan's ints and its buffers'."""
    name = f"{fn.__name__}_{next(_CODES)}"
    code = fn.__code__.replace(co_name=name)  # (co_qualname, Python 3.11's, need not change)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_CODES = itertools.count()


def _checked(
    backend: str | Callable[..., Any],
    check: Callable[[Any, list], None] | None,
    on_compiled: Callable[[Any], Callable[[], None]] | None = None,
) -> Callable:
    """``backend`` (a name or a callable) called after ``check(gm, example_inputs)``; inductor's
    options (``triton.cudagraphs``) reach it as torch.compile hands them to a callable. With
    ``on_compiled``, the compiled graph calls what it returned before each run."""

    def compile_graph(gm: Any, example_inputs: list, **kwargs: Any) -> Any:
        if check is not None:
            check(gm, example_inputs)
        options = kwargs.pop("options", None)
        if backend == "inductor" and options:
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=options)
        else:
            inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
            compiled = inner(gm, example_inputs, **kwargs)
        if on_compiled is None:
            return compiled
        ran = on_compiled(gm)

        @functools.wraps(compiled)  # its attributes too (what dynamo may read of it)
        def run(*args: Any) -> Any:
            ran()
            return compiled(*args)

        return run

    # named as the backend: dynamo's errors name the backend that raised by its __name__
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", None)
    compile_graph.__name__ = compile_graph.__qualname__ = name or type(backend).__name__
    return compile_graph


def capture_refusal(layout: Any) -> str | None:
    """Why the captured step (:mod:`funcshard.step.units.captured`) cannot run ``layout``'s
    ZeRO-2/3 microbatch, None when it can: a model-parallel axis that splits some params
    (tensor parallel). Param wires, narrow and 8-bit gradient wires and HFSDP (whose inner
    layout the step runs) are captured."""
    return layout.tensor.capture_refusal


def check_units(model: nn.Module, layout: Any, backend: Backend, *, overlap: bool = False) -> None:
    """``fs.init``'s checks of a ZeRO-2/3 layout's units against what is compiled: no
    compiled region around them (:func:`check_not_compiled_around_units`), and a warning
    where ``compile=`` cannot capture the step (:func:`warn_not_captured`); with a backend,
    the captured step's model and ``overlap`` recorded for the layout and for its
    :attr:`~funcshard.layout.layout.Layout.inner` one, the layout the step runs (HFSDP's is
    another object: unrecorded, its graphs ran without the gathers' and reduces' chains and
    drain, and ranks of other shapes deadlocked in the first backward)."""
    if layout.strategy.runs_units:
        check_not_compiled_around_units(model, layout.units[1:], layout.strategy)
        warn_not_captured(layout, backend)
        if backend is not None:
            entry = (weakref.ref(unwrapped(model)), overlap)
            for captured in {layout, layout.inner}:
                _CAPTURES[captured] = entry


# layout -> (the plain model fs.init read it from, overlap), weak both ways: the captured step
# refuses a graph that reads the model's own params (funcshard.step.units.captured)
_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# inductor's passes that move collectives to overlap compute (fs.init's overlap=True): its
# recommended order (torch/_inductor/config.py, reorder_for_compute_comm_overlap_passes)
OVERLAP = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}
# ... keeping the collectives' relative order. torch 2.13's passes may swap two collectives
# by the rank's own runtime estimates ("experimental unsafe", torch/_inductor/config_comms.py:
# meant only with the estimates agreed across ranks), and ranks whose shapes differ (uneven
# rows) would then issue them in different orders (gloo aborts on the mismatch). With these
# off, each rank issues its collectives in its graph's order, the same on every rank. Each
# pass may also raise its graph's estimated peak by a budget (torch's default 0.2, i.e. 20%):
# compounded over the three passes, captured ZeRO-3 held 1.38x eager's peak at 16 layers (a
# gather hoisted early is a gathered param held early). funcshard allows none: ZeRO-3 is for
# memory, and the overlap within the graph's peak is what it keeps.
OVERLAP_COMMS = {
    "reorder_iterative_unsafe_collectives_reorder": False,
    "sink_waits_iterative_unsafe_collectives_reorder": False,
    "reorder_iterative_peak_memory_budget": 0.0,
    "sink_iterative_peak_memory_budget": 0.0,
}


def model_of(layout: Any) -> nn.Module | None:
    """The model ``fs.init(compile=...)`` read ``layout`` from, while it lives (ZeRO-2/3)."""
    entry = _CAPTURES.get(layout)
    return entry[0]() if entry is not None else None


def overlaps(layout: Any, backend: Backend) -> bool:
    """Whether ``layout``'s captured step overlaps its collectives with compute: ``fs.init``
    asked for it (``overlap=True``, the default) and inductor compiles."""
    entry = _CAPTURES.get(layout)
    inductor = by_inductor(backend)
    return entry is not None and entry[1] and inductor


def by_inductor(backend: Backend) -> bool:
    """Whether inductor compiles the captured step's graphs (its post-grad passes run)."""
    return backend == "inductor" or isinstance(backend, CudaGraphs)


def overlap_config(layout: Any, backend: Backend) -> contextlib.AbstractContextManager:
    """Around a captured call: inductor's overlap passes (:data:`OVERLAP`) where ``fs.init``
    asked for them (``overlap=True``, the default) and inductor compiles."""
    if not overlaps(layout, backend):
        return contextlib.nullcontext()
    import torch._inductor.config
    import torch._inductor.config_comms as comms

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(OVERLAP))
    known = {k: v for k, v in OVERLAP_COMMS.items() if hasattr(comms, k)}  # torch's version
    stack.enter_context(comms.patch(known))
    return stack


def warn_not_captured(layout: Any, backend: Backend) -> None:
    """Warns (at ``fs.init``) where ``compile=`` under ZeRO-2/3 runs v4's per-unit regions,
    the collectives outside the graphs, instead of the captured step, naming why."""
    why = None if backend is None else capture_refusal(layout)
    if why is not None:
        warnings.warn(
            f"init: compile= captures a ZeRO-2/3 step's collectives in its graphs, but not "
            f"with {why}; each gather unit's module call is compiled instead, its gather and "
            "reduce-scatter outside the graph",
            stacklevel=4,
        )


def backend_of(
    compile: bool | str | Callable[..., Any] | None,
    *,
    deterministic: bool,
    cuda_graphs: bool = False,
    mesh: Any = None,
) -> Backend:
    """The backend ``fs.init``'s ``compile`` argument names: True = "inductor", False or None
    = eager, a string or callable = that ``torch.compile`` backend; with ``cuda_graphs`` (on
    ``mesh``, a CUDA one), :class:`CudaGraphs` (inductor, also when ``compile`` is False).

    Raises:
      TypeError: any other value.
      ValueError: a backend name torch.compile does not know; a backend with
        ``deterministic=True``; ``cuda_graphs`` on a mesh that is not
        CUDA's, or with a backend other than inductor.
    """
    if cuda_graphs:
        if compile not in (None, False, True, "inductor"):
            raise ValueError(
                f"init: cuda_graphs=True compiles with inductor (mode='reduce-overhead'); "
                f"compile={compile!r} names another backend"
            )
        device_type = getattr(mesh, "device_type", None)
        if device_type != "cuda":
            raise ValueError(
                f"init: cuda_graphs=True needs a CUDA mesh; this mesh's device is "
                f"{device_type!r} (CUDA graphs replay kernels captured on a GPU)"
            )
        compile = "inductor"
    if compile is None or compile is False:
        return None
    if compile is True:
        backend: Backend = "inductor"
    elif isinstance(compile, str) and compile:
        backend = _known_backend(compile)
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
    return CudaGraphs() if cuda_graphs else backend


def compile_settings(backend: Backend, overlap: bool) -> tuple[tuple[str, str], ...]:
    """``fs.init``'s compile settings as every rank must share them (compared with the
    layout's by :class:`~funcshard.layout.same_model.InitAgreement`): the backend (a callable
    by its qualified name and :func:`~funcshard.step.digest.callable_digest`: two lambdas
    share a name; a torch.compile backend's name it holds counts as written) and whether
    inductor's overlap passes run.
    Ranks that differ issue other collectives in the first step (a captured step beside an
    eager one, inductor beside aot_eager, overlap on beside off): each waited there for its
    peers until the process group's timeout.

    Raises:
      TypeError: ``overlap`` not a bool (a string such as "no" is truthy: it turned the
        passes on).
    """
    if not isinstance(overlap, bool):
        raise TypeError(f"init: overlap must be True or False; got {overlap!r}")
    if backend is None or isinstance(backend, str):
        name = repr(backend)
    elif isinstance(backend, CudaGraphs):
        name = f"{backend.backend!r} (cuda_graphs)"
    else:
        name = qualified_name(backend)
        known = frozenset(torch._dynamo.list_backends(exclude_tags=()))  # held names count
        name += f" (digest {callable_digest(backend, known)})"  # two lambdas share a name
    return (("compile", name), ("overlap", repr(overlap and by_inductor(backend))))


def _known_backend(name: str) -> str:
    """``name`` if torch.compile has a backend of that name (``torch._dynamo.list_backends``),
    else ValueError naming it and the known ones (torch.compile would fail only at the first
    step, inside the trace)."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(
            f"init: compile={name!r} is not a torch.compile backend; known backends: "
            f"{', '.join(known)} (or pass a backend callable)"
        )
    return name


@functools.cache
def _compiled_impl(backend: Backend) -> Callable[..., Any]:
    """``nn.Module._call_impl`` compiled once per backend (dynamo's cache is per code object
    anyway, guarded per module): called with the module first."""
    return compile_fn(nn.Module._call_impl, backend)


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
    while isinstance(model, _optimized_module()):
        model = model._orig_mod
    return model


def _optimized_module() -> type | tuple[()]:
    """torch.compile's module wrapper type; none (``()``) while torch's compiler was never
    imported, as then no model can be wrapped: an eager program does not import it (0.6 s)."""
    dynamo = sys.modules.get("torch._dynamo")
    return () if dynamo is None else dynamo.eval_frame.OptimizedModule


def compiled_around_units(model: nn.Module, prefixes: Iterable[str]) -> str | None:
    """The name of a module of ``model`` compiled as a whole that holds gather units
    (``model.compile()``, or a ``torch.compile(model)`` wrapper): "" for the model itself;
    None when no unit is inside a compiled region."""
    if isinstance(model, _optimized_module()):
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
