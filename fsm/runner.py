"""One attempt, start to finish: build the context, arm the signals and the watchdog,
drive the machine, and say how it ended."""

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
from fsm.clock import Deadline
from fsm.context import Context, Settings, StoreFactory
from fsm.errors import AttemptBusy
from fsm.payload import Destination
from fsm.store.base import Store
from fsm.watchdog import EXIT_DEADLINE, Watchdog

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNUSABLE = 2

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
    """Open the store named by ``--store``/``FLASH_STORE`` (default: the Hub)."""

    def open_for(dest: Destination, deadline: Deadline) -> Store:
        from fsm.store import open_store

        return open_store(
            settings.store_url, repo_id=dest.hf_repo, token=dest.token, deadline=deadline
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
) -> Outcome:
    """Run one attempt through the machine and return how it ended.

    ``hard_exit`` is what the deadline watchdog calls when the attempt is stuck past its
    deadline (the process's ``os._exit``; tests running in-process hand in their own).
    """
    from states import HANDLERS  # the handlers import the heavier machinery

    ctx = Context(
        settings=settings,
        environ=dict(os.environ if environ is None else environ),
        open_store=open_store or store_factory(settings),
        out_fd=out_fd,
        python=python,
        started_at=time.time(),
    )
    watchdog = Watchdog(ctx, exit=hard_exit)
    with _signals(ctx, handle_signals):
        watchdog.start()
        try:
            terminal = driver.run(ctx, HANDLERS)
        except AttemptBusy as exc:
            return Outcome(EXIT_FAILED, None, f"{exc}; leaving it alone", ctx)
        finally:
            watchdog.stop()
            if ctx.lock is not None:
                ctx.lock.release()
    return _outcome(ctx, terminal)


def _outcome(ctx: Context, terminal: str) -> Outcome:
    record = ctx.evidence.get("marker") or {}
    rule = record.get("rule") or (ctx.failure.rule if ctx.failure else "")
    attempt = ctx.dest.attempt if ctx.dest else "?"
    if terminal == table.SUCCEEDED:
        return Outcome(EXIT_OK, terminal, f"attempt {attempt} succeeded", ctx)
    error = record.get("error") or (ctx.redactor.text(ctx.failure.message) if ctx.failure else "")
    verdict = "retriable" if terminal == table.FAILED_RETRIABLE else "fatal"
    if rule == "payload-invalid":
        code = EXIT_UNUSABLE
        reason = f"payload unusable: {error}"
    elif rule == "deadline":
        code = EXIT_DEADLINE
        reason = f"attempt {attempt} failed ({verdict}, rule {rule}): {error}"
    else:
        code = EXIT_FAILED
        reason = f"attempt {attempt} failed ({verdict}, rule {rule}): {error}"
    if ctx.dest is None:
        reason += " (no marker: the payload names no usable hf_repo/hf_prefix)"
    return Outcome(code, terminal, " ".join(reason.split())[:2_000], ctx)


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
