"""What a layout reads off the model: its gather units and its tied parameter names.

A unit is a submodule gathered as one (ZeRO-3) and named by its prefix; unit 0
(``ROOT_UNIT``) holds every parameter outside the named ones. Computed from the module tree
alone, so every rank finds the same units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = [
    "ROOT_UNIT",
    "UnitsArg",
    "default_units",
    "resolve_units",
    "tied_aliases",
    "unit_of",
]

ROOT_UNIT = 0
UnitsArg = Sequence[str] | Callable[[str, nn.Module], bool] | None


def default_units(model: nn.Module) -> list[str]:
    """The repeated blocks: each child that holds parameters of an ``nn.ModuleList`` or of a
    torchtitan-style ``nn.ModuleDict`` of blocks (keys "0", "1", ...: a pipeline split drops
    entries and keeps the others' names, so torchtitan numbers its blocks by key).

    A list of blocks nested inside a unit does not split that unit further.
    """
    units: list[str] = []
    for name, module in model.named_modules():
        if not _blocks(module):
            continue
        if any(name == u or name.startswith(u + ".") for u in units):
            continue
        for child_name, child in module.named_children():
            if any(True for _ in child.parameters()):
                units.append(f"{name}.{child_name}" if name else child_name)
    return units


def _blocks(module: nn.Module) -> bool:
    """Whether ``module`` is a list of blocks: an ``nn.ModuleList``, or an ``nn.ModuleDict``
    whose every key is a number."""
    if isinstance(module, nn.ModuleList):
        return True
    return isinstance(module, nn.ModuleDict) and len(module) > 0 and all(map(str.isdigit, module))


def resolve_units(model: nn.Module, units: UnitsArg) -> list[str]:
    """The unit prefixes ``units`` names in ``model`` (``default_units`` when None)."""
    if units is None:
        return default_units(model)
    if callable(units):
        return [name for name, m in model.named_modules() if name and units(name, m)]
    modules = dict(model.named_modules())
    missing = [u for u in units if u not in modules or not u]
    if missing:
        raise ValueError(f"units: no submodule named {missing} in {type(model).__name__}")
    return list(units)


def tied_aliases(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """``(alias, parameter)`` for every name under which ``named_parameters()`` skips a
    parameter it already yielded under another name (tied weights), in model order."""
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return tuple(out)


def unit_of(name: str, prefixes: list[str]) -> int:
    """The unit of parameter ``name``: 1 + the index of its prefix, or ``ROOT_UNIT``."""
    for i, prefix in enumerate(prefixes):
        if name.startswith(prefix + "."):
            return i + 1
    return ROOT_UNIT
