"""A live runner is never read lost (CONTRACT section 10, ``fsm.attempts.judge``), as a
property over renewal periods, store delays and throttling.

The model: N runners (1 to 20) share one repo. Each renews its lease every period P (30 to
600 s; ``ttl_s`` = 3 P) from a start time: a try at ``r`` resolves at ``r + d`` (the
store's delay, 0 to 30 s), where it lands unless the store is throttled at that moment,
in one of the global throttle windows during which nothing lands. A refused try is tried
again within ``LATE_RETRY_S`` of its answer; after a landing the next try is one period
after that landing. Runner 0 is live throughout; the others are live, or die at a
random time (no try of theirs resolves after it). Other commits land too (console tails,
other runs), at random times when the store is open, and first thing when a window ends.

A reader reads at arbitrary times (and just after windows end, the hardest moments),
with what the store would show: each lease's last landing as its change time, the other
commits that landed so far as the listing's other change times, ``head_time`` the latest
landing of anything at or before ``now - GRACE_S`` (the store's history), and
``last_commit`` the latest landing of all.
Whatever it reads of the others, it never reads runner 0 as ``lost``.

The one assumption: the store, once it takes commits again, takes them for at least
``LATE_RETRY_S`` + the longest delay (45 s) before a new window starts; a store that opens
for a moment between long throttles (one commit of another runner's landing in a gap of a
few seconds) would let a commit count as evidence while no try of the live runner could
land. The rest is rule 3b's (``fsm.attempts``): a commit counts as the witness of a live
runner's silence only ``LANDING_S`` after the runner's renewal fell due (its try then
would have landed) and ``GRACE_S`` before the reading (its retry would have landed).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fsm.attempt.lease import GRACE_S, LATE_RETRY_S, TTL_PERIODS
from fsm.attempts import Found, judge

#: The store's longest delay between a try and its landing (or refusal).
MAX_DELAY = 30.0
#: The shortest stretch during which a store that took commits again keeps taking them.
OPEN_MIN = LATE_RETRY_S + MAX_DELAY
#: How long the model runs.
HORIZON = 4 * 3600.0


@dataclass(frozen=True)
class World:
    periods: tuple[int, ...]
    starts: tuple[float, ...]
    deaths: tuple[float | None, ...]  # runner 0's is None
    windows: tuple[tuple[float, float], ...]  # [start, end) of each throttle window
    traffic: tuple[float, ...]  # other commits' tries
    seed: int
    delay: str  # "none", "longest" or "random"
    retry: str  # "latest" or "random"

    def throttled(self, t: float) -> bool:
        return any(start <= t < end for start, end in self.windows)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    n = draw(st.integers(1, 20))
    periods = tuple(draw(st.integers(30, 600)) for _ in range(n))
    starts = tuple(draw(st.floats(0, 3600)) for _ in range(n))
    deaths = (None, *(draw(st.one_of(st.none(), st.floats(0, HORIZON))) for _ in range(n - 1)))
    windows = []
    at = draw(st.floats(OPEN_MIN, 3600))
    for _ in range(draw(st.integers(0, 6))):
        length = draw(st.floats(1, 3600))
        windows.append((at, at + length))
        at += length + draw(st.floats(OPEN_MIN, 3600))
    traffic = draw(st.lists(st.floats(0, HORIZON), max_size=30))
    # and the commits that land first when a window ends (the store opening again)
    traffic += [end + offset for _, end in windows
                for offset in draw(st.lists(st.floats(0, 60), max_size=3))]
    return World(periods, starts, deaths, tuple(windows), tuple(traffic),
                 draw(st.integers(0, 2**32 - 1)),
                 draw(st.sampled_from(["none", "longest", "random"])),
                 draw(st.sampled_from(["latest", "random"])))


def landings(world: World, runner: int, rng: random.Random, until: float) -> list[float]:
    """When each of the runner's renewals landed, in order, up to ``until``."""
    period, death = world.periods[runner], world.deaths[runner]
    end = until if death is None else min(death, until)
    landed: list[float] = []
    at = world.starts[runner]
    while at < end:
        delay = {"none": 0.0, "longest": MAX_DELAY}.get(world.delay) or rng.uniform(0, MAX_DELAY)
        resolved = at + delay
        if resolved >= end:
            break
        if world.throttled(resolved):
            at = resolved + (LATE_RETRY_S if world.retry == "latest"
                             else rng.uniform(1, LATE_RETRY_S))
        else:
            landed.append(resolved)
            at = resolved + period  # the keeper's next try: a period after it saw the landing
    return landed


def reading(world: World, lands: Sequence[Sequence[float]], now: float) -> list[Found]:
    """What a reader at ``now`` finds: each runner's lease, changed at its last landing."""
    found = []
    for runner, times in enumerate(lands):
        last = max((t for t in times if t <= now), default=None)
        if last is None:
            continue  # no lease yet
        lease = {"attempt": 1, "run_id": f"run-{runner}", "state": "Train",
                 "host": {"hostname": f"gpu-{runner}"}, "seq": 1,
                 "ttl_s": float(TTL_PERIODS * world.periods[runner]), "renewed_at": last,
                 "progress_at": None}
        found.append(Found(f"arm{runner}", 1, "p", lease=lease, lease_changed=last))
    return found


@settings(deadline=None)
@given(worlds(), st.lists(st.floats(0, HORIZON), min_size=1, max_size=8),
       st.lists(st.floats(0, 200), max_size=4))
# The two bounds of rule 3b, each pinned by a case it alone prevents (a run's 100 examples
# find them rarely; 5,000 do). The landing: the live runner's renewal falls due at 60 s,
# tried then, it would land at 90 s; another run's commit at 79 s is too early to show
# that it could (with LANDING_S at 15 s, that commit is read as the witness, and the runner
# is read lost at 210 s; it lands at 225 s). The grace: a window ends at 510.5 s just
# after the live runner's retry was refused; another run's commit lands at once, and the
# runner's next try lands at 555 s (with GRACE_S at 30 s, lost at 554 s).
@example(World(periods=(30,), starts=(0.0,), deaths=(None,), windows=((80.0, 200.0),),
               traffic=(79.0, 200.0), seed=0, delay="longest", retry="latest"),
         [210.0], [])
@example(World(periods=(30,), starts=(0.0,), deaths=(None,), windows=((140.0, 510.5),),
               traffic=(510.5,), seed=0, delay="longest", retry="latest"),
         [554.0], [])
def test_a_live_runner_is_never_read_lost(
    world: World, times: list[float], after_windows: list[float]
) -> None:
    rng = random.Random(world.seed)
    moments = times + [end + offset for _, end in world.windows for offset in after_windows]
    until = max(moments) + 1  # the runners run past every reading
    lands = [landings(world, runner, rng, until) for runner in range(len(world.periods))]
    other = [t for t in world.traffic if not world.throttled(t)]
    for now in moments:
        found = reading(world, lands, now)
        seen = [t for times_ in lands for t in times_ if t <= now] + [t for t in other if t <= now]
        head = max((t for t in seen if t <= now - GRACE_S), default=None)
        last = max(seen, default=None)
        views = judge(found, changes=[t for t in other if t <= now], head_time=head,
                      last_commit=last, now=now)
        live = [v for v in views if v.arm == "arm0"]
        assert not live or live[0].kind != "lost", (now, live[0])
        if live:
            event(f"live runner read {live[0].kind}")
        if any(v.kind == "lost" for v in views):
            event("a dead runner read lost")


def test_the_grace_covers_a_late_retry_and_the_longest_delay() -> None:
    """What the property's argument rests on: the grace outlasts a retry's wait plus its
    landing, and a lease outlives one period of tries (ttl_s = 3 periods)."""
    assert GRACE_S >= LATE_RETRY_S + MAX_DELAY
    assert TTL_PERIODS >= 3
