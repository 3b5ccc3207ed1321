"""Stop strings: the one rule deciding where generated text stops, shared by the engine (which checks the
decoded tail after every token) and the server (which cuts a streamed text).

Rule: the stop string that *completes* first wins, i.e. the match with the smallest end; of two ending at
the same character, the longer (it started earlier). The text is cut before that match."""

from __future__ import annotations


def first_stop(text: str, stops) -> tuple[int, str] | None:
    """(start of the winning match, the stop string) in `text`, or None when no stop string occurs."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i)
            if best is None or key < best[0]:
                best = (key, s)
    return None if best is None else (best[0][1], best[1])


class StopChecker:
    """Cuts a text stream before the winning stop string (`first_stop`), holding back a tail that may start
    one. The result does not depend on how the text is split into pieces."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit = False
        self.matched: str | None = None   # the stop string that ended the stream

    def feed(self, text: str) -> str:
        """Text that is safe to emit now ("" once a stop string was hit)."""
        if self.hit:
            return ""
        if not self.stops:
            return text
        self.buf += text
        found = first_stop(self.buf, self.stops)
        if found is not None:
            out, self.buf, self.hit, self.matched = self.buf[:found[0]], "", True, found[1]
            return out
        keep = len(self.buf) - self.hold
        out, self.buf = (self.buf[:keep], self.buf[keep:]) if keep > 0 else ("", self.buf)
        return out

    def flush(self) -> str:
        """The held-back tail (call when the stream ends without a hit, or before a non-text event)."""
        out, self.buf = self.buf, ""
        return out
