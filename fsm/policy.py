"""The failure policy: which failures are retried on a fresh host and which fail the run.

Rules are objects (``fsm.rules``): each has a stable id (carried into the marker), the
state where it applies (``*`` for any), its class, its exit event and the run's exit
status. This module orders them and says what else each claims. ``classify`` walks the
rules in order and the first rule that claims the failure decides; the catch-all last
rule makes a failure nobody classified fatal, never silently retried.

A rule claims a failure when

* the failure is a typed error (``RetriableError``/``FatalError``) naming the rule:
  the handler that raised it knew the class (wherever it was raised); or, in a state
  where the rule applies,
* the failure is an instance of one of the rule's exception types; or
* the failure carries no known rule and an HTTP status on it or on its cause chain
  (``exc.response.status_code``, ``exc.status_code`` or ``exc.status``) is one of the
  rule's statuses: an untyped HTTP error is classified by its status in any state.

``flash-bootstrap policy`` prints this table; the README's failure section is generated
from it (``python -m fsm policy``) and a test proves it current.
"""

from __future__ import annotations

from typing import NamedTuple

from fsm import rules
from fsm.errors import (
    DeadlineExceeded,
    FlashError,
    Interrupted,
    PayloadError,
    StoreAuthError,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.pip import NETWORK_SIGNATURES
from fsm.rules import ANY, Rule

__all__ = ["ANY", "CATCH_ALL", "RULES", "SUCCESS", "Rule", "claim", "classify", "rule"]

#: How far down ``__cause__``/``__context__`` an HTTP status is looked for.
MAX_CHAIN = 16

AUTH_STATUSES: tuple[int, ...] = (401, 403)
UNAVAILABLE_STATUSES: tuple[int, ...] = (408, 429, *range(500, 600))


class Claim(NamedTuple):
    """What a rule claims besides the typed errors that name it."""

    #: exception types this rule claims (in the states where it applies)
    matches: tuple[type[BaseException], ...] = ()
    #: HTTP statuses this rule claims on an untyped error or anywhere on its cause chain
    statuses: tuple[int, ...] = ()
    #: names of the pip output signatures (``fsm.pip.NETWORK_SIGNATURES``) behind the rule
    signatures: tuple[str, ...] = ()


#: The rules in the order they are tried, each with what it claims.
_TABLE: tuple[tuple[Rule, Claim], ...] = (
    (rules.INTERRUPTED, Claim((Interrupted, KeyboardInterrupt))),
    (rules.DEADLINE, Claim((DeadlineExceeded,))),
    (rules.PAYLOAD_INVALID, Claim((PayloadError,))),
    (rules.STORE_AUTH, Claim((StoreAuthError,), AUTH_STATUSES)),
    (rules.STORE_UNAVAILABLE, Claim((StoreUnavailable,), UNAVAILABLE_STATUSES)),
    (rules.PIP_NETWORK, Claim(signatures=tuple(sig.name for sig in NETWORK_SIGNATURES))),
    (rules.PIP_FAILED, Claim()),
    (rules.CODE_MISSING, Claim((StoreNotFound,))),
    (rules.STORE_NOT_FOUND, Claim((StoreNotFound,))),
    (rules.SPEC_ABSENT, Claim()),
    (rules.SPEC_FETCH, Claim()),
    (rules.WORKER_LAUNCH, Claim((OSError,))),
    (rules.VERIFY_UNREADABLE, Claim()),
    (rules.WORKER_HEARTBEAT_RETRIABLE, Claim()),
    (rules.WORKER_UPLOAD_LOST, Claim()),
    (rules.WORKER_FAILED, Claim()),
    (rules.STORE_UNSAFE_LINK, Claim()),
    (rules.WORKER_ENV_TOO_LARGE, Claim()),
    (rules.PRELOAD_UNMOUNTED, Claim()),
    (rules.PRELOAD_MODEL_FAILED, Claim()),
    (rules.INTERNAL_ERROR, Claim()),
    (rules.UNCLASSIFIED, Claim((BaseException,))),
)

RULES: tuple[Rule, ...] = tuple(r for r, _ in _TABLE)
_CLAIMS: dict[Rule, Claim] = dict(_TABLE)
BY_ID: dict[str, Rule] = {r.id: r for r in RULES}
CATCH_ALL = rules.UNCLASSIFIED
SUCCESS = rules.SUCCESS


def rule(rule_id: str) -> Rule:
    """The rule with this id (a persisted marker names its rule by id); KeyError if none."""
    return SUCCESS if rule_id == SUCCESS.id else BY_ID[rule_id]


def claim(r: Rule) -> Claim:
    """What ``r`` claims besides the typed errors that name it."""
    return _CLAIMS[r]


def named_rule(exc: BaseException) -> Rule | None:
    """The rule of the policy a typed error names, if it names one."""
    if isinstance(exc, FlashError) and exc.rule in _CLAIMS:
        return exc.rule
    return None


def claims(r: Rule, state: str, exc: BaseException) -> bool:
    """Whether ``r`` decides ``exc`` raised in ``state`` (order aside)."""
    named = named_rule(exc)
    if named is r:
        return True
    if not r.applies_in(state):
        return False
    what = _CLAIMS[r]
    if what.matches and isinstance(exc, what.matches):
        return True
    if what.statuses and named is None:
        return http_status(exc) in what.statuses
    return False


def http_status(exc: BaseException) -> int | None:
    """The first HTTP status found on ``exc`` or down its ``__cause__``/``__context__``
    chain: ``.response.status_code``, ``.status_code`` or ``.status``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(current))
        status = _status_of(current)
        if status is not None:
            return status
        current = current.__cause__ if current.__cause__ is not None else current.__context__
    return None


def _status_of(exc: BaseException) -> int | None:
    candidates: list[object] = []
    try:
        candidates.append(getattr(getattr(exc, "response", None), "status_code", None))
        candidates.append(getattr(exc, "status_code", None))
        candidates.append(getattr(exc, "status", None))
    except Exception:  # a property that raises: no status to be had from this one
        return None
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def classify(state: str, exc: BaseException) -> Rule:
    """The rule that decides ``exc`` raised in ``state``: the first rule that claims it.

    Total: every exception gets a rule, and the catch-all (fatal) when nothing else
    claims it. A typed error naming a rule the policy lacks is matched like an untyped
    one (so it ends fatal, never silently retried).
    """
    for candidate in RULES:
        try:
            if claims(candidate, state, exc):
                return candidate
        except Exception:  # pragma: no cover - claims() only reads attributes
            continue
    return CATCH_ALL  # pragma: no cover - the catch-all claims every BaseException


# --- the printed table ------------------------------------------------------------------


def _statuses_text(statuses: tuple[int, ...]) -> str:
    plain = [str(s) for s in statuses if not 500 <= s <= 599]
    if all(s in statuses for s in range(500, 600)):
        plain.append("5xx")
    else:
        plain += [str(s) for s in statuses if 500 <= s <= 599]
    return "HTTP " + ", ".join(plain)


def _matched_by(r: Rule) -> str:
    what = _CLAIMS[r]
    parts: list[str] = []
    if r is CATCH_ALL:
        parts.append("any exception")
    else:
        parts += [f"`{t.__name__}`" for t in what.matches]
    if what.statuses:
        parts.append(_statuses_text(what.statuses))
    if what.signatures:
        parts.append("pip output: " + ", ".join(f"`{name}`" for name in what.signatures))
    return "; ".join(parts) or "raised by the state's handler"


def render_table() -> str:
    """The policy as Markdown (printed by ``flash-bootstrap policy``, pasted in the README).

    First match wins, top to bottom; a typed error naming a rule is decided by that rule.
    """
    lines = [
        "Rules are tried top to bottom; the first that claims the failure decides. An error",
        "raised by a state naming a rule is decided by that rule; otherwise a rule claims a",
        "failure in the states where it applies by its type, or an untyped error by the HTTP",
        "status on it or its cause chain. The last rule catches everything else: fatal.",
        "",
        "| rule | where | what | matched by | class |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{r.id}` | {'any' if r.where == ANY else r.where} | {r.what} | {_matched_by(r)} "
        f"| {r.verdict} |"
        for r in RULES
    ]
    lines += [
        "",
        f"Success (rule `{SUCCESS.id}`): {SUCCESS.what}.",
        "",
        "pip output signatures of a network failure (`pip-network`); a failed install whose",
        "output shows none of them is `pip-failed`:",
        "",
        "| signature | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{sig.name}` | {sig.meaning} |" for sig in NETWORK_SIGNATURES]
    return "\n".join(lines)
