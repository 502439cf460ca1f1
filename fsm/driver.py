"""The one run loop: handler -> event -> trigger, and the one place a transition is logged.

Each working state's handler does its work and returns the event that happened. A
handler that raises is classified by the policy, and the failure becomes one of the four
exits every working state shares (retriable, fatal, interrupted, deadline). Mark is the
only handler that publishes; it leaves for exactly one terminal state.

The loop is total: a handler that returns an event its state does not allow, a state
without a handler, or a failure inside Mark itself is a defect of the runner, and it
still ends the attempt in a terminal state under the policy's ``internal-error`` rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from fsm import policy, rules, table
from fsm.attempt import marker, outcome, result
from fsm.context import Context, Failure
from fsm.errors import AttemptBusy, DeadlineExceeded, FatalError, FlashError, HostFault, Interrupted
from fsm.machine import RunMachine
from fsm.output import log as log_config

Handler = Callable[[Context], str]

log = structlog.get_logger("fsm.driver")


def describe(exc: BaseException) -> str:
    """The text of a failure, as the marker carries it (made one line by the redactor,
    after masking: collapsing whitespace first could hide a secret that holds some)."""
    if isinstance(exc, Interrupted):
        return (
            f"interrupted by signal {exc.signum} (host stop or preemption); retry on a fresh host"
        )
    text = str(exc).strip() or type(exc).__name__
    if not hasattr(exc, "rule") and not isinstance(exc, DeadlineExceeded):
        text = f"{type(exc).__name__}: {text}"
    return text


def handler_problems(handlers: Mapping[str, Handler]) -> list[str]:
    """Where the handlers and the table disagree (each a defect): a working state without
    a handler, or a handler for something that is not a working state."""
    missing = [f"{state} has no handler" for state in table.WORKING if state not in handlers]
    stray = [f"a handler for {name!r}, which is no working state of the table"
             for name in handlers if name not in table.WORKING]
    return missing + stray


# structlog names its message key "event"; the renderer (fsm.output.log) moves the message to
# "msg" and this "_event" to "event", so a state.changed line reads {msg, from, event, to}.


def run(ctx: Context, handlers: Mapping[str, Handler]) -> str:
    """Drive a new machine from its initial state to a terminal one; return that state."""
    machine = RunMachine()
    # Loud now; a state without a handler still ends in its internal-error marker.
    if problems := handler_problems(handlers):
        log.error("driver.table_mismatch", problems=problems, rule=rules.INTERNAL_ERROR.id)
    while True:
        state = machine.state
        started = ctx.timeline.enter(state)
        log_config.bind(state=state)  # every event carries it
        if machine.is_terminal:
            return state
        if state == table.PUBLISHES:
            event = _mark(ctx, handlers.get(state))
        else:
            event = _step(ctx, state, handlers.get(state))
            if event not in machine.allowed():
                event = _internal(
                    ctx, state,
                    f"the handler of {state} returned {event!r}, which {state} does not allow "
                    f"(allowed: {', '.join(machine.allowed())})",
                )
        machine.fire(event)
        log.info(  # run_id and attempt are bound (fsm.output.log.bind) once LoadPayload knows them
            "state.changed",
            **{"from": state, "_event": event, "to": machine.state},
            seconds=round(time.monotonic() - started, 4),
        )


def _step(ctx: Context, state: str, handler: Handler | None) -> str:
    if handler is None:
        return _internal(ctx, state, f"no handler for state {state}")
    try:
        if ctx.interrupt.is_set() and state not in table.RUN_AFTER_SIGNAL:
            raise Interrupted(ctx.interrupt.signum or 15)
        if ctx.work_deadline.expired() and state not in table.RUN_AFTER_DEADLINE:
            raise DeadlineExceeded(f"run wall deadline exceeded before {state} could start")
        if ctx.halt is not None:
            raise ctx.halt
        ctx.raise_on_interrupt = True
        try:
            event = handler(ctx)
        finally:
            ctx.raise_on_interrupt = False
        # A fault the GPUs reported while setup ran (fsm.host.probe, from its thread)
        # ends the state it came in, whether or not the state's work saw it.
        if ctx.halt is not None:
            raise ctx.halt
        return event
    except BaseException as exc:  # every failure is classified, none escapes the machine
        if isinstance(exc, SystemExit | AttemptBusy):
            raise
        if ctx.halt is not None:
            # What setup raised after the GPUs reported a fault (an install or download
            # stopped for it) came of that fault: the fault decides.
            exc = ctx.halt
        if isinstance(exc, HostFault):
            ctx.evidence.update(exc.evidence)
        if (
            ctx.interrupt.is_set()
            and not isinstance(exc, Interrupted)
            and not (isinstance(exc, FlashError) and exc.stands_after_signal)
        ):
            # Whatever broke after a SIGTERM/SIGINT broke because of it (a pipe cut, a
            # process killed): the host is going away, and that is what decides.
            exc = Interrupted(ctx.interrupt.signum or 15)
        # The typed failure of the host's storage it may be (``fsm.host.storage``): a full
        # or read-only filesystem under one of the runner's own writes, with its evidence.
        from fsm.host import storage

        found = storage.classify(exc, state=state, candidates=storage_dirs(ctx, state),
                                 start=ctx.storage_start, environ=ctx.merged_env())
        if found is not None:
            exc, ctx.evidence["storage"] = found
        rule = policy.classify(state, exc)
        return _failed(ctx, state, rule, describe(exc), type(exc).__name__)


def storage_dirs(ctx: Context, state: str) -> list[Path]:
    """The directories the runner writes in, those ``state`` writes (``table.WRITES``) first."""
    s = ctx.settings
    cache = ctx.merged_env().get("HF_HOME")
    folders = {"payload": [s.payload_path.parent], "code": [s.code_root],
               "scratch": [s.scratch_dir], "cache": [Path(cache)] if cache else []}
    order = [*table.WRITES.get(state, ()), *folders]
    return list(dict.fromkeys(d for name in order for d in folders[name]))


def _failed(ctx: Context, state: str, rule: policy.Rule, message: str, exc_type: str) -> str:
    message = ctx.redactor.line(message, marker.MAX_ERROR_CHARS)  # redact, then shorten
    ctx.failure = Failure(rule=rule, message=message, state=state)
    for branch in ctx.prefetch.values():
        branch.cancel()  # the states that would join them will not run
    log.warning(
        "state.failed",
        state=state,
        rule=rule.id,
        verdict=rule.verdict,
        error=message,
        exc_type=exc_type,
    )
    return rule.event


def _internal(ctx: Context, state: str, fault: str) -> str:
    """A defect of the runner in ``state``: the attempt fails fatally, naming it."""
    defect = FatalError(f"internal error in {state}: {fault}", rule=rules.INTERNAL_ERROR)
    return _failed(ctx, state, policy.classify(state, defect), defect.message, "InternalError")


def _mark(ctx: Context, handler: Handler | None) -> str:
    """Run Mark; when Mark itself fails, keep the outcome persisted (exit 3 says the
    marker was not published) and still reach the terminal state of that outcome."""
    # Mark runs to the end: a signal only sets the flag. False already (``_step`` leaves it
    # so after every handler), and set here too: Mark's guarantee rests on no other code.
    ctx.raise_on_interrupt = False
    try:
        if handler is None:
            raise LookupError("no handler for state Mark")
        event = handler(ctx)
        if event in table.allowed(table.MARK):
            return event
        raise LookupError(f"Mark returned {event!r}, which Mark does not allow")
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        fault = describe(exc)
        log.error("mark.failed", error=ctx.redactor.line(fault, marker.MAX_ERROR_CHARS),
                  rule=rules.INTERNAL_ERROR.id)
        return _salvage(ctx, fault)


def _salvage(ctx: Context, fault: str) -> str:
    """Mark failed: persist the outcome the attempt had decided (a restart publishes it)."""
    record = ctx.publisher.record
    if record is None and ctx.dest is not None:
        failure = ctx.failure
        try:
            record = outcome.record(ctx, failure)
        except Exception:  # the builder is what failed: the bare contract fields
            record = result.Persisted(
                marker=marker.build(
                    ok=failure is None,
                    retriable=bool(failure and failure.retriable),
                    error=failure.message if failure else "",
                    dest=ctx.dest,
                    redactor=ctx.redactor,
                    evidence={"rule": (failure.rule if failure else rules.INTERNAL_ERROR).id,
                              "state": failure.state if failure else table.MARK},
                ),
                artifacts={},
            )
        ctx.publisher.record = record
        if (path := outcome.result_file(ctx)) is not None and ctx.owns_attempt:
            try:
                result.persist(path, outcome.identity(ctx), record)
                ctx.publisher.result.persisted = path
            except OSError as exc:
                log.error("result.persist_failed", path=str(path), error=exc.strerror)
    if not ctx.publisher.result.landed:
        ctx.publisher.result.error = f"Mark failed: {fault}"
    if record is None:  # no destination: nothing to persist, the failure decides
        retriable = bool(ctx.failure and ctx.failure.retriable)
        return outcome.event_for({"ok": False, "retriable": retriable})
    ctx.published_marker = record.marker
    return outcome.event_for(record.marker)
