"""Overload policy of a video session: when it is overloaded, and which knob to turn next.

The order is the book's (ch.19): lookahead first (one frame or chunk less in flight refunds its
slack at once), then denoising steps, then resolution last (it changes the denoiser's shapes,
so the graph bucket and which sessions can share a batch). When the load is gone (a long run of
on-time outcomes: hysteresis, so a session does not flap), the notches come back one at a time in
the reverse order. Pure bookkeeping: no tensors, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Degradation:
    """One knob turned down; announced to the client in `session.updated`."""

    knob: str  # "lookahead" | "steps" | "resolution"
    before: int | str  # lookahead / steps as ints, resolution as "WxH"
    after: int | str

    def event(self) -> dict:
        return {"knob": self.knob, "from": self.before, "to": self.after}


class OverloadLadder:
    """Counts late frames (or chunks) over a sliding window; says when to degrade one notch, and when a
    degraded session has been on time long enough to get one back."""

    def __init__(self, window: int, late_fraction: float = 0.5, calm_windows: int = 4):
        if window < 1 or not 0 < late_fraction <= 1 or calm_windows < 1:
            raise ValueError(f"window and calm_windows must be >= 1 and late_fraction in (0, 1], got {window}, "
                             f"{calm_windows} and {late_fraction}")
        self.window = window  # observations that decide
        self.late_fraction = late_fraction  # this share of them late -> overloaded
        self.calm_after = calm_windows * window  # on-time outcomes in a row that restore one notch
        self._marks: deque[bool] = deque(maxlen=window)
        self._on_time = 0  # on-time outcomes since the last late one (or the last change)

    def observe(self, late: bool) -> bool:
        """Record one outcome; True when the last `window` outcomes were mostly late. The window then
        restarts, so the next notch waits for evidence measured under the new settings."""
        self._marks.append(late)
        self._on_time = 0 if late else self._on_time + 1
        if len(self._marks) == self.window and sum(self._marks) >= self.late_fraction * self.window:
            self._marks.clear()
            self._on_time = 0
            return True
        return False

    def calm(self) -> bool:
        """True once `calm_after` outcomes in a row were on time; the count then restarts (one notch at a time)."""
        if self._on_time >= self.calm_after:
            self._on_time = 0
            self._marks.clear()
            return True
        return False


def next_degradation(*, lookahead: int, steps: int, min_steps: int, width: int, height: int,
                     size_factor: int, min_side: int) -> Degradation | None:
    """The next notch down, or None when every knob is at its floor.

    `min_steps`: the fewest steps that still run a denoising step (img2img: ceil(1 / strength)).
    Resolution halves each side, rounded down to `size_factor`, never below `min_side`.
    """
    if lookahead > 1:
        return Degradation("lookahead", lookahead, lookahead - 1)
    if steps > min_steps:
        return Degradation("steps", steps, max(min_steps, steps // 2))
    floor = max(size_factor, min_side)
    new_w = max(floor, (width // 2) // size_factor * size_factor)
    new_h = max(floor, (height // 2) // size_factor * size_factor)
    if (new_w, new_h) != (width, height) and new_w <= width and new_h <= height:
        return Degradation("resolution", f"{width}x{height}", f"{new_w}x{new_h}")
    return None
