"""The attempt's last line of defence: a thread that ends the process when time is up.

Handlers stop their own work at the work deadline (the attempt deadline less the exit
reserve), so normally the machine reaches Mark in time. When something is stuck instead
(a hung download inside C code, a wedged pip), the watchdog fires at the attempt
deadline itself; once the end of the attempt has begun (``fsm.context.End``, which may run
past that deadline), it fires a moment after the bound of the part under way. It kills the
worker's process group, publishes the fatal marker from its own thread (through the same
builder and publisher as Mark, with at least the time Mark gets, split into tries), says
why on stderr, and hard-exits: 124, or the status of a marker that did not land.

It obeys the owner rule like everyone else: a runner that does not hold the attempt's
lock writes nothing, so then it only says why and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import structlog

from fsm import exits, rules
from fsm.attempt import outcome
from fsm.attempt.publish import Published
from fsm.budget import Budget
from fsm.clock import Deadline
from fsm.context import END_GRACE_S, END_TRIES, SIGNAL_MARK_S, Context, Failure, marker_try_s

EXIT_DEADLINE = exits.DEADLINE.code
MAX_REASON_CHARS = 2_000
#: How often the watchdog looks at the deadline (the payload may still move it).
POLL_S = 0.25
log = structlog.get_logger("fsm.watchdog")


class Watchdog:
    def __init__(self, ctx: Context, *, exit: Callable[[int], object],
                 say: Callable[[str], None]) -> None:
        self._ctx = ctx
        self._exit = exit
        self._say = say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="flash-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _left(self) -> float:
        """Seconds until the watchdog takes over: the attempt deadline while work goes on;
        once the end of the attempt began, a little after the bound of its part under way
        (so an end that runs past the attempt deadline, as it may, is not cut short)."""
        end = self._ctx.end
        if end is None:
            return self._ctx.deadline.remaining()
        return end.watchdog_due() - time.monotonic()

    def _watch(self) -> None:
        # The deadline is replaced once the payload is read, so look at it afresh each time.
        while not self._stop.wait(max(0.0, min(POLL_S, self._left()))):
            if self._left() <= 0:
                self._fire()
                return

    def _fire(self) -> None:
        ctx = self._ctx
        where = ctx.path[-1] if ctx.path else "start-up"
        log.error("deadline.watchdog_fired", state=where)
        if ctx.worker_pgid is not None:
            with contextlib.suppress(OSError):
                os.killpg(ctx.worker_pgid, signal.SIGKILL)
        status = EXIT_DEADLINE
        if ctx.dest is None or not ctx.owns_attempt:
            reason = (f"the attempt deadline passed in {where} before this runner owned the "
                      "attempt; it wrote nothing")
        elif ctx.publisher.claim():
            published = self._publish(ctx, where)
            reason = (f"attempt {ctx.dest.attempt} failed (fatal, rule deadline): run wall "
                      f"deadline exceeded in {where}")
            if not published.landed:
                status, unpublished = published.unpublished()
                reason = f"{unpublished}; {reason}"
        else:
            # Mark is publishing, and its bound has passed: a last moment to finish.
            ctx.publisher.done.wait(END_GRACE_S)
            result = ctx.publisher.result
            status = EXIT_DEADLINE if result.landed else result.unpublished()[0]
            reason = f"the attempt deadline passed while its marker was being published in {where}"
        log.error("deadline.hard_exit", status=status)
        reason = ctx.redactor.line(reason, MAX_REASON_CHARS)
        with contextlib.suppress(Exception):  # the last event: the machine stays where it hung
            outcome.announce(ctx, exit_code=status, terminal=None, reason=reason)
        with contextlib.suppress(Exception):
            self._say(reason)
        self._exit(status)

    def _publish(self, ctx: Context, where: str) -> Published:
        message = (f"run wall deadline exceeded: the attempt was still in {where} when its "
                   "deadline passed")
        record = outcome.record(ctx, Failure(rules.DEADLINE, message, where), watchdog=True)
        # The watchdog's own time, split into tries as Mark's is: never less than Mark gets.
        budget = Budget(Deadline.after(outcome.WATCHDOG_MARK_S), ctx.interrupt,
                        split=END_TRIES, stops=False, signal_s=SIGNAL_MARK_S,
                        min_try_s=marker_try_s(ctx.store_stats))
        writer = threading.Thread(target=outcome.publish, args=(ctx, record, budget),
                                  name="flash-watchdog-marker", daemon=True)
        writer.start()
        writer.join(outcome.WATCHDOG_MARK_S + END_GRACE_S)
        return ctx.publisher.result
