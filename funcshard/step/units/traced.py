"""An op that fails as dynamo traces the captured step, said as eager would say it.

Dynamo runs each op of ``loss_fn`` on fake tensors before its graph runs; an op that cannot
take its inputs (a batch of the wrong width) raises there, and dynamo reports it as a
``TorchRuntimeError`` of some forty lines: its explanation, a hint, a link and the frames.
:func:`traced_error` turns it into the op's own error type and message, naming the user's
line that called it and the batch's shapes, the way the eager step raises it. No update
has run then (only a graph before a graph break may have: its gathers, on every rank whose
batch is alike); ``train_step`` puts the buffers back and the state passed is usable.
"""

from __future__ import annotations

import builtins
import os
import re
from typing import Any

import optree
import torch

__all__ = ["traced_error"]

# "...: got RuntimeError('a and b must have same reduction dim, but got [4, s9] X [8, 16].')"
_GOT = re.compile(r"got (?P<type>\w+)\((?P<q>['\"])(?P<message>.*)(?P=q)\)\s*$")
# the packages whose frames are not the user's line
_LIBRARIES = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, optree, __import__("funcshard"))
    if m.__file__ is not None
)


def _user_line(e: Exception) -> str:
    """The innermost frame of the traced code outside torch and funcshard, or ""."""
    stack = getattr(e, "real_stack", None) or []
    for frame in reversed(list(stack)):
        if not frame.filename.startswith(_LIBRARIES):
            code = f": {frame.line.strip()}" if frame.line else ""
            return f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}{code}"
    return ""


def _shapes(batch: Any) -> str:
    paths = optree.tree_paths(batch)
    leaves = optree.tree_leaves(batch)
    return ", ".join(
        f"{'/'.join(map(str, p)) or '<batch>'} {tuple(x.shape)}"
        for p, x in zip(paths, leaves, strict=True)
        if isinstance(x, torch.Tensor)
    )


def traced_error(e: Exception, batch: Any, backend: Any) -> Exception:
    """``e`` (dynamo's TorchRuntimeError) as the error of the op that failed on fake
    tensors: its type where it is a builtin exception, else RuntimeError; ``e`` itself where
    dynamo's text names no such op error."""
    lines = [line.strip() for line in str(e).splitlines()]
    why = next((line for line in lines if line.startswith("Explanation:")), "")
    got = _GOT.search(why)
    if got is None:
        return e
    kind = getattr(builtins, got["type"], None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = RuntimeError
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", None)
    return kind(
        f"{got['message']} (an op of loss_fn{_user_line(e)}, as "
        f"compile={name or type(backend).__name__!r} traced it on this batch: "
        f"{_shapes(batch)}; the op fails in an eager step too; nothing was applied and the "
        "state passed is usable)"
    )
