"""The failure policy: which failures are retried on a fresh host and which fail the run.

Rules are data. Each has a stable id (carried into the marker), the state where it
applies (``*`` for any), what it matches, and its class. Handlers that know the class of a
failure raise ``RetriableError``/``FatalError`` naming a rule; anything else is matched
here by type, first match wins, and the catch-all last rule makes an unclassified
failure fatal, never silently retried.

``flash-bootstrap policy`` prints this table; the README's failure section is generated
from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsm.errors import (
    DeadlineExceeded,
    FlashError,
    Interrupted,
    PayloadError,
    StoreAuthError,
    StoreNotFound,
    StoreUnavailable,
)

ANY = "*"


@dataclass(frozen=True)
class Rule:
    id: str
    where: str  # a state name, or ANY
    what: str  # what the rule matches, in words
    retriable: bool
    #: exception types this rule claims when a handler raised one untyped by rule
    matches: tuple[type[BaseException], ...] = ()

    @property
    def verdict(self) -> str:
        return "retriable" if self.retriable else "fatal"


#: The success rule: recorded in the marker of a succeeded attempt.
SUCCESS_RULE = "completion-confirmed"

RULES: tuple[Rule, ...] = (
    Rule("interrupted", ANY, "SIGTERM or SIGINT reached the runner (host stop, preemption)",
         True, (Interrupted, KeyboardInterrupt)),
    Rule("deadline", ANY, "the attempt deadline passed: run wall deadline exceeded",
         False, (DeadlineExceeded,)),
    Rule("payload-invalid", "LoadPayload", "payload missing, unreadable or invalid (exit 2)",
         False, (PayloadError,)),
    Rule("store-auth", ANY, "store answered HTTP 401 or 403", False, (StoreAuthError,)),
    Rule("store-unavailable", ANY,
         "store: connection error, timeout, HTTP 408/429/5xx after bounded retries",
         True, (StoreUnavailable,)),
    Rule("pip-network", "InstallExtras",
         "pip failed and its output shows a network failure, after 3 tries", True),
    Rule("pip-failed", "InstallExtras",
         "pip failed otherwise (no such version, resolution or build error)", False),
    Rule("code-missing", "FetchCode", "the repo holds no code/ tree or no worker module",
         False, (StoreNotFound,)),
    Rule("spec-absent", "ResolveSpec", "neither an inline spec nor the spill flag", False),
    Rule("spec-fetch", "ResolveSpec", "the spilled spec could not be fetched", True),
    Rule("worker-launch", "Train", "the worker process could not be started", False, (OSError,)),
    Rule("verify-unreadable", "VerifyRemote", "the store could not be read while verifying",
         True),
    Rule("worker-heartbeat-retriable", "VerifyRemote",
         "no completion artifacts; the worker's heartbeat for this attempt says retriable",
         True),
    Rule("worker-upload-lost", "VerifyRemote",
         "the worker wrote local metrics.json but the store lacks the completion artifacts",
         True),
    Rule("worker-failed", "VerifyRemote", "the worker exited without completion artifacts",
         False),
    Rule("preload-unmounted", "Preload",
         "the weight cache is not mounted or its sentinel is missing", False),
    Rule("preload-model-failed", "Preload", "a model could not be warmed", False),
    Rule("unclassified", ANY, "anything else: exception type and message in the marker",
         False, (BaseException,)),
)

BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}


def rule(rule_id: str) -> Rule:
    """The rule with this id; a KeyError names an id the policy lacks."""
    return BY_ID[rule_id]


def classify(state: str, exc: BaseException) -> Rule:
    """The rule that decides ``exc`` raised in ``state``.

    A typed ``FlashError`` names its rule; its class must agree with the rule's class (a
    mismatch is a bug, and the conservative answer is the rule's). Anything else is
    matched by type against the rules that apply to ``state``, first match wins.
    """
    if isinstance(exc, FlashError) and exc.rule in BY_ID:
        return BY_ID[exc.rule]
    for candidate in RULES:
        if candidate.where not in (ANY, state):
            continue
        if candidate.matches and isinstance(exc, candidate.matches):
            return candidate
    return BY_ID["unclassified"]  # pragma: no cover - the catch-all matches BaseException


def render_table() -> str:
    """The policy as a Markdown table (printed by ``flash-bootstrap policy``)."""
    lines = [
        "| rule | where | what | class |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{r.id}` | {r.where} | {r.what} | {r.verdict} |" for r in RULES]
    return "\n".join(lines)
