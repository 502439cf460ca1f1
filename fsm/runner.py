"""One attempt, start to finish: build the context, arm the signals and the watchdog,
drive the machine, and say how it ended.

The exit status is a fact about what was published (CONTRACT section 2): 0 or 1 only when
the marker landed, 3 when the outcome was decided and persisted but the marker could not
be published, 2 for an unusable payload, 124 for the deadline, and 75 when this runner
never owned the attempt (another live runner holds its lock) and so wrote nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import structlog

from fsm import driver, table
from fsm import log as log_config
from fsm.clock import Deadline
from fsm.context import Context, Settings, StoreFactory
from fsm.errors import AttemptBusy
from fsm.interrupt import InterruptFlag
from fsm.payload import Destination
from fsm.store.base import Store
from fsm.watchdog import EXIT_DEADLINE, Watchdog

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNUSABLE = 2
EXIT_UNPUBLISHED = 3
EXIT_NOT_OWNER = 75  # EX_TEMPFAIL: another runner owns the attempt; nothing was written
EXIT_INTERNAL = 70  # EX_SOFTWARE: a defect escaped the runner (never expected)
MAX_REASON_CHARS = 2_000

log = structlog.get_logger("fsm.runner")


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    terminal: str | None
    reason: str  # the one human-readable line for stderr
    context: Context

    @property
    def marker(self) -> dict[str, Any] | None:
        record = self.context.evidence.get("marker")
        return record if isinstance(record, dict) else None


def store_factory(settings: Settings) -> StoreFactory:
    """Open the store named by ``--store``, else by ``FLASH_STORE`` in the environment
    merged with the payload's env (else the Hub at that environment's ``HF_ENDPOINT``)."""

    def open_for(dest: Destination, deadline: Deadline, environ: Mapping[str, str]) -> Store:
        from fsm.store import open_store

        url = settings.store_url or environ.get("FLASH_STORE") or None
        return open_store(
            url, repo_id=dest.hf_repo, token=dest.token, deadline=deadline, environ=environ
        )

    return open_for


def run_attempt(
    settings: Settings,
    environ: Mapping[str, str] | None = None,
    *,
    open_store: StoreFactory | None = None,
    out_fd: int = 1,
    python: str = sys.executable,
    handle_signals: bool = True,
    hard_exit: Callable[[int], object] = os._exit,
    interrupt: InterruptFlag | None = None,
    say: Callable[[str], None] | None = None,
    handlers: Mapping[str, driver.Handler] | None = None,
) -> Outcome:
    """Run one attempt through the machine and return how it ended.

    ``hard_exit`` is what the deadline watchdog calls when the attempt is stuck past its
    deadline (the process's ``os._exit``; tests running in-process hand in their own), after
    ``say`` has written the one-line reason. ``interrupt`` is the flag the signals set (the
    command line hands in the one it armed before its imports). ``handlers`` replaces the
    states' handlers (tests of the driver's totality hand in broken ones).
    """
    if handlers is None:
        from states import HANDLERS  # the handlers import the heavier machinery

        handlers = HANDLERS

    ctx = Context(
        settings=settings,
        environ=dict(os.environ if environ is None else environ),
        open_store=open_store or store_factory(settings),
        interrupt=interrupt or InterruptFlag(),
        out_fd=out_fd,
        python=python,
        started_at=time.time(),
    )
    log_config.attach(ctx.redactor)  # the attempt's one redaction path, logs included
    watchdog = Watchdog(ctx, exit=hard_exit, say=say or _stderr_line)
    with _signals(ctx, handle_signals):
        watchdog.start()
        try:
            terminal = driver.run(ctx, handlers)
        except AttemptBusy as exc:
            code = EXIT_DEADLINE if exc.ended_by == "deadline" else EXIT_NOT_OWNER
            return Outcome(code, None, str(exc), ctx)
        except Exception as exc:  # a defect outside the (total) driver: still one line
            log.error("runner.internal_error", exc_type=type(exc).__name__)
            return _said(ctx, EXIT_INTERNAL, None, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            watchdog.stop()
            if ctx.lock is not None:
                ctx.lock.release()
    return _outcome(ctx, terminal)


def _stderr_line(line: str) -> None:
    print(f"flash-bootstrap: {line}", file=sys.stderr, flush=True)


def _outcome(ctx: Context, terminal: str) -> Outcome:
    record = ctx.evidence.get("marker") or {}
    rule = record.get("rule") or (ctx.failure.rule if ctx.failure else "")
    attempt = ctx.dest.attempt if ctx.dest else "?"
    published = ctx.publisher.result
    error = record.get("error") or (ctx.failure.message if ctx.failure else "")
    verdict = {
        table.SUCCEEDED: "succeeded",
        table.FAILED_RETRIABLE: "failed (retriable",
        table.FAILED_FATAL: "failed (fatal",
    }[terminal]
    if terminal != table.SUCCEEDED:
        verdict += f", rule {rule}): {error}"
    if ctx.dest is None:
        reason = f"payload unusable: {error} (no marker: the payload names no usable destination)"
        return _said(ctx, EXIT_UNUSABLE, terminal, reason)
    if ctx.payload is None:  # a usable destination, an unusable rest: the fatal marker
        code, reason = EXIT_UNUSABLE, f"payload unusable: {error}"
    elif not published.landed:
        code, reason = EXIT_UNPUBLISHED, f"attempt {attempt} {verdict}"
    elif terminal == table.SUCCEEDED:
        code, reason = EXIT_OK, f"attempt {attempt} succeeded"
    elif rule == "deadline":
        code, reason = EXIT_DEADLINE, f"attempt {attempt} {verdict}"
    else:
        code, reason = EXIT_FAILED, f"attempt {attempt} {verdict}"
    if not published.landed:
        kept = (
            f"the result is persisted at {published.persisted} and running the same payload "
            "again publishes it"
            if published.persisted
            else "the result could not be persisted either"
        )
        reason = f"marker NOT published ({published.error}); {kept}; {reason}"
    return _said(ctx, code, terminal, reason)


def _said(ctx: Context, code: int, terminal: str | None, reason: str) -> Outcome:
    return Outcome(code, terminal, ctx.redactor.line(reason, MAX_REASON_CHARS), ctx)


@contextmanager
def _signals(ctx: Context, enabled: bool) -> Iterator[None]:
    """SIGTERM and SIGINT set the interrupt flag (as PID 1 nothing else would catch them)."""
    if not enabled:
        yield
        return
    previous = {sig: signal.signal(sig, ctx.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
