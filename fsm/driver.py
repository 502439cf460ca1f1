"""The one run loop: handler -> event -> trigger, and the one place a transition is logged.

Each working state's handler does its work and returns the event that happened. A
handler that raises is classified by the policy, and the failure becomes one of the four
exits every working state shares (retriable, fatal, interrupted, deadline). Mark is the
only handler that publishes; it leaves for exactly one terminal state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog

from fsm import policy, table
from fsm.context import Context, Failure
from fsm.errors import AttemptBusy, DeadlineExceeded, Interrupted
from fsm.machine import RunMachine

Handler = Callable[[Context], str]

log = structlog.get_logger("fsm.driver")


def failure_event(rule: policy.Rule) -> str:
    """The exit a classified failure takes out of its state."""
    if rule.id == "interrupted":
        return table.INTERRUPTED
    if rule.id == "deadline":
        return table.DEADLINE_EXCEEDED
    return table.FAILED_RETRIABLE_EVENT if rule.retriable else table.FAILED_FATAL_EVENT


def describe(exc: BaseException) -> str:
    """The one-line text of a failure, as the marker carries it."""
    if isinstance(exc, Interrupted):
        return (
            f"interrupted by signal {exc.signum} (host stop or preemption); retry on a fresh host"
        )
    text = str(exc).strip() or type(exc).__name__
    if not hasattr(exc, "rule") and not isinstance(exc, DeadlineExceeded):
        text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


# structlog names its message key "event"; the renderer (fsm.log) moves the message to
# "msg" and this "_event" to "event", so a state.changed line reads {msg, from, event, to}.


def run(ctx: Context, handlers: Mapping[str, Handler], machine: RunMachine | None = None) -> str:
    """Drive the machine from its current state to a terminal one; return that state."""
    machine = machine or RunMachine()
    while not machine.is_terminal:
        state = machine.state
        ctx.path.append(state)
        started = time.monotonic()
        event = _step(ctx, state, handlers[state])
        source = state
        machine.fire(event)
        log.info(
            "state.changed",
            run_id=ctx.payload.run_id if ctx.payload else None,
            attempt=ctx.dest.attempt if ctx.dest else None,
            **{"from": source, "_event": event, "to": machine.state},
            seconds=round(time.monotonic() - started, 4),
        )
    ctx.path.append(machine.state)
    return machine.state


def _step(ctx: Context, state: str, handler: Handler) -> str:
    if state == table.MARK:
        # Mark publishes the outcome and must run to the end: a signal now only sets the
        # flag. (Affects transitions: Mark has no failure exits in the table.)
        ctx.raise_on_interrupt = False
        return handler(ctx)
    try:
        if ctx.interrupt.is_set():
            raise Interrupted(ctx.interrupt.signum or 15)
        if ctx.work_deadline.expired():
            raise DeadlineExceeded(f"run wall deadline exceeded before {state} could start")
        ctx.raise_on_interrupt = True
        try:
            return handler(ctx)
        finally:
            ctx.raise_on_interrupt = False
    except BaseException as exc:  # every failure is classified, none escapes the machine
        if isinstance(exc, SystemExit | AttemptBusy):
            raise
        if ctx.interrupt.is_set() and not isinstance(exc, Interrupted):
            # Whatever broke after a SIGTERM/SIGINT broke because of it (a pipe cut, a
            # process killed): the host is going away, and that is what decides.
            exc = Interrupted(ctx.interrupt.signum or 15)
        rule = policy.classify(state, exc)
        ctx.failure = Failure(
            rule=rule.id, retriable=rule.retriable, message=describe(exc), state=state
        )
        log.warning(
            "state.failed",
            state=state,
            rule=rule.id,
            verdict=rule.verdict,
            error=ctx.redactor.text(ctx.failure.message),
            exc_type=type(exc).__name__,
        )
        return failure_event(rule)
