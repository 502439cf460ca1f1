"""Mark: publish the attempt's one marker and leave for the terminal state it announces.

The only handler that writes a marker (the deadline watchdog is the one other writer,
through the same builder and publisher, when the main thread is stuck). The order is
fixed: persist the result next to the payload, seal the optional uploads, then one
commit of the end-of-attempt artifacts (console tail, preload result) with the marker
last. When the marker cannot land in time the result stays persisted and the run exits 3
(the runner reads ``ctx.publisher.result``); running the same payload again publishes it.
"""

from __future__ import annotations

import time

import structlog

from fsm.attempt import outcome, result
from fsm.clock import os_timeout
from fsm.context import END_GRACE_S, Context

log = structlog.get_logger("states.mark")


def mark(ctx: Context) -> str:
    publisher = ctx.publisher
    if ctx.dest is None:
        publisher.result.error = "the payload names no usable marker destination"
        log.error("marker.destination_unknown", reason=publisher.result.error)
        retriable = bool(ctx.failure and ctx.failure.retriable)
        return outcome.event_for({"ok": False, "retriable": retriable})
    end = ctx.begin_end()  # the end of the attempt: VerifyRemote's share, if it ran, is over
    end.marking_since = time.monotonic()
    if ctx.replayed is not None:
        record = ctx.replayed
        # Where it was found is where it stays: a replay that fails leaves it there.
        publisher.result.persisted = result.result_path(ctx.settings.payload_path, ctx.dest)
        log.info("marker.replay", ok=record.marker.get("ok"), rule=record.marker.get("rule"))
    else:
        outcome.attach_tail(ctx, ctx.failure)
        record = outcome.record(ctx, ctx.failure)
    if publisher.claim():
        outcome.publish(ctx, record, end.mark_budget())
    else:  # the watchdog is publishing its record: give it the bound it has
        publisher.done.wait(os_timeout(outcome.WATCHDOG_MARK_S + END_GRACE_S))
    published = publisher.record or record
    ctx.published_marker = published.marker
    return outcome.event_for(published.marker)

