"""The arithmetic of the end of the attempt (docs/lifecycle.md, "The end of the attempt"),
checked over generated budgets, signals and hang patterns on a fake clock:

* the end's windows: VerifyRemote before Mark, Mark's share never under its floor, the
  signal bounds (Docker's stop timeout), the watchdog after whatever is under way, and
  an overrun past the attempt deadline of at most the end's floor;
* the tries of one store call in a split budget (``Budget.try_bound``,
  ``fsm.store.hub.retry_delay`` and ``Budget.retry``, the pieces ``HubStore._call`` is
  made of): whenever the store hangs or fails on fewer tries than the budget is split
  into, and then answers within half a try's even share, the call succeeds in time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm.attempt.outcome import WATCHDOG_MARK_S
from fsm.budget import MIN_TRY_S, Budget, GaveUp
from fsm.clock import Deadline
from fsm.context import (
    END_GRACE_S,
    END_MIN_S,
    END_TRIES,
    SIGNAL_MARK_S,
    SIGNAL_VERIFY_S,
    VERIFY_SHARE,
    End,
)
from fsm.hub.library import Failure
from fsm.interrupt import InterruptFlag
from fsm.store.hub import _Transient, retry_delay

#: Mark's least window: what the end leaves it when it begins at (or past) the deadline.
MARK_FLOOR_S = END_MIN_S * (1 - VERIFY_SHARE)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# --- the end's windows ------------------------------------------------------------------------


@dataclass
class Ending:
    end: End
    deadline_in: float  # the attempt deadline, seconds after the end began
    signal_at: float | None  # seconds after the end began (None: no signal)


@st.composite
def endings(draw: st.DrawFn) -> Ending:
    # The end begins anywhere from long before the deadline (a state failed early) to long
    # after it (a stuck state the watchdog outlived, a restart past its budget).
    deadline_in = draw(st.floats(-600.0, 86_400.0))
    flag = InterruptFlag()
    end = End(Deadline.after(deadline_in), flag)
    signal_at = draw(st.none() | st.floats(-10.0, 30.0))
    if signal_at is not None:
        flag.signum, flag.at_mono = 15, end.began + signal_at
    return Ending(end, deadline_in, signal_at)


def _bounds(e: Ending) -> tuple[float, float]:
    """(verify by, mark by) in seconds after the end began, signals included, as the
    budgets the end hands out see them."""
    since = time.monotonic() - e.end.began
    return (since + e.end.verify_budget().remaining(),
            since + e.end.mark_budget().remaining())


@given(endings())
def test_verification_comes_before_the_marker_and_leaves_it_its_floor(e: Ending) -> None:
    verify_by, mark_by = _bounds(e)
    slack = 0.05  # the clock moves while the budgets are read
    assert verify_by <= mark_by + slack
    if e.signal_at is None:
        assert mark_by - verify_by >= MARK_FLOOR_S - slack
        assert mark_by >= END_MIN_S - slack  # the end never gets less than its floor
        # past the attempt deadline only by what the floor needs
        assert mark_by <= max(e.deadline_in, END_MIN_S) + slack


@given(endings())
def test_after_a_signal_the_end_keeps_to_docker_s_stop_timeout(e: Ending) -> None:
    if e.signal_at is None:
        return
    verify_by, mark_by = _bounds(e)
    slack = 0.05
    assert verify_by <= e.signal_at + SIGNAL_VERIFY_S + slack
    assert mark_by <= e.signal_at + SIGNAL_MARK_S + slack


@given(endings(), st.booleans())
def test_the_watchdog_takes_over_only_after_the_part_under_way_is_due(
    e: Ending, marking: bool
) -> None:
    if marking:
        e.end.marking_since = e.end.began
    verify_by, mark_by = _bounds(e)
    due = e.end.watchdog_due() - e.end.began
    slack = 0.05
    assert due >= (mark_by if marking else verify_by) + END_GRACE_S - slack


def test_the_watchdog_publishes_with_no_less_time_than_mark_is_ever_given() -> None:
    assert WATCHDOG_MARK_S >= MARK_FLOOR_S
    assert WATCHDOG_MARK_S >= SIGNAL_MARK_S - SIGNAL_VERIFY_S


# --- the tries of one call --------------------------------------------------------------------


@dataclass(frozen=True)
class Try:
    kind: str  # "hang", "error" (a 5xx answered after latency) or "answer"
    latency: float = 0.0


@st.composite
def patterns(draw: st.DrawFn) -> tuple[float, list[Try]]:
    """A budget and a store that fails fewer tries than the budget is split into (hanging,
    or answering 5xx within half a try's share), then answers within half a share."""
    budget_s = draw(st.floats(END_TRIES * MIN_TRY_S * 2, 3_600.0))
    half_share = budget_s / (2 * END_TRIES)
    failures = draw(st.lists(
        st.builds(Try, st.sampled_from(["hang", "error"]), st.floats(0.0, half_share)),
        max_size=END_TRIES - 1))
    return budget_s, [*failures, Try("answer", draw(st.floats(0.0, half_share)))]


def _call(budget: Budget, clock: FakeClock, pattern: list[Try], *, bound_s: float,
          tries: int) -> int:
    """One store call the way HubStore._call makes it, on the fake clock: each try is
    bounded by ``budget.try_bound``, a hang is abandoned at its bound, the wait before the
    next try is ``retry_delay``'s. Returns how many tries it took."""

    def once(attempt: int) -> int:
        if budget.remaining() <= 0:
            raise AssertionError("no time left for a try")
        bound = budget.try_bound(bound_s, attempt)
        outcome = pattern[attempt - 1] if attempt <= len(pattern) else Try("hang")
        if outcome.kind == "hang" or outcome.latency > bound:
            clock.now += bound
            raise _Transient(Failure("retriable", "no answer", hung=True))
        clock.now += outcome.latency
        if outcome.kind == "error":
            raise _Transient(Failure("retriable", "HTTP 503", 503))
        return attempt

    def delay(attempt: int, exc: Exception) -> float | None:
        assert isinstance(exc, _Transient)
        return retry_delay(budget, attempt, exc.failure, base_s=1.0, max_s=30.0)

    return budget.retry(once, tries=tries, delay=delay, what="a store call")


@given(patterns(), st.sampled_from([5.0, 60.0, 4 * 3600.0]), st.integers(END_TRIES, 8))
def test_a_call_of_the_end_lands_whenever_an_answer_comes_within_its_share(
    case: tuple[float, list[Try]], bound_s: float, tries: int
) -> None:
    budget_s, pattern = case
    clock = FakeClock()
    budget = Budget(_FakeDeadline(clock.now + budget_s), clock=clock, sleep=clock.sleep,
                    split=END_TRIES, stops=False)
    # A call timeout below half a share bounds the tries itself: the answers come within it.
    pattern = [Try(t.kind, min(t.latency, bound_s)) for t in pattern]
    took = _call(budget, clock, pattern, bound_s=bound_s, tries=tries)
    assert took == len(pattern)
    assert clock.now - 1_000.0 <= budget_s + 1e-6


@given(st.floats(END_TRIES * MIN_TRY_S, 3_600.0))
def test_one_hung_try_never_takes_the_whole_end(budget_s: float) -> None:
    """The first try of a split budget gets its share, not everything that is left."""
    clock = FakeClock()
    budget = Budget(_FakeDeadline(clock.now + budget_s), clock=clock, sleep=clock.sleep,
                    split=END_TRIES)
    assert budget.try_bound(60.0, 1) <= max(budget_s / END_TRIES, MIN_TRY_S) + 1e-9
    unsplit = Budget(_FakeDeadline(clock.now + budget_s), clock=clock)
    assert unsplit.try_bound(60.0, 1) == pytest.approx(min(60.0, budget_s))  # as before


def test_when_every_try_hangs_the_call_gives_up_within_its_budget() -> None:
    clock = FakeClock()
    budget = Budget(_FakeDeadline(clock.now + 10.0), clock=clock, sleep=clock.sleep,
                    split=END_TRIES, stops=False)
    with pytest.raises(GaveUp):
        _call(budget, clock, [], bound_s=60.0, tries=5)
    assert clock.now - 1_000.0 <= 10.0 + 1e-6


def _FakeDeadline(mono_at: float) -> Deadline:  # noqa: N802 - read as the type it makes
    """A deadline on the test's fake clock (the budget passes it on)."""
    return Deadline(at=mono_at, _mono_at=mono_at)
