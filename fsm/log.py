"""structlog configuration: JSON lines on stderr, readable when stderr is a terminal.

Every event passes through the redaction processor, so a secret value that reaches a
log call is masked before it is rendered.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from fsm.redact import Redactor

#: The redactor every log event passes through; LoadPayload adds the payload's secrets.
REDACTOR = Redactor()


def redact_event(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
    """structlog processor: mask every known secret in every value of the event."""
    if not REDACTOR:
        return event
    return {key: REDACTOR.deep(value) for key, value in event.items()}


def configure(stream: TextIO | None = None, *, json: bool | None = None) -> None:
    """Route structlog to ``stream`` (stderr); JSON unless the stream is a terminal."""
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_event,
            # The message goes to "msg"; a transition's trigger ("_event") becomes "event".
            structlog.processors.EventRenamer("msg", replace_by="_event"),
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def _drop(_logger: Any, _method: str, _event: MutableMapping[str, Any]) -> Any:
    raise structlog.DropEvent


def silence() -> None:
    """Drop every log event from here on: the process's last stderr line is its reason
    (CONTRACT section 2), whatever a lingering thread still has to say."""
    structlog.configure(processors=[_drop])
