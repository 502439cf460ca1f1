"""The runner's exception types.

Nearly a leaf module: it imports only the rules (``fsm.rules``, itself a leaf), so every
other module can raise and catch these without import cycles.

Failures a handler understands are raised as :class:`RetriableError` or
:class:`FatalError` carrying the rule that classifies them (an object of ``fsm.rules``).
Anything else is classified by the policy from its type.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fsm import rules
from fsm.rules import Rule

#: How many exceptions of a chain are looked at, at the most (a chain can be a cycle).
MAX_CHAIN = 32


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions behind it (``__cause__`` and ``__context__``), nearest
    first, each once, at most ``MAX_CHAIN``: the one walk of a cause chain, for whoever
    looks for an HTTP status, an errno or a library's error type down it."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < MAX_CHAIN:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


class FlashError(Exception):
    """A classified failure: a message for the marker plus the deciding policy rule.

    ``stands_after_signal``: the verdict was reached on facts that came before a
    SIGTERM/SIGINT (a worker that had already exited on its own), so a later signal does
    not turn it into ``interrupted``.

    A :class:`RetriableError` or :class:`FatalError` (or a subclass) naming a rule of the
    other class is refused with ``TypeError``; a bare ``FlashError`` takes any rule.
    """

    retriable: bool = False

    def __init__(self, message: str, *, rule: Rule, stands_after_signal: bool = False) -> None:
        if type(self) is not FlashError and rule.retriable is not self.retriable:
            kind = "RetriableError" if self.retriable else "FatalError"
            raise TypeError(f"{kind} names the {rule.verdict} rule {rule.id!r}")
        super().__init__(message)
        self.message = message
        self.rule = rule
        self.stands_after_signal = stands_after_signal


class RetriableError(FlashError):
    """Infra-shaped: the same attempt on a fresh host would likely succeed."""

    retriable = True


class HostFault(RetriableError):
    """A fault the host's own GPUs reported before the worker started (``fsm.host.probe``):
    ``evidence`` (the findings and the snapshot) goes into the marker."""

    def __init__(self, message: str, *, rule: Rule, evidence: dict[str, Any]) -> None:
        super().__init__(message, rule=rule, stands_after_signal=True)
        self.evidence = evidence


class FatalError(FlashError):
    """The run cannot succeed by retrying: fail it."""

    retriable = False


class PayloadError(FatalError):
    """The payload or the command line is unusable (exit status 2)."""

    def __init__(self, message: str, *, rule: Rule = rules.PAYLOAD_INVALID) -> None:
        super().__init__(message, rule=rule)


class StoreUnavailable(RetriableError):
    """The store could not be reached or answered 408/409/425/429/5xx after bounded retries.
    ``status`` is the last HTTP status met (None for a transport failure) and
    ``retry_after`` the wait its ``Retry-After`` asked for, if any."""

    def __init__(
        self,
        message: str,
        *,
        rule: Rule = rules.STORE_UNAVAILABLE,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, rule=rule)
        self.status = status
        self.retry_after = retry_after


class StoreAuthError(FatalError):
    """The store refused our credentials (HTTP 401/403)."""

    def __init__(self, message: str, *, rule: Rule = rules.STORE_AUTH) -> None:
        super().__init__(message, rule=rule)


class StoreRefused(FatalError):
    """The store refused a request for good: no other try, and no rerun of the same
    payload, can change its answer. ``fix`` says, in a line, what has to change."""

    def __init__(self, message: str, *, fix: str, rule: Rule = rules.STORE_REFUSED) -> None:
        super().__init__(message, rule=rule)
        self.fix = fix


class StoreNotFound(FatalError):
    """A path the runner needs is not in the store (HTTP 404 on a download)."""

    def __init__(self, message: str, *, rule: Rule = rules.STORE_NOT_FOUND) -> None:
        super().__init__(message, rule=rule)


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached the runner. BaseException so no ``except Exception`` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


class DeadlineExceeded(Exception):
    """The attempt's time ran out before the work finished."""


class IllegalEvent(Exception):
    """An event fired from a state that does not allow it. The machine is unchanged."""

    def __init__(self, state: str, event: str, allowed: list[str]) -> None:
        super().__init__(
            f"event {event!r} is not allowed in state {state!r}; "
            f"allowed: {', '.join(allowed) or 'none'}"
        )
        self.state = state
        self.event = event
        self.allowed = allowed


class AttemptBusy(Exception):
    """Another live runner holds this attempt's lock: it, not we, will write the marker.
    ``ended_by`` says what ended the wait: "busy" (too long), "interrupted", "deadline"."""

    def __init__(self, message: str, *, ended_by: str = "busy") -> None:
        super().__init__(message)
        self.ended_by = ended_by
