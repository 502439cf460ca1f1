"""The attempt's last line of defence: a thread that ends the process at the deadline.

Handlers stop their own work at the work deadline (the attempt deadline less the exit
reserve), so normally the machine reaches Mark in time. When something is stuck instead
(a hung download inside C code, a wedged pip), the watchdog fires at the attempt
deadline itself: it kills the worker's process group, publishes the fatal marker from
its own thread under a short bound (through the same builder and publisher as Mark),
says why on stderr, and hard-exits: 124, or 3 when the marker could not be published.

It obeys the owner rule like everyone else: a runner that does not hold the attempt's
lock writes nothing, so then it only says why and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

import structlog

from fsm import exits, marker, outcome, rules
from fsm.clock import Deadline
from fsm.context import Context, Failure

EXIT_DEADLINE = exits.DEADLINE.code
MARKER_BOUND_S = 8.0
MAX_REASON_CHARS = 2_000
log = structlog.get_logger("fsm.watchdog")


class Watchdog:
    def __init__(
        self,
        ctx: Context,
        *,
        exit: Callable[[int], object] = os._exit,
        say: Callable[[str], None] = print,
        poll_s: float = 0.25,
    ) -> None:
        self._ctx = ctx
        self._exit = exit
        self._say = say
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="flash-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        # The deadline is replaced once the payload is read, so look at it afresh each time.
        while not self._stop.wait(max(0.0, min(self._poll_s, self._ctx.deadline.remaining()))):
            if self._ctx.deadline.expired():
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
            reason = (
                f"the attempt deadline passed in {where} before this runner owned the attempt; "
                "it wrote nothing"
            )
        elif ctx.publisher.claim():
            published = self._publish(ctx, where)
            reason = (
                f"attempt {ctx.dest.attempt} failed (fatal, rule deadline): run wall deadline "
                f"exceeded in {where}"
            )
            if not published.landed:
                status, unpublished = published.unpublished()
                reason = f"{unpublished}; {reason}"
        else:
            # Mark is publishing: give it the same short bound to finish.
            ctx.publisher.done.wait(MARKER_BOUND_S)
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

    def _publish(self, ctx: Context, where: str) -> marker.Published:
        assert ctx.dest is not None
        rule = rules.DEADLINE
        failure = Failure(
            rule=rule,
            message=(
                f"run wall deadline exceeded: the attempt was still in {where} when its "
                "deadline passed"
            ),
            state=where,
        )
        record = outcome.record(ctx, failure, watchdog=True)
        writer = threading.Thread(
            target=outcome.publish,
            args=(ctx, record, Deadline.after(MARKER_BOUND_S)),
            kwargs={"tries": 3, "base_delay_s": 0.5},
            name="flash-watchdog-marker",
            daemon=True,
        )
        writer.start()
        writer.join(MARKER_BOUND_S)
        return ctx.publisher.result
