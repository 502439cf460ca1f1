"""Whole attempts under generated fault plans: the real driver, states and local store, a
fault-injecting wrapper around the store, real worker processes, real signals.

A fault plan says which store call fails, how and how often, what the worker does, and
whether a signal arrives (from inside a store call, or sent by the worker to the runner).
A small model of the states says which policy rule must decide each plan and whether the
marker's commit lands; the invariants hold for every plan: at most one marker, published
once, in the last store call, its commit carrying the end-of-attempt artifacts with the
marker last; the outcome persisted next to the payload either way; the exit status a fact
about publishing (0/1/124 only when the marker landed, else 3 or 78, and running the payload
again then publishes the persisted outcome without redoing the work); ``ok`` iff
Succeeded; ``retriable`` iff FailedRetriable; the marker names the rule the policy gives
for the fault; a signal that stopped the worker or came before it ran gives retriable
unless completion was confirmed; a deadline gives fatal; success only after ``DONE`` and
``metrics.json`` were confirmed in the store; the canary token nowhere.
"""

from __future__ import annotations

import io
import json
import os
import signal
import tempfile
import threading
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal
from unittest import mock

import pytest
import structlog
from conftest import ARM, CANARY, PREFIX, REPO, Layout
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fsm import policy, table
from fsm.attempt import outcome, result
from fsm.attempt.runner import Outcome, run_attempt
from fsm.budget import Budget
from fsm.errors import (
    DeadlineExceeded,
    Interrupted,
    StoreAuthError,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.output import log
from fsm.payload import Destination
from fsm.store.base import Fence, Store, StoreStats, WarmOutcome, WarmStart
from fsm.store.local import LocalStore

MARKER = f"{ARM}_attempt0.json"
MARKER_PATH = f"{PREFIX}/{MARKER}"
CONSOLE_PATH = f"{PREFIX}/console_sft.txt"
#: The persisted result next to the payload (fsm.attempt.result.result_path).
RESULT = f".flash-{ARM}_attempt0.result.json"
IDENTITY = {"hf_repo": REPO, "hf_prefix": PREFIX, "run_id": "run-1", "mode": "train",
            "flash_arm": ARM, "attempt": 0}
#: How often Mark tries the marker's commit (``Publisher.publish``'s default).
MARKER_TRIES = 5
#: "upload_marker" is the commit of the end-of-attempt artifacts with the marker last.
#: (Periodic console tails, op "upload_file", need FLASH_UPLOAD_CONSOLE and a worker that
#: outlives the 5 s minimum interval: these plans make none, and check that they do not.)
STORE_OPS = ("fetch_folder", "download_file", "list_folder", "upload_marker")
HTTP_STATUSES = (400, 401, 403, 404, 408, 429, 500, 503)
KINDS_BY_OP: dict[str, tuple[str, ...]] = {
    # list_folder() answers an empty listing for a missing folder: no not-found there
    "fetch_folder": ("unavailable", "auth", "not-found", "deadline", "crash", "signal", "http"),
    "download_file": ("unavailable", "auth", "not-found", "deadline", "crash", "signal", "http"),
    "list_folder": ("unavailable", "auth", "deadline", "crash", "signal", "http"),
    "upload_marker": ("unavailable", "auth", "not-found", "deadline", "crash", "signal", "http"),
}



class InjectedHttpError(Exception):
    """An untyped HTTP error, shaped like huggingface_hub's: the status on ``.response``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.response = SimpleNamespace(status_code=status)


def make_exc(kind: str) -> BaseException:
    """The exception a fault of ``kind`` raises; its text carries the canary token."""
    text = f"injected {kind} fault (token {CANARY})"
    if kind == "unavailable":
        return StoreUnavailable(text)
    if kind == "auth":
        return StoreAuthError(text)
    if kind == "not-found":
        return StoreNotFound(text)
    if kind == "deadline":
        return DeadlineExceeded(text)
    if kind == "crash":
        return RuntimeError(text)
    if kind == "signal":
        return Interrupted(signal.SIGTERM)
    if kind.startswith("http-"):
        return InjectedHttpError(text, int(kind.removeprefix("http-")))
    raise AssertionError(kind)


# --- plans ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    op: str  # a store operation, or "upload_marker" (Mark's upload of the marker)
    nth: int  # the first call of ``op`` that fails (0-based)
    kind: str
    times: int  # consecutive calls of ``op`` that fail from ``nth`` on

    def hits(self, op: str, index: int) -> bool:
        return op == self.op and self.nth <= index < self.nth + self.times


Exit = int | Literal["SIGKILL", "interrupt-runner", "hang"]


@dataclass(frozen=True)
class Worker:
    uploads: Literal["both", "metrics", "done", "none"]
    local_metrics: bool  # writes <scratch>/metrics.json even when it uploads nothing
    heartbeat: tuple[bool, bool] | None  # (retriable, for this attempt)
    exit: Exit
    leak: bool  # prints the token and dies with it in its message

    @property
    def returncode_nonzero(self) -> bool:
        return self.exit != 0

    @property
    def wrote_local_metrics(self) -> bool:
        return self.local_metrics or self.uploads in ("both", "metrics")

    def script(self) -> str:
        lines = ["import signal"]
        if self.leak:
            lines += [
                "print('my token is ' + os.environ['HF_TOKEN'], flush=True)",
                "print('stderr token ' + os.environ['HF_TOKEN'], file=sys.stderr, flush=True)",
            ]
        if self.heartbeat is not None:
            retriable, same = self.heartbeat
            attempt = "int(os.environ['ATTEMPT'])" + ("" if same else " + 1")
            lines += [
                "beat = SCRATCH / 'hb.json'",
                f"beat.write_text(json.dumps({{'stage': 'train', 'ts': time.time(), "
                f"'attempt': {attempt}, 'retriable': {retriable}}}))",
                "upload(beat, 'heartbeat.json')",
            ]
        if self.uploads in ("both", "metrics"):
            lines.append("upload(write_metrics(), 'metrics.json')")
        elif self.local_metrics:
            lines.append("write_metrics()")
        if self.uploads in ("both", "done"):
            lines += ["(SCRATCH / 'DONE').write_text(str(time.time()))",
                      "upload(SCRATCH / 'DONE', 'DONE')"]
        if self.exit == "interrupt-runner":
            lines += ["os.kill(os.getppid(), signal.SIGTERM)", "time.sleep(60)"]
        elif self.exit == "hang":
            lines += ["print('training forever', flush=True)", "time.sleep(60)"]
        elif self.exit == "SIGKILL":
            lines.append("os.kill(os.getpid(), signal.SIGKILL)")
        elif self.leak and self.exit != 0:
            lines.append("raise SystemExit('failing with ' + os.environ['HF_TOKEN'])")
        else:
            lines.append(f"sys.exit({self.exit})")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Plan:
    worker: Worker
    spilled: bool  # the spec lives in the store (ResolveSpec downloads it)
    faults: tuple[Fault, ...] = ()


@st.composite
def faults(draw: st.DrawFn) -> Fault:
    op = draw(st.sampled_from(STORE_OPS))
    kind = draw(st.sampled_from(KINDS_BY_OP[op]))
    if kind == "http":
        kind = f"http-{draw(st.sampled_from(HTTP_STATUSES))}"
    # Mark's commit is tried as one series (the first try is call 0); elsewhere most calls
    # happen once or twice: the first is the likeliest target.
    nth = 0 if op == "upload_marker" else draw(st.sampled_from([0, 0, 0, 1, 2]))
    return Fault(op, nth, kind, draw(st.integers(1, 3)))


def workers(exits: st.SearchStrategy[Exit]) -> st.SearchStrategy[Worker]:
    return st.builds(
        Worker,
        uploads=st.sampled_from(["both", "metrics", "done", "none"]),
        local_metrics=st.booleans(),
        heartbeat=st.none() | st.tuples(st.booleans(), st.booleans()),
        exit=exits,
        leak=st.booleans(),
    )


FAULT_EXITS: st.SearchStrategy[Exit] = st.sampled_from([0, 0, 1, 3, 139, "SIGKILL",
                                                       "interrupt-runner"])


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    found = draw(st.lists(faults(), max_size=2, unique_by=lambda f: f.op))
    return Plan(draw(workers(FAULT_EXITS)), draw(st.booleans()), tuple(found))


# --- the model: which rule must decide a plan, and whether its marker lands ----------------


@dataclass(frozen=True)
class Expect:
    rule: str
    state: str
    landed: bool = True  # the marker's commit lands in the store
    marker_tries: int = 1  # commits of the marker Mark makes
    refused: bool = False  # the store refused the marker for good (no rerun can publish it)

    @property
    def ok(self) -> bool:
        return self.rule == policy.SUCCESS.id


class _Calls:
    """Replays the plan's faults against the store calls the states make, in order."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.count: Counter[str] = Counter()
        self.made: list[tuple[str, str]] = []  # (op, state)

    def take(self, op: str, state: str) -> str | None:
        index = self.count[op]
        self.count[op] += 1
        self.made.append((op, state))
        return next((f.kind for f in self.plan.faults if f.hits(op, index)), None)


def _escape(state: str, kind: str) -> Expect:
    """A fault that escapes its handler: the policy decides it."""
    return Expect(policy.classify(state, make_exc(kind)).id, state)


def model(plan: Plan) -> tuple[Expect, list[tuple[str, str]]]:
    """What must decide ``plan`` and whether its marker lands (mirroring the states and
    the publisher), and the store calls made before Mark."""
    calls = _Calls(plan)
    decided = _decide(plan, calls)
    landed, tries, refused = _marker_commit(plan)
    return replace(decided, landed=landed, marker_tries=tries, refused=refused), calls.made


def _marker_commit(plan: Plan) -> tuple[bool, int, bool]:
    """Whether Mark's one commit (end-of-attempt artifacts, the marker last) lands, after
    how many tries (fsm.attempt.publish._commit), and whether the store refused it for good."""
    fault = next((f for f in plan.faults if f.op == "upload_marker"), None)
    if fault is None or fault.kind == "signal":
        return True, 1, False  # a signal during Mark only sets the flag: the outcome stands
    if fault.kind == "unavailable":  # retried with backoff; a retry drops the console tail
        return fault.times < MARKER_TRIES, min(fault.times + 1, MARKER_TRIES), False
    # auth, not-found: refused for good, at once (exit 78); deadline: final at once;
    # untyped (crash, http): Mark fails and the driver keeps the persisted outcome. Those
    # two: exit 3. Either way no marker in the store.
    return False, 1, fault.kind in ("auth", "not-found")


def _decide(plan: Plan, calls: _Calls) -> Expect:
    if kind := calls.take("fetch_folder", table.FETCH_CODE):
        return _escape(table.FETCH_CODE, kind)
    if plan.spilled:
        kind = calls.take("download_file", table.RESOLVE_SPEC)
        if kind in ("unavailable", "not-found"):
            return Expect("spec-fetch", table.RESOLVE_SPEC)
        if kind:
            return _escape(table.RESOLVE_SPEC, kind)
    if plan.worker.exit == "hang":  # pragma: no cover - hanging workers are deadline plans
        return Expect("deadline", table.TRAIN)
    return _verify(plan, calls)


def _verify(plan: Plan, calls: _Calls) -> Expect:
    """VerifyRemote runs after a signal too: completion confirmed in the store outranks
    it; otherwise a worker the signal stopped is ``interrupted``, and a worker that had
    exited on its own before the signal is judged by its own exit."""
    verify = table.VERIFY_REMOTE
    w = plan.worker
    stopped = w.exit == "interrupt-runner"  # the worker's SIGTERM stopped it
    signalled = stopped

    def broke(kind: str) -> Expect:
        if signalled:  # whatever broke after a signal broke because of it
            return Expect("interrupted", verify)
        if kind in ("unavailable", "deadline"):  # the store, or verification's share of
            return Expect("verify-unreadable", verify)  # the end's time, ran out
        return _escape(verify, kind)

    kind = calls.take("list_folder", verify)  # one listing: DONE, metrics.json, heartbeat
    if kind == "signal":
        signalled = True  # the flag is set; verification goes on
    elif kind:
        return broke(kind)
    if w.uploads == "both":
        return Expect(policy.SUCCESS.id, verify)
    # The heartbeat is downloaded only when the listing shows one.
    kind = "not-found" if w.heartbeat is None else calls.take("download_file", verify)
    if kind == "signal":
        signalled, kind = True, None
    if kind not in (None, "not-found"):
        return broke(kind)
    if stopped:
        return Expect("interrupted", verify)
    if kind is None and w.heartbeat == (True, True):
        return Expect("worker-heartbeat-retriable", verify)
    if w.wrote_local_metrics:
        return Expect("worker-upload-lost", verify)
    return Expect("worker-failed", verify)


# --- the fault-injecting store ---------------------------------------------------------------


@dataclass
class Journal:
    """Every store call of the attempt, across every store the runner opened."""

    plan: Plan
    count: Counter[str] = field(default_factory=Counter)
    calls: list[dict[str, Any]] = field(default_factory=list)
    hang_at: int | None = None  # hang at this non-marker call until the watchdog fires
    #: That call by its op and its index among the calls of that op (the model's serial
    #: order: the code and a spilled spec download beside each other, in either order).
    hang: tuple[str, int] | None = field(init=False, default=None)
    released: threading.Event = field(default_factory=threading.Event)
    exit_codes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hang_at is not None:
            made = [op for op, _ in model(self.plan)[1]]
            if self.hang_at < len(made):
                op = made[self.hang_at]
                self.hang = (op, made[: self.hang_at].count(op))

    def hard_exit(self, code: int) -> None:
        """The watchdog's os._exit, in-process: record it and end the hung call."""
        self.exit_codes.append(code)
        self.released.set()

    @property
    def store_calls(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["op"] != "upload_marker"]

    @property
    def marker_commits(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["op"] == "upload_marker"]


class FaultyStore:
    """The real LocalStore, with the plan's faults injected at the planned calls."""

    def __init__(self, inner: LocalStore, journal: Journal) -> None:
        self.inner = inner
        self.journal = journal

    def describe(self) -> str:
        return self.inner.describe()

    def worker_env(self) -> Mapping[str, str]:
        return self.inner.worker_env()

    def _enter(self, op: str, path: str, **about: Any) -> dict[str, Any]:
        journal = self.journal
        if threading.current_thread().name == "lease":
            op = f"lease_{op}"  # the lease keeper's own calls: counted apart
        index = journal.count[op]
        journal.count[op] += 1
        call: dict[str, Any] = {"op": op, "path": path, "fault": None, **about}
        if journal.hang is not None and op != "upload_marker" and (
            (op, index) == journal.hang
        ):
            call["fault"] = "hang"
        journal.calls.append(call)
        if call["fault"] == "hang":
            # A call that never returns: only the watchdog's hard exit ends it.
            if not journal.released.wait(30):
                raise AssertionError("the watchdog never fired on a hung store call")
            raise SystemExit(124)
        kind = next((f.kind for f in journal.plan.faults if f.hits(op, index)), None)
        call["fault"] = kind
        if kind == "signal":
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the runner
        elif kind is not None:
            raise make_exc(kind)
        return call

    def commit(
        self, files: Mapping[str, Path], *, message: str, fence: Fence | None = None,
        optional: Collection[str] = (), delete: Collection[str] = (),
    ) -> bool:
        # The marker's commit (with the end-of-attempt artifacts), or a periodic tail.
        op = "upload_marker" if MARKER_PATH in files else "upload_file"
        call = self._enter(
            op,
            MARKER_PATH if op == "upload_marker" else ", ".join(files),
            files=list(files),
            fenced=fence is not None,
            deleted=list(delete),
        )
        call["landed"] = self.inner.commit(files, message=message, fence=fence,
                                            optional=optional, delete=delete)
        return bool(call["landed"])

    def exists(self, path_in_repo: str) -> bool:  # pragma: no cover - the runner lists
        call = self._enter("exists", path_in_repo)
        call["result"] = self.inner.exists(path_in_repo)
        return bool(call["result"])

    def list_folder(self, folder: str) -> frozenset[str]:
        call = self._enter("list_folder", folder)
        listed = self.inner.list_folder(folder)
        call["result"] = sorted(listed)
        return listed

    def changes(self, folder: str) -> dict[str, float]:
        call = self._enter("changes", folder)
        changed = self.inner.changes(folder)
        call["result"] = sorted(changed)
        return changed

    def head_time(self, until: float | None = None) -> float | None:
        call = self._enter("head_time", "")
        when = self.inner.head_time(until)
        call["result"] = when
        return when

    def download_file(self, path_in_repo: str, dest_dir: Path) -> Path:
        self._enter("download_file", path_in_repo)
        return self.inner.download_file(path_in_repo, dest_dir)

    def fetch_folder(self, folder: str, local_root: Path) -> int:
        self._enter("fetch_folder", folder)
        return self.inner.fetch_folder(folder, local_root)

    def warm_model(
        self, repo_id: str, cache_dir: Path, ignore_patterns: Sequence[str],
        on_start: WarmStart | None = None,
    ) -> WarmOutcome:  # pragma: no cover - train plans never warm
        self._enter("warm_model", repo_id)
        return self.inner.warm_model(repo_id, cache_dir, ignore_patterns, on_start)


# --- running a plan --------------------------------------------------------------------------


@contextmanager
def rendered_logs() -> Iterator[io.StringIO]:
    """Route structlog's real chain (redaction included) to a buffer for the block."""
    saved = structlog.get_config()
    buffer = io.StringIO()
    log.configure(buffer, json=True)
    try:
        yield buffer
    finally:
        structlog.configure(**saved)


@dataclass
class Ran:
    layout: Layout
    journal: Journal
    outcome: Outcome | None
    exit_code: int
    logs: str


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("FLASH_", "HF_"))}


#: Mark's backoff between tries of the marker's commit, shortened so a plan whose commit
#: fails three times costs milliseconds, not seconds (the tries and what they carry are
#: the real publisher's; the watchdog passes its own backoff and keeps it). Mark reads its
#: backoff from the store's settings (``retry_delays``), so that is what is shortened.
_real_delays = outcome.retry_delays
_quick_retries = mock.patch.object(
    outcome, "retry_delays", lambda environ: (0.01, _real_delays(environ)[1]))


def run_in_process(layout: Layout, journal: Journal) -> Ran:
    """One attempt of the payload in ``layout``, in this process, every store call
    through a FaultyStore over ``layout``'s local store."""

    def open_store(
        dest: Destination, budget: Budget, environ: Mapping[str, str], stats: StoreStats
    ) -> Store:
        return FaultyStore(LocalStore(layout.store, deadline=budget.deadline, stats=stats),
                           journal)

    outcome: Outcome | None = None
    with rendered_logs() as logs, open(layout.root / "stdout.bin", "ab") as out, _quick_retries:
        try:
            outcome = run_attempt(
                layout.settings(),
                _environ(),
                open_store=open_store,
                out_fd=out.fileno(),
                handle_signals=True,
                hard_exit=journal.hard_exit,
            )
            code = outcome.exit_code
        except SystemExit as exc:  # the hung call ended by the (in-process) hard exit
            code = int(exc.code or 0)
    return Ran(layout, journal, outcome, code, logs.getvalue())


@contextmanager
def attempt(
    plan: Plan, *, hang_at: int | None = None, **payload: Any
) -> Iterator[Ran]:
    """Lay out a fresh world, run one attempt of ``plan`` in-process, yield what happened."""
    with tempfile.TemporaryDirectory(prefix="flash-prop-") as tmp:
        layout = Layout(Path(tmp))
        for sub in ("store", "scratch", "runcode", "flash"):
            (layout.root / sub).mkdir()
        layout.write_worker(plan.worker.script())
        spec = json.dumps({"hf_prefix": PREFIX})
        if plan.spilled:
            layout.artifact("job_spec.json").parent.mkdir(parents=True, exist_ok=True)
            layout.artifact("job_spec.json").write_text(spec)
            payload.setdefault("job_spec_json", None)
            payload.setdefault("job_spec_in_hf", True)
        layout.write_payload(**payload)
        yield run_in_process(layout, Journal(plan, hang_at=hang_at))


# --- the invariants --------------------------------------------------------------------------


def _persisted(layout: Layout) -> dict[str, Any]:
    path = layout.payload_path.parent / RESULT
    assert path.is_file(), "the outcome is persisted next to the payload"
    record = json.loads(path.read_text())
    assert record["version"] == result.RESULT_VERSION
    assert record["identity"] == IDENTITY
    return record  # type: ignore[no-any-return]


def _check_one_marker_written_last(ran: Ran) -> tuple[dict[str, Any], bool]:
    """The outcome is persisted next to the payload; the runner's last store call is the
    marker's commit; every try of it is one must-land commit with the marker last (a retry
    carries nothing the first try did not); at most one lands, and then the store holds
    that one marker, newer than every other file of the run; when none lands the store
    holds no marker. Returns the marker and whether it landed."""
    layout, journal = ran.layout, ran.journal
    persisted = _persisted(layout)
    commits = journal.marker_commits
    assert commits, "the outcome was published (by Mark, or the watchdog when it fired)"
    assert journal.calls[-1] is commits[-1], "no store call came after the marker's commit"
    assert not [c for c in journal.calls if c["op"] == "upload_file"], (
        "no separate console-tail upload: the tail goes up in the marker's commit"
    )
    for call in commits:
        assert call["files"][-1] == MARKER_PATH and not call["fenced"]
    for retry in commits[1:]:
        assert set(retry["files"]) <= set(commits[0]["files"]), "a retry adds nothing"
    assert ("console_sft.txt" in persisted["artifacts"]) == (CONSOLE_PATH in commits[0]["files"])
    landed = [c for c in commits if c.get("landed")]
    assert landed in ([], commits[-1:]), "the marker landed at most once, on the last try"
    if not landed:
        assert layout.markers() == [], "no marker in the store when its commit never landed"
        return persisted["marker"], False
    assert [p.name for p in layout.markers()] == [MARKER]
    published = layout.marker()
    assert published is not None and published == persisted["marker"]
    # The tail is in the store iff it rode on the try that landed.
    assert layout.artifact("console_sft.txt").is_file() == (CONSOLE_PATH in landed[0]["files"])
    marker_path = layout.artifact(MARKER)
    for path in marker_path.parent.rglob("*"):
        if path.is_file():
            assert path.stat().st_mtime_ns <= marker_path.stat().st_mtime_ns, path
    return published, True


def expected_exit(marker: dict[str, Any], landed: bool, refused: bool = False) -> int:
    """CONTRACT section 2: 0, 1 (fatal) or 75 (retriable), 124 for the deadline, only when
    the marker landed; 3 when the outcome was decided and persisted but the marker could
    not be published; 78 when the store refused it for good."""
    if not landed:
        return 78 if refused else 3
    if marker["ok"]:
        return 0
    return 124 if marker["rule"] == "deadline" else 75 if marker["retriable"] else 1


def _check_canary_nowhere(ran: Ran) -> None:
    layout = ran.layout
    for path in layout.store.rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), f"token leaked into {path}"
    for path in [layout.scratch / MARKER, *layout.payload_path.parent.glob(".flash-*")]:
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), f"token leaked into {path}"
    for line in ran.logs.splitlines():
        assert CANARY not in json.dumps(json.loads(line), ensure_ascii=False), line
    if ran.outcome is not None:
        assert CANARY not in ran.outcome.reason


def _check_outcome_agrees_with_marker(
    ran: Ran, marker: dict[str, Any], landed: bool, refused: bool
) -> None:
    outcome = ran.outcome
    assert outcome is not None
    assert outcome.marker == marker
    assert marker["ok"] == (outcome.terminal == table.SUCCEEDED)
    assert marker["retriable"] == (outcome.terminal == table.FAILED_RETRIABLE)
    fatal = not marker["ok"] and not marker["retriable"]
    assert (outcome.terminal == table.FAILED_FATAL) == fatal
    assert ran.exit_code == expected_exit(marker, landed, refused)
    assert outcome.context.path[-1] == outcome.terminal
    assert outcome.context.path.count(table.MARK) == 1


def _check_success_was_confirmed(ran: Ran, marker: dict[str, Any]) -> None:
    if not marker["ok"]:
        return
    confirmed = {
        name
        for c in ran.journal.calls
        if c["op"] == "list_folder"
        for name in c.get("result", ())
    }
    assert {"DONE", "metrics.json"} <= confirmed
    assert ran.layout.artifact("DONE").is_file() and ran.layout.artifact("metrics.json").is_file()


def _check_signal_rule(ran: Ran, marker: dict[str, Any]) -> None:
    """A signal before the worker ran, or one that stopped the worker, ends the attempt
    retriable ``interrupted``, unless the worker's completion was confirmed after it."""
    plan = ran.journal.plan
    assert ran.outcome is not None
    before_worker = any(
        c["fault"] == "signal" and c["op"] in ("fetch_folder", "download_file")
        and not c["path"].endswith("heartbeat.json") and _joined(ran, c)
        for c in ran.journal.calls
    )
    stopped = plan.worker.exit == "interrupt-runner" and table.TRAIN in ran.outcome.context.path
    if before_worker:
        assert (marker["rule"], marker["retriable"]) == ("interrupted", True)
        assert marker["state"] in (table.FETCH_CODE, table.RESOLVE_SPEC)
    elif stopped and not marker["ok"]:
        assert (marker["rule"], marker["retriable"]) == ("interrupted", True)
        assert marker["state"] == table.VERIFY_REMOTE
    elif stopped:
        assert plan.worker.uploads == "both"


def _injected_and_escaped(ran: Ran, kind: str) -> bool:
    """A fault of ``kind`` fired in a store call of the work (not Mark's commit) whose
    outcome the attempt took."""
    return any(c["fault"] == kind and c["op"] != "upload_marker" and _joined(ran, c)
               for c in ran.journal.calls)


def _is_spec(call: dict[str, Any]) -> bool:
    return call["op"] == "download_file" and call["path"].endswith("job_spec.json")


def _joined(ran: Ran, call: dict[str, Any]) -> bool:
    """Whether the attempt took ``call``'s outcome. The spilled spec downloads beside the
    code (FetchCode starts it, ResolveSpec joins it): when FetchCode fails, ResolveSpec
    never runs, and whatever that download met is dropped, as in a serial run, where it
    is never made."""
    assert ran.outcome is not None
    return not _is_spec(call) or table.RESOLVE_SPEC in ran.outcome.context.path


def _decided_as(ran: Ran, expect: Expect) -> set[tuple[str, str]]:
    """The (rule, state) the marker may carry: the serial model's, and, when the spilled
    spec's download sent a signal, ``interrupted`` in FetchCode too: that download runs
    beside the code's, so its signal lands in either state."""
    allowed = {(expect.rule, expect.state)}
    if any(c["fault"] == "signal" and _is_spec(c) for c in ran.journal.calls):
        allowed.add(("interrupted", table.FETCH_CODE))
    return allowed


def _check_rerun_publishes_persisted(ran: Ran, marker: dict[str, Any]) -> None:
    """After exit 3, running the same payload again publishes the persisted outcome
    without redoing the work: the marker's commit is its only store call."""
    again = run_in_process(ran.layout, Journal(replace(ran.journal.plan, faults=())))
    assert [c["op"] for c in again.journal.calls] == ["upload_marker"]
    assert again.layout.marker() == marker
    assert again.exit_code == expected_exit(marker, True)
    assert again.outcome is not None and again.outcome.context.replayed is not None


def check_plan(plan: Plan) -> None:
    expect, _ = model(plan)
    with attempt(plan) as ran:
        marker, landed = _check_one_marker_written_last(ran)
        _check_outcome_agrees_with_marker(ran, marker, landed, expect.refused)
        _check_success_was_confirmed(ran, marker)
        _check_canary_nowhere(ran)
        assert ran.journal.exit_codes == [], "the watchdog fired in a run with no deadline"
        assert (marker["rule"], marker["state"]) in _decided_as(ran, expect), (
            marker["error"]
        )
        assert marker["ok"] == expect.ok
        assert (landed, len(ran.journal.marker_commits)) == (expect.landed, expect.marker_tries)
        if not marker["ok"]:
            assert marker["retriable"] == policy.rule(marker["rule"]).retriable
        _check_signal_rule(ran, marker)
        signalled = _injected_and_escaped(ran, "signal") or plan.worker.exit == "interrupt-runner"
        if _injected_and_escaped(ran, "deadline") and not signalled:
            # Work that runs out of time is fatal; VerifyRemote's store calls run out of
            # its share of the end of the attempt, which only says the store was not read.
            expected = ("verify-unreadable", True) if marker["state"] == table.VERIFY_REMOTE \
                else ("deadline", False)
            assert (marker["rule"], marker["retriable"]) == expected
        if not landed:
            _check_rerun_publishes_persisted(ran, marker)


# --- the properties --------------------------------------------------------------------------

_SUCCESS = Worker("both", False, None, 0, False)


@given(plans())
@example(Plan(_SUCCESS, spilled=False))
@example(Plan(Worker("both", False, None, 139, True), spilled=True))
@example(Plan(_SUCCESS, False, (Fault("list_folder", 0, "unavailable", 1),)))
@example(Plan(_SUCCESS, False, (Fault("upload_marker", 0, "signal", 1),)))
@example(Plan(_SUCCESS, False, (Fault("upload_marker", 0, "auth", 1),)))
@example(Plan(Worker("none", False, None, 1, True), False,
              (Fault("upload_marker", 0, "http-503", 1),)))
@example(Plan(Worker("none", True, None, "interrupt-runner", True), False))
@example(Plan(Worker("both", False, None, "interrupt-runner", False), False))
@example(Plan(Worker("none", False, (True, True), 1, False), True,
              (Fault("download_file", 1, "http-503", 1),)))
# The spilled spec downloads beside the code: what it meets when FetchCode fails is dropped.
@example(Plan(_SUCCESS, True, (Fault("fetch_folder", 0, "unavailable", 1),
                               Fault("download_file", 0, "deadline", 1))))
@example(Plan(_SUCCESS, True, (Fault("fetch_folder", 0, "auth", 1),
                               Fault("download_file", 0, "signal", 1))))
@example(Plan(_SUCCESS, True, (Fault("download_file", 0, "signal", 1),)))
def test_every_fault_plan_ends_with_one_marker_whose_rule_the_policy_gives(plan: Plan) -> None:
    """The outcome is persisted, then published by one commit with the marker last and the
    runner's last store call; its rule is the policy's for the injected fault; ok iff
    Succeeded; retriable iff FailedRetriable; the exit status is 0/1 only when the marker
    landed, else 3, or 78 when the store refused it for good (and a rerun publishes the
    persisted outcome without working again); a
    signal before the worker ran, or one that stopped it, is retriable unless completion
    was confirmed; an escaped deadline is fatal (in VerifyRemote: verify-unreadable, its
    share of the end ran out); success only after DONE and metrics.json
    were confirmed in the store; the token appears in no artifact, marker, log line or
    reason."""
    expect = model(plan)[0]
    event(f"rule {expect.rule}")
    event(f"marker {'landed' if expect.landed else 'not published'}")
    check_plan(plan)


# --- the deadline, on the real clock -------------------------------------------------------

#: A real deadline costs its wall time: a fifth of the profile's examples.
DEADLINE_EXAMPLES = max(4, settings().max_examples // 5)
DEADLINE_PAYLOAD: dict[str, Any] = {
    "max_wall_s": 1.5,
    "env": {"HF_TOKEN": CANARY, "FLASH_EXIT_RESERVE_S": "0.4", "FLASH_STOP_GRACE_S": "1"},
}


@st.composite
def deadline_plans(draw: st.DrawFn) -> tuple[Plan, int | None]:
    """A plan whose attempt is still working when the deadline arrives: the worker never
    ends, or one of the store calls the attempt makes never returns."""
    exits: st.SearchStrategy[Exit] = st.sampled_from([0, 1, "SIGKILL", "hang"])
    plan = Plan(draw(workers(exits)), draw(st.booleans()))
    if plan.worker.exit == "hang":
        return plan, None
    _, made = model(plan)
    return plan, draw(st.integers(0, len(made) - 1))


@settings(max_examples=DEADLINE_EXAMPLES)
@given(deadline_plans())
def test_the_deadline_anywhere_ends_the_attempt_fatally_with_one_deadline_marker(
    planned: tuple[Plan, int | None],
) -> None:
    """Wherever the attempt deadline finds the attempt (a worker that never ends, a store
    call that never returns), the one marker is fatal with rule ``deadline`` and the
    attempt ends with status 124."""
    plan, hang_at = planned
    _, made = model(plan)
    with attempt(plan, hang_at=hang_at, **DEADLINE_PAYLOAD) as ran:
        marker, landed = _check_one_marker_written_last(ran)
        assert landed
        assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "deadline")
        assert ran.exit_code == 124
        _check_canary_nowhere(ran)
        if any(c["fault"] == "hang" for c in ran.journal.calls):
            assert ran.journal.exit_codes == [124], "the watchdog ends a hung call"
            assert marker["state"] == made[hang_at or 0][1]
            assert marker["watchdog"] is True
        else:
            # The worker never ended (or, on a very slow host, the deadline came before
            # the planned hung call): the state that was working when it came decides.
            assert ran.outcome is not None
            _check_outcome_agrees_with_marker(ran, marker, landed, refused=False)
            assert marker["state"] == ran.outcome.context.path[-3]
            if hang_at is None:
                assert marker["state"] == table.TRAIN


# --- what the properties found -----------------------------------------------------------------

@pytest.mark.parametrize("times", [1, 2])
def test_a_signal_is_retriable_even_when_the_marker_commit_carrying_the_tail_fails_first(
    times: int,
) -> None:
    """Shrunk from the fault-plan property: the worker's SIGTERM reached the runner, then
    the first try(s) of the marker's commit, the console tail riding on it, failed; a
    retry lands, the marker still says ``interrupted`` and the status is 1."""
    plan = Plan(Worker("none", False, None, "interrupt-runner", False), False,
                (Fault("upload_marker", 0, "unavailable", times),))
    assert model(plan)[0] == Expect("interrupted", table.VERIFY_REMOTE, True, times + 1)
    check_plan(plan)
    with attempt(plan) as ran:
        commits = ran.journal.marker_commits
        assert CONSOLE_PATH in commits[0]["files"] and commits[0]["fault"] == "unavailable"
        assert commits[-1]["landed"] and ran.exit_code == 75


def test_the_deadline_is_fatal_deadline_even_when_the_marker_commit_carrying_the_tail_fails_first(
) -> None:
    """The same with the deadline: a worker stopped at the deadline, then the first try of
    the marker's commit (the one with the console tail) failing, must still give rule
    ``deadline`` and status 124 once a retry lands."""
    plan = Plan(Worker("none", False, None, "hang", False), False,
                (Fault("upload_marker", 0, "unavailable", 1),))
    with attempt(plan, **DEADLINE_PAYLOAD) as ran:
        marker, landed = _check_one_marker_written_last(ran)
        commits = ran.journal.marker_commits
        assert CONSOLE_PATH in commits[0]["files"] and commits[0]["fault"] == "unavailable"
        assert len(commits) == 2 and commits[1]["landed"]
        assert (marker["rule"], marker["state"], landed, ran.exit_code) == (
            "deadline", "Train", True, 124
        )


@pytest.mark.parametrize(
    ("worker", "rule"),
    [
        (Worker("both", False, None, 0, False), policy.SUCCESS.id),
        (Worker("none", False, None, 1, False), "worker-failed"),
    ],
    ids=["completed", "failed-on-its-own"],
)
def test_a_signal_during_verification_does_not_override_what_the_worker_did(
    worker: Worker, rule: str
) -> None:
    """Completion outranks a late signal, and a worker that exited on its own before the
    signal is judged by its own exit: a SIGTERM arriving while VerifyRemote asks the store
    for DONE changes neither."""
    plan = Plan(worker, False, (Fault("list_folder", 0, "signal", 1),))
    assert model(plan)[0].rule == rule
    check_plan(plan)
