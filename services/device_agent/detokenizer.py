"""Text deltas for the token events: the tokens decoded so far, minus what was already shown."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text deltas from a growing token list, holding back incomplete UTF-8."""

    def __init__(self, tokenizer, prefix_ids: list[int] | None = None, prefix_text: str | None = None):
        self.tokenizer = tokenizer
        # Text already shown (another endpoint's tokens): deltas continue it, so they join without a seam.
        # The other endpoint may have held back the start of a character its last tokens began: given
        # what it did show, the first delta here carries the rest.
        self.token_ids: list[int] = list(prefix_ids or [])
        self.emitted = "" if tokenizer is None or not self.token_ids else self._decode()
        if prefix_text is not None and self.emitted.startswith(prefix_text):
            self.emitted = prefix_text

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.token_ids += token_ids
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta
