"""The attempt's one budget (deadline, interrupt flag, sleep) and the one retry.

Every wait of the runner goes through a :class:`Budget`: it never sleeps past the
deadline, wakes within a short slice of SIGTERM/SIGINT (the flag is set inside a signal
handler, which may not set an ``Event``), and hands the OS only timeouts it accepts.
:meth:`Budget.retry` is the one retry loop: backoff with jitter or the store's
``Retry-After``, never a wait that would reach the deadline, never a wait after a signal.
Callers say which failures are worth another try and how long to wait; the budget says
whether there is time. Time is measured by one clock, the deadline's
(:attr:`fsm.clock.Deadline.clock`); tests hand in a fake one and a fake sleep to run the
deadline paths without waiting for them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import structlog

from fsm.clock import SLICE_S, Deadline, os_timeout
from fsm.interrupt import InterruptFlag

_T = TypeVar("_T")
log = structlog.get_logger("fsm.budget")



class GaveUp(Exception):
    """The retries ended without success: ``last`` is the final failure, ``why`` says
    what ended them ("tries", "deadline", "interrupted" or "refused": the caller's delay
    said no)."""

    def __init__(self, last: BaseException, tries: int, why: str) -> None:
        super().__init__(f"{last} ({why} after {tries} tries)")
        self.last = last
        self.tries = tries
        self.why = why


def backoff(attempt: int, *, base_s: float, max_s: float, jitter: bool = True) -> float:
    """The wait before try ``attempt + 1``: ``base_s * 2**(attempt-1)``, at most ``max_s``,
    jittered down to half (so a fleet does not retry in step)."""
    wait = min(max_s, base_s * 2.0 ** (attempt - 1))
    return wait * random.uniform(0.5, 1.0) if jitter else wait


#: A try of a split budget never gets less than this (unless less is left in all).
MIN_TRY_S = 1.0


class Budget:
    """The time a piece of work may take: until ``deadline``, watching ``interrupt``.

    ``stops`` (the default): a signal ends the budget's waits and retries at once. A budget
    that outlives a signal (the end of the attempt: its verification, its marker) has
    ``stops`` off and ``signal_s`` set instead: after a signal it ends ``signal_s`` seconds
    after it (Docker's stop timeout is close), and until then its tries go on.

    ``split``: the budget is meant for that many tries of one call (the end of the
    attempt), so :meth:`try_bound` gives each of the first ``split`` tries an even share of
    what is left: a hung connection is abandoned for a fresh one while there is still time
    for another answer, instead of one try taking all of it.
    """

    # A plain class, not a dataclass: a dataclass costs its code generation at import, and
    # every millisecond before the worker starts is paid on every attempt.
    __slots__ = ("deadline", "interrupt", "min_try_s", "reserve_s", "signal_s", "sleep",
                 "split", "stops")

    def __init__(
        self,
        deadline: Deadline,
        interrupt: InterruptFlag | None = None,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        split: int = 1,
        stops: bool = True,
        signal_s: float | None = None,
        min_try_s: float = MIN_TRY_S,
        reserve_s: float = 0.0,
    ) -> None:
        # One clock: the deadline's (``clock``, a test's fake one, goes onto it).
        self.deadline = deadline if clock is None else deadline.on(clock)
        self.interrupt = interrupt if interrupt is not None else InterruptFlag()
        self.sleep = sleep
        self.split = max(1, split)
        self.stops = stops
        self.signal_s = signal_s
        self.min_try_s = min_try_s
        self.reserve_s = reserve_s

    @property
    def clock(self) -> Callable[[], float]:
        """The clock time is measured by: the deadline's."""
        return self.deadline.clock

    def remaining(self) -> float:
        """Seconds left; negative once the deadline passed (or, with ``signal_s``, once
        that long has passed since a signal); ``reserve_s`` before either is kept back."""
        now = self.clock()
        left = self.deadline.mono_at - now
        at = self.interrupt.at_mono
        if self.signal_s is not None and at is not None:
            left = min(left, at + self.signal_s - now)
        return left - self.reserve_s

    def expired(self) -> bool:
        return self.remaining() <= 0

    def stopped(self) -> bool:
        """Whether a signal ended this budget's waits (only when it ``stops``)."""
        return self.stops and self.interrupt.is_set()

    def reserving(self, seconds: float) -> Budget:
        """The same budget, ending ``seconds`` earlier: what comes after it (the marker's
        read-back) keeps that time whatever the tries before it take."""
        return Budget(self.deadline, self.interrupt, clock=self.clock, sleep=self.sleep,
                      split=self.split, stops=self.stops, signal_s=self.signal_s,
                      min_try_s=self.min_try_s, reserve_s=self.reserve_s + seconds)

    def try_bound(self, bound_s: float, attempt: int) -> float:
        """How long try ``attempt`` (1-based) of a call may take: at most ``bound_s``, and
        in a split budget an even share of what is left among the tries still planned
        (the last planned one, and any after it, get all of it), never under ``min_try_s``
        (:data:`MIN_TRY_S`, or the call's observed time) while that much is left."""
        left = max(0.0, self.remaining())
        share = left / max(1, self.split - attempt + 1)
        return min(bound_s, left, max(share, self.min_try_s))

    def capped_backoff(self, wait: float) -> float:
        """A backoff ``wait`` as this budget allows it: in a split budget no wait takes
        more than half of one planned try's share of what is left (the tries matter more)."""
        if self.split == 1:
            return wait
        return min(wait, max(0.0, self.remaining()) / (2 * self.split))

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, in slices that watch the flag; True when the whole wait
        passed, False when a signal (if the budget ``stops``) or its end came first."""
        end = self.clock() + seconds
        while not self.stopped():
            now = self.clock()
            if now >= end:
                return True
            left = self.remaining()
            if left <= 0:
                return False
            self.sleep(os_timeout(min(end - now, left, SLICE_S)))
        return False

    def retry(
        self,
        call: Callable[[int], _T],
        *,
        tries: int,
        delay: Callable[[int, Exception], float | None],
        what: str,
    ) -> _T:
        """``call(n)`` for n = 1..``tries`` until it returns.

        After a failure, ``delay(n, exc)`` says how long to wait before the next try, or
        None when the failure is not worth another (then :class:`GaveUp` with "refused").
        A wait that would reach the deadline is not started ("deadline"), a signal ends
        the retries ("interrupted"), and the last try's failure ends them ("tries").
        Exceptions that are not ``Exception`` (``Interrupted``) pass through untouched.
        """
        if tries < 1:
            raise ValueError(f"tries must be at least 1, got {tries}")
        for attempt in range(1, tries + 1):
            try:
                return call(attempt)
            except Exception as exc:
                if attempt == tries:
                    raise GaveUp(exc, attempt, "tries") from exc
                wait = delay(attempt, exc)
                if wait is None:
                    raise GaveUp(exc, attempt, "refused") from exc
                if wait >= self.remaining():
                    raise GaveUp(exc, attempt, "deadline") from exc
                # "try", not "attempt": every event carries the attempt's number (fsm.output.log)
                log.warning("retry", what=what, delay_s=round(wait, 3),
                            exc_type=type(exc).__name__, **{"try": attempt})
                if not self.wait(wait):
                    why = "interrupted" if self.stopped() else "deadline"
                    raise GaveUp(exc, attempt, why) from exc
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
