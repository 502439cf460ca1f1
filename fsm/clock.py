"""Time: one deadline for the whole attempt, measured on the monotonic clock.

The payload speaks wall-clock epoch seconds (``deadline_at``); everything inside the
runner measures against ``time.monotonic`` so a clock step on the host cannot stretch
or shrink the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline, anchored on both clocks when it is created."""

    at: float  # epoch seconds
    _mono_at: float = field(repr=False, compare=False)

    @classmethod
    def at_epoch(cls, at: float) -> Deadline:
        return cls(at=at, _mono_at=time.monotonic() + (at - time.time()))

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls.at_epoch(time.time() + seconds)

    @classmethod
    def at_monotonic(cls, mono_at: float) -> Deadline:
        """The deadline at ``mono_at`` on the ``time.monotonic`` clock."""
        return cls(at=time.time() + (mono_at - time.monotonic()), _mono_at=mono_at)

    def earliest(self, other: Deadline) -> Deadline:
        return self if self._mono_at <= other._mono_at else other

    @classmethod
    def never(cls) -> Deadline:
        return cls(at=float("inf"), _mono_at=float("inf"))

    @property
    def mono_at(self) -> float:
        """The deadline on the ``time.monotonic`` clock."""
        return self._mono_at

    def remaining(self) -> float:
        """Seconds left; negative once passed."""
        return self._mono_at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def earlier_by(self, seconds: float) -> Deadline:
        """The same deadline moved ``seconds`` earlier (the worker's share of the budget)."""
        return Deadline(at=self.at - seconds, _mono_at=self._mono_at - seconds)

    def bound(self, seconds: float) -> float:
        """``seconds``, cut so that it never reaches past this deadline (never below 0)."""
        return max(0.0, min(seconds, self.remaining()))


#: The longest wait handed to the OS in one call. ``poll``/``select``/``epoll`` take
#: milliseconds in a C int and ``threading`` waits refuse more than ``TIMEOUT_MAX``: a
#: budget of a month (~2**31 ms) raises ``OverflowError``. Longer waits simply wake and
#: wait again.
MAX_OS_WAIT_S = 86_400.0 * 20


def os_timeout(seconds: float | None) -> float:
    """``seconds`` made safe to hand to any OS wait: never negative, never past
    :data:`MAX_OS_WAIT_S`; None (wait forever) becomes the maximum too."""
    if seconds is None or seconds != seconds:  # None or NaN
        return MAX_OS_WAIT_S
    return max(0.0, min(float(seconds), MAX_OS_WAIT_S))
