"""The one place an attempt's marker record is built from what the attempt learned, and
the one way it is published.

Mark builds and publishes the record of the attempt's outcome here, and so does the
deadline watchdog when the main thread is stuck (the driver's salvage of a failed Mark
persists through the same helpers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from fsm import interrupt as interrupt_mod
from fsm import policy, rules, table
from fsm.attempt import marker, result
from fsm.attempt.publish import READBACK_S, Published
from fsm.attempt.result import Persisted
from fsm.budget import Budget
from fsm.context import END_MIN_S, Context, Failure
from fsm.host.probe import FACTS_WAIT_S
from fsm.output import outlet
from fsm.store import retry_delays
from fsm.store.base import Store
from fsm.worker import termination

log = structlog.get_logger("fsm.outcome")


def record(ctx: Context, failure: Failure | None, *, watchdog: bool = False) -> Persisted:
    """The marker (CONTRACT section 4, with evidence) and the artifacts that go with it."""
    assert ctx.dest is not None, "a record needs the destination"
    working = [state for state in ctx.path if state != table.MARK]
    evidence: dict[str, Any] = {
        # where the attempt's fate was decided: the failing state, or the last one of work
        "state": failure.state if failure else (working[-1] if working else None),
        "path": [*ctx.path],
        "rule": failure.rule.id if failure else rules.SUCCESS.id,
        "run_id": ctx.evidence.get("run_id"),
        # Every key the states put in, as they put it, and the worker's facts, typed.
        **ctx.evidence,
        **ctx.worker.evidence(),
    }
    # Signals the runner caught and ignored by its table (fsm.interrupt): evidence only.
    if ignored := interrupt_mod.ignored_evidence():
        evidence["signals_ignored"] = ignored
    # Commits landed before the marker's own, and the 429s the attempt met.
    evidence["store"] = ctx.store_stats.evidence()
    # What the runner's own stdout and stderr could not take (a reader gone or stuck),
    # once the log lines offered so far were written or met the error that stops them
    # (the writer is a thread: a line logged just now may not have reached its descriptor).
    if not watchdog:
        outlet.settle(_SETTLE_S)
    if (lost := outlet.evidence(ctx.out)) is not None:
        evidence["output"] = lost
    # The ``host`` evidence: nvidia-smi's answer, waited for at most FACTS_WAIT_S (by the
    # watchdog not at all), else what has answered so far.
    host: dict[str, Any] | None = None
    if ctx.host is not None:
        left = ctx.begin_end().mark_budget().remaining()
        host = ctx.host.facts(0.0 if watchdog else max(0.0, min(FACTS_WAIT_S, left / 4))).evidence()
    if failure is not None:
        # Every failure names its cause and its machine (CONTRACT section 9): the cause as
        # VerifyRemote judged the worker when its rule is the failure's, else the rule's own.
        judged = ctx.judged_fault
        if judged is None or judged.rule != failure.rule.id:
            judged = policy.fault_of(failure.rule)
        evidence["fault"] = judged.evidence()
        if host is None:
            host = {"id": ctx.host_id(), "hostname": ctx.hostname()}
    if host is not None:
        evidence["host"] = host
    if watchdog:
        evidence["watchdog"] = True
    built = marker.build(ok=failure is None, retriable=failure is not None and failure.retriable,
                         error=failure.message if failure else "", dest=ctx.dest,
                         redactor=ctx.redactor, evidence=evidence)
    lease = ctx.lease
    return Persisted(marker=built, artifacts=dict(ctx.end_artifacts),
                     remove=(lease.name,) if lease is not None and lease.written else ())


#: How long the marker waits for the log's lines offered so far (a reader that keeps up
#: takes microseconds; a stuck one is evidence, not worth waiting for).
_SETTLE_S = 0.2


#: The console tail rides with the marker only when at least this much of the marker's
#: time is left: it is optional, the marker is not.
TAIL_MIN_LEFT_S = 2.0


def attach_tail(ctx: Context, failure: Failure | None) -> None:
    """Put the console tail among the end artifacts when the attempt ran a worker and
    either failed or uploads its console: redacted, at most the last 64,000 bytes."""
    from fsm.worker.console import console_name, console_path
    from fsm.worker.supervise import TAIL_BYTES

    if ctx.worker.exit is None or not (failure is not None or ctx.tuning.upload_console):
        return
    if failure is not None and failure.rule is rules.SUPERSEDED:
        return  # the prefix's console is the later attempt's now
    if ctx.begin_end().mark_budget().remaining() < TAIL_MIN_LEFT_S:
        log.warning("console.tail_dropped", reason="no time left before the marker")
        return
    try:
        # Redacted before the cut: a secret straddling the tail's start is masked whole.
        tail = ctx.redactor.tail_of(console_path(ctx), TAIL_BYTES)
    except FileNotFoundError:
        return
    except OSError as exc:
        ctx.evidence.setdefault("console_error", exc.strerror)
        return
    ctx.end_artifacts[console_name(ctx)] = tail.decode("utf-8", "replace")


def announce(ctx: Context, *, exit_code: int, terminal: str | None, reason: str) -> None:
    """The attempt's last log event, ``attempt.outcome``: how it ended, so that a log
    shipper's last line for the attempt answers the first question without opening the
    store. The end state, the class and rule, the exit status, where the marker is (or why
    it was not published, and where the result is kept), the seconds spent in each state,
    and the one-line reason the process ends with. Then the termination message: the same
    verdict, for the container engine (``fsm.worker.termination``)."""
    record = ctx.published_marker
    if record is None and ctx.publisher.record is not None:
        record = ctx.publisher.record.marker
    fields: dict[str, Any] = {"end_state": terminal, "exit_code": exit_code}
    if isinstance(record, dict):
        fields["class"] = marker.verdict(record)
        fields["rule"] = record.get("rule")
    elif ctx.failure is not None:
        fields["class"], fields["rule"] = ctx.failure.rule.verdict, ctx.failure.rule.id
    published = ctx.publisher.result
    if published.landed and ctx.dest is not None:
        fields["marker"] = ctx.dest.path(ctx.dest.marker_name)
        fields["repo"] = ctx.dest.hf_repo
    else:
        fields["marker_unpublished"] = published.error or reason
        if published.persisted is not None:
            fields["persisted"] = str(published.persisted)
    fields["seconds"] = ctx.timeline.seconds()
    log.info("attempt.outcome", **fields, reason=reason)
    # The same verdict where Kubernetes shows it (fsm.worker.termination): after the last event,
    # since it can never fail and never says anything.
    termination.write(ctx.environ, ctx.redactor, status=exit_code, reason=reason,
                      verdict=fields.get("class"), rule=fields.get("rule"),
                      marker=fields.get("marker"))


def event_for(record: dict[str, Any]) -> str:
    """The event that leads Mark to the terminal state of the marker it announced."""
    return {"succeeded": table.MARKED_SUCCEEDED, "retriable": table.MARKED_RETRIABLE,
            "fatal": table.MARKED_FATAL}[marker.verdict(record)]


def result_file(ctx: Context) -> Path | None:
    """Where to persist the result for a restart, or None: a replay is persisted already,
    and an unusable payload is not an attempt's result (fixed and restarted, it runs)."""
    if ctx.dest is None or ctx.replayed is not None or ctx.payload is None:
        return None
    return result.result_path(ctx.settings.payload_path, ctx.dest)


def identity(ctx: Context) -> dict[str, Any]:
    """The attempt's identity, persisted with its result (CONTRACT section 4)."""
    assert ctx.dest is not None
    p = ctx.payload
    return result.identity(ctx.dest, run_id=p.run_id if p else None, mode=p.mode if p else "")


#: The deadline watchdog's own time to publish the marker of a stuck attempt: the least
#: the end of an attempt ever gives Mark, and more (``fsm.context.END_MIN_S``).
WATCHDOG_MARK_S = END_MIN_S


def publish(ctx: Context, record: Persisted, budget: Budget) -> Published:
    """Persist ``record`` and publish it within ``budget`` (Mark's and the watchdog's way:
    split into tries; a signal bounds it, it does not stop it). The waits between the
    marker's tries follow the store's own retry settings (``FLASH_STORE_RETRY_BASE_S``,
    ``FLASH_STORE_RETRY_MAX_S``)."""
    assert ctx.dest is not None
    try:
        # The tries end READBACK_S before the budget: the read-back keeps that.
        store: Store | None = ctx.store_for(budget.reserving(READBACK_S))
        readback: Store | None = ctx.store_for(budget)
        base_s, max_s = retry_delays(ctx.store_env())
    except Exception as exc:  # an unusable store setting: the result stays persisted
        log.error("marker.store_unusable", exc_type=type(exc).__name__,
                  error=ctx.redactor.text(str(exc)))
        store, readback, (base_s, max_s) = None, None, retry_delays({})
    return ctx.publisher.publish(
        record, dest=ctx.dest, store=store, result_file=result_file(ctx), ident=identity(ctx),
        scratch_dir=ctx.scratch, budget=budget, fence=ctx.fence, base_delay_s=base_s,
        max_delay_s=max_s, readback=readback)
