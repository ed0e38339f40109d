"""Compiled bundle vs torch eager reference, step by step (used by `verify` and the tests).

Errors are scaled by the magnitude of the terms of the final dot product,
sum_j |W_ij| |h_j| for logit i, not by the logit itself: a logit near zero
made of large terms legitimately carries a large absolute rounding error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..frontend.deferred_weights import materialize_module
from ..frontend.model import CausalLM, new_state
from ..runtime import Model

# fp32 through a few layers: the scaled error stays far below this.
SCALED_TOL_FP32 = 1e-4
# float16 compute (`--dtype f16`) against the float32 reference: a few units of float16's rounding
# (2^-11 = 4.9e-4) of the terms through a few layers; a wrong cast or weight gives errors of order 1.
SCALED_TOL_F16 = 3e-3


@dataclass
class ParityReport:
    steps: int = 0
    worst_scaled_error: float = 0.0
    worst_abs_error: float = 0.0
    eager_tokens: list[int] = field(default_factory=list)
    compiled_tokens: list[int] = field(default_factory=list)

    @property
    def tokens_agree(self) -> bool:
        return self.eager_tokens == self.compiled_tokens

    def ok(self, tol: float = SCALED_TOL_FP32) -> bool:
        return self.tokens_agree and self.worst_scaled_error <= tol

    def summary(self) -> str:
        agree = sum(a == b for a, b in zip(self.eager_tokens, self.compiled_tokens))
        return (
            f"{self.steps} steps: worst scaled error {self.worst_scaled_error:.2e}, "
            f"worst abs error {self.worst_abs_error:.2e}, greedy tokens agree {agree}/{len(self.eager_tokens)}"
        )


class EagerRunner:
    """Runs the reference module chunk by chunk with its own state, like the runtime does."""

    def __init__(self, module: CausalLM, chunk: int):
        materialize_module(module)  # a module loaded for compiling may hold deferred weights
        self.module = module
        self.chunk = chunk
        self.state = new_state(module.cfg, 1)
        self.position = 0
        self._hidden: torch.Tensor | None = None
        module.norm.register_forward_hook(self._capture)

    def _capture(self, _mod, _inp, out) -> None:
        self._hidden = out.detach()

    def term_scale(self) -> np.ndarray:
        m = self.module
        w = m.embed_tokens.weight if m.cfg.tie_word_embeddings else m.lm_head.weight
        return (self._hidden.float().abs() @ w.detach().float().abs().T).reshape(-1).numpy()

    @torch.no_grad()
    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        logits = None
        for off in range(0, len(ids), self.chunk):
            piece = list(ids[off : off + self.chunk])
            tokens = torch.zeros((1, self.chunk), dtype=torch.int64)
            tokens[0, : len(piece)] = torch.tensor(piece)
            logits = self.module(tokens, torch.tensor([self.position]), torch.tensor([len(piece)]), *self.state)
            self.position += len(piece)
        return logits.reshape(-1).numpy()

    @torch.no_grad()
    def decode(self, token: int) -> np.ndarray:
        logits = self.module(torch.tensor([[token]]), torch.tensor([self.position]), torch.tensor([1]), *self.state)
        self.position += 1
        return logits.reshape(-1).numpy()


def compare_logits(report: ParityReport, compiled: np.ndarray, eager: np.ndarray, scale: np.ndarray) -> None:
    err = np.abs(compiled.astype(np.float64) - eager.astype(np.float64))
    report.worst_abs_error = max(report.worst_abs_error, float(err.max()))
    report.worst_scaled_error = max(report.worst_scaled_error, float((err / np.maximum(scale, 1e-30)).max()))
    report.steps += 1


def run_parity(
    module: CausalLM, bundle: Model, prompt_ids: Sequence[int], steps: int, chunk: int | None = None
) -> ParityReport:
    """Greedy-decode with both; the eager side follows its own tokens, the compiled its own."""
    eager = EagerRunner(module, chunk or bundle.chunk)
    session = bundle.session()
    report = ParityReport()
    e_logits = eager.prefill(prompt_ids)
    c_logits = session.prefill(prompt_ids)
    for step in range(steps + 1):
        compare_logits(report, c_logits, e_logits, eager.term_scale())
        e_tok, c_tok = int(np.argmax(e_logits)), int(np.argmax(c_logits))
        report.eager_tokens.append(e_tok)
        report.compiled_tokens.append(c_tok)
        if step == steps or session.position >= bundle.max_context:
            break
        e_logits = eager.decode(e_tok)
        c_logits = session.decode(c_tok)
    return report


def batches_differ(batches: Sequence, feeds: Sequence[dict[int, list[int]]]) -> float:
    """Feed the same steps to batched sessions (runtime.batch), rows 0 and 1 opened on each; returns the
    largest difference of any row's logits from the first batch's, over that row's largest logit."""
    for batch in batches:
        batch.open_row(0), batch.open_row(1)
    worst = 0.0
    for step in feeds:
        first, *others = (batch.step(dict(step)) for batch in batches)
        for other in others:
            assert first.keys() == other.keys() == step.keys()
            for row in step:
                worst = max(worst, float(np.abs(other[row] - first[row]).max() / np.abs(first[row]).max()))
    return worst
