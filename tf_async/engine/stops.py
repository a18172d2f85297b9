"""Stop strings on the loop side: text that could still become a stop string is held back."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str, *, final: bool) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[: min(hits)], True
        if final:
            self._pending = ""
            return buf, False
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        return buf[:cut], False
