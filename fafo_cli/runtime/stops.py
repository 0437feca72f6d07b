"""Stop strings: the answer ends where one first appears in its text, and the stop string is not shown.

Text arrives in pieces (a step may emit several tokens, a token may hold part of a stop string), so the tail
that could still begin a stop string is held back until the next piece settles it: nothing released is ever
taken back.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        if not all(stops):
            raise ValueError("a stop string must not be empty")
        self.stops = stops
        self.held = ""  # text not released yet: a suffix of it may begin a stop string
        self.found = False

    def feed(self, text: str) -> str:
        """The part of the text so far that can be released. Once a stop string appears, `found` is set, the text
        before it is the last released and everything after it is dropped."""
        if self.found:
            return ""
        text = self.held + text
        at = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if at >= 0:
            self.found, self.held = True, ""
            return text[:at]
        keep = self._open_prefix(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What is held back, released at the end of the answer (no stop string can complete any more)."""
        text, self.held = self.held, ""
        return text

    def _open_prefix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), max(map(len, self.stops)) - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
