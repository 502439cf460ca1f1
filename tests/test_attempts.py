"""The control plane's reader of attempts (``fsm/attempts.py``, CONTRACT section 10):
running, succeeded, retriable, fatal, lost or unknown, and why.

First :func:`fsm.attempts.judge`, rule by rule (each case fails if its rule breaks); then
``read_attempts`` and ``read_attempt`` against the real local store, whose clock is the
files' modification times (a lease is aged with ``os.utime``, never by sleeping), and
against stores that cannot be read; then ``status`` through the real command, which shows
attempts that have a lease and no marker as rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsm.attempt.lease import GRACE_S, LANDING_S, lease_name
from fsm.attempts import NEITHER, TOGETHER, AttemptView, Found, judge, read_attempt, read_attempts
from fsm.clock import Deadline
from fsm.errors import FatalError, StoreUnavailable
from fsm.output.redact import Redactor
from fsm.store import open_store
from fsm.store.base import Store
from fsm.testing import LocalHubServer

NOW = 1_700_000_000.0
TTL = 900.0
REPO = "org/leases"
_AMBIENT = ("FLASH_STORE", "HF_TOKEN", "HF_ENDPOINT", "FLASH_STORE_MAX_ATTEMPTS")


def lease(attempt: int = 1, *, ttl: float = TTL, state: str = "Train", host: str = "gpu-1",
          **over: Any) -> dict[str, Any]:
    value: dict[str, Any] = {
        "attempt": attempt, "run_id": "run-1", "state": state,
        "host": {"id": f"id-{host}", "hostname": host}, "seq": 4, "ttl_s": ttl,
        "renewed_at": 12.0,  # the host's clock, far off: never read for the age
        "progress_at": None}
    value.update(over)
    return value


def leased(arm: str = "a", attempt: int = 1, *, changed: float, prefix: str = "p",
           **over: Any) -> Found:
    return Found(arm, attempt, prefix, lease=lease(attempt, **over), lease_changed=changed)


def marker(ok: bool = False, retriable: bool | None = True, rule: str = "worker-host-fault",
           **over: Any) -> dict[str, Any]:
    value: dict[str, Any] = {"ok": ok, "ts": NOW - 100, "attempt": 1, "error": "",
                             "rule": rule, "state": "VerifyRemote",
                             "host": {"hostname": "gpu-9"}}
    if retriable is not None:
        value["retriable"] = retriable
    value.update(over)
    return value


def one(found: Found, *, changes: tuple[float, ...] = (), head_time: float | None = None,
        now: float = NOW) -> AttemptView:
    (view,) = judge([found], changes=changes, head_time=head_time, now=now)
    return view


# --- rule 1: a marker is the truth ----------------------------------------------------------


@pytest.mark.parametrize(("ok", "retriable", "kind"), [
    (True, False, "succeeded"), (True, True, "succeeded"), (False, True, "retriable"),
    (False, False, "fatal"), (False, None, "fatal"),
])
def test_a_marker_is_its_verdict(ok: bool, retriable: bool | None, kind: str) -> None:
    view = one(Found("a", 1, "p", marker=marker(ok, retriable)))
    assert (view.kind, view.rule, view.state, view.hostname) == (
        kind, "worker-host-fault", "VerifyRemote", "gpu-9")
    assert view.marker is not None and view.lease is None and view.prefix == "p"
    assert view.why


def test_a_retriable_that_is_not_the_boolean_true_is_fatal() -> None:
    assert one(Found("a", 1, marker=marker(retriable="true"))).kind == "fatal"  # type: ignore[arg-type]


def test_a_lease_beside_a_marker_is_ignored() -> None:
    """Expired and with commits since (lost, were it alone): the marker decides."""
    found = Found("a", 1, "p", marker=marker(True, False, "completion-confirmed"),
                  lease=lease(), lease_changed=NOW - 10_000)
    view = one(found, changes=(NOW - 100,), head_time=NOW - 100)
    assert (view.kind, view.rule, view.lease, view.lease_age_s) == (
        "succeeded", "completion-confirmed", None, None)


def test_an_unreadable_marker_is_unknown_and_says_why() -> None:
    view = one(Found("a", 1, marker_problem="not JSON: Expecting value at line 1 column 1",
                     lease=lease(), lease_changed=NOW - 1))
    assert view.kind == "unknown"
    assert view.why == "the marker is unreadable: not JSON: Expecting value at line 1 column 1"


# --- rule 2: a lease, and its age by the store's clock ---------------------------------------


def test_an_unreadable_lease_is_unknown_and_says_why() -> None:
    view = one(Found("a", 1, lease_problem="no positive number 'ttl_s'", lease_changed=NOW))
    assert (view.kind, view.why) == ("unknown",
                                     "the lease is unreadable: no positive number 'ttl_s'")


def test_a_lease_naming_another_attempt_is_unreadable() -> None:
    view = one(Found("a", 1, lease=lease(2), lease_changed=NOW - 1))
    assert view.kind == "unknown" and "names attempt 2, its file 1" in view.why


def test_a_lease_without_a_store_time_is_unknown() -> None:
    view = one(Found("a", 1, lease=lease(), lease_changed=None))
    assert view.kind == "unknown" and "no time" in view.why


@pytest.mark.parametrize("age", [0.0, 1.0, TTL / 2, TTL])
def test_a_lease_within_its_ttl_is_running_by_the_stores_time(age: float) -> None:
    """Up to ``changed + ttl_s`` inclusive; the host's ``renewed_at`` plays no part."""
    view = one(leased(changed=NOW - age, state="Train"), changes=(NOW - 5000,))
    assert (view.kind, view.state, view.hostname, view.lease_age_s, view.since) == (
        "running", "Train", "gpu-1", age, None)
    assert view.lease is not None and view.lease["seq"] == 4


def test_the_ttl_is_the_leases_own() -> None:
    found = leased(changed=NOW - 200, ttl=90.0)
    assert one(found, changes=(NOW - 61,)).kind == "lost"
    assert one(leased(changed=NOW - 200, ttl=300.0), changes=(NOW - 61,)).kind == "running"


# --- rule 3: expired is lost only with commits since, and not most leases at once ------------


EXPIRED = NOW - 2000  # changed; expires at NOW - 1100
EXPIRES = EXPIRED + TTL


@pytest.mark.parametrize("source", ["changes", "other lease", "head_time"])
def test_an_expired_lease_with_a_commit_since_is_lost_since_it_expired(source: str) -> None:
    """The evidence may be any file of the reading, another attempt's lease, or the repo's
    last commit."""
    later = EXPIRES + 10
    found = [leased(changed=EXPIRED, host="gpu-7", state="Download")]
    kwargs: dict[str, Any] = {"head_time": None, "changes": ()}
    if source == "changes":
        kwargs["changes"] = (later,)
    elif source == "other lease":
        found.append(leased("b", changed=later, ttl=3600.0))  # running, renewed since
    else:
        kwargs["head_time"] = later
    view = judge(found, now=NOW, **kwargs)[0]
    assert (view.kind, view.since, view.state, view.hostname, view.lease_age_s) == (
        "lost", EXPIRES, "Download", "gpu-7", 2000.0)
    assert "went silent" in view.why


def test_no_commit_since_the_lease_expired_is_unknown() -> None:
    """Commits up to the moment it expired, none after: unknown, and why says so."""
    view = one(leased(changed=EXPIRED), changes=(EXPIRED, EXPIRES - 1, EXPIRES),
               head_time=EXPIRES)
    assert view.kind == "unknown" and view.since is None
    assert "no commit has landed in the repo since: the store may be" in view.why
    assert view.lease_age_s == 2000.0 and view.state == "Train"


def test_a_commit_counts_only_after_the_grace() -> None:
    """A commit that landed less than GRACE_S ago is no evidence yet (a live runner's
    late renewal may land within it); from GRACE_S on it is."""
    t = NOW - GRACE_S + 0.5
    view = one(leased(changed=EXPIRED), changes=(t,), head_time=t)
    assert view.kind == "unknown" and "within the grace" in view.why
    assert one(leased(changed=EXPIRED), changes=(t,), now=NOW + 0.5).kind == "lost"
    assert one(leased(changed=EXPIRED), head_time=t, now=NOW + 0.5).kind == "lost"


DUE = EXPIRED + TTL / 3  # when the lease's renewal fell due


def test_a_dead_runner_reads_lost_at_the_first_commit_after_its_lease_expired() -> None:
    """With a commit in the repo while the renewal was late (LANDING_S after it fell due,
    GRACE_S before the reading), one commit after the expiry is all it takes: no grace
    after the expiry (issue 40's latency, ttl_s + one read)."""
    after = EXPIRES + 0.001
    assert one(leased(changed=EXPIRED), changes=(DUE + LANDING_S, after),
               now=after).kind == "lost"
    # the same witness, but nothing after the expiry: the contract's "commits since"
    view = one(leased(changed=EXPIRED), changes=(DUE + LANDING_S, EXPIRES), now=after)
    assert view.kind == "unknown" and "no commit has landed in the repo since" in view.why


def test_a_commit_too_soon_after_the_renewal_fell_due_is_no_witness() -> None:
    """A live runner tried its renewal when it fell due; a commit of another run within
    LANDING_S of that try does not show the try could land."""
    early = DUE + LANDING_S - 0.001
    view = one(leased(changed=EXPIRED), changes=(early, EXPIRES + 1), now=EXPIRES + 2)
    assert view.kind == "unknown" and "none yet that a live runner" in view.why
    assert one(leased(changed=EXPIRED), changes=(early + 0.001, EXPIRES + 1),
               now=EXPIRES + 2).kind == "lost"


@pytest.mark.parametrize(("running", "expired", "kind"), [
    (0, 1, "lost"),      # one lease alone: no "most"
    (1, 1, "lost"),      # half is not more than half
    (2, 2, "lost"),
    (0, 2, "unknown"),   # all
    (1, 2, "unknown"),   # more than half
    (9, 11, "unknown"),
    (11, 9, "lost"),
])
def test_most_leases_expired_together_is_the_stores_outage(
    running: int, expired: int, kind: str
) -> None:
    """With commits since every expiry, the expired leases are lost unless more than half
    of the reading's leases (at least two) expired."""
    found = [leased(f"r{i}", changed=NOW - 100) for i in range(running)]
    found += [leased(f"x{i}", changed=EXPIRED - i) for i in range(expired)]
    views = judge(found, changes=(NOW - 61,), head_time=NOW - 61, now=NOW)
    assert [v.kind for v in views] == ["running"] * running + [kind] * expired
    if kind == "unknown":
        assert all(v.why.startswith(TOGETHER) for v in views[running:])
        assert f"{expired} of {running + expired} leases" in views[-1].why


def test_leases_beside_markers_and_unreadable_ones_are_not_counted_as_expired_together() -> None:
    """Only readable leases of attempts without markers count: one expired lease beside
    expired leases that markers overrule, and an unreadable one, is still lost."""
    found = [
        leased("x", changed=EXPIRED),
        Found("m1", 1, "p", marker=marker(), lease=lease(), lease_changed=EXPIRED),
        Found("m2", 1, "p", marker=marker(), lease=lease(), lease_changed=EXPIRED),
        Found("u", 1, "p", lease_problem="not JSON (JSONDecodeError)", lease_changed=EXPIRED),
    ]
    views = judge(found, changes=(NOW - 100,), head_time=None, now=NOW)
    assert [v.kind for v in views] == ["lost", "retriable", "retriable", "unknown"]


# --- rule 4, and judge itself --------------------------------------------------------------


def test_neither_lease_nor_marker_is_unknown() -> None:
    view = one(Found("a", 3, "p"))
    assert (view.kind, view.why, view.attempt, view.arm) == ("unknown", NEITHER, 3, "a")


def test_judge_keeps_the_order_and_is_deterministic() -> None:
    found = [leased("b", changed=NOW - 10), Found("a", 0, marker=marker(True, False)),
             leased("c", changed=EXPIRED), Found("d", 2)]
    first = judge(found, changes=(NOW - 100,), head_time=None, now=NOW)
    assert [(v.arm, v.kind) for v in first] == [
        ("b", "running"), ("a", "succeeded"), ("c", "lost"), ("d", "unknown")]
    assert judge(found, changes=(NOW - 100,), head_time=None, now=NOW) == first


# --- reading the local store ---------------------------------------------------------------


class Counting:
    """A store that counts the calls the reader makes of it (and forwards them)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: list[tuple[str, str]] = []

    def changes(self, folder: str) -> dict[str, float]:
        self.calls.append(("changes", folder))
        return self.store.changes(folder)

    def head_time(self, until: float | None = None) -> float | None:
        self.calls.append(("head_time", "" if until is None else "until"))
        return self.store.head_time(until)

    def read_file(self, path: str, max_bytes: int) -> bytes:
        self.calls.append(("read_file", path))
        return self.store.read_file(path, max_bytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class Tree:
    """A local store's directory, and files put in it changed at a given time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.store = open_store(root.as_uri(), repo_id=REPO, token=None,
                                deadline=Deadline.after(60), environ={})

    def put(self, path: str, value: Any, when: float) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(value if isinstance(value, str) else json.dumps(value))
        os.utime(target, (when, when))

    def lease(self, folder: str, arm: str, attempt: int, when: float, **over: Any) -> None:
        self.put(f"{folder}/{lease_name(arm, attempt)}", lease(attempt, **over), when)

    def counting(self) -> Counting:
        return Counting(self.store)


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path / "store")


def _kinds(views: list[AttemptView]) -> list[tuple[str, str, int, str]]:
    return [(v.prefix, v.arm, v.attempt, v.kind) for v in views]


def test_read_attempts_judges_markers_and_leases_by_the_files_times(tree: Tree) -> None:
    now = time.time()
    tree.put("r/a_attempt0.json", marker(attempt=0), now - 5000)
    tree.lease("r", "a", 0, now - 5000)  # beside its marker: ignored, never read
    tree.lease("r", "a", 1, now - 2000, host="gpu-7", state="Download")  # expired
    tree.lease("r", "b", 1, now - 120)  # renewed 2 minutes ago: running, and evidence
    tree.put("r/console_sft.txt", "x\n", now - 3000)
    counting = tree.counting()
    views = read_attempts(counting, "r/", now=now)  # type: ignore[arg-type]
    assert _kinds(views) == [("r", "a", 0, "retriable"), ("r", "a", 1, "lost"),
                             ("r", "b", 1, "running")]
    lost = views[1]
    assert (lost.hostname, lost.state, lost.since) == ("gpu-7", "Download",
                                                       pytest.approx(now - 2000 + TTL))
    assert lost.lease_age_s == pytest.approx(2000, abs=0.01)
    assert views[2].lease_age_s == pytest.approx(120, abs=0.01)
    # one listing, each marker and each marker-less lease read once, no head_time needed
    assert sorted(counting.calls) == [
        ("changes", "r"), ("read_file", "r/a_attempt0.json"),
        ("read_file", "r/a_attempt1.lease.json"), ("read_file", "r/b_attempt1.lease.json")]


def test_head_time_is_asked_once_only_when_an_expired_lease_needs_it(tree: Tree) -> None:
    """The listings show no commit since the expiry; the repo's last commit (elsewhere)
    does: lost, after one head_time() for the whole reading (that commit, older than the
    grace, is also the newest at or before it: no history read)."""
    now = time.time()
    tree.lease("r1", "a", 1, now - 2000)  # expired at now - 1100
    tree.lease("r2", "a", 1, now - 1500, ttl=3600.0)  # running; changed before that
    tree.put("elsewhere/notes.txt", "x", now - 300)  # the repo's last commit
    counting = tree.counting()
    views = read_attempts(counting, ["r1", "r2"], now=now)  # type: ignore[arg-type]
    assert _kinds(views) == [("r1", "a", 1, "lost"), ("r2", "a", 1, "running")]
    assert [c for c in counting.calls if c[0] != "read_file"] == [
        ("changes", "r1"), ("changes", "r2"), ("head_time", "")]
    # nothing expired: never asked
    counting = tree.counting()
    read_attempts(counting, ["r1", "r2"], now=now - 1500)  # type: ignore[arg-type]
    assert not [c for c in counting.calls if c[0] == "head_time"]


def test_a_busy_repo_is_asked_its_last_commit_and_its_history_once_each(tree: Tree) -> None:
    """A repo that took a commit seconds ago (within the grace): its last commit says the
    store took commits since the expiry, and the newest at or before ``now - GRACE_S``
    (the history) is the witness that the runner was silent while its renewal was late."""
    now = time.time()
    tree.lease("r1", "a", 1, now - 2000)  # expired at now - 1100
    tree.put("elsewhere/old.txt", "x", now - 600)
    tree.put("elsewhere/new.txt", "x", now - 5)
    counting = tree.counting()
    (view,) = read_attempts(counting, ["r1"], now=now)  # type: ignore[arg-type]
    assert view.kind == "lost" and "one 10m00s ago" in view.why, view
    assert [c for c in counting.calls if c[0] == "head_time"] == [
        ("head_time", ""), ("head_time", "until")]


def test_the_readers_clock_may_be_a_later_one(tree: Tree) -> None:
    """Asking about the future needs no waiting: the running lease, read an hour on with
    no commit since, is unknown (and both leases expired together)."""
    now = time.time()
    tree.lease("r", "a", 1, now - 120)
    tree.lease("r", "b", 1, now - 110)
    assert [v.kind for v in read_attempts(tree.store, "r", now=now)] == ["running"] * 2
    later = read_attempts(tree.store, "r", now=now + 3600)
    assert [v.kind for v in later] == ["unknown"] * 2
    assert all(v.why.startswith(TOGETHER) for v in later)


def test_a_fleet_of_20_runs_all_expired_with_no_commit_since_is_all_unknown(tree: Tree) -> None:
    """The repo throttled for an hour: every lease is stale, nothing landed since. Nothing
    is lost, every attempt is unknown and says why."""
    now = time.time()
    folders = [f"sft/run-{i:02d}" for i in range(20)]
    for i, folder in enumerate(folders):
        tree.put(f"{folder}/a_attempt0.json", marker(attempt=0), now - 7000 - i)
        tree.lease(folder, "a", 1, now - 3600 - i)
        tree.put(f"{folder}/console_sft.txt", "x", now - 3600 - i)
    views = read_attempts(tree.store, folders, now=now)
    leases = [v for v in views if v.attempt == 1]
    assert len(leases) == 20 and {v.kind for v in leases} == {"unknown"}
    assert not [v for v in views if v.kind == "lost"]
    assert all(v.why.startswith(TOGETHER) for v in leases)
    # and one run alone (no "most" to speak of): unknown because nothing landed since
    alone = read_attempt(tree.store, folders[3], "a", 1, now=now)
    assert alone.kind == "unknown"
    assert "no commit has landed in the repo since" in alone.why


def test_read_attempt_answers_each_kind(tree: Tree) -> None:
    now = time.time()
    tree.put("r/a_attempt0.json", marker(True, False, "completion-confirmed", attempt=0),
             now - 9000)
    tree.lease("r", "a", 1, now - 2000, host="gpu-7")
    tree.lease("r", "b", 1, now - 100)
    tree.put("r/console_sft.txt", "x", now - 500)
    tree.put("r/c_attempt1.json", "{not json", now - 400)
    assert read_attempt(tree.store, "r", "a", 0, now=now).kind == "succeeded"
    lost = read_attempt(tree.store, "r", "a", 1, now=now)
    assert (lost.kind, lost.hostname, lost.prefix) == ("lost", "gpu-7", "r")
    assert read_attempt(tree.store, "r", "b", 1, now=now).kind == "running"
    bad = read_attempt(tree.store, "r", "c", 1, now=now)
    assert bad.kind == "unknown" and bad.why.startswith("the marker is unreadable: not JSON")
    none = read_attempt(tree.store, "r", "a", 2, now=now)
    assert (none.kind, none.why) == ("unknown", NEITHER)
    assert read_attempt(tree.store, "nowhere", "a", 0, now=now).why == NEITHER
    with pytest.raises(ValueError, match="not an attempt"):
        read_attempt(tree.store, "r", "a/b", 0)


def test_read_attempt_reads_the_other_leases_only_when_its_own_expired(tree: Tree) -> None:
    now = time.time()
    tree.lease("r", "a", 1, now - 100)
    for arm in "bcd":
        tree.lease("r", arm, 1, now - 2000)
    counting = tree.counting()
    view = read_attempt(counting, "r", "a", 1, now=now)  # type: ignore[arg-type]
    assert view.kind == "running"
    assert counting.calls == [("changes", "r"), ("read_file", "r/a_attempt1.lease.json")]
    counting = tree.counting()
    view = read_attempt(counting, "r", "b", 1, now=now)  # type: ignore[arg-type]
    assert view.kind == "unknown" and view.why.startswith(TOGETHER)  # 3 of 4 expired
    assert sorted(p for op, p in counting.calls if op == "read_file") == [
        f"r/{arm}_attempt1.lease.json" for arm in "abcd"]


def test_a_lease_gone_between_the_listing_and_its_read_is_unknown(tree: Tree) -> None:
    """The marker's commit removed it meanwhile: read again."""
    now = time.time()
    tree.lease("r", "a", 1, now - 100)

    class Racing(Counting):
        def read_file(self, path: str, max_bytes: int) -> bytes:
            (tree.root / path).unlink()
            return super().read_file(path, max_bytes)

    view = read_attempt(Racing(tree.store), "r", "a", 1, now=now)  # type: ignore[arg-type]
    assert view.kind == "unknown" and "gone when read" in view.why


def test_a_lease_too_long_is_unknown(tree: Tree) -> None:
    now = time.time()
    tree.lease("r", "b", 1, now - 100)
    tree.put("r/a_attempt1.lease.json", "x" * 20_000, now - 100)
    views = read_attempts(tree.store, "r", now=now)
    assert [(v.arm, v.kind) for v in views] == [("a", "unknown"), ("b", "running")]
    assert views[0].why == "the lease is unreadable: larger than 16,384 bytes"


def test_a_lease_that_links_out_of_the_store_is_never_followed(
    tree: Tree, tmp_path: Path
) -> None:
    """The local store refuses to list a folder holding a link out of its root: the
    reader says unknown (read_attempt), raises (read_attempts), and status shows the
    folder's leases as unknown while the rest of the tree is judged."""
    now = time.time()
    secret = tmp_path / "outside.json"
    secret.write_text(json.dumps(lease(run_id="SECRET")))
    tree.lease("sft/bad", "b", 1, now - 100)
    (tree.root / "sft/bad/a_attempt1.lease.json").symlink_to(secret)
    tree.lease("sft/good", "a", 1, now - 100)
    view = read_attempt(tree.store, "sft/bad", "b", 1)
    assert view.kind == "unknown" and "link" in view.why and "SECRET" not in view.why
    with pytest.raises(FatalError):
        read_attempts(tree.store, "sft/bad")
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft", "--recursive", "--json",
                   "--store", tree.root.as_uri())
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert "SECRET" not in proc.stdout
    runs = json.loads(proc.stdout)["runs"]
    assert [(r["run"], r["arm"], r["class"]) for r in runs] == [
        ("sft/bad", "a", "unknown"), ("sft/bad", "b", "unknown"), ("sft/good", "a", "running")]
    assert runs[0]["why"].startswith("the lease is unreadable: the store refused to list")


# --- a store that cannot be read -------------------------------------------------------------


def test_a_missing_local_store_is_unknown_for_read_attempt_and_raised_by_read_attempts(
    tmp_path: Path,
) -> None:
    store = open_store((tmp_path / "gone").as_uri(), repo_id=REPO, token=None,
                       deadline=Deadline.after(5), environ={})
    view = read_attempt(store, "r", "a", 1)
    assert view.kind == "unknown"
    assert view.why.startswith("the store cannot be read (StoreUnavailable): local store: ")
    with pytest.raises(StoreUnavailable):
        read_attempts(store, "r")


def test_a_store_past_its_deadline_is_unknown(tree: Tree) -> None:
    store = open_store(tree.root.as_uri(), repo_id=REPO, token=None,
                       deadline=Deadline.after(0), environ={})
    view = read_attempt(store, "r", "a", 1)
    assert view.kind == "unknown" and "(DeadlineExceeded): no answer in time" in view.why


def test_the_why_of_a_store_failure_is_redacted(tree: Tree) -> None:
    secret = "hf_secret_in_an_error_0123456789"

    class Leaky(Counting):
        def changes(self, folder: str) -> dict[str, float]:
            raise StoreUnavailable(f"the proxy said {secret} is refused")

    view = read_attempt(Leaky(tree.store), "r", "a", 1,  # type: ignore[arg-type]
                        redactor=Redactor([secret]))
    assert view.kind == "unknown" and secret not in view.why and "***" in view.why
    # by default the environment's secrets are known
    os.environ["FLASH_TEST_ATTEMPTS_TOKEN"] = secret
    try:
        view = read_attempt(Leaky(tree.store), "r", "a", 1)  # type: ignore[arg-type]
    finally:
        del os.environ["FLASH_TEST_ATTEMPTS_TOKEN"]
    assert secret not in view.why


@pytest.mark.hub
def test_an_unavailable_or_refusing_hub_is_unknown_never_raised(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    hub_server.create_repo(REPO)
    hub_server.add_file(REPO, "r/a_attempt1.lease.json", json.dumps(lease()),
                        when=time.time() - 100)

    def hub(token: str) -> Store:
        return open_store(hub_server.url, repo_id=REPO, token=token,
                          deadline=Deadline.after(30),
                          environ={"FLASH_STORE_MAX_ATTEMPTS": "1",
                                   "FLASH_STORE_RETRY_BASE_S": "0"})

    assert read_attempt(hub(hub_token), "r", "a", 1).kind == "running"
    hub_server.fail("GET", r"/tree/", status=503, times=100)
    view = read_attempt(hub(hub_token), "r", "a", 1)
    assert view.kind == "unknown" and "(StoreUnavailable)" in view.why and "503" in view.why
    assert hub_token not in view.why
    hub_server.clear_faults()
    wrong = f"hf_wrong_{hub_token}"
    view = read_attempt(hub(wrong), "r", "a", 1)
    assert view.kind == "unknown" and "(StoreAuthError)" in view.why
    assert wrong not in view.why and hub_token not in view.why


# --- status shows attempts that have a lease and no marker ------------------------------------


def fsm_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in _AMBIENT}
    return subprocess.run([sys.executable, "-m", "fsm", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)


def _one_run(tree: Tree, now: float) -> None:
    """A marker of attempt 0, then arm a's lease lost (expired 15 minutes before a
    renewal of arm b's landed), arm b's running."""
    tree.put("sft/r/a_attempt0.json", marker(attempt=0, run_id="run-1"), now - 9000)
    tree.lease("sft/r", "a", 1, now - 2000, host="gpu-7", state="Download")
    tree.lease("sft/r", "b", 1, now - 200, host="gpu-8", state="Train")


def test_status_shows_a_lost_and_a_running_attempt(tree: Tree) -> None:
    now = time.time()
    _one_run(tree, now)
    args = ("--repo", REPO, "--prefix", "sft/r", "--store", tree.root.as_uri())
    proc = fsm_cli("status", *args)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["ARM", "ATTEMPT", "OUTCOME", "CLASS", "RULE", "AGE", "STATE",
                                "RUN_ID"]
    rows = [line.split() for line in lines[1:4]]
    assert rows[0][:5] == ["a", "0", "failed", "retriable", "worker-host-fault"]
    assert rows[1][:5] + rows[1][6:] == ["a", "1", "lost", "lost", "-", "Download", "run-1"]
    # the lease's age, read once the command ran (a loaded machine may take seconds)
    ages = {f"{(2000 + s) // 60}m{(2000 + s) % 60:02d}s"
            for s in range(int(time.time() - now) + 2)}
    assert rows[1][5] in ages
    assert rows[2][:5] + rows[2][6:] == ["b", "1", "running", "running", "-", "Train", "run-1"]
    assert rows[2][5] in {f"{(200 + s) // 60}m{(200 + s) % 60:02d}s"
                          for s in range(int(time.time() - now) + 2)}
    notes = lines[4:]
    assert len(notes) == 1 and notes[0].startswith("a_attempt1: lost since ")
    assert "host gpu-7" in notes[0] and "last state Download" in notes[0]

    listed = json.loads(fsm_cli("status", *args, "--json").stdout)
    assert [(r["arm"], r["attempt"], r["class"]) for r in listed] == [
        ("a", 0, "retriable"), ("a", 1, "lost"), ("b", 1, "running")]
    lost, running = listed[1], listed[2]
    assert lost["file"] == "a_attempt1.lease.json" and lost["host"] == "gpu-7"
    assert lost["since"] == pytest.approx(now - 2000 + TTL, abs=0.01)
    assert 2000 <= lost["age_s"] < 2030 and lost["why"].startswith("the lease expired ")
    assert running["since"] is None and running["host"] == "gpu-8"
    assert "since" not in listed[0] and "why" not in listed[0]  # marker rows unchanged


def test_numbers_too_large_for_a_float_read_as_unreadable_not_as_a_crash(tree: Tree) -> None:
    """JSON integers have no bound: a marker's ``ts`` or a lease's ``ttl_s`` of 10**400
    (which ``math.isfinite`` and ``float`` raise on) is no time, and ``status`` still
    lists every attempt."""
    now = time.time()
    tree.put("sft/r/a_attempt0.json", marker(attempt=0, run_id="run-1", ts=10**400), now - 90)
    tree.lease("sft/r", "a", 1, now - 60, ttl=10**400)
    args = ("--repo", REPO, "--prefix", "sft/r", "--store", tree.root.as_uri())
    proc = fsm_cli("status", *args, "--json")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["arm"], r["attempt"], r["class"]) for r in rows] == [
        ("a", 0, "retriable"), ("a", 1, "unknown")]
    assert "ttl_s" in rows[1]["why"]


def test_status_recursive_json_counts_lost_running_and_unknown(tree: Tree) -> None:
    now = time.time()
    _one_run(tree, now)  # sft/r: attempt 1 of two arms (lost, running)
    tree.put("sft/done/a_attempt0.json", marker(True, False, "completion-confirmed",
                                                attempt=0), now - 500)
    tree.put("sft/next/a_attempt0.json", marker(attempt=0), now - 4000)
    tree.lease("sft/next", "a", 1, now - 100)  # running, its marker-less lease the latest
    tree.put("sft/odd/a_attempt2.lease.json", "{not json", now - 100)
    args = ("--repo", REPO, "--prefix", "sft", "--recursive", "--store", tree.root.as_uri())
    proc = fsm_cli("status", *args, "--json")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    value = json.loads(proc.stdout)
    assert [(r["run"], r["arm"], r["attempt"], r["attempts"], r["class"]) for r in
            value["runs"]] == [
        ("sft/done", "a", 0, 1, "succeeded"), ("sft/next", "a", 1, 2, "running"),
        ("sft/odd", "a", 2, 1, "unknown"), ("sft/r", "a", 1, 3, "lost"),
        ("sft/r", "b", 1, 3, "running")]
    assert value["runs"][2]["why"].startswith("the lease is unreadable: not JSON")
    assert value["runs"][3]["host"] == "gpu-7"
    summary = value["summary"]
    assert summary["runs"] == 5
    assert summary["class"] == {"running": 2, "lost": 1, "succeeded": 1, "unknown": 1}
    assert summary["failed_hosts"] == {"gpu-7": 1}

    proc = fsm_cli("status", *args)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("5 runs: running 2, lost 1, succeeded 1, unknown 1; ")
    assert any(line.startswith("sft/odd a_attempt2: unknown: the lease is unreadable")
               for line in lines)
    assert any(line.startswith("sft/r a_attempt1: lost since ") for line in lines)


def test_status_recursive_of_20_runs_all_expired_with_no_commit_since(tree: Tree) -> None:
    now = time.time()
    for i in range(20):
        tree.put(f"sft/run-{i:02d}/a_attempt0.json", marker(attempt=0), now - 7000)
        tree.lease(f"sft/run-{i:02d}", "a", 1, now - 3600 - i)
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft", "--recursive", "--json",
                   "--store", tree.root.as_uri())
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    value = json.loads(proc.stdout)
    assert [r["class"] for r in value["runs"]] == ["unknown"] * 20
    assert value["summary"]["class"] == {"unknown": 20}


@pytest.mark.hub
def test_status_on_the_hub_dates_leases_by_their_commits(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """On the Hub the lease's age is its last commit's date: a lease committed 2,000 s ago
    (whatever its renewed_at says) is lost once another commit landed since."""
    now = time.time()
    hub_server.create_repo(REPO)
    hub_server.add_file(REPO, "sft/r/a_attempt1.lease.json",
                        json.dumps(lease(host="gpu-7", renewed_at=now)), when=now - 2000)
    hub_server.add_file(REPO, "sft/r/b_attempt1.lease.json", json.dumps(lease(host="gpu-8")),
                        when=now - 200)
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft/r", "--json",
                   "--store", hub_server.url, env={"HF_TOKEN": hub_token})
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr[-2000:]
    assert hub_token not in proc.stdout
    rows = json.loads(proc.stdout)
    assert [(r["arm"], r["class"], r["host"]) for r in rows] == [
        ("a", "lost", "gpu-7"), ("b", "running", "gpu-8")]
    assert 2000 <= rows[0]["age_s"] < 2060


# --- the poller of docs/leases.md ------------------------------------------------------------


def test_the_poller_of_docs_leases_md_retries_a_lost_attempt_and_ends_on_success(
    tree: Tree, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The example as written: attempt 1 is lost (its lease stale, another arm's renewed
    since), so attempt 2 is launched; it runs, then its marker lands: done."""
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "leases.md").read_text()
    (body,) = re.findall(r"```python\n# poller\.py\n(.*?)```", text, re.S)
    namespace: dict[str, Any] = {"__name__": "poller"}
    exec(compile(body, "docs/leases.md#poller.py", "exec"), namespace)

    now = time.time()
    tree.lease("r", "a", 1, now - 2000, host="gpu-7")
    tree.lease("r", "b", 1, now - 120)
    launched: list[tuple[str, int]] = []
    steps = iter([
        lambda: tree.lease("r", "a", 2, time.time()),  # the new host's lease
        lambda: (tree.put("r/a_attempt2.json", marker(True, False, "completion-confirmed",
                                                      attempt=2), time.time()),
                 (tree.root / "r" / lease_name("a", 2)).unlink()),
    ])
    view = namespace["watch"](tree.root.as_uri(), REPO, "r", "a", 1,
                              launch=lambda arm, n: launched.append((arm, n)),
                              fail=lambda view: pytest.fail(f"failed: {view}"),
                              sleep=lambda seconds: next(steps)())
    assert view.kind == "succeeded" and launched == [("a", 2)]
    said = capsys.readouterr().out.splitlines()
    assert [line.split(":")[:2] for line in said] == [
        ["a attempt 1", " lost"], ["a attempt 2", " running"], ["a attempt 2", " succeeded"]]
