"""The attempt's one budget and its one retry, on a fake clock: the deadline paths run in
microseconds and the same way every time."""

from __future__ import annotations

import pytest

from fsm.budget import SLICE_S, Budget, GaveUp, backoff
from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag


class FakeClock:
    """A monotonic clock that only moves when the budget sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.naps: list[float] = []
        self.on_nap: list[tuple[float, InterruptFlag]] = []  # (at, flag): signal then

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds
        for at, flag in self.on_nap:
            if self.now >= at:
                flag.trigger(15)


def _budget(fake: FakeClock, deadline_s: float, flag: InterruptFlag | None = None) -> Budget:
    return Budget(
        Deadline(at=deadline_s, _mono_at=deadline_s),
        flag or InterruptFlag(),
        clock=fake.clock,
        sleep=fake.sleep,
    )


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self, attempt: int) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(f"try {attempt} failed")
        return "ok"


def test_a_transient_failure_is_retried_after_the_callers_delay() -> None:
    fake = FakeClock()
    call = Flaky(2)
    got = _budget(fake, 100).retry(call, tries=5, delay=lambda n, _e: 2.0 * n, what="x")
    assert (got, call.calls) == ("ok", 3)
    assert fake.now == pytest.approx(2.0 + 4.0)
    assert max(fake.naps) <= SLICE_S + 1e-9  # waits watch the flag in short naps


def test_no_wait_is_started_that_would_reach_the_deadline() -> None:
    fake = FakeClock()
    with pytest.raises(GaveUp) as info:
        _budget(fake, 5).retry(Flaky(9), tries=5, delay=lambda _n, _e: 6.0, what="x")
    assert (info.value.why, info.value.tries, fake.now) == ("deadline", 1, 0.0)
    assert isinstance(info.value.last, OSError)


def test_a_failure_the_caller_will_not_retry_ends_at_once() -> None:
    fake = FakeClock()
    call = Flaky(9)
    with pytest.raises(GaveUp) as info:
        _budget(fake, 100).retry(call, tries=5, delay=lambda _n, _e: None, what="x")
    assert (info.value.why, call.calls, fake.now) == ("refused", 1, 0.0)


def test_the_last_try_ends_the_retries() -> None:
    fake = FakeClock()
    with pytest.raises(GaveUp) as info:
        _budget(fake, 100).retry(Flaky(9), tries=3, delay=lambda _n, _e: 1.0, what="x")
    assert (info.value.why, info.value.tries) == ("tries", 3)
    assert fake.now == pytest.approx(2.0)


def test_a_signal_during_a_wait_ends_the_retries_within_one_slice() -> None:
    fake = FakeClock()
    flag = InterruptFlag()
    fake.on_nap.append((1.0, flag))
    with pytest.raises(GaveUp) as info:
        _budget(fake, 100, flag).retry(Flaky(9), tries=5, delay=lambda _n, _e: 30.0, what="x")
    assert info.value.why == "interrupted"
    assert 1.0 <= fake.now <= 1.0 + SLICE_S + 1e-9


def test_an_interrupt_passes_through_untouched() -> None:
    from fsm.errors import Interrupted

    def call(_attempt: int) -> None:
        raise Interrupted(15)

    with pytest.raises(Interrupted):
        _budget(FakeClock(), 100).retry(call, tries=5, delay=lambda _n, _e: 1.0, what="x")


def test_a_wait_ends_at_the_deadline_and_says_so() -> None:
    fake = FakeClock()
    assert _budget(fake, 3).wait(10) is False
    assert fake.now == pytest.approx(3.0)
    assert _budget(fake, 100).wait(2) is True


def test_a_month_long_wait_hands_the_os_only_short_naps() -> None:
    fake = FakeClock()
    flag = InterruptFlag()
    fake.on_nap.append((0.2, flag))
    assert _budget(fake, 40 * 86_400, flag).wait(30 * 86_400) is False
    assert max(fake.naps) <= SLICE_S + 1e-9


def test_backoff_doubles_up_to_its_cap_and_jitters_down_to_half() -> None:
    assert [backoff(n, base_s=1, max_s=5, jitter=False) for n in (1, 2, 3, 4)] == [1, 2, 4, 5]
    for n in range(1, 8):
        value = backoff(n, base_s=1, max_s=5)
        assert min(5, 2 ** (n - 1)) / 2 <= value <= min(5, 2 ** (n - 1))


def test_the_budget_and_its_deadlines_measure_time_by_one_clock() -> None:
    """A fake clock given to a budget is its deadline's too: what the budget says is left
    and what its deadline says agree."""
    fake = FakeClock()
    budget = _budget(fake, 100)
    fake.now = 40.0
    assert budget.remaining() == budget.deadline.remaining() == 60.0
