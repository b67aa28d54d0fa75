"""``fs.pipeline.split``: a model cut into pipeline stages by deleting modules (torchtitan's
manual split), and :func:`merge`, one pipeline rank's stages as one module tree.

No parameter is copied: a stage is a shallow copy of the modules on the path from the root
to the split points, the modules it keeps shared with the model; so a meta-device model
splits as well as a real one, and every stage's parameter names are the whole model's.

>>> import torch.nn as nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.embed = nn.Linear(2, 4)
...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
...         self.head = nn.Linear(4, 2)
...     def forward(self, x):
...         x = self.embed(x)
...         for layer in self.layers:
...             x = layer(x)
...         return self.head(x)
>>> first, second = split(Net(), ["layers.2"])
>>> sorted({n.rsplit(".", 1)[0] for n, _ in first.named_parameters()})
['embed', 'layers.0', 'layers.1']
>>> sorted({n.rsplit(".", 1)[0] for n, _ in second.named_parameters()})
['head', 'layers.2', 'layers.3']
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["split", "merge"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def split(model: nn.Module, split_points: Sequence[str]) -> list[nn.Module]:
    """``len(split_points) + 1`` stages of ``model``, in model order.

    Stage ``i`` holds the modules from split point ``i - 1`` (a module name where a stage
    begins: torch.distributed.pipelining's ``SplitPoint.BEGINNING``) up to split point ``i``,
    in the order the model registers its modules (which must be the order its forward runs
    them). Every other module is removed: an entry of an ``nn.ModuleList`` / ``nn.ModuleDict``
    is dropped (the kept entries keep their names: ``layers.2`` stays ``layers.2``; iterate
    such a container rather than index it), any other module is replaced by ``nn.Identity``
    (so a stage's forward passes the previous stage's output through the removed embedding
    or head). ``model`` itself is left as it was.

    Raises:
      ValueError: a split point that is not a submodule of ``model``, named twice, out of
        model order, or inside another split point; a module cut across stages that holds
        parameters of its own (put them in a submodule).
    """
    points = list(split_points)
    modules = dict(model.named_modules())
    for p in points:
        if not p or p not in modules:
            raise ValueError(f"pipeline.split: {p!r} is not a submodule of {type(model).__name__}")
        inner = [q for q in points if q.startswith(p + ".")]
        if inner:
            raise ValueError(f"pipeline.split: split point {inner[0]!r} is inside {p!r}")
    if len(set(points)) != len(points):
        raise ValueError(f"pipeline.split: a split point is named twice in {points}")
    atoms = _atoms(model, "", points)
    where = [atoms.index(p) for p in points]
    if where != sorted(where):
        raise ValueError(
            f"pipeline.split: split points {points} are not in model order "
            f"({[atoms[i] for i in sorted(where)]})"
        )
    stage_of = {a: sum(1 for w in where if w <= i) for i, a in enumerate(atoms)}
    cut = {_parent(p) for p in points} | {a for p in points for a in _ancestors(p)}
    return [
        _keep(model, "", {a for a, s in stage_of.items() if s == i}, cut)
        for i in range(len(points) + 1)
    ]


def _d(module: nn.Module, field: str) -> Any:
    """One of torch's own dicts of ``module`` (its children, parameters, buffers)."""
    return vars(module)[field]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(len(parts))]


def _atoms(module: nn.Module, prefix: str, points: list[str]) -> list[str]:
    """The modules no split point is strictly inside, in registration order."""
    own = [n for n, p in _d(module, "_parameters").items() if p is not None]
    if own:
        raise ValueError(
            f"pipeline.split: module {prefix.rstrip('.') or '<root>'!r} is cut across stages "
            f"but holds parameters of its own ({sorted(own)}); put them in a submodule"
        )
    out = []
    for key, child in _d(module, "_modules").items():
        if child is None:
            continue
        name = prefix + key
        if any(p.startswith(name + ".") for p in points):
            out.extend(_atoms(child, name + ".", points))
        else:
            out.append(name)
    return out


def _shell(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own dicts of children, parameters, buffers."""
    new = copy.copy(module)
    new.__dict__.update(  # torch's own dicts, each the copy's
        _modules={},
        _parameters=dict(_d(module, "_parameters")),
        _buffers=dict(_d(module, "_buffers")),
        _non_persistent_buffers_set=set(_d(module, "_non_persistent_buffers_set")),
    )
    return new


def _keep(module: nn.Module, prefix: str, keep: set[str], cut: set[str]) -> nn.Module:
    new = _shell(module)
    children = _d(new, "_modules")
    for key, child in _d(module, "_modules").items():
        name = prefix + key
        if child is None:
            children[key] = None
        elif name in cut:
            children[key] = _keep(child, name + ".", keep, cut)
        elif name in keep:
            children[key] = child
        elif not isinstance(module, _CONTAINERS):
            children[key] = nn.Identity()
    return new


def merge(modules: Sequence[nn.Module]) -> nn.Module:
    """One module tree holding every module, parameter and buffer of ``modules`` (stages of
    one model, on one pipeline rank) under their own names; shares their tensors. It is read
    (names, gather units, tied weights, buffers), never run."""
    if len(modules) == 1:
        return modules[0]
    out = _shell(modules[0])
    for m in modules[1:]:
        for field in ("_parameters", "_buffers"):
            mine = _d(out, field)
            mine.update({k: v for k, v in _d(m, field).items() if k not in mine})
        _d(out, "_non_persistent_buffers_set").update(_d(m, "_non_persistent_buffers_set"))
    children = _d(out, "_modules")
    for key in dict.fromkeys(k for m in modules for k in _d(m, "_modules")):
        present = [_d(m, "_modules").get(key) for m in modules]
        present = [c for c in present if c is not None]
        real = [c for c in present if not isinstance(c, nn.Identity)]
        distinct = list({id(c): c for c in real}.values())
        if not distinct:
            children[key] = present[0] if present else None
        else:
            children[key] = distinct[0] if len(distinct) == 1 else merge(distinct)
    return out
