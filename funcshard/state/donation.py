"""Buffer-level donation: which states may still use their buffers.

Every storage a state holds carries one :class:`Liveness` token, kept in a weak dictionary
keyed by the storage object itself (not by its ``id``, which Python reuses once the storage is
collected; the entry goes with the storage). States that share a storage share its token, so
donating one state refuses every state that shares a buffer with it, however it was made
(``replace``, a tree map, unflatten).

Only :class:`funcshard.state.state.TrainState` uses this module, through its ``check`` and
``donate`` methods.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ConsumedStateError", "Liveness", "liveness", "check", "consume", "spoil"]


class ConsumedStateError(RuntimeError):
    """A TrainState was used after a function consumed it."""


class Liveness:
    """Whether the buffers of a group of states are still theirs (None) or were donated."""

    __slots__ = ("consumed_by", "__weakref__")

    def __init__(self) -> None:
        self.consumed_by: str | None = None


_TOKENS: weakref.WeakKeyDictionary[torch.UntypedStorage, Liveness] = weakref.WeakKeyDictionary()


def liveness(tensors: Iterable[Any]) -> tuple[Liveness, ...]:
    """The liveness tokens of the storages under ``tensors``; storages with no live token
    (new ones, or buffers a donation handed on) get one fresh token, shared among them."""
    tokens: list[Liveness] = []
    fresh: Liveness | None = None
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        token = _TOKENS.get(storage)
        if token is None or token.consumed_by is not None:
            fresh = fresh or Liveness()
            token = fresh
            _TOKENS[storage] = token
        if not any(token is seen for seen in tokens):
            tokens.append(token)
    return tuple(tokens) or (Liveness(),)


def check(tokens: tuple[Liveness, ...]) -> None:
    """Raises :class:`ConsumedStateError` if any of the tokens was donated."""
    for live in tokens:
        if live.consumed_by is not None:
            raise ConsumedStateError(
                f"this TrainState was consumed by {live.consumed_by}: it, or a state "
                "sharing buffers with it, was donated and its buffers reused; use the state "
                "that call returned"
            )


def consume(tokens: tuple[Liveness, ...], by: str) -> None:
    """Marks the tokens donated to ``by`` (after checking that none already is)."""
    check(tokens)
    for live in tokens:
        live.consumed_by = by


def spoil(tokens: tuple[Liveness, ...], by: str) -> None:
    """Records that the function the tokens were donated to failed after writing into the
    buffers (``by`` says so): their states refuse use as before, naming it."""
    for live in tokens:
        assert live.consumed_by is not None, "spoiled before it was donated"
        live.consumed_by = by
