"""``functional_call``: run a module with given params, and the params ``train_step`` hands
to ``loss_fn`` (:class:`StepParams` under ZeRO-0/1, :class:`GatheredParams` under ZeRO-2/3; the
unit-by-unit machinery behind the latter is :mod:`funcshard.step.units`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless
from torch.nn.utils._named_member_accessor import NamedMemberAccessor, swap_tensor

from funcshard.step.compiling import compile_units, unwrapped

__all__ = ["functional_call", "GatheredParams", "StepParams"]


def functional_call(
    model: nn.Module,
    params: Any,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    strict: bool = False,
) -> Any:
    """Calls ``model`` with ``params`` in place of its parameters.

    Like ``torch.func.functional_call``; ``params`` may also be what ``train_step`` hands to
    ``loss_fn`` (a :class:`StepParams` dict, or :class:`GatheredParams` under ZeRO-2/3). The
    model then keeps those params until the step's backward is over, so that activation
    checkpointing (``torch.utils.checkpoint``, non-reentrant) recomputes with the weights of
    this step, not with the module's own stale ones. ``model`` may be a ``torch.compile(model)``
    wrapper: ``params`` carry the plain model's names (as ``fs.init`` names them) and the
    wrapper runs.
    """
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = kwargs or {}
    if isinstance(params, (GatheredParams, StepParams)) and params.closed:
        raise RuntimeError(
            "functional_call: these params belong to a train_step that has "
            "finished; use them only inside loss_fn"
        )
    if isinstance(params, GatheredParams):
        return params._run.call(model, args, kwargs)
    plain = unwrapped(model)  # the wrapper's modules are the plain model's: swap into those
    if isinstance(params, StepParams):
        params.stack.callback(Swap(plain, params, strict=strict).restore)
        compile_units(plain, *params.compile_units, params.stack)
        return model(*args, **kwargs)
    if plain is model:
        return torch.func.functional_call(model, params, args, kwargs, strict=strict)
    swap = Swap(plain, params, strict=strict)
    try:
        return model(*args, **kwargs)
    finally:
        swap.restore()


class Swap:
    """The model's tensors swapped for given ones (tied names included) until ``restore``.

    The one way funcshard puts params into a module; unlike a context manager it can stay
    past the call that made it (until backward is over) and be ``replace``d meanwhile.
    ``aliases``: the module's tied names as (alias, name) pairs, where the caller knows them
    (a state's layout): each alias takes its name's tensor, without walking the module's tree
    to find them (torch's way, which a unit's swap would repeat for every microbatch).
    """

    def __init__(
        self,
        module: nn.Module,
        tensors: Mapping[str, torch.Tensor],
        *,
        strict: bool = False,
        aliases: tuple[tuple[str, str], ...] | None = None,
        accessor: NamedMemberAccessor | None = None,
    ) -> None:
        self._module, self._aliases = module, aliases
        self._accessor = NamedMemberAccessor(module) if accessor is None else accessor
        untied = self._untie(tensors)
        if strict:
            missing, unexpected = self._accessor.check_keys(untied)
            if missing or unexpected:
                raise RuntimeError(
                    f"functional_call: missing keys {missing}, unexpected keys "
                    f"{unexpected} for {type(module).__name__}"
                )
        self._orig = self._swap(untied)

    def _swap(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Puts ``tensors`` in, returning what they replaced (torch's ``_MISSING`` where
        nothing was); a parameter slot is written directly, anything else as torch does."""
        done: dict[str, Any] = {}
        try:
            for name, tensor in tensors.items():
                path, _, attr = name.rpartition(".")
                owner = self._accessor.get_submodule(path)
                slots = owner._parameters
                if attr in slots:
                    done[name], slots[attr] = slots[attr], tensor
                else:
                    done[name] = swap_tensor(owner, attr, tensor, allow_missing=True)
        except Exception:
            self._accessor.swap_tensors_dict(done, allow_missing=True)  # back as it was
            raise
        return done

    def _untie(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._aliases is None:
            return stateless._untie_named_tensors_map(self._module, tensors)
        untied = dict(tensors)
        untied.update({a: tensors[n] for a, n in self._aliases if n in tensors})
        return untied

    def replace(self, tensors: dict[str, torch.Tensor]) -> None:
        """Swaps in other tensors, dropping the current ones (the originals stay kept)."""
        self._swap(self._untie(tensors))

    def restore(self) -> None:
        self._swap(self._orig)


class StepParams(dict):
    """``{name: param}`` that ``train_step`` hands to ``loss_fn`` under ZeRO-0/1.

    ``functional_call`` swaps them into the model until ``close()``, which ``train_step``
    calls after backward.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stack = contextlib.ExitStack()
        self.closed = False
        self.compile_units: tuple[tuple[str, ...], Any] = ((), None)  # unit modules, backend

    def close(self) -> None:
        self.closed = True
        self.stack.close()


class GatheredParams(Mapping):
    """``{name: full param}`` that ``train_step`` hands to ``loss_fn`` under ZeRO-2/3.

    ``functional_call(model, params, ...)`` runs the model with each unit's params entering
    the graph as the unit runs (:class:`funcshard.step.units.UnitRun`). Read by name, for a
    ``loss_fn`` that uses a parameter outside the model call (a penalty, a tied head),
    ``params[name]`` brings in its bucket (gathering it under ZeRO-3) as one more use in the
    graph, and its gradient is reduced and accumulated like the model's. Every rank must take
    the same params by name: each one is a collective (the reduce-scatter in backward). A
    membership test gathers nothing.
    """

    def __init__(self, run: Any) -> None:
        self._run = run
        self._names = frozenset(run.layout.names)

    @property
    def closed(self) -> bool:
        return self._run.closed

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.closed:
            raise RuntimeError(
                f"params[{name!r}]: these params belong to a train_step that "
                "has finished; use them only inside loss_fn"
            )
        return self._run.param(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._run.layout.names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)
