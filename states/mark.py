"""Mark: publish the attempt's one marker and leave for the terminal state it announces.

The only handler that writes a marker (the deadline watchdog is the one other writer,
through the same builder and publisher, when the main thread is stuck). The order is
fixed: persist the result next to the payload, seal the optional uploads, then one
commit of the end-of-attempt artifacts (console tail, preload result) with the marker
last. When the marker cannot land in time the result stays persisted and the run exits 3
(the runner reads ``ctx.publisher.result``); running the same payload again publishes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from fsm import marker, outcome
from fsm.budget import Budget
from fsm.clock import Deadline, os_timeout
from fsm.context import Context
from fsm.store.base import Store

log = structlog.get_logger("states.mark")


def mark(ctx: Context) -> str:
    publisher = ctx.publisher
    if ctx.dest is None:
        publisher.result.error = "the payload names no usable marker destination"
        log.error("marker.destination_unknown", reason=publisher.result.error)
        retriable = bool(ctx.failure and ctx.failure.retriable)
        return outcome.event_for({"ok": False, "retriable": retriable})
    if ctx.replayed is not None:
        record = ctx.replayed
        log.info("marker.replay", ok=record.marker.get("ok"), rule=record.marker.get("rule"))
    else:
        outcome.attach_tail(ctx, ctx.failure)
        record = outcome.record(ctx, ctx.failure)
    if publisher.claim():
        deadline = ctx.mark_deadline
        publisher.publish(
            record,
            dest=ctx.dest,
            store=_store(ctx, deadline),
            result_file=_result_file(ctx),
            ident=_identity(ctx),
            scratch_dir=ctx.scratch,
            budget=Budget(deadline),  # a signal does not stop the marker: its deadline does
            fence=ctx.fence,
        )
    else:  # the watchdog is publishing its record: give it the same bound
        publisher.done.wait(os_timeout(ctx.mark_deadline.remaining()))
    published = publisher.record or record
    ctx.evidence["marker"] = published.marker
    return outcome.event_for(published.marker)


def _store(ctx: Context, deadline: Deadline) -> Store | None:
    try:
        return ctx.store_until(deadline, stop_on_signal=False)  # the marker must still land
    except Exception as exc:  # an unusable store setting: the result stays persisted
        log.error("marker.store_unusable", exc_type=type(exc).__name__,
                  error=ctx.redactor.text(str(exc)))
        return None


def _result_file(ctx: Context) -> Path | None:
    """Where to persist the result for a restart, or None: a replay is persisted already,
    and an unusable payload is not an attempt's result (fixed and restarted, it runs)."""
    assert ctx.dest is not None
    if ctx.replayed is not None or ctx.payload is None:
        return None
    return marker.result_path(ctx.settings.payload_path, ctx.dest)


def _identity(ctx: Context) -> dict[str, Any]:
    assert ctx.dest is not None
    p = ctx.payload
    return marker.identity(ctx.dest, run_id=p.run_id if p else None, mode=p.mode if p else "")
