"""The model's own parameters while a captured step's eager code runs.

Under the captured step (:mod:`funcshard.step.units.captured`) ``loss_fn`` gets the state's
params; the model itself keeps its initial weights. Where the whole microbatch is one graph,
a read of the model's own parameter is a graph input, refused before the backend gets it.
Where dynamo breaks the graph (a ``print``, a ``torch._dynamo.disable`` helper, code it
cannot trace), the code between the graphs runs eagerly and would read the initial weights
and drop their gradient, silently. So once a graph that ends at a break has run, the model's
parameter slots hold placeholders until the microbatch's backward is over
(:func:`~funcshard.step.units.placeholders.absent_in_capture`): any use raises
:class:`~funcshard.step.units.placeholders.UnitParamsError` naming the parameter, as eager
ZeRO-3 raises for a param used outside its unit. A graph resumed after the break that runs
``fs.functional_call`` swaps the state's params in over them as it swapped in the model's own.

Every rank runs the same ``loss_fn``: each raises at the same read, after the same graphs,
with no collective of another graph started, so no peer is left waiting. The step whose
graph has no break (the normal path) swaps nothing: whether a graph ends at a break is
known when it is compiled (dynamo's ``compile_subgraph_reason``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from funcshard.layout.layout import Layout
from funcshard.step.compiling import model_of
from funcshard.step.units.placeholders import absent_in_capture

__all__ = ["EagerReads", "ends_at_break"]


def ends_at_break(gm: Any) -> bool:
    """Whether dynamo compiled graph ``gm`` at a graph break (code runs eagerly after it)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return reason is None or bool(reason.graph_break)


class EagerReads:
    """The placeholders of one layout's captured step, put into the model's parameter slots
    by :meth:`cover` (once per microbatch, by a graph ending at a break as it runs) and
    taken out by :meth:`uncover` (as the microbatch ends, or raises). Weak on the layout."""

    def __init__(self, layout: Layout) -> None:
        self._layout = weakref.ref(layout)
        self._taken: list[tuple[dict, str, Any]] | None = None  # (slots, attr, own param)

    def on_run(self, gm: Any, ran: Callable[[], None]) -> Callable[[], None]:
        """What graph ``gm`` calls as it runs: ``ran``, then, where it ends at a break,
        :meth:`cover`."""
        if not ends_at_break(gm):
            return ran
        return functools.partial(_both, ran, self.cover)

    def cover(self) -> None:
        """Each parameter slot of the model (a tied one under each of its names) holds its
        placeholder; the model's own tensors are kept for :meth:`uncover`."""
        layout = self._layout()
        model = model_of(layout) if layout is not None and self._taken is None else None
        if model is None:
            return
        placeholders, canonical = absent_in_capture(layout), dict(layout.aliases)
        taken, seen = [], set()
        for path, module in model.named_modules(remove_duplicate=False):
            for attr, param in module._parameters.items():
                name = f"{path}.{attr}" if path else attr
                name = canonical.get(name, name)
                if param is None or (id(module), attr) in seen or name not in placeholders:
                    continue
                seen.add((id(module), attr))
                taken.append((module._parameters, attr, param, placeholders[name]))
        for slots, attr, _, placeholder in taken:
            slots[attr] = placeholder
        self._taken = [t[:3] for t in taken]

    def uncover(self) -> None:
        """The model's own tensors back in their slots."""
        taken, self._taken = self._taken, None
        for slots, attr, param in reversed(taken or ()):
            slots[attr] = param


def _both(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()
