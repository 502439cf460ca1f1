"""The attempt's last line of defence: a thread that ends the process at the deadline.

Handlers stop their own work at the work deadline (the attempt deadline less the exit
reserve), so normally the machine reaches Mark in time. When something is stuck instead
(a hung download inside C code, a wedged pip), the watchdog fires at the attempt
deadline itself: it kills the worker's process group, publishes the fatal marker from
its own thread under a short bound, and hard-exits with status 124.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

import structlog

from fsm import marker, policy
from fsm.clock import Deadline
from fsm.context import Context

EXIT_DEADLINE = 124
MARKER_BOUND_S = 8.0
log = structlog.get_logger("fsm.watchdog")


class Watchdog:
    def __init__(
        self, ctx: Context, *, exit: Callable[[int], object] = os._exit, poll_s: float = 0.25
    ) -> None:
        self._ctx = ctx
        self._exit = exit
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
        log.error("deadline.watchdog_fired", state=ctx.path[-1] if ctx.path else None)
        if ctx.worker_pgid is not None:
            with contextlib.suppress(OSError):
                os.killpg(ctx.worker_pgid, signal.SIGKILL)
        if ctx.publisher.claim() and ctx.dest is not None:
            rule = policy.rule("deadline")
            record = marker.build(
                ok=False,
                retriable=rule.retriable,
                error=(
                    "run wall deadline exceeded: the attempt was still in "
                    f"{ctx.path[-1] if ctx.path else 'start-up'} when its deadline passed"
                ),
                dest=ctx.dest,
                redactor=ctx.redactor,
                evidence={
                    "state": ctx.path[-1] if ctx.path else None,
                    "path": [*ctx.path],
                    "rule": rule.id,
                    "run_id": ctx.evidence.get("run_id"),
                    "watchdog": True,
                },
            )
            payload_path = ctx.settings.payload_path
            writer = threading.Thread(
                target=ctx.publisher.publish,
                kwargs={
                    "marker": record,
                    "dest": ctx.dest,
                    "store": ctx.open_store(ctx.dest, Deadline.after(MARKER_BOUND_S)),
                    "result_file": marker.result_path(payload_path, ctx.dest),
                    "scratch_dir": ctx.scratch,
                    "deadline": Deadline.after(MARKER_BOUND_S),
                    "tries": 3,
                    "base_delay_s": 0.5,
                },
                name="flash-watchdog-marker",
                daemon=True,
            )
            writer.start()
            writer.join(MARKER_BOUND_S)
        else:
            # Mark is publishing: give it the same short bound to finish.
            ctx.publisher.done.wait(MARKER_BOUND_S)
        log.error("deadline.hard_exit", status=EXIT_DEADLINE)
        self._exit(EXIT_DEADLINE)
