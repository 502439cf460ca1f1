"""Time: one deadline for the whole attempt, measured on the monotonic clock.

The payload speaks wall-clock epoch seconds (``deadline_at``); everything inside the
runner measures against ``time.monotonic`` so a clock step on the host cannot shrink the
budget. The worker, though, is handed an epoch (``FLASH_RUN_DEADLINE_AT``) and reads the
wall clock. So the attempt's deadline (:meth:`Deadline.for_attempt`, and every deadline
derived from it with :meth:`Deadline.earlier_by`) follows a *backward* step of the wall
clock: when the wall clock has moved back by ``s`` seconds relative to the monotonic clock
since the deadline was fixed, the deadline falls ``min(s, CLOCK_STEP_TOLERANCE_S)`` seconds
later on the monotonic clock. A worker that finishes by the epoch it was given is then not
stopped, and the attempt overruns its budget by at most the step. A forward step changes
nothing: the runner never stops anything before its monotonic deadline. Every other
deadline (a short bound such as ``Deadline.after(8)``) ignores the wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

#: How long one nap lasts at most while a wait watches the interrupt flag (between naps
#: the main thread runs the handler of a signal another thread caught).
SLICE_S = 0.05

#: The largest backward step of the wall clock that the attempt deadline absorbs.
CLOCK_STEP_TOLERANCE_S = 60.0

#: How often a long wait on a deadline looks at it again: a deadline that follows the wall
#: clock can move while it is waited for (a backward step, then a forward one).
DEADLINE_RECHECK_S = 1.0


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline, anchored on both clocks when it is created. ``clock`` is the
    one clock the runner measures time left by (``time.monotonic``; a test's fake one,
    :meth:`on`): a :class:`fsm.budget.Budget` reads its deadline's."""

    at: float  # epoch seconds
    _mono_at: float = field(repr=False, compare=False)
    #: Follows backward wall-clock steps (the attempt's deadline and what derives from it).
    #: Then ``at - _mono_at`` is the wall clock's lead over the monotonic one when fixed.
    _follows_wall: bool = field(default=False, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

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

    @classmethod
    def for_attempt(cls, at: float, *, mono_at: float | None = None) -> Deadline:
        """The attempt's deadline: epoch ``at``, at ``mono_at`` on the monotonic clock (the
        anchor persisted at the attempt's first start, same boot), else anchored now. It
        follows backward wall-clock steps made since that anchor, up to
        :data:`CLOCK_STEP_TOLERANCE_S` (see the module's docstring)."""
        if mono_at is None:
            mono_at = time.monotonic() + (at - time.time())
        return cls(at=at, _mono_at=mono_at, _follows_wall=True)

    def earliest(self, other: Deadline) -> Deadline:
        return self if self.mono_at <= other.mono_at else other

    @classmethod
    def never(cls) -> Deadline:
        return cls(at=float("inf"), _mono_at=float("inf"))

    @property
    def mono_at(self) -> float:
        """The deadline on the ``time.monotonic`` clock (now: it moves with a backward
        wall-clock step when the deadline follows the wall clock)."""
        return self._mono_at + self.step_back(time.time(), time.monotonic())

    def step_back(self, wall: float, mono: float) -> float:
        """How much later this deadline falls, given readings of the wall (``time.time``)
        and monotonic clocks taken together: how far the wall clock has stepped back since
        the deadline was fixed, at most :data:`CLOCK_STEP_TOLERANCE_S`; 0 for a forward
        step and for a deadline that does not follow the wall clock."""
        if not self._follows_wall:
            return 0.0
        back = (self.at - self._mono_at) - (wall - mono)
        return min(max(back, 0.0), CLOCK_STEP_TOLERANCE_S)

    def on(self, clock: Callable[[], float]) -> Deadline:
        """The same deadline, its time left measured by ``clock``."""
        return self if clock is self.clock else replace(self, clock=clock)

    def remaining(self) -> float:
        """Seconds left by :attr:`clock`; negative once passed."""
        return self.mono_at - self.clock()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def earlier_by(self, seconds: float) -> Deadline:
        """The same deadline moved ``seconds`` earlier (the worker's share of the budget);
        it follows the wall clock when this one does."""
        return replace(self, at=self.at - seconds, _mono_at=self._mono_at - seconds)

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


def wait_up_to(wait: Callable[[float], bool], seconds: float) -> bool:
    """Call ``wait(timeout)`` (an ``Event``'s wait, a lock's acquire) until it returns True
    or ``seconds`` have passed, whatever they are (a month, infinity): each ``timeout`` is
    one the OS accepts (:func:`os_timeout`), and a longer wait simply waits again. True
    when ``wait`` said so."""
    end = time.monotonic() + seconds
    while not wait(os_timeout(end - time.monotonic())):
        if time.monotonic() >= end:
            return False
    return True
