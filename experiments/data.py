"""Training data whose order is a pure function of (seed, step, rank).

Two sources share one interface (``vocab``, ``floor``, ``batch(step, ...)``):

* :class:`MarkovSource`, the default: a synthetic order-2 Markov chain over a small vocabulary,
  with transition rows drawn from a sparse Dirichlet. Its entropy rate (nats/token) is computed
  exactly from the stationary distribution of the pair chain, so a loss can be judged against
  the physical limit: no model can beat it on average.
* :class:`TextSource`: char-level windows of a user's text file. There is no known floor.

The global batch for step ``s`` is drawn from a generator seeded by ``(seed, stream, s)`` and
every rank takes its own rows of it, so a resumed run sees exactly the data an uninterrupted
one would have seen.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "MarkovSource",
    "TextSource",
    "entropy_rate",
    "make_markov",
    "rank_rows",
    "stationary_pairs",
]

TRAIN, EVAL = 0, 1  # generator streams: eval batches never repeat a training batch


def rank_rows(global_batch: int, rank: int, world: int) -> slice:
    """The rows of the global batch that ``rank`` trains on (equal, contiguous, rank order)."""
    if global_batch % world:
        raise ValueError(f"batch_size {global_batch} is not divisible by the {world} ranks")
    per = global_batch // world
    return slice(rank * per, (rank + 1) * per)


def stationary_pairs(
    transitions: np.ndarray, tol: float = 1e-13, max_iter: int = 100_000
) -> np.ndarray:
    """The stationary distribution ``pi[a, b]`` of the pair chain ``(a, b) -> (b, c)``.

    Power iteration in float64 on the lazy chain ``(I + P) / 2``, which has the same stationary
    distributions as ``P`` but is aperiodic, so the iteration converges.

    Args:
      transitions: ``P[a, b, c] = p(x_t = c | x_{t-2} = a, x_{t-1} = b)``, shape (V, V, V).

    Raises:
      RuntimeError: the iteration did not converge.
    """
    V = transitions.shape[0]
    pi = np.full((V, V), 1.0 / V**2)
    for _ in range(max_iter):
        # new[b, c] = sum_a pi[a, b] P[a, b, c]
        step = np.einsum("ab,abc->bc", pi, transitions)
        new = 0.5 * (pi + step)
        if np.abs(new - pi).sum() < tol:
            return new / new.sum()
        pi = new
    raise RuntimeError(f"stationary_pairs: power iteration did not converge in {max_iter} steps")


def entropy_rate(transitions: np.ndarray) -> float:
    """Entropy rate in nats/token of the stationary order-2 chain with these transitions."""
    pi = stationary_pairs(transitions)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(transitions > 0, transitions * np.log(transitions), 0.0)
    row_entropy = -plogp.sum(-1)
    return float((pi * row_entropy).sum())


@dataclasses.dataclass(frozen=True)
class MarkovSource:
    """An order-2 Markov chain started from its stationary pair distribution.

    Sequences are stationary from their first token, so the expected loss of predicting token
    ``t >= 2`` from its past is at least ``floor`` (the entropy rate), with equality for the
    true conditional distribution.
    """

    transitions: np.ndarray  # (V, V, V) float64, rows sum to 1
    seed: int

    def __post_init__(self) -> None:
        pi = stationary_pairs(self.transitions)
        object.__setattr__(self, "_pair_cdf", np.cumsum(pi.reshape(-1)))
        object.__setattr__(self, "_cdf", np.cumsum(self.transitions, axis=-1))
        object.__setattr__(self, "_floor", entropy_rate(self.transitions))

    @property
    def vocab(self) -> int:
        return self.transitions.shape[0]

    @property
    def floor(self) -> float | None:
        return self._floor

    def sample(self, rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
        """``rows`` stationary sequences of ``length`` tokens (int64)."""
        V = self.vocab
        u = rng.random((rows, length))
        out = np.empty((rows, length), dtype=np.int64)
        first = np.minimum(np.searchsorted(self._pair_cdf, u[:, 0], side="right"), V * V - 1)
        out[:, 0], out[:, 1] = first // V, first % V
        for t in range(2, length):
            cdf = self._cdf[out[:, t - 2], out[:, t - 1]]  # (rows, V)
            out[:, t] = np.minimum((cdf <= u[:, t, None]).sum(-1), V - 1)
        return out

    def batch(
        self,
        step: int,
        *,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world: int = 1,
        stream: int = TRAIN,
    ) -> torch.Tensor:
        """This rank's rows of the global batch for ``step``: (batch_size/world, seq_len+1)."""
        rng = np.random.default_rng([self.seed, stream, step])
        tokens = self.sample(rng, batch_size, seq_len + 1)
        return torch.from_numpy(tokens[rank_rows(batch_size, rank, world)])


def make_markov(
    vocab: int = 32,
    concentration: float = 0.1,
    smoothing: float = 1e-3,
    *,
    chain_seed: int = 0,
    seed: int = 0,
) -> MarkovSource:
    """A random order-2 chain: Dirichlet(concentration) rows mixed with ``smoothing`` uniform.

    The small uniform share keeps every pair reachable, so the stationary distribution is
    unique, and keeps the Dirichlet's underflowing rows well defined.

    Args:
      vocab: number of symbols V.
      concentration: Dirichlet concentration of each row; small means few likely successors.
      smoothing: share of the uniform distribution mixed into every row.
      chain_seed: seeds the transition table (fixed, so the floor is a constant of the flags).
      seed: seeds the sampled sequences.
    """
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    if concentration <= 0:
        raise ValueError(f"concentration must be > 0, got {concentration}")
    if not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must lie in (0, 1], got {smoothing}")
    rng = np.random.default_rng([chain_seed, 0x6D61726B])
    rows = rng.dirichlet(np.full(vocab, concentration), size=(vocab, vocab))
    rows = np.nan_to_num(rows, nan=0.0)
    rows /= np.maximum(rows.sum(-1, keepdims=True), np.finfo(np.float64).tiny)
    transitions = (1 - smoothing) * rows + smoothing / vocab
    transitions /= transitions.sum(-1, keepdims=True)
    return MarkovSource(transitions=transitions, seed=seed)


@dataclasses.dataclass(frozen=True)
class TextSource:
    """Char-level windows of a text file; the last tenth is held out for evaluation."""

    text: str
    seed: int

    def __post_init__(self) -> None:
        chars = sorted(set(self.text))
        lookup = {c: i for i, c in enumerate(chars)}
        tokens = np.fromiter((lookup[c] for c in self.text), dtype=np.int64, count=len(self.text))
        split = int(len(tokens) * 0.9)
        object.__setattr__(self, "chars", chars)
        object.__setattr__(self, "_splits", (tokens[:split], tokens[split:]))

    @classmethod
    def from_file(cls, path: str | Path, seed: int = 0) -> TextSource:
        text = Path(path).read_text(encoding="utf-8")
        return cls(text=text, seed=seed)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    @property
    def floor(self) -> float | None:
        return None  # a text file has no known entropy rate

    def batch(
        self,
        step: int,
        *,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world: int = 1,
        stream: int = TRAIN,
    ) -> torch.Tensor:
        tokens = self._splits[stream]
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"--data: the {'training' if stream == TRAIN else 'held-out'} part of the file has "
                f"{len(tokens)} characters; need more than seq_len + 1 = {seq_len + 1}"
            )
        rng = np.random.default_rng([self.seed, stream, step])
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        rows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        return torch.from_numpy(rows[rank_rows(batch_size, rank, world)])


def describe(source: MarkovSource | TextSource) -> str:
    """One line naming the source and its floor."""
    if isinstance(source, MarkovSource):
        return (
            f"order-2 Markov source, vocab {source.vocab}, entropy rate {source.floor:.4f} "
            f"nats/token (uniform would be {math.log(source.vocab):.4f})"
        )
    return f"char-level text, vocab {source.vocab}, no known floor"
