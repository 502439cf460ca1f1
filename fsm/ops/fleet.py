"""The operator's view of the fleet: ``flash-bootstrap status`` and ``flash-bootstrap explain``.

Both read what the runners left under one run's prefix, through the runner's own store
calls (:func:`fsm.store.open_store`: bounded, retried, classified), on either store:

* ``status`` lists the prefix once (one ``list_tree``) and downloads each attempt
  marker found directly in it (``<arm>_attempt<N>.json``): arm, attempt, outcome, class,
  rule, age, end state and run id, as a table or as JSON. An attempt with a lease and no
  marker (``<arm>_attempt<N>.lease.json``, CONTRACT section 10) is a row too, judged by
  :mod:`fsm.attempts`: ``running``, ``lost`` or ``unknown``, the lease's state, its age by
  the store's clock and its host; lost and unknown ones get a line under the table (since
  when, or why). Only then does it list the prefix with its change times (``changes``)
  and read each such lease once (and the repo's ``head_time`` at most twice);
* ``explain`` shows one attempt: its marker, the policy row that decided it, the last
  lines of the console tail uploaded under the prefix, and its path on the machine.

Nothing here writes to the store. Everything printed passes through a redactor that
knows the token, although the store's content was redacted when it was uploaded and the
store's error texts never carry the token.

Exit status: 0 shown (an unreadable marker is shown as such); 1 the store failed
(unavailable, refused the token, a path not found, ``--timeout`` reached); 2 the command
line is unusable, or ``explain`` would have to pick among several arms.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fsm.attempt import marker as marker_format
from fsm.attempt.lease import lease_name
from fsm.attempt.marker import MARKER_MAX_BYTES, MarkerFile
from fsm.attempts import AttemptView, Found, attempt_files, decide, found_in, human_age
from fsm.clock import Deadline
from fsm.errors import (
    DeadlineExceeded,
    FatalError,
    FlashError,
    PayloadError,
    StoreAuthError,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.files import finite_number
from fsm.output.redact import Redactor
from fsm.store.base import Store

__all__ = ["arguments_problem", "explain", "status"]

#: A console tail the runner uploaded: ``console_<phase>.txt``.
CONSOLE_RE = re.compile(r"console_[^/]+\.txt")
#: How many of the console tail's last lines ``explain`` shows.
TAIL_LINES = 20
#: A stacks file of an attempt (``stacks_<phase>.txt``, CONTRACT section 7).
STACKS_RE = re.compile(r"stacks_[^/]+\.txt")
#: explain shows the head of the stacks file: this many lines.
STACKS_LINES = 30
#: The longest cell of the status table (longer values are cut, ``...`` appended).
CELL_CHARS = 48
#: How much of an unreadable marker ``explain`` shows.
RAW_CHARS = 2_000
_REPO_MAX = 200

Say = Callable[[str], None]


# --- the command line's values ------------------------------------------------------------


def arguments_problem(repo: str, prefix: str, arm: str | None = None) -> str | None:
    """Why ``--repo``, ``--prefix`` or ``--arm`` is unusable (one line), or None."""
    from fsm.payload import NAME_RE, REPO_RE, _prefix_problem

    if len(repo) > _REPO_MAX or not REPO_RE.fullmatch(repo):
        return f"--repo {_shown(repo)}: expected a repo id like 'org/name'"
    problem = _prefix_problem(prefix)
    if problem:
        return f"--prefix {_shown(prefix)}: {problem}"
    if arm is not None and not NAME_RE.fullmatch(arm):
        return f"--arm {_shown(arm)}: letters, digits and ._- (at most 64, a letter or digit first)"
    return None


def _shown(value: str) -> str:
    return repr(value[:80] + ("..." if len(value) > 80 else ""))


# --- what a prefix holds --------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One attempt marker of a prefix, as ``status`` shows it; or, with ``view``, an
    attempt that has a lease and no marker (``file`` is then its lease)."""

    file: MarkerFile
    marker: dict[str, Any] | None
    problem: str | None = None  # why the marker is unreadable
    #: the run's folder (its hf_prefix), and how many attempts (markers, leases) it holds
    folder: str = ""
    attempts: int = 1
    #: a lease's row: what fsm.attempts judged the attempt (running, lost, unknown)
    view: AttemptView | None = None

    @property
    def outcome(self) -> str:
        if self.view is None and self.marker is not None:
            return "ok" if self.marker["ok"] else "failed"
        return self.verdict or "unreadable"  # a lease's row: its kind

    @property
    def verdict(self) -> str | None:
        """succeeded, retriable or fatal (None when unreadable): what the control plane does;
        a lease's row: running, lost or unknown."""
        if self.view is not None:
            return self.view.kind
        return None if self.marker is None else marker_format.verdict(self.marker)

    @property
    def ts(self) -> float | None:
        return finite_number(self.marker.get("ts")) if self.marker is not None else None

    def age_s(self, now: float) -> float | None:
        """The marker's age by its ``ts``; a lease's row: the lease's, by the store's clock."""
        if self.view is not None:
            return self.view.lease_age_s
        ts = self.ts
        return None if ts is None else round(now - ts, 3)

    def field(self, key: str) -> Any:
        if self.view is not None:  # a lease's row shows its state and run id, nothing else
            lease = self.view.lease or {}
            return {"state": self.view.state, "run_id": lease.get("run_id")}.get(key)
        return self.marker.get(key) if self.marker is not None else None

    @property
    def host(self) -> str | None:
        """The host the attempt ran on (the marker's ``host.hostname`` evidence; a lease's
        row: the lease's)."""
        if self.view is not None:
            return self.view.hostname
        host = self.field("host")
        name = host.get("hostname") if isinstance(host, dict) else None
        return name if isinstance(name, str) and name else None

    def as_json(self, now: float, columns: Iterable[Column]) -> dict[str, Any]:
        row = {c.key: c.value(self, now) for c in columns}
        if self.problem is not None:
            row["problem"] = self.problem
        if self.view is not None:
            row.setdefault("host", self.host)
            row["since"] = self.view.since
            row["why"] = self.view.why
        return row

    def note(self, now: float, recursive: bool = False) -> str | None:
        """The line under the table of a lease's row that is lost (since when, on which
        host, in which state) or unknown (why); None for any other row."""
        view = self.view
        if view is None or view.kind not in ("lost", "unknown"):
            return None
        name = self.file.name.removesuffix(".lease.json")
        label = f"{_cell(self.folder)} {name}" if recursive else name
        if view.kind == "unknown":
            return f"{label}: unknown: {_printable(' '.join(view.why.split()), 400)}"
        since = view.since if view.since is not None else now
        return (f"{label}: lost since {_when(since)} ({human_age(now - since)} ago) on host "
                f"{_cell(self.host)}, last state {_cell(view.state)}")


def _when(epoch: float) -> str:
    """An epoch time as UTC, to the second."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    except (OverflowError, OSError, ValueError):
        return "?"


@dataclass(frozen=True)
class Column:
    """One column of ``status``: its JSON key, its table header (None: JSON only), its
    value, and how the table shows that value. The table and the JSON are both read off
    the same columns (one render path, two notations)."""

    key: str
    header: str | None
    value: Callable[[Row, float], Any]
    cell: Callable[[Any], str] = lambda value: _cell(value)


#: The columns of ``status``, in the table's order.
COLUMNS: tuple[Column, ...] = (
    Column("arm", "ARM", lambda r, now: r.file.arm),
    Column("attempt", "ATTEMPT", lambda r, now: r.file.attempt, str),
    Column("file", None, lambda r, now: r.file.name),
    Column("outcome", "OUTCOME", lambda r, now: r.outcome, str),
    Column("class", "CLASS", lambda r, now: r.verdict),
    Column("rule", "RULE", lambda r, now: r.field("rule")),
    Column("ts", None, lambda r, now: r.ts),
    Column("age_s", "AGE", lambda r, now: r.age_s(now), lambda age: human_age(age)),
    Column("state", "STATE", lambda r, now: r.field("state")),
    Column("run_id", "RUN_ID", lambda r, now: r.field("run_id")),
    Column("retriable", None, lambda r, now: r.field("retriable")),
    Column("error", None, lambda r, now: r.field("error")),
)
#: ``status --recursive``: the run's folder first, how many attempts it holds, its host.
RECURSIVE_COLUMNS: tuple[Column, ...] = (
    Column("run", "RUN", lambda r, now: r.folder),
    *COLUMNS[:2],
    Column("attempts", None, lambda r, now: r.attempts),
    *COLUMNS[2:9],
    Column("host", "HOST", lambda r, now: r.host),
    *COLUMNS[9:],
)


def status_table(rows: Iterable[Row], now: float, columns: Iterable[Column] = COLUMNS) -> str:
    """Aligned columns under a header, one line per marker."""
    shown = [c for c in columns if c.header is not None]
    lines = [tuple(c.header or "" for c in shown)]
    lines += [tuple(c.cell(c.value(row, now)) for c in shown) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(shown))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _cell(value: Any) -> str:
    """A marker's value as one printable cell: ``-`` when absent, no control characters."""
    if value is None or value == "":
        return "-"
    return _printable(" ".join(str(value).split()), CELL_CHARS)


def _printable(text: str, limit: int | None = None) -> str:
    """``text`` without control characters (a terminal would obey them), cut to ``limit``."""
    text = "".join(
        "?" if unicodedata.category(ch) in ("Cc", "Cf") and ch != "\t" else ch for ch in text
    )
    if limit is not None and len(text) > limit:
        return text[: limit - 3] + "..."
    return text


# --- talking to the store ---------------------------------------------------------------------


class _StoreFailed(Exception):
    """One line for stderr: the store failed (exit 1)."""


#: What a store failure says, by the first of its classes that matches.
STORE_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (StoreAuthError, "the store refused the credentials (HF_TOKEN) at {where}: {text}"),
    (StoreUnavailable, "store unavailable at {where}: {text}"),
    (StoreNotFound, "not found in the store at {where}: {text}"),
    (DeadlineExceeded, "the store at {where} did not answer within --timeout {timeout_s:g}s"),
    (BaseException, "the store at {where} refused: {text}"),
)


def _store_failure(exc: BaseException, store: Store, timeout_s: float) -> str:
    words = next(words for kind, words in STORE_FAILURES if isinstance(exc, kind))
    return words.format(where=store.describe(), text=" ".join(str(exc).split())[:500],
                        timeout_s=timeout_s)


#: A console tail or stacks file explain reads at most this much of (the runner's own are
#: at most 64,000 bytes and a few hundred KiB).
FILE_MAX_BYTES = 4 << 20


def _session(
    command: str,
    *,
    url: str | None,
    repo: str,
    environ: Mapping[str, str],
    timeout_s: float,
    say: Say,
    body: Callable[[Store, Say], int],
) -> int:
    """Open the store, run ``body(store, emit)`` and turn store failures into one line
    (exit 1). ``emit`` prints to stdout through the token's redactor."""
    import contextlib
    import os
    import sys

    from fsm.output import log
    from fsm.store import open_store

    log.silence()  # the store's log events would mix into the output: its failure is one line
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")  # type: ignore[union-attr]
    redactor = Redactor([environ.get("HF_TOKEN") or ""])

    def emit(text: str) -> None:
        sys.stdout.write(redactor.text(text) + "\n")

    def tell(line: str) -> None:
        say(f"{command}: {redactor.text(line)}")

    # The Hub client draws no progress bars and logs no retries of its own into the
    # operator's terminal: a failure is the one line below (settings read at its import).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    try:
        store = open_store(url, repo_id=repo, token=environ.get("HF_TOKEN") or None,
                           deadline=Deadline.after(timeout_s), environ=environ)
    except PayloadError as exc:
        tell(str(exc))
        return 2
    try:
        return body(store, emit)
    except _StoreFailed as exc:
        tell(str(exc))
        return 1
    except (FlashError, DeadlineExceeded) as exc:
        tell(_store_failure(exc, store, timeout_s))
        return 1


# --- status -------------------------------------------------------------------------------


#: ``status --recursive`` lists at most this many files under the prefix (one listing, in
#: pages on the Hub); a prefix holding more is refused with a line saying so.
MAX_LISTED = 200_000
#: The summary line names at most this many hosts.
SUMMARY_HOSTS = 10


def status(
    *,
    repo: str,
    prefix: str,
    url: str | None,
    as_json: bool,
    environ: Mapping[str, str],
    timeout_s: float,
    say: Say,
    recursive: bool = False,
) -> int:
    """``flash-bootstrap status``: every attempt marker directly under ``prefix``; with
    ``recursive``, the latest attempt of every run (folder) below it, and a summary."""
    prefix = prefix.strip("/")

    def body(store: Store, emit: Say) -> int:
        wanted, leases = _wanted(store, prefix, recursive)
        rows = _read_rows(store, wanted)
        unread = sum(row.problem == NOT_READ for row in rows)
        lease_rows = _lease_rows(store, leases)
        leases_unread = sum(row.view is not None and row.view.why == LEASE_NOT_READ
                            for row in lease_rows)
        rows = sorted(rows + lease_rows, key=lambda r: (r.folder, r.file.attempt, r.file.arm))
        now = time.time()
        columns = RECURSIVE_COLUMNS if recursive else COLUMNS
        listed = [row.as_json(now, columns) for row in rows]
        if as_json:
            value: Any = {"runs": listed, "summary": summary(rows)} if recursive else listed
            emit(json.dumps(_finite(value), indent=2, ensure_ascii=False))
        elif not rows:
            emit(f"no attempt markers under {_printable(prefix)}/ in {store.describe()} "
                 "(none there, or no such folder or repo)")
        else:
            emit(status_table(rows, now, columns))
            for note in (row.note(now, recursive) for row in rows):
                if note is not None:
                    emit(note)
            if recursive:
                emit(summary_line(summary(rows)))
        if unread:  # what was read is shown; what was not is said, and the status says it
            say(f"status: --timeout {timeout_s:g}s reached: {unread} of "
                f"{len(rows) - len(lease_rows)} markers not read (shown as unreadable, "
                f"{NOT_READ!r}); a longer --timeout reads them")
        if leases_unread:
            say(f"status: --timeout {timeout_s:g}s reached: {leases_unread} of "
                f"{len(lease_rows)} leases not judged (shown as unknown, "
                f"{LEASE_NOT_READ!r}); a longer --timeout reads them")
        return 1 if unread or leases_unread else 0

    return _session("status", url=url, repo=repo, environ=environ, timeout_s=timeout_s,
                    say=say, body=body)


def _listed(store: Store, prefix: str) -> list[str]:
    """Every file under ``prefix`` (paths relative to it), in one bounded listing: a file
    that is a hostile link is listed, and refused only when it is read, so one such entry
    does not hide the others (the runner's own listing refuses it at once)."""
    paths = store.list_tree(prefix, MAX_LISTED)
    if len(paths) > MAX_LISTED:
        raise _StoreFailed(f"more than {MAX_LISTED:,} files under {_printable(prefix)}/ in "
                           f"{store.describe()}: choose a narrower --prefix")
    return paths


def _parse(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """A marker downloaded (at most one byte more than a marker may hold), or why not."""
    if len(data) > MARKER_MAX_BYTES:
        return None, f"larger than {MARKER_MAX_BYTES:,} bytes: no marker"
    return marker_format.parse(data)


#: The problem of a marker that ``status --recursive`` had no time left to read.
NOT_READ = "not read: --timeout reached"


Wanted = list[tuple[str, MarkerFile, int]]


def _wanted(store: Store, prefix: str, recursive: bool) -> tuple[Wanted, Wanted]:
    """The markers to read, and the leases of attempts without a marker to judge, each as
    (the run's folder, the file, how many attempts the run holds), from one bounded listing:
    every attempt directly under ``prefix`` (a run of one attempt each); with ``recursive``,
    the latest attempt of every folder under it that holds markers or leases (a run's
    hf_prefix)."""
    folders: dict[str, list[str]] = {}
    for path in _listed(store, prefix):
        folder, _, name = path.rpartition("/")
        if recursive or not folder:
            folders.setdefault(folder, []).append(name)
    wanted: Wanted = []
    leases: Wanted = []
    for folder in sorted(folders):
        held = attempt_files(folders[folder])  # its marker, or else its lease, by attempt
        last = max((attempt for _, attempt, _ in held), default=None)
        run = "/".join(part for part in (prefix, folder) if part)  # the run's hf_prefix
        count = len(held) if recursive else 1
        for arm, attempt, marked in held:
            if not recursive or attempt == last:
                name = marker_format.name(arm, attempt) if marked else lease_name(arm, attempt)
                (wanted if marked else leases).append((run, MarkerFile(name, arm, attempt), count))
    return wanted, leases


#: The why of a lease that ``status`` had no time left to judge.
LEASE_NOT_READ = "not judged: --timeout reached"


def _lease_rows(store: Store, leases: Wanted) -> list[Row]:
    """The attempts with a lease and no marker, judged as one reading (:mod:`fsm.attempts`):
    one ``changes()`` listing of each folder holding such a lease (the tree's listing
    carries no times), each lease read once, and the repo's ``head_time()`` and
    ``head_time(until)`` at most once each, only when an expired lease needs it. A folder
    the store refuses to list (a link out of its root) makes its leases unknown; once
    ``--timeout`` is reached, every lease is unknown (:data:`LEASE_NOT_READ`); any other
    store failure is raised (exit 1)."""
    now = time.time()  # before the listings: no lease looks older than it is
    found: list[Found] = []
    changes: list[float] = []
    try:  # a folder's leases are together in ``leases`` (_wanted), one Found each, in order
        for folder, group in itertools.groupby(leases, key=lambda lease: lease[0]):
            files = [f for _, f, _ in group]
            try:
                listing = store.changes(folder)
            except StoreAuthError:  # a FatalError, but the store's failure, not the folder's
                raise
            except FatalError as exc:
                why = f"the store refused to list {folder}/: {' '.join(exc.message.split())}"
                found += [Found(f.arm, f.attempt, folder, lease_problem=why) for f in files]
                continue
            changes += listing.values()
            for f in files:
                if f.name in listing or marker_format.name(f.arm, f.attempt) in listing:
                    found.append(found_in(store, folder, listing, f.arm, f.attempt))
                else:
                    found.append(Found(f.arm, f.attempt, folder, lease_problem=(
                        "listed, then gone when listed again (its marker may have landed "
                        "since: read again)")))
        views = decide(store, found, changes, now)
    except DeadlineExceeded:
        views = [AttemptView(f.arm, f.attempt, "unknown", LEASE_NOT_READ, prefix=folder)
                 for folder, f, _ in leases]
    rows = []
    for (folder, f, held), view in zip(leases, views, strict=True):  # views in found's order
        landed = view.marker is not None  # its marker landed between the two listings: shown
        if landed:
            f = MarkerFile(marker_format.name(f.arm, f.attempt), f.arm, f.attempt)
        rows.append(Row(f, view.marker, None, folder, held, None if landed else view))
    return rows


def _read_rows(store: Store, wanted: Wanted) -> list[Row]:
    """One download per marker (folder, marker, attempts of its run), in order; once
    ``--timeout`` is reached, the markers left are rows of :data:`NOT_READ`."""
    rows: list[Row] = []
    for folder, m, attempts in wanted:
        marker: dict[str, Any] | None = None
        problem: str | None = NOT_READ
        try:
            if not rows or rows[-1].problem != NOT_READ:
                path = f"{folder}/{m.name}" if folder else m.name
                marker, problem = _parse(store.read_file(path, MARKER_MAX_BYTES))
        except DeadlineExceeded:
            pass  # not read
        except StoreNotFound:  # gone since the listing (a repo rewritten meanwhile)
            problem = "listed, then not found when downloaded"
        except FatalError as exc:  # the store will not read it (a link out of its root)
            problem = f"refused: {_printable(exc.message, 300)}"
        rows.append(Row(m, marker, problem, folder, attempts))
    return rows


def summary(rows: list[Row]) -> dict[str, Any]:
    """How many runs ended in each class and by each rule, and the hosts of the failures
    (a lost attempt's host among them); runs still without a marker count as running, lost
    or unknown."""
    classes, by_rule, hosts = Counter[str](), Counter[str](), Counter[str]()
    for row in rows:
        verdict = row.verdict or "unreadable"
        classes[verdict] += 1
        rule = row.field("rule")
        if isinstance(rule, str) and rule and verdict != "succeeded":
            by_rule[rule] += 1
        if row.host is not None and verdict in ("retriable", "fatal", "lost"):
            hosts[row.host] += 1

    def ranked(counts: dict[str, int]) -> dict[str, int]:
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    return {"runs": len(rows), "class": ranked(classes), "rule": ranked(by_rule),
            "failed_hosts": ranked(hosts)}


def summary_line(counted: Mapping[str, Any]) -> str:
    """The summary as one line: runs by class, failures by rule, the hosts that failed."""
    def listed(counts: Mapping[str, int], limit: int | None = None) -> str:
        items = list(counts.items())
        shown = ", ".join(f"{_cell(name)} {n}" for name, n in items[:limit])
        more = len(items) - len(items[:limit])
        return shown + (f" and {more} more" if more > 0 else "") if items else "none"

    return (f"{counted['runs']} runs: {listed(counted['class'])}; failed by rule: "
            f"{listed(counted['rule'])}; hosts of the failures: "
            f"{listed(counted['failed_hosts'], SUMMARY_HOSTS)}")


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (JSON has none; a marker may hold them, as
    Python's json reads them) replaced by None."""
    return json.loads(json.dumps(value), parse_constant=lambda constant: None)


# --- explain ------------------------------------------------------------------------------


def explain(
    *,
    repo: str,
    prefix: str,
    attempt: int,
    arm: str | None,
    url: str | None,
    environ: Mapping[str, str],
    timeout_s: float,
    say: Say,
) -> int:
    """``flash-bootstrap explain``: one attempt's marker, rule, console tail and path."""
    prefix = prefix.strip("/")

    def body(store: Store, emit: Say) -> int:
        names = frozenset(path for path in _listed(store, prefix) if "/" not in path)
        every = marker_format.listed(names)
        candidates = [m for m in every if m.attempt == attempt and arm in (None, m.arm)]
        if not candidates:
            held = ", ".join(m.name for m in every) or "none"
            wanted = marker_format.name(arm, attempt) if arm else f"attempt {attempt}"
            raise _StoreFailed(
                f"no marker of {wanted} under {_printable(prefix)}/ in {store.describe()} "
                f"(markers there: {_printable(held, 300)})"
            )
        if len(candidates) > 1:
            arms = ", ".join(m.arm for m in candidates)
            say(f"explain: attempt {attempt} has markers of several arms ({arms}): "
                "choose one with --arm")
            return 2
        chosen = candidates[0]
        path = f"{prefix}/{chosen.name}"
        data = store.read_file(path, MARKER_MAX_BYTES)
        marker, problem = _parse(data)
        emit(f"marker  {_printable(path)}")
        if marker is None:
            emit(f"unreadable: {problem}")
            emit(_printable(data.decode("utf-8", "replace"), RAW_CHARS))
        else:
            emit(_pretty(marker))
        emit("\n" + _rule_row(marker) + "\n")
        if marker is not None:  # its evidence: a stall, the GPUs, the stacks file it names
            for evidence in (_stall(marker), _gpus(marker)):
                if evidence:
                    emit(evidence + "\n")
            stacks = marker.get("stacks")
            named = stacks.get("file") if isinstance(stacks, dict) else None
            if isinstance(named, str) and STACKS_RE.fullmatch(named) and named in names:
                emit(_quote(store, prefix, named, "stacks") + "\n")
        note = ("\n  note: the prefix holds other attempts' markers too; this is the last tail "
                "uploaded under it, which may be another attempt's") if len(every) > 1 else ""
        tails = sorted(name for name in names if CONSOLE_RE.fullmatch(name))
        if not tails:
            emit("console tail  no console tail in the store\n")
        for name in tails:
            emit(_quote(store, prefix, name, "console tail", tail_note=note) + "\n")
        emit(_path(marker))
        return 0

    return _session("explain", url=url, repo=repo, environ=environ, timeout_s=timeout_s,
                    say=say, body=body)


def _pretty(marker: Mapping[str, Any]) -> str:
    """The marker as indented JSON, non-ASCII text kept but every control or format
    character escaped (json.dumps leaves C1 controls and bidi overrides raw)."""
    text = json.dumps(marker, indent=2, ensure_ascii=False)
    return "".join(
        json.dumps(ch)[1:-1] if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf") else ch
        for ch in text
    )


def _rule_row(marker: Mapping[str, Any] | None) -> str:
    from fsm import policy
    from fsm.rules import ANY

    if marker is None:
        return "decided by  unknown: the marker is unreadable"
    rule_id = marker.get("rule")
    if not isinstance(rule_id, str) or not rule_id:
        return "decided by  unknown: the marker names no rule"
    try:
        rule = policy.rule(rule_id)
    except KeyError:
        return (f"decided by  {_printable(rule_id, 80)}: not a rule of this runner's policy "
                "(written by another version?)")
    ruled = "succeeded" if rule is policy.SUCCESS else rule.verdict
    lines = [
        f"decided by  {rule.id}",
        f"  class  {ruled}",
        f"  where  {'any state' if rule.where == ANY else rule.where}",
        f"  what   {rule.what}",
    ]
    said = marker_format.verdict(marker)
    if said != ruled:
        lines.append(f"  note   the marker says {said}, the rule {ruled}")
    return "\n".join(lines)


def _quote(store: Store, prefix: str, name: str, label: str,
           tail_note: str | None = None) -> str:
    """A file explain quotes under a head (``label``): a console tail's last
    :data:`TAIL_LINES` lines (``tail_note`` after the head), else the stacks' first
    :data:`STACKS_LINES`. Bounded: a larger file is not the runner's, and is not shown."""
    path = f"{prefix}/{name}"
    data = store.read_file(path, FILE_MAX_BYTES)
    if len(data) > FILE_MAX_BYTES:
        return (f"{label}  {_printable(path)}: larger than {FILE_MAX_BYTES:,} bytes, not a "
                "file the runner wrote; not shown")
    lines = data.decode("utf-8", "replace").split("\n")
    if tail_note is None:  # the stacks
        shown, which = lines[:STACKS_LINES], "first"
    else:
        if lines[-1] == "":
            lines.pop()
        # what a terminal would show of a line rewritten with carriage returns
        shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines[-TAIL_LINES:]]
        which = "last"
    head = f"{label}  {_printable(prefix)}/{name} ({which} {len(shown)} of {len(lines)} lines)"
    return "\n".join([head + (tail_note or ""), *(f"  | {_printable(line)}" for line in shown)])


def _stall(marker: Mapping[str, Any]) -> str | None:
    """The marker's stall evidence as lines (CONTRACT section 7), or None."""
    stall = marker.get("stall")
    if not isinstance(stall, dict):
        return None
    lines = [f"stall  no progress for {_printable(str(stall.get('silent_s', '?')), 20)}s"]
    for key in ("where", "where_in_code", "last_line"):
        if isinstance(stall.get(key), str) and stall[key]:
            lines.append(f"  {key.replace('_', ' ')}: {_printable(stall[key], 300)}")
    previous = stall.get("previous")
    if isinstance(previous, dict):
        lines.append(f"  stalled in the same place in attempt "
                     f"{_printable(str(previous.get('attempt', '?')), 20)} too")
    return "\n".join(lines)


#: The GPU evidence explain shows (CONTRACT section 8), and how it heads each.
GPU_EVIDENCE = (("gpu_health", "gpus before setup"), ("gpu_change", "gpus changed"))


def _gpus(marker: Mapping[str, Any]) -> str | None:
    """The GPUs' findings the marker carries (before setup, or a change since), a line a
    GPU, or None."""
    lines: list[str] = []
    for key, head in GPU_EVIDENCE:
        facts = marker.get(key)
        if not isinstance(facts, dict) or not isinstance(facts.get("findings"), list):
            continue
        when = facts.get("when") if isinstance(facts.get("when"), str) else None
        lines.append(f"{head}{f' ({_printable(when, 60)})' if when else ''}")
        for finding in facts["findings"][:16]:
            if not isinstance(finding, dict):
                continue
            gpu = " ".join(_printable(str(finding[k]), 60) for k in ("index", "uuid", "bus_id")
                           if finding.get(k) is not None)
            lines.append(f"  {_printable(str(finding.get('kind', '?')), 40)}: "
                         f"GPU {gpu or '?'}")
    return "\n".join(lines) or None


def _path(marker: Mapping[str, Any] | None) -> str:
    from fsm.ops import diagram

    if marker is None:
        return "path  cannot be drawn: the marker is unreadable"
    try:
        drawn = diagram.render("mermaid", marker=marker).decode()
    except diagram.DiagramUnavailable as exc:
        return f"path  cannot be drawn: {exc}"
    return "path  (mermaid)\n" + drawn.rstrip("\n")
