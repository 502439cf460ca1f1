"""The lease through the real runner (CONTRACT section 10), on both stores.

A runner keeps ``<arm>_attempt<N>.lease.json`` while its worker runs: written as the worker
starts, renewed every FLASH_LEASE_S (riding a console tail's commit when one is due),
removed by the marker's commit. A later attempt of the run found under the prefix stops
the worker at once and ends the attempt ``superseded``. The control plane's reader
(``fsm.attempts``) judges the lease by the store's clock, never the host's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, PREFIX, Layout, make_store, read_until, survivors
from hubrun import REPO, HubRun
from test_attempt_budget import faketime, libfaketime_mt  # noqa: F401 - fixtures

from fsm.attempt.lease import GRACE_S, LANDING_S, lease_name
from fsm.attempts import read_attempt
from fsm.clock import Deadline
from fsm.store import open_store
from fsm.store.base import Store

#: The least period the contract allows: the tests' renewals come every 30 s.
LEASE_S = 30
TTL_S = 3 * LEASE_S
LEASE = lease_name(ARM, 0)
LATER = lease_name(ARM, 1)

#: Prints a line every 0.2 s until stopped; on SIGTERM it completes (uploads DONE and
#: metrics.json), as a worker that saves its work when asked to stop would: a superseded
#: runner kills it at once, so that upload never comes.
SAVES_ON_STOP = """
import signal
(SCRATCH / "worker.pid").write_text(str(os.getpid()))

def on_term(signum, frame):
    complete()
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
step = 0
while not (SCRATCH / "go").exists():
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.2)
"""

#: The runner's environment for these tests: renewals every 30 s, tails every 5 s.
LEASE_ENV = {"FLASH_LEASE_S": str(LEASE_S), "FLASH_UPLOAD_CONSOLE": "1",
             "FLASH_CONSOLE_UPLOAD_INTERVAL_S": "5", "FLASH_STOP_GRACE_S": "5"}


def _local_store(layout: Layout) -> Store:
    """The reader's handle on the layout's local store."""
    return open_store(layout.store_url, repo_id=layout.payload()["hf_repo"], token=None,
                      deadline=Deadline.after(60), environ={})


def _poll(what: str, probe: Callable[[], Any], timeout_s: float) -> Any:
    """``probe()`` until it answers something truthy, at most ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _lease_at(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


class _World:
    """One store's side of a run: where its files land, how a runner starts on it."""

    def __init__(self, kind: str, layout: Layout | HubRun, hub_run: HubRun | None) -> None:
        self.kind, self.layout, self.hub = kind, layout, hub_run

    @property
    def prefix_dir(self) -> Path:
        if self.hub:
            return self.hub.repo_dir / PREFIX
        assert isinstance(self.layout, Layout)
        return self.layout.store / PREFIX

    @property
    def scratch(self) -> Path:
        return self.hub.scratch if self.hub else self.layout.scratch

    def write_worker(self, body: str) -> None:
        (self.hub or self.layout).write_worker(body)

    def put(self, name: str, data: str, *, prefix: str = PREFIX,
            when: float | None = None) -> None:
        """A file under ``prefix``, as another attempt's runner would commit it (at the
        store's time ``when``: now when None)."""
        if self.hub:
            self.hub.server.add_file(REPO, f"{prefix}/{name}", data, when=when)
            return
        assert isinstance(self.layout, Layout)
        path = self.layout.store / prefix / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data)
        if when is not None:
            os.utime(path, (when, when))

    def changed(self, name: str) -> float:
        """When ``name`` under the prefix last changed, by the store's clock."""
        if self.hub:
            return self.hub.server.last_commit(REPO, f"{PREFIX}/{name}").when
        return (self.prefix_dir / name).stat().st_mtime

    def reader(self) -> Store:
        """The control plane's handle on the store (a fresh one: its calls' deadline)."""
        if self.hub:
            return make_store(self.hub.server, REPO, self.hub.token)
        assert isinstance(self.layout, Layout)
        return _local_store(self.layout)

    def start(self, env: dict[str, str], process_env: dict[str, str] | None = None,
              ) -> subprocess.Popen[bytes]:
        """The runner as a process, the payload's env with ``env``; ``process_env`` adds
        to its own environment (its PYTHONPATH put first)."""
        extra = dict(process_env or {})
        if self.hub:
            self.hub.write_payload(env={**self.hub.payload()["env"], **env})
            argv, base = self.hub.args(), self.hub.environ()
        else:
            assert isinstance(self.layout, Layout)
            self.layout.write_payload(env={**self.layout.payload()["env"], **env})
            argv, base = [sys.executable, "-m", "fsm", *self.layout.run_args()], dict(os.environ)
        if "PYTHONPATH" in extra:
            extra["PYTHONPATH"] = os.pathsep.join(
                filter(None, [extra["PYTHONPATH"], base.get("PYTHONPATH")]))
        return subprocess.Popen(argv, env={**base, **extra},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def marker(self) -> dict[str, Any] | None:
        return (self.hub or self.layout).marker()


@pytest.fixture(params=["local", pytest.param("hub", marks=pytest.mark.hub)])
def world(request: pytest.FixtureRequest) -> _World:
    if request.param == "hub":
        hub_run = request.getfixturevalue("hub_run")
        return _World("hub", hub_run, hub_run)
    return _World("local", request.getfixturevalue("layout"), None)


def test_the_lease_is_kept_and_a_later_attempt_stops_the_runner_within_one_period(
    world: _World,
) -> None:
    world.write_worker(SAVES_ON_STOP)
    proc = world.start(LEASE_ENV)
    try:
        lease_path = world.prefix_dir / LEASE
        first = _poll("the lease at the worker's start", lambda: _lease_at(lease_path), 30)
        assert (first["attempt"], first["state"], first["ttl_s"]) == (0, "Train", TTL_S)
        assert first["run_id"] == "run-1"
        assert first["host"]["hostname"] == socket.gethostname() and first["host"]["id"]
        assert abs(first["renewed_at"] - time.time()) < 30
        # Renewed: a console tail carries it once it is half a period old.
        renewed = _poll("a renewal", lambda: (lease := _lease_at(lease_path)) is not None
                        and lease["seq"] > first["seq"] and lease, LEASE_S + 15)
        assert renewed["progress_at"] is not None
        # The control plane moved on: attempt 1's lease and console appear under the prefix.
        world.put(LATER, json.dumps({"attempt": 1, "seq": 0, "ttl_s": TTL_S}))
        world.put("console_sft.txt", "attempt 1's console\n")
        written = time.monotonic()
        _, err = proc.communicate(timeout=LEASE_S + 30)
        took = time.monotonic() - written
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, err.decode()[-3000:]
    assert took <= LEASE_S + 5, took
    marker = world.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, True, "superseded")
    assert marker["lease"]["superseded_by"] == LATER
    assert marker["lease"]["renewals"] >= 2
    # The lease went with the marker; nothing of this attempt landed once it found the
    # later one: not the worker's DONE (it was killed, not asked), not its final tail.
    assert not (world.prefix_dir / LEASE).exists()
    assert (world.prefix_dir / LATER).exists()
    # The final tail did not go up with the marker: the prefix's console is attempt 1's
    # or a periodic tail from before the runner found attempt 1, never this one's end.
    console = (world.prefix_dir / "console_sft.txt").read_text()
    assert "took over" not in console
    assert not (world.prefix_dir / "DONE").exists()
    assert not (world.prefix_dir / "metrics.json").exists()
    assert survivors(str(world.scratch)) == []


def test_a_dead_runner_reads_lost_only_after_its_ttl_by_the_stores_clock(
    world: _World,
) -> None:
    """The runner SIGKILLed and its worker's group SIGSTOPped (the host hung): its lease
    stays as it was. The reader says running until the lease is ttl_s old by the store's
    clock (a file's mtime, the Hub's commit date), unknown while no other commit shows the
    store working, and lost once one does, though commits keep landing up to the reading
    (the evidence is the repo's newest commit before the grace, not its last); with a
    commit of the repo while the renewal was late, lost well before the expiry's grace."""
    world.write_worker(SAVES_ON_STOP)
    proc = world.start(LEASE_ENV)
    pgid = None
    try:
        read_until(proc.stdout, b"step 3")
        _poll("the lease", lambda: _lease_at(world.prefix_dir / LEASE), 30)
        pgid = os.getpgid(int((world.scratch / "worker.pid").read_text()))
        os.killpg(pgid, signal.SIGSTOP)
        proc.kill()
        proc.communicate(timeout=30)
        changed = world.changed(LEASE)
        view = read_attempt(world.reader(), PREFIX, ARM, 0, now=changed + TTL_S - 1)
        assert (view.kind, view.state) == ("running", "Train"), view
        late = changed + TTL_S + GRACE_S + 5
        view = read_attempt(world.reader(), PREFIX, ARM, 0, now=late)
        assert view.kind == "unknown", view  # nothing shows the store took commits since
        # Other runs' runners committed after the lease expired, by the store's clock, and
        # kept committing up to the reading (a busy fleet's repo never stops taking them).
        for k, when in enumerate([changed + TTL_S + 1, late - 30, late - 10, late - 1]):
            world.put(lease_name(ARM, 0), json.dumps({"attempt": 0, "seq": k, "ttl_s": TTL_S}),
                      prefix=f"sft/run-{k + 2}/seed0", when=when)
        view = read_attempt(world.reader(), PREFIX, ARM, 0, now=late)
        assert (view.kind, view.state) == ("lost", "Train"), view
        assert view.since == pytest.approx(changed + TTL_S, abs=0.01)
        assert view.host is not None and view.host["hostname"] == socket.gethostname()
        early = read_attempt(world.reader(), PREFIX, ARM, 0, now=changed + TTL_S - 1)
        assert early.kind == "running"
        # Not GRACE_S after the expiry, but as soon as the repo shows a commit after it and
        # one a live runner's late renewal would have followed by now (issue 40's latency):
        # another run's commit LANDING_S after the renewal fell due, read GRACE_S later.
        witness = changed + LEASE_S + LANDING_S + 1
        for k, when in enumerate([witness, changed + TTL_S + 2]):  # in the order of their dates
            world.put(lease_name(ARM, 0), json.dumps({"attempt": 0, "seq": k, "ttl_s": TTL_S}),
                      prefix=f"sft/run-{k + 9}/seed0", when=when)
        soon = read_attempt(world.reader(), PREFIX, ARM, 0, now=witness + GRACE_S + 1)
        assert (soon.kind, soon.since) == ("lost", pytest.approx(changed + TTL_S, abs=0.01))
        view = read_attempt(world.reader(), PREFIX, ARM, 0, now=witness + GRACE_S - 2)
        assert view.kind == "unknown", view  # the witness is younger than the grace
    finally:
        if pgid is not None:
            os.killpg(pgid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_hosts_clock_ahead_then_stepped_back_reads_no_false_lost(
    world: _World, faketime: dict[str, str],  # noqa: F811 - the fixture imported above
) -> None:
    """The runner's wall clock is 10 minutes ahead, then steps back to 10 minutes behind:
    its leases' ``renewed_at`` says so, and the reader, judging by the store's clock,
    reads running all along."""
    Path(faketime["FAKETIME_TIMESTAMP_FILE"]).write_text("+600\n")
    world.write_worker("""
        stamp = Path(os.environ["FAKETIME_TIMESTAMP_FILE"])
        print("forward", flush=True)
        while not (SCRATCH / "back").exists():
            time.sleep(0.1)
        stamp.write_text("-600\\n")
        print("back", flush=True)
        while not (SCRATCH / "go").exists():
            time.sleep(0.1)
        complete()
    """)
    proc = world.start(LEASE_ENV, faketime)
    lease_path = world.prefix_dir / LEASE
    try:
        read_until(proc.stdout, b"forward")
        ahead = _poll("a lease written ahead", lambda: (lease := _lease_at(lease_path))
                      and lease["renewed_at"] > time.time() + 500 and lease, 40)
        assert read_attempt(world.reader(), PREFIX, ARM, 0).kind == "running"
        (world.scratch / "back").write_text("")
        read_until(proc.stdout, b"back")
        behind = _poll("a lease written behind", lambda: (lease := _lease_at(lease_path))
                       and lease["renewed_at"] < time.time() - 500 and lease, LEASE_S + 15)
        assert behind["seq"] > ahead["seq"]
        view = read_attempt(world.reader(), PREFIX, ARM, 0)
        assert view.kind == "running" and view.lease_age_s is not None, view
        assert view.lease_age_s < LEASE_S, view
        (world.scratch / "go").write_text("")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert not lease_path.exists()
    assert read_attempt(world.reader(), PREFIX, ARM, 0).kind == "succeeded"


@pytest.mark.hub
def test_a_429_window_longer_than_a_renewal_makes_the_lease_late_never_lost(
    hub_run: HubRun,
) -> None:
    """Every commit refused 429 for 45 s, longer than a renewal period: the renewal is
    late and tried again, the reader says running while the lease is within its ttl_s and
    unknown (never lost) past it while nothing lands, and when the window ends the marker
    lands and the lease is gone with it."""
    hub_run.write_worker("""
        while not (SCRATCH / "go").exists():
            print("working", flush=True)
            time.sleep(0.5)
        sys.exit(1)
    """)
    payload = hub_run.payload()
    proc = hub_run.start(env={**payload["env"], **LEASE_ENV, "FLASH_UPLOAD_CONSOLE": "0"})
    lease_path = hub_run.artifact(LEASE)
    try:
        _poll("the lease", lambda: _lease_at(lease_path), 30)
        # No commit admitted (its Retry-After says 5 s) until the quota is lifted.
        hub_run.server.set_quota(commits=0, window_s=5)
        closed = time.monotonic()
        changed = lease_path.stat().st_mtime

        def reader() -> Store:
            return make_store(hub_run.server, REPO, hub_run.token)

        _poll("a late renewal", lambda: any(
            r.throttled == "commits" for r in hub_run.server.requests), LEASE_S + 15)
        view = read_attempt(reader(), PREFIX, ARM, 0)
        assert view.kind == "running", view
        view = read_attempt(reader(), PREFIX, ARM, 0, now=changed + TTL_S + GRACE_S + 5)
        assert view.kind == "unknown", view
        (hub_run.scratch / "go").write_text("")  # the worker ends inside the window
        time.sleep(max(0.0, 45 - (time.monotonic() - closed)))  # the window's length
        hub_run.server.set_quota()
        opened = time.monotonic()
        err = hub_run.finish(proc, timeout=90)
        landed_after = time.monotonic() - opened
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and marker["rule"] == "worker-failed"
    assert marker["lease"]["late"] >= 1
    assert not lease_path.exists()
    assert landed_after < 15, landed_after


@pytest.mark.parametrize("value", ["10", "nan", "soon", "-30"])
def test_an_unusable_lease_period_is_one_line_and_a_marker(layout: Layout, value: str) -> None:
    layout.write_worker("complete()")
    layout.write_payload(env={"FLASH_LEASE_S": value})
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.decode().splitlines() if "FLASH_LEASE_S" in line]
    assert lines and "Traceback" not in proc.stderr.decode()
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "payload-invalid"
    assert "FLASH_LEASE_S" in marker["error"]


def test_a_lease_of_a_short_attempt_is_gone_with_its_marker_and_none_with_the_lease_off(
    layout: Layout,
) -> None:
    layout.write_worker("complete()")
    layout.write_payload(env={"FLASH_LEASE_S": str(LEASE_S)})
    outcome = layout.run()
    assert outcome.exit_code == 0
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["lease"]["period_s"] == LEASE_S
    assert not (layout.store / PREFIX / LEASE).exists()
    layout.write_payload(env={"FLASH_LEASE_S": "0"})
    (layout.store / PREFIX / f"{ARM}_attempt0.json").unlink()
    for stale in layout.root.glob("flash/.flash-*"):
        stale.unlink()
    outcome = layout.run()
    marker = layout.marker()
    assert marker is not None and "lease" not in marker
    assert sorted(p.name for p in (layout.store / PREFIX).iterdir()) == [
        "DONE", f"{ARM}_attempt0.json", "metrics.json"]
