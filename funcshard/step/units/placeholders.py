"""Placeholders: what a unit's parameter is where its unit is not running (ZeRO-2/3).

Any use of a placeholder raises :class:`UnitParamsError`, naming the parameter, instead of
silently taking the module's own (stale) weights; metadata reads (shape, dtype) answer.
"""

from __future__ import annotations

import weakref

import torch

from funcshard.layout.layout import ROOT_UNIT, Layout

__all__ = ["UnitParamsError", "Absent", "absent", "read_in_capture", "absent_in_capture"]


class UnitParamsError(RuntimeError):
    """A unit's parameter was used where the unit was not running (ZeRO-2/3)."""


# Metadata reads a placeholder answers; any other use raises.
_METADATA = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.__repr__,
        torch.Tensor.__format__,
        torch.Tensor.__hash__,
    }
)


class Absent(torch.Tensor):
    """A meta tensor standing in for a parameter outside the unit that holds it."""

    _why: str

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, why: str) -> Absent:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t._why = why
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA or getattr(func, "__name__", None) == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        absent = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Absent))
        raise UnitParamsError(absent._why)


_MADE: weakref.WeakKeyDictionary[Layout, dict[str, Absent]] = weakref.WeakKeyDictionary()


def absent(layout: Layout, names: list[str]) -> dict[str, Absent]:
    """A placeholder per name, whose error says why the param is not there (made once per
    layout: every microbatch of every step puts them in)."""
    made = _MADE.setdefault(layout, {})
    missing = [name for name in names if name not in made]
    if missing:
        made.update(_make(layout, missing))
    return {name: made[name] for name in names}


def _make(layout: Layout, names: list[str]) -> dict[str, Absent]:
    out = {}
    for name in names:
        spec = layout.leaf(name)
        if spec.unit == ROOT_UNIT:
            why = (
                f"parameter {name!r} (root unit) was used after forward: under "
                f"{layout.strategy} the root's params are gathered for forward only, so "
                "code outside the units cannot be recomputed in backward (activation "
                "checkpointing); checkpoint units, or code inside them, instead"
            )
        else:
            why = _outside_its_unit(layout, name, layout.units[spec.unit])
        out[name] = Absent(spec.shape, spec.dtypes.compute, why)
    return out


def _outside_its_unit(layout: Layout, name: str, unit: str) -> str:
    """Why unit ``unit``'s parameter ``name`` was absent: read outside the unit, or (tied
    into a module of another unit, e.g. one Linear in two blocks) used there."""
    tied = [a for a in layout.aliases_of(name) if not a.startswith(unit + ".")]
    if tied:
        return (
            f"parameter {name!r} of unit {unit!r} is tied into another module as {tied[0]!r} "
            f"(one tensor under both names) and was used there while {unit!r} was not "
            f"running: under {layout.strategy} a unit's params exist only inside its forward "
            "(and its backward). Make the modules that share it one unit (fs.init(units=...)), "
            "or register the shared module on the model itself before them (the root unit)"
        )
    return (
        f"parameter {name!r} of unit {unit!r} was used where that unit was not running: "
        f"under {layout.strategy} a unit's params exist only inside its forward (and its "
        "backward). Take a param outside of its unit through params[name] in loss_fn"
    )


def read_in_capture(layout: Layout, name: str) -> UnitParamsError:
    """The error of a ``loss_fn`` that reads param ``name`` from the model itself under the
    captured step (``compile=`` under ZeRO-2/3): there the model's own tensor is not the
    state's (it holds the initial weights), so the read is refused, not trained on."""
    return UnitParamsError(
        f"parameter {name!r} was read from the model itself in loss_fn, outside "
        f"fs.functional_call: under {layout.strategy} with compile= the captured step hands "
        "loss_fn the state's params, and the model's own tensor is not one of them (it holds "
        f"the initial weights); read params[{name!r}] instead"
    )


_CAPTURED: weakref.WeakKeyDictionary[Layout, dict[str, Absent]] = weakref.WeakKeyDictionary()


def absent_in_capture(layout: Layout) -> dict[str, Absent]:
    """A placeholder per parameter of ``layout`` whose error is :func:`read_in_capture`'s:
    what the model holds while a captured step's eager code runs (made once per layout)."""
    if layout not in _CAPTURED:
        _CAPTURED[layout] = {
            s.name: _InCapture(s.shape, s.dtypes.compute, str(read_in_capture(layout, s.name)))
            for s in layout.leaves
        }
    return _CAPTURED[layout]


class _InCapture(Absent):
    """:class:`Absent` for the captured step's model, which dynamo may trace while it holds
    one (a graph resumed after a break that runs ``fs.functional_call`` reads the model's
    slots to swap the state's params in): dynamo's own reads of it as it traces answer, so
    that the swap traces as over the model's own param; a use that runs, eagerly or in the
    code dynamo falls back to, raises as :class:`Absent` does. Of its attributes only those
    it shares with the param (:data:`_AS_THE_PARAM`: its shape and dtype) answer: its device
    is ``meta`` and it needs no grad, so that a loss_fn asking the model for its device
    (``torch.zeros(..., device=p.device)``) or counting its trained params by
    ``requires_grad`` would get a wrong answer; each such read raises instead (found by
    review: "Cannot copy out of meta tensor", a count of 0 trained params)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch._guards.TracingContext.try_get() is not None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name = getattr(getattr(func, "__self__", None), "__name__", None)
        if getattr(func, "__name__", None) == "__get__" and name not in _AS_THE_PARAM:
            raise UnitParamsError(args[0]._why)
        return super().__torch_function__(func, types, args, kwargs)


# the attributes a captured step's placeholder shares with the param it stands for
_AS_THE_PARAM = frozenset({"shape", "dtype", "ndim", "layout", "names", "_why"})
