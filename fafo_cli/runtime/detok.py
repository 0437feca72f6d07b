"""Incremental detokenization: text deltas that never split a multi-byte character or a merged word."""

from __future__ import annotations

from typing import Sequence

CONTEXT_IDS = 5  # the prompt's last tokens, decoded with the answer's first ones (as vLLM's offset)


class Detokenizer:
    """`context`: the ids before the first one `add` gets (the prompt's last few). Decoded with the first new ones
    and not returned: a SentencePiece decoder drops the space of the first token of what it decodes ("▁Paris" is
    "Paris" alone, " Paris" after "is"), and a continuation must keep it."""

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context)
        # from a character's start: cut inside one (its last bytes as byte-fallback tokens), the context would join
        # the answer's byte tokens in a run that a SentencePiece decoder turns into U+FFFD as a whole
        while self.ids and self._decode(self.ids).startswith("\ufffd"):
            del self.ids[0]
        self._context = len(self.ids)
        self._prefix = 0  # start of the window re-decoded for context (spacing depends on the left token)
        self._read = len(self.ids)  # ids up to here have been returned as text (or are the context)
        self._shown = 0  # characters returned of the ids after _read: those before an incomplete one at the end

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, ids: list[int]) -> str:
        """The text these ids add. Where the text ends in an incomplete character (a token holding the first bytes
        of one), that character waits for the ids that complete it; the text before it does not (a stop string
        that ends there is found at the token that completes it)."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith("\ufffd"):
            settled = after.rstrip("\ufffd")[len(before) + self._shown:]
            self._shown += len(settled)
            return settled
        if len(after) > len(before):
            text = after[len(before) + self._shown:]
            self._prefix, self._read, self._shown = self._read, len(self.ids), 0
            return text
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        text = after[len(before) + self._shown:]
        self._prefix = self._read = len(self.ids)
        self._shown = 0
        return text

    @property
    def text(self) -> str:
        """The text of every id added (after the context), as the deltas spell it."""
        return self._decode(self.ids)[len(self._decode(self.ids[:self._context])):]
