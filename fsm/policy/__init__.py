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

``flash-bootstrap policy`` prints this table; ``docs/policy.md`` carries it, generated
(``python -m fsm.ops.diagram --doc docs/policy.md``), and a test proves it current.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from fsm import rules
from fsm.errors import (
    DeadlineExceeded,
    FlashError,
    Interrupted,
    PayloadError,
    StoreAuthError,
    StoreNotFound,
    StoreRefused,
    StoreUnavailable,
    causes,
)
from fsm.policy import families, signatures
from fsm.rules import ANY, AUTH_STATUSES, TRANSIENT_STATUSES, Rule

__all__ = ["ANY", "CATCH_ALL", "RULES", "SUCCESS", "Rule", "claim", "classify", "rule"]



class Claim(NamedTuple):
    """What a rule claims besides the typed errors that name it."""

    #: exception types this rule claims (in the states where it applies)
    matches: tuple[type[BaseException], ...] = ()
    #: HTTP statuses this rule claims on an untyped error or anywhere on its cause chain
    statuses: tuple[int, ...] = ()
    #: names of the pip output signatures (``fsm.policy.signatures.PIP_NETWORK``) behind the rule
    signatures: tuple[str, ...] = ()
    #: ids of the worker console signatures (``CONSOLE_SIGNATURES``) behind the rule
    console: tuple[str, ...] = ()


# --- the worker's console: host faults and the job's own faults -----------------------

#: The console's rows and its verdict live in ``fsm.policy.families``; the policy decides with them.
ConsoleMatch = signatures.Match
CONSOLE_SIGNATURES = families.CONSOLE_SIGNATURES
CONSOLE_WINDOW_LINES = families.CONSOLE_WINDOW_LINES
HOST_XIDS = families.HOST_XIDS
console_verdict = families.console_verdict


class WorkerFacts(NamedTuple):
    """What is known of a worker that ended without its completion artifacts."""

    #: its own heartbeat for this attempt says ``retriable: true`` (its verdict wins)
    heartbeat_retriable: bool = False
    #: it wrote metrics.json locally, but the store lacks the completion artifacts
    upload_lost: bool = False
    #: the memory cgroup's ``oom_kill`` count rose while it ran
    oom_killed: bool = False
    #: its console's tail, redacted
    console: str = ""
    #: the runner stopped it: no progress for FLASH_STALL_S (its exit was not its own)
    stalled: bool = False
    #: the GPUs changed since the start (a GPU gone or out of reach, new uncorrectable ECC)
    gpus_changed: bool = False
    #: the job's own CUDA_VISIBLE_DEVICES names no GPU the host has
    env_hides_gpus: bool = False
    #: nvidia-smi answered before setup and after the worker died, every GPU the same
    gpus_fine: bool = False
    #: a scratch or cache filesystem was already short of space before setup
    disk_short_at_start: bool = False


def judge_worker(facts: WorkerFacts) -> tuple[Rule, ConsoleMatch | None]:
    """The rule for a worker without completion artifacts, and the console line that
    decided (or, for ``worker-failed``, the job fault it showed), if any. (The previous
    attempt is evidence too: ``across_attempts`` applies it to this verdict.)

    A worker the runner stopped as stalled did not end on its own: its heartbeat and its
    local metrics.json describe an attempt that never finished. What stalled it decides
    when something shows it (a kernel OOM kill of one of its processes; a host or a job
    fault in its console: one rank's CUDA OOM leaves the others waiting); otherwise the
    stall does."""
    if facts.heartbeat_retriable and not facts.stalled:
        return rules.WORKER_HEARTBEAT_RETRIABLE, None
    if facts.upload_lost and not facts.stalled:
        return rules.WORKER_UPLOAD_LOST, None
    if facts.oom_killed:
        return rules.WORKER_OOM_KILLED, None
    if _host_evidence(facts, None) == "host":  # the GPUs know better than the console
        return rules.WORKER_HOST_FAULT, None
    match = console_verdict(facts.console)
    if match is not None and _the_hosts(match, facts):
        return rules.WORKER_HOST_FAULT, match
    if match is None and facts.stalled:
        return rules.WORKER_STALLED, None
    return rules.WORKER_FAILED, match


#: Console rows that say CUDA sees no GPU: the job's own doing too, when the GPUs are fine.
NO_GPU_SIGNATURES = frozenset(
    {"cuda-no-gpus", "cuda-no-device", "cuda-unknown-init", "nvml-no-devices"})


class Evidence(NamedTuple):
    """A row of the policy where the host's own evidence decides beside the console."""

    #: the console rows it applies to (empty: whatever the console says, or nothing)
    console: frozenset[str]
    #: the ``WorkerFacts`` field that must be true for the row to apply ("" always)
    fact: str
    #: the evidence, in words
    when: str
    #: ``host`` (``worker-host-fault``, retriable) or ``job`` (``worker-failed``, fatal)
    verdict: str
    why: str

    def applies(self, facts: WorkerFacts, match: ConsoleMatch | None) -> bool:
        if self.console and (match is None or match.signature.id not in self.console):
            return False
        return not self.fact or getattr(facts, self.fact) is True


#: How the GPUs' answers and the host's own facts decide beside the console (issue 24):
#: the first row that applies decides (``_host_evidence``); ``render_table`` prints them.
HOST_EVIDENCE: tuple[Evidence, ...] = (
    Evidence(frozenset(), "gpus_changed",
             "the GPUs changed since before setup: a GPU gone or out of NVML's reach, "
             "or new uncorrectable ECC errors (asked again after the worker died)", "host",
             "a sick GPU makes any job fail, in words of the job's own (an ECC error "
             "surfacing as a CUDA OOM, kubernetes/k8s-device-plugin#267): the GPUs win"),
    Evidence(NO_GPU_SIGNATURES, "env_hides_gpus",
             "the job's own `CUDA_VISIBLE_DEVICES` (payload `env`) names no GPU the host has",
             "job", "the job hid the GPUs from itself: it would on any host"),
    Evidence(NO_GPU_SIGNATURES, "gpus_fine",
             "nvidia-smi answered before setup and after the worker died, every GPU the same",
             "job", "the GPUs were there and fine: something inside the job hid them (a "
             "scheduler's own placement, ray-project/ray#37225)"),
    Evidence(frozenset({"disk-full"}), "disk_short_at_start",
             "a filesystem of the scratch, code, payload or cache directory "
             "had less than `FLASH_STORAGE_FLOOR_BYTES` (256 MiB) or no inode free before "
             "setup, as for the runner's own writes (`host-storage`)", "host",
             "the host came full (a previous tenant's files): a fresh host has the space"),
    Evidence(frozenset({"disk-full"}), "", "otherwise (the filesystems had room before "
             "setup, or are unknown)", "job", "the attempt wrote the disk full; a fresh host "
             "of the same kind has the same disk"),
    Evidence(frozenset({"shm-exhausted"}), "",
             "always; the marker's `shm` evidence gives /dev/shm's size", "job",
             "/dev/shm is the container's configuration (Docker's default is 64 MiB), "
             "the same on every host the run is sent to, or the job's own use: a fresh host "
             "changes nothing (13 of 15 threads of the corpus settled it so)"),
    Evidence(frozenset({"nccl-timeout"}), "", "no host row matched", "job", "by Meta's "
             "account most collective timeouts start on the CPU side: a rank that stopped "
             "calling the collective (every such thread of the corpus settled it in the job)"),
    Evidence(frozenset({"cuda-driver-too-old", "cuda-forward-compat"}), "", "always", "host",
             "the hosts of a rented fleet differ in driver; a fresh host may have a newer one "
             "(10 of 12 threads of the corpus settled it as the host's driver), and "
             "`fault-follows-job` ends a job whose image needs a driver no host has"),
)


def _host_evidence(facts: WorkerFacts, match: ConsoleMatch | None) -> str | None:
    """The verdict of the first ``HOST_EVIDENCE`` row that applies: ``host``, ``job``, or
    None when none does. Without a console match only the rows for any console apply."""
    return next((row.verdict for row in HOST_EVIDENCE if row.applies(facts, match)), None)


def _the_hosts(match: ConsoleMatch, facts: WorkerFacts) -> bool:
    """Whether a console row's fault is the host's, the host's own evidence considered."""
    verdict = _host_evidence(facts, match)
    return match.signature.retriable if verdict is None else verdict == "host"


# --- across attempts: a fault that follows the job is the job's (CONTRACT section 9) -----


class Fault(NamedTuple):
    """What a failed marker says of its cause (``fault``): the rule, the class of cause,
    what identifies this occurrence across hosts, and the strongest witness."""

    rule: str
    family: str
    fingerprint: str
    #: ``gpus``, ``console``, ``worker`` or ``runner``
    confirmed_by: str

    def evidence(self) -> dict[str, str]:
        return self._asdict()


class Previous(NamedTuple):
    """The previous attempt's marker, as far as it is evidence."""

    run_id: str | None
    retriable: bool
    #: its ``host.id``
    host_id: str | None
    fault: Fault | None


class Across(NamedTuple):
    """A row of the policy across attempts: when it applies, this attempt's verdict."""

    when: str
    #: ``stands`` (this attempt's own verdict stands) or ``job`` (fatal, the job's)
    verdict: str
    why: str


#: The rows across attempts, in order; the first that applies decides (``across_attempts``).
ACROSS_ATTEMPTS: tuple[Across, ...] = (
    Across("no previous attempt, or its marker is missing, unreadable, of another run or "
           "not a failure", "stands", "no evidence: nothing is known of the earlier host"),
    Across("this attempt's fault is fatal already, or not a worker's (the store, a signal, "
           "the deadline, the payload), or the worker's own verdict (its heartbeat says "
           "retriable)", "stands", "only a worker's fault can follow the job, and a worker "
           "that judged its own failure knows it better than a comparison of two attempts"),
    Across("the GPUs confirm this attempt's fault (`confirmed_by: gpus`)", "stands",
           "a GPU that reports a fault is the host's, however often hosts fail"),
    Across("the previous attempt's fault has another `fingerprint`", "stands",
           "two different faults say nothing of each other"),
    Across("the previous attempt ran on a host with the same `id`, or either `id` is "
           "unknown", "stands", "a fault that stayed with its host is the host's"),
    Across("otherwise: the same fault, witnessed by the console or the worker alone, on "
           "another host", "job", "it followed the job to a fresh host: the job's "
           "(`worker-stalled-again` for a stall, `fault-follows-job` for the rest)"),
)


def across_attempts(rule: Rule, fault: Fault, host_id: str | None, run_id: str | None,
                    previous: Previous | None) -> tuple[Rule, int]:
    """This attempt's rule, the previous attempt considered, and the index of the
    ``ACROSS_ATTEMPTS`` row that decided."""
    if (previous is None or previous.fault is None or not previous.retriable
            or (run_id is not None and previous.run_id != run_id)):
        return rule, 0
    if (not rule.retriable or fault.confirmed_by not in ("console", "worker")
            or rule is rules.WORKER_HEARTBEAT_RETRIABLE):
        return rule, 1 if fault.confirmed_by != "gpus" else 2
    if previous.fault.fingerprint != fault.fingerprint:
        return rule, 3
    if same_host(host_id, previous.host_id) is not False:
        return rule, 4
    follows = rules.WORKER_STALLED_AGAIN if rule is rules.WORKER_STALLED else \
        rules.FAULT_FOLLOWS_JOB
    return follows, 5


def previous_of(marker: object) -> Previous | None:
    """A marker read from the store as evidence: None unless it is a failed attempt's
    marker whose ``fault`` is well formed (anything else is no evidence)."""
    if not isinstance(marker, dict) or marker.get("ok") is not False:
        return None
    fault, host = marker.get("fault"), marker.get("host")
    if not isinstance(fault, dict) or not all(
            isinstance(fault.get(key), str) for key in Fault._fields):
        return None
    host_id = host.get("id") if isinstance(host, dict) else None
    run_id = marker.get("run_id")
    return Previous(run_id if isinstance(run_id, str) else None,
                    marker.get("retriable") is True,
                    host_id if isinstance(host_id, str) else None,
                    Fault(*(str(fault[key]) for key in Fault._fields)))


def same_host(one: str | None, other: str | None) -> bool | None:
    """Whether two ``host.id`` values name the same machine; None when they cannot tell
    (either is unknown, or one names the GPUs and the other the boot:
    ``fsm.host.probe.host_id``)."""
    if not one or not other or one.startswith("boot:") is not other.startswith("boot:"):
        return None
    return one == other


#: The family and the witness of each rule's failure when no console line or GPU change
#: names them (``fault_of``).
_RULE_FAMILY: dict[str, tuple[str, str]] = {
    rules.WORKER_STALLED.id: ("stall", "worker"),
    rules.WORKER_STALLED_AGAIN.id: ("stall", "worker"),
    rules.WORKER_HEARTBEAT_RETRIABLE.id: ("worker-verdict", "worker"),
    rules.WORKER_FAILED.id: ("job", "worker"),
    rules.FAULT_FOLLOWS_JOB.id: ("job", "worker"),
    rules.WORKER_OOM_KILLED.id: ("job-host-oom", "worker"),
    rules.WORKER_UPLOAD_LOST.id: ("store", "runner"),
    rules.HOST_GPU_MISSING.id: ("gpu-missing", "gpus"),
    rules.HOST_GPU_UNHEALTHY.id: ("gpu-unhealthy", "gpus"),
    rules.HOST_GPU_UNRESPONSIVE.id: ("gpu-unresponsive", "gpus"),
    rules.HOST_GPU_BUSY.id: ("gpu-busy", "gpus"),
    rules.HOST_GPU_LOST.id: ("gpu-lost", "gpus"),
}


def fault_of(rule: Rule, match: ConsoleMatch | None = None, *, gpus_changed: bool = False,
             place: str | None = None) -> Fault:
    """The ``fault`` a failed marker carries: from the console line that decided, the
    GPUs' change, a stall's place, or the rule alone."""
    if gpus_changed:
        return Fault(rule.id, "gpu-change", f"gpu-change: {rule.id}", "gpus")
    if match is not None:
        return Fault(rule.id, match.signature.family, families.fingerprint(match), "console")
    family, witness = _RULE_FAMILY.get(rule.id, (rule.id, "runner"))
    return Fault(rule.id, family, f"{family}: {rule.id if place is None else place}", witness)


#: The rules in the order they are tried.
RULES: tuple[Rule, ...] = (
    rules.INTERRUPTED, rules.DEADLINE, rules.PAYLOAD_INVALID, rules.SUPERSEDED,
    rules.HOST_GPU_MISSING, rules.HOST_GPU_UNHEALTHY, rules.HOST_GPU_UNRESPONSIVE,
    rules.HOST_GPU_BUSY, rules.HOST_STORAGE, rules.HOST_STORAGE_FILLED,
    rules.STORE_AUTH, rules.STORE_REFUSED, rules.STORE_UNAVAILABLE,
    rules.PIP_NETWORK, rules.PIP_FAILED, rules.CODE_MISSING, rules.STORE_NOT_FOUND,
    rules.SPEC_ABSENT, rules.SPEC_FETCH, rules.WORKER_LAUNCH, rules.VERIFY_UNREADABLE,
    rules.WORKER_HEARTBEAT_RETRIABLE, rules.WORKER_UPLOAD_LOST, rules.WORKER_OOM_KILLED,
    rules.WORKER_HOST_FAULT, rules.HOST_GPU_LOST, rules.WORKER_STALLED,
    rules.WORKER_STALLED_AGAIN, rules.FAULT_FOLLOWS_JOB, rules.WORKER_FAILED,
    rules.STORE_UNSAFE_LINK, rules.WORKER_ENV_TOO_LARGE, rules.PRELOAD_UNMOUNTED,
    rules.PRELOAD_MODEL_FAILED, rules.INTERNAL_ERROR, rules.UNCLASSIFIED,
)
#: What each rule claims besides the typed errors that name it (a rule not listed: nothing).
_CLAIMS: dict[Rule, Claim] = dict.fromkeys(RULES, Claim()) | {
    rules.INTERRUPTED: Claim((Interrupted, KeyboardInterrupt)),
    rules.DEADLINE: Claim((DeadlineExceeded,)),
    rules.PAYLOAD_INVALID: Claim((PayloadError,)),
    rules.STORE_AUTH: Claim((StoreAuthError,), AUTH_STATUSES),
    rules.STORE_REFUSED: Claim((StoreRefused,)),
    rules.STORE_UNAVAILABLE: Claim((StoreUnavailable,), TRANSIENT_STATUSES),
    rules.PIP_NETWORK: Claim(signatures=tuple(sig.name for sig in signatures.PIP_NETWORK)),
    rules.CODE_MISSING: Claim((StoreNotFound,)),
    rules.STORE_NOT_FOUND: Claim((StoreNotFound,)),
    rules.WORKER_LAUNCH: Claim((OSError,)),
    rules.WORKER_HOST_FAULT: Claim(console=tuple(s.id for s in CONSOLE_SIGNATURES if s.retriable)),
    rules.WORKER_FAILED: Claim(console=tuple(s.id for s in CONSOLE_SIGNATURES if not s.retriable)),
    rules.UNCLASSIFIED: Claim((BaseException,)),
}
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
    named, what = named_rule(exc), _CLAIMS[r]
    return named is r or (r.applies_in(state) and (
        isinstance(exc, what.matches)
        or (named is None and bool(what.statuses) and http_status(exc) in what.statuses)))


def http_status(exc: BaseException) -> int | None:
    """The first HTTP status found on ``exc`` or down its ``__cause__``/``__context__``
    chain: ``.response.status_code``, ``.status_code`` or ``.status``."""
    return next(filter(None, map(_status_of, causes(exc))), None)


def _status_of(exc: BaseException) -> int | None:
    try:
        candidates = (getattr(getattr(exc, "response", None), "status_code", None),
                      getattr(exc, "status_code", None), getattr(exc, "status", None))
    except Exception:  # a property that raises: no status to be had from this one
        return None
    return next((value for value in candidates if isinstance(value, int)
                 and not isinstance(value, bool) and 100 <= value <= 599), None)


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
    """The statuses in words: the whole 5xx range as ``5xx``."""
    every_5xx = set(range(500, 600)) <= set(statuses)
    shown = [str(s) for s in statuses if not (every_5xx and 500 <= s <= 599)]
    return "HTTP " + ", ".join([*shown, "5xx"] if every_5xx else shown)


def _matched_by(r: Rule) -> str:
    what = _CLAIMS[r]
    parts = ["any exception"] if r is CATCH_ALL else [f"`{t.__name__}`" for t in what.matches]
    if what.statuses:
        parts.append(_statuses_text(what.statuses))
    parts += [f"{witness}: " + ", ".join(f"`{name}`" for name in names) for witness, names in
              (("pip output", what.signatures), ("worker console", what.console)) if names]
    return "; ".join(parts) or "raised by the state's handler"


def _cell(text: str) -> str:
    """``text`` inside a Markdown table cell (a bare ``|`` would end the cell)."""
    return text.replace("|", "\\|")


def _table(columns: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> list[str]:
    """A Markdown table: the header, its rule, a line per row."""
    lines = [f"| {' | '.join(cells)} |" for cells in (columns, *rows)]
    return [lines[0], "|---" * len(columns) + "|", *lines[1:]]


def render_table() -> str:
    """The policy as Markdown (printed by ``flash-bootstrap policy``, generated into
    ``docs/policy.md``).

    First match wins, top to bottom; a typed error naming a rule is decided by that rule.
    """
    network = ("signature", "meaning")
    return "\n".join([
        "Rules are tried top to bottom; the first that claims the failure decides. An error",
        "raised by a state naming a rule is decided by that rule; otherwise a rule claims a",
        "failure in the states where it applies by its type, or an untyped error by the HTTP",
        "status on it or its cause chain. The last rule catches everything else: fatal.",
        "",
        *_table(("rule", "where", "what", "matched by", "class"), (
            (f"`{r.id}`", "any" if r.where == ANY else r.where, r.what, _matched_by(r), r.verdict)
            for r in RULES)),
        "",
        f"Success (rule `{SUCCESS.id}`): {SUCCESS.what}.",
        "",
        "Installer output signatures of a network failure (`pip-network`): pip's when pip ran,",
        "uv's when uv did (`FLASH_INSTALLER`, docs/running.md, \"Extra packages\"); a failed",
        "install whose output shows none of them is `pip-failed`. pip (console and verbose",
        "log):",
        "",
        *_table(network, ((f"`{sig.name}`", sig.meaning) for sig in signatures.PIP_NETWORK)),
        "",
        "uv (`uv pip install`, its console):",
        "",
        *_table(network, ((f"`{sig.name}`", sig.meaning) for sig in signatures.UV_NETWORK)),
        "",
        "Worker console signatures (`fsm.policy.families`), matched in the last "
        f"{CONSOLE_WINDOW_LINES} lines of the redacted console of a worker",
        "that ended without completion artifacts, without a retriable heartbeat, a lost",
        "upload or an OOM kill. A `job` row anywhere in those lines wins (fatal, the job's",
        "own fault, on any host); otherwise the last line matching a host row decides",
        "(`worker-host-fault`, retried on a fresh host); a weak row (`nccl-timeout`, a",
        "consequence) decides only when no other row matches, and the last row",
        "(`gpu-stack-error`, the GPU stack's error in words no row names) only when no row",
        "matches at all. Where the words could be the",
        "host's or the job's, the row is retriable: the next attempt ends a fault that",
        "follows the job (`fault-follows-job`, below). The marker's `host_fault` (or",
        "`job_fault`) evidence names the row and the line, and its `fault` the family and the",
        "fingerprint. The host's own evidence then decides beside the console as the table",
        "after this one says.",
        "",
        *_table(("signature", "family", "blame", "pattern", "meaning", "class", "sources"), (
            (f"`{sig.id}`", sig.family, sig.blame, f"`{_cell(sig.pattern)}`", sig.meaning,
             "retriable" if sig.retriable else "fatal", ", ".join(map(_source, sig.sources)))
            for sig in (*CONSOLE_SIGNATURES, families.GPU_STACK_ERROR))),
        "",
        "The host's own evidence beside the console (CONTRACT section 8), in this order; the",
        "first row that applies decides:",
        "",
        *_table(("when", "console", "verdict", "why"), (
            (_cell(row.when), ", ".join(f"`{i}`" for i in sorted(row.console)) or "any",
             "`worker-host-fault`, retriable" if row.verdict == "host"
             else "`worker-failed`, fatal", _cell(row.why))
            for row in HOST_EVIDENCE)),
        "",
        "Across attempts (CONTRACT section 9): the previous attempt's marker",
        "(`<arm>_attempt<N-1>.json`, read once within verification's budget) beside this",
        "attempt's retriable verdict, in this order; the first row that applies decides:",
        "",
        *_table(("when", "verdict", "why"), (
            (_cell(row.when), "this attempt's own" if row.verdict == "stands"
             else "`fault-follows-job` (`worker-stalled-again` for a stall), fatal",
             _cell(row.why))
            for row in ACROSS_ATTEMPTS)),
    ])


#: What NVIDIA's reference pages are called in the table.
_DOCUMENTS = {
    families.CUDA_ERRORS: "CUDA error codes",
    families.XID_CATALOGUE: "Xid catalogue",
    families.NVML_API: "NVML return codes",
    families.NCCL_ERRORS: "NCCL troubleshooting",
}


def _source(url: str) -> str:
    """A link as a short name: ``owner/repo#n`` for a thread, the page's name for a document."""
    parts = url.removeprefix("https://").split("/")
    if parts[0] == "github.com" and len(parts) >= 5:
        return f"[{parts[1]}/{parts[2]}#{parts[4]}]({url})"
    return f"[{_DOCUMENTS.get(url, parts[-1] or parts[-2])}]({url})"
