"""Mark: publish the attempt's one marker and leave for the terminal state it announces.

The only handler that writes a marker. It never fails: a marker that cannot be uploaded
is still persisted next to the payload and in the scratch directory, and the outcome
stays what it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from fsm import marker, policy, table
from fsm.clock import Deadline
from fsm.context import Context

log = structlog.get_logger("states.mark")
MIN_PUBLISH_S = 10.0


def mark(ctx: Context) -> str:
    if ctx.dest is None:
        log.error("marker.destination_unknown", reason="hf_repo or hf_prefix unusable")
        return table.OUTCOME_EVENT[_terminal_of(ctx.failure is None, ctx.failure)]
    publisher = ctx.publisher
    if ctx.replayed is not None:
        record = ctx.replayed
        log.info("marker.replay", ok=record.get("ok"), rule=record.get("rule"))
    else:
        record = _record(ctx)
    if publisher.claim():
        # Mark may run after the work deadline: it gets the whole attempt deadline, and
        # at least a short bound even when that passed too.
        deadline = Deadline.after(max(ctx.deadline.remaining(), MIN_PUBLISH_S))
        try:
            publisher.publish(
                record,
                dest=ctx.dest,
                store=ctx.open_store(ctx.dest, deadline),
                result_file=_result_file(ctx),
                scratch_dir=ctx.scratch,
                deadline=deadline,
            )
        except Exception as exc:  # Mark never fails: the outcome stands, the logs say why
            log.error("marker.publish_crashed", exc_type=type(exc).__name__,
                      error=ctx.redactor.text(str(exc)))
    ctx.evidence["marker"] = record
    if record.get("ok"):
        return table.MARKED_SUCCEEDED
    return table.MARKED_RETRIABLE if record.get("retriable") else table.MARKED_FATAL


def _result_file(ctx: Context) -> Path | None:
    """Where to persist the result for a restart, or None: a replay is persisted already,
    and an unusable payload is not an attempt's result (fixed and restarted, it runs)."""
    assert ctx.dest is not None
    if ctx.replayed is not None or (ctx.failure and ctx.failure.rule == "payload-invalid"):
        return None
    return marker.result_path(ctx.settings.payload_path, ctx.dest)


def _record(ctx: Context) -> dict[str, Any]:
    assert ctx.dest is not None
    failure = ctx.failure
    evidence: dict[str, Any] = {
        # where the attempt's fate was decided: the failing state, or the last one of work
        "state": failure.state if failure else ctx.path[-2],
        "path": [*ctx.path],
        "rule": failure.rule if failure else ctx.evidence.get("rule", policy.SUCCESS_RULE),
        "run_id": ctx.evidence.get("run_id"),
    }
    if "worker" in ctx.evidence:
        evidence["worker"] = ctx.evidence["worker"]
    if "preload" in ctx.evidence:
        evidence["preload"] = ctx.evidence["preload"]
    return marker.build(
        ok=failure is None,
        retriable=failure.retriable if failure else False,
        error=failure.message if failure else "",
        dest=ctx.dest,
        redactor=ctx.redactor,
        evidence=evidence,
    )


def _terminal_of(ok: bool, failure: Any) -> str:
    if ok:
        return table.SUCCEEDED
    return table.FAILED_RETRIABLE if failure.retriable else table.FAILED_FATAL
