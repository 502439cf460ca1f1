"""structlog configuration: JSON lines on stderr, readable when stderr is a terminal.

Every event passes through a redaction processor holding the attempt's own redactor
(``attach``): a secret value that reaches a log call is masked before it is rendered.
There is no module-level redactor: the processor in structlog's chain is the one place,
and each attempt puts its own there.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from fsm.redact import Redactor


class RedactEvent:
    """structlog processor: mask every secret the attempt knows in every value."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor

    def __call__(
        self, _logger: Any, _method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        return {key: self.redactor.deep(value) for key, value in event.items()}


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
            RedactEvent(Redactor()),
            # The message goes to "msg"; a transition's trigger ("_event") becomes "event".
            structlog.processors.EventRenamer("msg", replace_by="_event"),
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def attach(redactor: Redactor) -> None:
    """Make ``redactor`` (the attempt's) the one every log event passes through from now."""
    processors = list(structlog.get_config()["processors"])
    found = [i for i, p in enumerate(processors) if isinstance(p, RedactEvent)]
    if found:
        processors[found[0]] = RedactEvent(redactor)
    else:  # configured by someone else (a test, an embedding program): redact before rendering
        processors.insert(max(0, len(processors) - 1), RedactEvent(redactor))
    structlog.configure(processors=processors)


def _drop(_logger: Any, _method: str, _event: MutableMapping[str, Any]) -> Any:
    raise structlog.DropEvent


def silence() -> None:
    """Drop every log event from here on: the process's last stderr line is its reason
    (CONTRACT section 2), whatever a lingering thread still has to say."""
    structlog.configure(processors=[_drop])
