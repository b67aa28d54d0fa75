"""What dynamo reports of the captured step, said as the step would say it eagerly.

* :func:`traced_error`: an op that fails as dynamo traces the step.
* :func:`unwrapped_error`: a :class:`UnitParamsError` raised inside a backend (the check
  that a graph reads no model parameter), out of dynamo's ``BackendCompilerFailed``.
* :func:`warn_graph_breaks`: where dynamo broke the step's graph, warned once per state.

Dynamo runs each op of ``loss_fn`` on fake tensors before its graph runs; an op that cannot
take its inputs (a batch of the wrong width) raises there, and dynamo reports it as a
``TorchRuntimeError`` of some forty lines: its explanation, a hint, a link and the frames.
:func:`traced_error` turns it into the op's own error type and message, naming the user's
line that called it and the batch's shapes, the way the eager step raises it. No update
has run then (only a graph before a graph break may have: its gathers, on every rank whose
batch is alike); ``train_step`` puts the buffers back and the state passed is usable.
"""

from __future__ import annotations

import os
import re
import warnings
import weakref
from typing import Any

import optree
import torch

from funcshard.layout.layout import Layout
from funcshard.parallel.batch import leaf_paths
from funcshard.step.units.placeholders import UnitParamsError

__all__ = ["traced_error", "unwrapped_error", "warn_graph_breaks"]

# "...: got RuntimeError('a and b must have same reduction dim, but got [4, s9] X [8, 16].')"
_GOT = re.compile(r"got (?P<type>\w+)\((?P<q>['\"])(?P<message>.*)(?P=q)\)\s*$")
# the op errors kept as their type; any other (an AssertionError of a meta check) is said as
# RuntimeError, as eager's kernels raise it
_KINDS = {k.__name__: k for k in (RuntimeError, ValueError, TypeError, IndexError)}
# a function dynamo resumed after a graph break: "torch_dynamo_resume_in_loss_fn_at_19"
_RESUMED = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")
# the packages whose frames are not the user's line
_FUNCSHARD = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep for path in (torch.__file__, optree.__file__) if path
) + (_FUNCSHARD + os.sep,)


def _user_line(e: Exception) -> str:
    """The innermost frame of the traced code outside torch and funcshard, or ""."""
    stack = getattr(e, "real_stack", None) or []
    for frame in reversed(list(stack)):
        if not frame.filename.startswith(_LIBRARIES):
            code = f": {frame.line.strip()}" if frame.line else ""
            name = _RESUMED.sub(r"\g<name>", frame.name)
            return f" at {os.path.basename(frame.filename)}:{frame.lineno} in {name}{code}"
    return ""


def _shapes(batch: Any) -> str:
    leaves = optree.tree_leaves(batch)
    return ", ".join(
        f"{path} {tuple(x.shape)}"
        for path, x in zip(leaf_paths(batch), leaves, strict=True)
        if isinstance(x, torch.Tensor)
    )


def _explanation(text: str) -> str:
    """The "Explanation:" line of dynamo's report, without its label ("" if none)."""
    lines = (line.strip() for line in text.splitlines())
    why = next((line for line in lines if line.startswith("Explanation:")), "")
    return why.removeprefix("Explanation: ")


def traced_error(e: Exception, batch: Any, backend: Any) -> Exception:
    """``e`` (dynamo's TorchRuntimeError) as the error of the op that failed on fake
    tensors: its type where it is RuntimeError, ValueError, TypeError or IndexError, else
    RuntimeError; ``e`` itself where dynamo's text names no such op error."""
    got = _GOT.search(_explanation(str(e)))
    if got is None:
        return e
    # an op's meta check may assert where its kernel raises RuntimeError: a bad input is not
    # an assertion of funcshard's
    kind = _KINDS.get(got["type"], RuntimeError)
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", None)
    return kind(
        f"{got['message']} (an op of loss_fn{_user_line(e)}, as "
        f"compile={name or type(backend).__name__!r} traced it on this batch: "
        f"{_shapes(batch)}; the op fails in an eager step too; nothing was applied and the "
        "state passed is usable)"
    )


# layouts whose captured step was warned of a graph break (once each), weak on the layout
_BROKEN: weakref.WeakSet = weakref.WeakSet()


def _first_lines(reason: str) -> str:
    """A graph break's reason as dynamo counts it, cut to its title and explanation."""
    title, why = reason.strip().splitlines()[0].strip(), _explanation(reason)
    return f"{title}: {why}" if why else title


def warn_graph_breaks(layout: Layout, before: dict[str, int]) -> None:
    """Warns, once per layout, where dynamo broke the captured step's graph during a call
    (``before``: its graph-break counters then), naming each reason: the graphs on either
    side of a break are compiled apart, so the forward's params cross between them, and the
    joint pass places each graph's collectives within it alone."""
    counts = torch._dynamo.utils.counters["graph_break"]
    new = {r: n - before.get(r, 0) for r, n in counts.items() if n > before.get(r, 0)}
    if not new or layout in _BROKEN:
        return
    _BROKEN.add(layout)
    short: dict[str, int] = {}
    for reason, n in new.items():
        short[_first_lines(reason)] = short.get(_first_lines(reason), 0) + n
    reasons = "; ".join(f"{r} (x{n})" for r, n in short.items())
    warnings.warn(
        f"train_step: compile= captured the {layout.strategy} step in pieces: dynamo broke the "
        f"graph inside loss_fn or the model, {sum(new.values())} time(s): {reasons}. Each "
        "piece compiles on its own: the collectives of one piece do not overlap another's, "
        "and ZeRO-3's params gathered before a break are kept for the backward past it. "
        "Remove the break (a print, a .item(), data-dependent Python) to capture the step "
        "whole; torch._dynamo.explain(fn)(...) lists each break. Warned once per state",
        stacklevel=4,
    )


def unwrapped_error(e: Exception) -> Exception:
    """A backend's failure as dynamo reports it, or the UnitParamsError inside it."""
    inner = getattr(e, "inner_exception", None)
    return inner if isinstance(inner, UnitParamsError) else e
