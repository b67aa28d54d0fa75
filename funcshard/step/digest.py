"""A digest of a compile backend given as a callable, the same in every process that runs the
same source, so that ``fs.init``'s agreement tells two backends of one name apart (two
lambdas, two ``aot_autograd(...)`` backends with other compilers, two partials of other
functions).

It reads code, not plain values: a backend may hold what differs between ranks that run
the same backend (a rank, a log path), so a str or a number counts by its type only; the
literals of a function's code count as written (every rank runs the same source), and so
does a str that names a torch.compile backend (``names``: a backend that holds one, as torch's
``CompileCounterWithBackend("aot_eager")`` does, compiles with it; two ranks holding
"aot_eager" and "eager" initialized and waited in the first step's collectives). Not told
apart: backends that differ only by a plain value other than a backend's name (a flag, a
mode string), or by a global their code reads."""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

__all__ = ["callable_digest", "qualified_name"]

_PLAIN = (str, int, float, bool, type(None))


def callable_digest(fn: Any, names: frozenset[str] = frozenset()) -> str:
    """12 hex digits of ``fn``: a function's code and closure, a method's function, a
    partial's function and arguments, another object's type and attributes; what they hold
    by digest where callable, else by type (a str in ``names``, a backend's name, as
    written)."""
    return hashlib.sha1(_text(fn, 0, names).encode()).hexdigest()[:12]


def _text(value: Any, depth: int, names: frozenset[str]) -> str:
    if isinstance(value, _PLAIN):  # by type: a rank or a path may differ between ranks
        return repr(value) if isinstance(value, str) and value in names else type(value).__name__
    if depth > 4:  # deep enough to tell backends apart; a cycle ends here
        return qualified_name(value)
    d = depth + 1
    if isinstance(value, types.FunctionType):
        cells = [_text(_contents(c), d, names) for c in value.__closure__ or ()]
        return "\x00".join([_code(value.__code__), *cells])
    if isinstance(value, types.MethodType):
        return _text(value.__func__, d, names)
    if isinstance(value, functools.partial):
        parts = [_text(value.func, d, names), *(_text(a, d, names) for a in value.args)]
        return "\x00".join(parts + _items(value.keywords, d, names))
    if isinstance(value, (tuple, list)):
        return f"({','.join(_text(v, d, names) for v in value)})"
    if isinstance(value, dict):
        return "{" + ",".join(_items(value, d, names)) + "}"
    attrs = getattr(value, "__dict__", None)
    if callable(value) and isinstance(attrs, dict) and not isinstance(value, type):
        return "\x00".join([qualified_name(value), *_items(attrs, d, names)])
    return qualified_name(value)


def _contents(cell: types.CellType) -> Any:
    """A closure cell's value; an empty one (a variable the enclosing function assigns after
    making the backend, or never) as None: ``cell_contents`` raised ValueError in fs.init."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _items(mapping: dict, depth: int, names: frozenset[str]) -> list[str]:
    return sorted(f"{_key(k)}={_text(v, depth, names)}" for k, v in mapping.items())


def _key(key: Any) -> str:
    """A mapping's key: a str as written (a keyword, an attribute's name), another plain key
    by type (a rank; a module's hooks are keyed by a process-wide handle count), else by
    name: a function's ``str`` holds its address, which differs from process to process (a
    table keyed by ``F.silu`` or ``torch.relu`` was refused on every run)."""
    if isinstance(key, str):
        return key
    if isinstance(key, _PLAIN):
        return type(key).__name__
    if isinstance(key, tuple):
        return f"({','.join(map(_key, key))})"
    return qualified_name(key)


def qualified_name(value: Any) -> str:
    """A function's or class's qualified name, else its type's (never an address)."""
    named = value if hasattr(value, "__qualname__") else type(value)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _code(code: types.CodeType) -> str:
    """A code object as text: its bytecode, names and constants (a frozenset's sorted: its
    order follows its strings' hashes, which differ from process to process)."""
    return "\x00".join([code.co_code.hex(), repr(code.co_names), *map(_const, code.co_consts)])


def _const(value: Any) -> str:
    if isinstance(value, types.CodeType):
        return _code(value)
    if isinstance(value, tuple):
        return f"({','.join(map(_const, value))})"
    if isinstance(value, frozenset):
        return f"{{{','.join(sorted(map(_const, value)))}}}"
    return repr(value)
