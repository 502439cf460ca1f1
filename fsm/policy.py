"""The failure policy: which failures are retried on a fresh host and which fail the run.

Rules are data. Each has a stable id (carried into the marker), the state where it
applies (``*`` for any), what it matches, and its class. ``classify`` walks the rules in
order and the first rule that claims the failure decides; the catch-all last rule makes
a failure nobody classified fatal, never silently retried.

A rule claims a failure when

* the failure is a typed error (``RetriableError``/``FatalError``) naming the rule's id:
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
from fsm.pip import NETWORK_SIGNATURES

ANY = "*"

#: How far down ``__cause__``/``__context__`` an HTTP status is looked for.
MAX_CHAIN = 16

AUTH_STATUSES: tuple[int, ...] = (401, 403)
UNAVAILABLE_STATUSES: tuple[int, ...] = (408, 429, *range(500, 600))


@dataclass(frozen=True)
class Rule:
    id: str
    where: str  # a state name, or ANY
    what: str  # what the rule matches, in words
    retriable: bool
    #: exception types this rule claims (in the states where it applies)
    matches: tuple[type[BaseException], ...] = ()
    #: HTTP statuses this rule claims on an untyped error or anywhere on its cause chain
    statuses: tuple[int, ...] = ()
    #: names of the pip output signatures (``fsm.pip.NETWORK_SIGNATURES``) behind the rule
    signatures: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return "retriable" if self.retriable else "fatal"

    def applies_in(self, state: str) -> bool:
        return self.where in (ANY, state)

    def claims(self, state: str, exc: BaseException) -> bool:
        """Whether this rule decides ``exc`` raised in ``state`` (order aside)."""
        if named_rule(exc) == self.id:
            return True
        if not self.applies_in(state):
            return False
        if self.matches and isinstance(exc, self.matches):
            return True
        if self.statuses and named_rule(exc) is None:
            return http_status(exc) in self.statuses
        return False


#: The success rule: recorded in the marker of a succeeded attempt.
SUCCESS_RULE = "completion-confirmed"
SUCCESS_WHAT = "`DONE` and `metrics.json` confirmed in the store, whatever the worker's exit code"

RULES: tuple[Rule, ...] = (
    Rule("interrupted", ANY, "SIGTERM or SIGINT reached the runner (host stop, preemption)",
         True, (Interrupted, KeyboardInterrupt)),
    Rule("deadline", ANY, "the attempt deadline passed: run wall deadline exceeded",
         False, (DeadlineExceeded,)),
    Rule("payload-invalid", "LoadPayload", "payload missing, unreadable or invalid (exit 2)",
         False, (PayloadError,)),
    Rule("store-auth", ANY, "store answered HTTP 401 or 403", False, (StoreAuthError,),
         statuses=AUTH_STATUSES),
    Rule("store-unavailable", ANY,
         "store: connection error, timeout, HTTP 408/429/5xx after bounded retries",
         True, (StoreUnavailable,), statuses=UNAVAILABLE_STATUSES),
    Rule("pip-network", "InstallExtras",
         "pip failed and its output shows a network failure, after 3 tries", True,
         signatures=tuple(sig.name for sig in NETWORK_SIGNATURES)),
    Rule("pip-failed", "InstallExtras",
         "pip failed otherwise (no such version, resolution or build error)", False),
    Rule("code-missing", "FetchCode", "the repo holds no code/ tree or no worker module",
         False, (StoreNotFound,)),
    Rule("store-not-found", ANY, "a path the runner needs is not in the store", False,
         (StoreNotFound,)),
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
    Rule("store-unsafe-link", ANY,
         "a store entry is a link that leaves the store's root, or a dangling link", False),
    Rule("worker-env-too-large", "ResolveSpec",
         "the worker's environment exceeds the kernel's exec limits (one variable over "
         "128 KiB, or the whole environment over ARG_MAX)", False),
    Rule("preload-unmounted", "Preload",
         "the weight cache is not mounted or its sentinel is missing", False),
    Rule("preload-model-failed", "Preload", "a model could not be warmed", False),
    Rule("internal-error", ANY,
         "a defect in the runner: a handler returned an event its state does not allow, a "
         "state has no handler, or Mark itself failed", False),
    Rule("unclassified", ANY, "anything else: exception type and message in the marker",
         False, (BaseException,)),
)

BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}
CATCH_ALL = RULES[-1]


def rule(rule_id: str) -> Rule:
    """The rule with this id; a KeyError names an id the policy lacks."""
    return BY_ID[rule_id]


def named_rule(exc: BaseException) -> str | None:
    """The id of the policy rule a typed error names, when the policy has that rule."""
    if isinstance(exc, FlashError):
        named = getattr(exc, "rule", None)
        if isinstance(named, str) and named in BY_ID:
            return named
    return None


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
    claims it. A typed error naming an id the policy lacks is matched like an untyped
    one (so a mistyped id ends fatal, never silently retried).
    """
    for candidate in RULES:
        try:
            if candidate.claims(state, exc):
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
    parts: list[str] = []
    if r is CATCH_ALL:
        parts.append("any exception")
    else:
        parts += [f"`{t.__name__}`" for t in r.matches]
    if r.statuses:
        parts.append(_statuses_text(r.statuses))
    if r.signatures:
        parts.append("pip output: " + ", ".join(f"`{name}`" for name in r.signatures))
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
        f"Success (rule `{SUCCESS_RULE}`): {SUCCESS_WHAT}.",
        "",
        "pip output signatures of a network failure (`pip-network`); a failed install whose",
        "output shows none of them is `pip-failed`:",
        "",
        "| signature | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{sig.name}` | {sig.meaning} |" for sig in NETWORK_SIGNATURES]
    return "\n".join(lines)
