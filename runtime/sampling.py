"""Next-token selection from logits: greedy, or temperature / top-k / top-p sampling; log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError


@dataclass
class Sampler:
    """temperature 0 means greedy (argmax, ties to the lowest id)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InputError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InputError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InputError("top_k must be >= 0")
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.temperature == 0:
            return int(np.argmax(logits))
        # shift before dividing: a tiny temperature then sends the others to -inf, never inf - inf = NaN
        scaled = (logits - logits.max()) / self.temperature
        order = np.argsort(-scaled, kind="stable")
        if self.top_k > 0:
            order = order[: self.top_k]
        kept = scaled[order]
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            cutoff = int(np.searchsorted(np.cumsum(probs), self.top_p) + 1)
            order, probs = order[:cutoff], probs[:cutoff] / probs[:cutoff].sum()
        return int(order[self._rng.choice(len(order), p=probs)])


@dataclass(frozen=True)
class TokenLogprobs:
    """The model's log-probability of a chosen token and the `k` most likely tokens (id, log-probability)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, token: int, k: int = 0) -> TokenLogprobs:
    """log_softmax of the raw logits (before temperature or top-p): what the model itself assigns."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    peak = x.max()
    logp = x - (peak + np.log(np.exp(x - peak).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, logp.size)
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.lexsort((best, -logp[best]))]  # most likely first, ties to the lowest id
        top = tuple((int(i), float(logp[i])) for i in best)
    return TokenLogprobs(float(logp[token]), top)
