"""Log-probabilities in the two shapes of the OpenAI API: chat's `content` list and completions' columns.

The values are the model's own: log_softmax of the row's logits before
temperature and top-p (runtime/sampling.py `token_logprobs`), so they do not
change with the sampling parameters. A token's text is its id decoded alone
(a piece of a multi-byte character shows as U+FFFD; `bytes` then carries the
UTF-8 of that text, as decoded); a bundle without a tokenizer names tokens
`token_id:N`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..runtime.sampling import TokenLogprobs

Item = tuple[int, TokenLogprobs]  # a generated token and its log-probabilities


class LogprobFormatter:
    def __init__(self, model: Any):
        self.tokenizer = model.tokenizer if model.manifest.tokenizer_path is not None else None

    def text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, items: Sequence[Item]) -> dict[str, Any]:
        """choices[].logprobs of a chat completion (or of one chunk of a stream)."""
        content = [self._entry(token, lp.logprob) | {"top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                   for token, lp in items]
        return {"content": content, "refusal": None}

    def completion(self, items: Sequence[Item], offset: int = 0) -> dict[str, Any]:
        """choices[].logprobs of a text completion; `offset` is where these tokens' text starts."""
        tokens = [self.text(token) for token, _ in items]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in items],
            "top_logprobs": [{self.text(t): v for t, v in lp.top} for _, lp in items],
            "text_offset": offsets,
        }
