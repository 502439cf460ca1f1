"""One attempt, start to finish: build the context, arm the signals and the watchdog,
drive the machine, and say how it ended.

The exit status is a fact about what was published (CONTRACT section 2, ``fsm.exits``): 0,
1 (fatal) or 75 (retriable) only when the marker landed, 3 when the outcome was decided and
persisted but the marker could not be published, 2 for an unusable payload, 124 for the
deadline, and 73 when this runner never owned the attempt (another live runner holds its
lock) and so wrote nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import structlog

from fsm import driver, exits, policy, rules, table
from fsm import interrupt as interrupts
from fsm.attempt import outcome
from fsm.attempt._watchdog import EXIT_DEADLINE, MAX_REASON_CHARS, Watchdog
from fsm.budget import Budget
from fsm.context import Context, Settings, StoreFactory
from fsm.errors import AttemptBusy
from fsm.interrupt import InterruptFlag
from fsm.output import log as log_config
from fsm.output import outlet
from fsm.payload import Destination
from fsm.rules import Rule
from fsm.store.base import Store, StoreStats
from fsm.worker import procs

EXIT_UNUSABLE = exits.UNUSABLE.code
EXIT_UNPUBLISHED = exits.UNPUBLISHED.code
EXIT_NOT_OWNER = exits.NOT_OWNER.code  # another runner owns the attempt; nothing written
EXIT_INTERNAL = exits.INTERNAL.code  # a defect escaped the runner (never expected)

log = structlog.get_logger("fsm.runner")


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    terminal: str | None
    reason: str  # the one human-readable line for stderr
    context: Context

    @property
    def marker(self) -> dict[str, Any] | None:
        return self.context.published_marker


def store_factory(settings: Settings) -> StoreFactory:
    """Open the store named by ``--store``, else by ``FLASH_STORE`` in the environment
    merged with the payload's env (else the Hub at that environment's ``HF_ENDPOINT``)."""

    def open_for(dest: Destination, budget: Budget, environ: Mapping[str, str],
                 stats: StoreStats) -> Store:
        from fsm.store import open_store

        url = settings.store_url or environ.get("FLASH_STORE") or None
        return open_store(url, repo_id=dest.hf_repo, token=dest.token, deadline=budget.deadline,
                          environ=environ, interrupt=budget.interrupt, stats=stats,
                          budget=budget)

    return open_for


def run_attempt(settings: Settings, environ: Mapping[str, str] | None = None, *,
                open_store: StoreFactory | None = None, out_fd: int = 1,
                python: str = sys.executable, handle_signals: bool = True,
                hard_exit: Callable[[int], object] = os._exit,
                interrupt: InterruptFlag | None = None, say: Callable[[str], None] | None = None,
                handlers: Mapping[str, driver.Handler] | None = None) -> Outcome:
    """Run one attempt through the machine and return how it ended.

    ``hard_exit`` is what the deadline watchdog calls when the attempt is stuck past its
    deadline (the process's ``os._exit``; tests running in-process hand in their own), after
    ``say`` has written the one-line reason. ``interrupt`` is the flag the signals set (the
    command line hands in the one it armed before its imports). ``handlers`` replaces the
    states' handlers (tests of the driver's totality hand in broken ones).
    """
    from states import AHEAD, HANDLERS  # the states' modules import the heavier machinery

    handlers = HANDLERS if handlers is None else handlers

    # The worker's console goes on to ``out_fd`` through an outlet: never blocking the pump
    # (so never the worker), never raising. The process's own stdout has one already.
    out = outlet.STDOUT if out_fd == 1 and outlet.STDOUT is not None else None
    owned = out is None
    if out is None:
        out = outlet.Outlet(out_fd, "stdout", capacity=outlet.STDOUT_CAPACITY,
                            wait_s=outlet.STDOUT_WAIT_S)
    ctx = Context(settings=settings, environ=dict(os.environ if environ is None else environ),
                  open_store=open_store or store_factory(settings),
                  interrupt=interrupt or InterruptFlag(), out=out, python=python,
                  started_at=time.time(), ahead=AHEAD)
    log_config.attach(ctx.redactor)  # the attempt's one redaction path, logs included
    from fsm.host import storage  # the filesystems at the start: a full one is judged against them

    folders = {"payload": settings.payload_path.parent, "code": settings.code_root,
               "scratch": settings.scratch_dir}
    ctx.storage_start = storage.snapshot([folders[name] for name in table.WRITTEN_AT_START])
    watchdog = Watchdog(ctx, exit=hard_exit, say=say or _stderr_line)
    with _signals(ctx, handle_signals):
        watchdog.start()
        try:
            terminal = driver.run(ctx, handlers)
        except AttemptBusy as exc:
            code = EXIT_DEADLINE if exc.ended_by == "deadline" else EXIT_NOT_OWNER
            return _said(ctx, code, None, str(exc))
        except Exception as exc:  # a defect outside the (total) driver: still one line
            log.error("runner.internal_error", exc_type=type(exc).__name__)
            return _said(ctx, EXIT_INTERNAL, None, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            watchdog.stop()
            if ctx.lock is not None:
                ctx.lock.release()
            if owned:
                out.close(drain_s=outlet.LEAVE_BOUND_S)
    return _outcome(ctx, terminal)


def _stderr_line(line: str) -> None:
    print(f"flash-bootstrap: {line}", file=sys.stderr, flush=True)


def _outcome(ctx: Context, terminal: str) -> Outcome:
    record = ctx.published_marker or {}
    rule = _rule_of(ctx, record, terminal)
    published = ctx.publisher.result
    error = record.get("error") or (ctx.failure.message if ctx.failure else "")
    if ctx.dest is None:
        reason = f"payload unusable: {error} (no marker: the payload names no usable destination)"
        return _said(ctx, EXIT_UNUSABLE, terminal, reason)
    if rule.exit_status == EXIT_UNUSABLE:
        reason = f"payload unusable: {error}"
    elif terminal == table.SUCCEEDED:
        reason = f"attempt {ctx.dest.attempt} succeeded"
    else:
        reason = f"attempt {ctx.dest.attempt} failed ({rule.verdict}, rule {rule.id}): {error}"
    if published.landed:
        if published.persist_error is not None:  # a restart would not find it: say so
            reason = f"{reason}; {published.persist_error}"
        return _said(ctx, _published_status(rule, record), terminal, reason)
    code, unpublished = published.unpublished()
    if rule.exit_status == EXIT_UNUSABLE:
        code = EXIT_UNUSABLE  # the payload is what to fix first
    return _said(ctx, code, terminal, f"{unpublished}; {reason}")


def _published_status(rule: Rule, record: dict[str, Any]) -> int:
    """The status of a published marker: the rule's own (0, 2, 124), else its class, which
    the marker itself states (a replayed marker of another runner version included)."""
    if rule.exit_status not in (rules.EXIT_FAILED, rules.EXIT_RETRIABLE):
        return rule.exit_status
    retriable = record.get("retriable")
    return exits.failed(retriable if isinstance(retriable, bool) else rule.retriable).code


def _rule_of(ctx: Context, record: dict[str, Any], terminal: str) -> Rule:
    """The rule that decided the attempt: the published (or replayed) marker names it."""
    named = record.get("rule")
    if isinstance(named, str):
        with contextlib.suppress(KeyError):  # another runner version's rule: its class counts
            return policy.rule(named)
    if ctx.failure is not None:
        return ctx.failure.rule
    return rules.SUCCESS if terminal == table.SUCCEEDED else rules.UNCLASSIFIED


def _said(ctx: Context, code: int, terminal: str | None, reason: str) -> Outcome:
    said = Outcome(code, terminal, ctx.redactor.line(reason, MAX_REASON_CHARS), ctx)
    outcome.announce(ctx, exit_code=code, terminal=terminal, reason=said.reason)  # last event
    return said


def _on_child(_signum: int, _frame: object) -> None:
    """SIGCHLD: nothing to do here; its byte on the wakeup descriptor wakes the supervisor,
    which reaps the worker's orphans (``fsm.worker.procs.reap_orphans``)."""


@contextmanager
def _signals(ctx: Context, enabled: bool) -> Iterator[None]:
    """The stop signals (``fsm.interrupt.STOP_SIGNALS``) set the interrupt flag (as PID 1
    nothing else would catch them), the ignored ones are caught and counted, and whichever
    thread catches one wakes the main thread's waits (``fsm.interrupt``). And the process's
    hold on the host (``fsm.worker.procs``): a child subreaper, so no descendant of the
    worker escapes to the host's init; woken by SIGCHLD (restarting system calls), so
    orphans are reaped as they die; and its own ``oom_score_adj`` lowered where that is
    permitted."""
    if not enabled:
        yield
        return
    armed = interrupts.wakeup_fd() is None
    interrupts.arm_wakeup()  # a signal another thread caught still wakes the main thread
    previous = {sig: signal.signal(sig, ctx.on_signal) for sig in interrupts.STOP_SIGNALS}
    interrupts.install_ignored()
    subreaper = procs.become_subreaper()
    previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, _on_child)  # put back after
    signal.siginterrupt(signal.SIGCHLD, False)
    lowered = procs.lower_own_oom_score()
    log.info("runner.host_hold", subreaper=subreaper, oom_score_lowered=lowered, pid=os.getpid())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if armed:
            interrupts.disarm_wakeup()
