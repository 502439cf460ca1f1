"""The fleet view: ``flash-bootstrap status --prefix P --recursive`` (``fsm/ops/fleet.py``)
lists the latest attempt of every run below a folder, with the host it ran on, and ends
with one summary line by class, by rule and by failing host; ``--json`` gives the same as
one object. One bounded listing of the whole tree (paginated on the Hub), one download per
marker shown.

On a local store of 1,000 runs holding 2,000 attempts (and on the local Hub server, its
listings cut into pages of 40 entries) through the real command, ``python -m fsm``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from fsm.ops import fleet
from fsm.testing import LocalHubServer

REPO = "org/fleet"
RUNS = 1_000
#: What run r's attempts end with: (rule, ok, retriable) of attempt 0, then of attempt 1.
RULES = [("completion-confirmed", True, False), ("worker-failed", False, False),
         ("host-gpu-lost", False, True), ("worker-stalled", False, True)]
_AMBIENT = ("FLASH_STORE", "HF_TOKEN", "HF_ENDPOINT")


def _marker(run: int, attempt: int, now: float) -> dict[str, Any]:
    rule, ok, retriable = RULES[(run + attempt) % len(RULES)]
    return {"ok": ok, "ts": now - 60 * run - attempt, "attempt": attempt,
            "retriable": retriable, "error": "" if ok else f"{rule} on run {run}",
            "rule": rule, "state": "VerifyRemote", "run_id": f"run-{run}",
            "host": {"hostname": f"gpu-node-{run % 7}", "gpus": []}}


def _folder(run: int) -> str:
    return f"sft/team-{run % 4}/run-{run:04d}/seed{run % 3}"


def _lay_out(put: Any, runs: int, now: float) -> None:
    """``runs`` runs of two attempts each, with the files a run leaves besides its markers,
    and names that only look like markers."""
    for run in range(runs):
        folder = _folder(run)
        for attempt in (0, 1):
            put(f"{folder}/lambda_attempt{attempt}.json", json.dumps(_marker(run, attempt, now)))
        put(f"{folder}/console_sft.txt", "last line\n")
    put("sft/team-0/run-0000/seed0/lambda_attempt01.json", json.dumps(_marker(0, 9, now)))
    put("sft/team-0/run-0000/seed0/lambda_attempt1.json.bak", "{}")
    put("sft/README.md", "not a run")


def _expected(runs: int) -> tuple[list[tuple[str, str, str]], Counter[str], Counter[str]]:
    rows, classes, rules = [], Counter[str](), Counter[str]()
    for run in sorted(range(runs), key=_folder):
        rule, ok, retriable = RULES[(run + 1) % len(RULES)]
        verdict = "succeeded" if ok else "retriable" if retriable else "fatal"
        rows.append((_folder(run), verdict, rule))
        classes[verdict] += 1
        if not ok:
            rules[rule] += 1
    return rows, classes, rules


def fsm_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in _AMBIENT}
    return subprocess.run([sys.executable, "-m", "fsm", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)


def _hub_status(hub_server: LocalHubServer, hub_token: str) -> Any:
    """``status --recursive --json`` of the Hub's ``sft`` prefix: exit 0, nothing on
    stderr, the token nowhere in the answer; the answer's JSON."""
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft", "--recursive", "--json",
                   "--store", hub_server.url, env={"HF_TOKEN": hub_token})
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr[-2000:]
    assert hub_token not in proc.stdout
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fleet-view") / "store"

    def put(path: str, text: str) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)

    _lay_out(put, RUNS, time.time())
    return root


def test_the_latest_attempt_of_every_run_with_a_summary_on_a_local_store(store: Path) -> None:
    """2,000 attempts in 1,000 runs: one row per run (its attempt 1, of two), the host,
    and the summary line last; look-alike names are no markers."""
    started = time.monotonic()
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft/", "--recursive",
                   "--store", store.as_uri())
    took = time.monotonic() - started
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["RUN", "ARM", "ATTEMPT", "OUTCOME", "CLASS", "RULE", "AGE",
                                "STATE", "HOST", "RUN_ID"]
    rows = [line.split() for line in lines[1:-1]]
    expected, classes, rules = _expected(RUNS)
    assert [(r[0], r[4], r[5]) for r in rows] == expected
    assert {r[2] for r in rows} == {"1"}  # attempt 01 is not attempt 1, nor attempt 9
    assert rows[0][8] == "gpu-node-0"
    summary = lines[-1]
    assert summary.startswith(f"{RUNS} runs: ")
    for verdict, n in classes.items():
        assert f"{verdict} {n}" in summary
    for rule, n in rules.items():
        assert f"{rule} {n}" in summary
    print(f"status --recursive, {RUNS} runs, {2 * RUNS} attempts, local store: {took:.2f}s")


def test_the_json_fleet_view_is_one_object_of_runs_and_summary(store: Path) -> None:
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft/team-1", "--recursive",
                   "--json", "--store", store.as_uri())
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr[-2000:]
    value = json.loads(proc.stdout)
    runs = [r for r in range(RUNS) if r % 4 == 1]
    assert [row["run"] for row in value["runs"]] == sorted(_folder(r) for r in runs)
    first = value["runs"][0]
    assert (first["attempt"], first["attempts"], first["host"]) == (1, 2, "gpu-node-1")
    summary = value["summary"]
    assert summary["runs"] == len(runs) == sum(summary["class"].values())
    failed = sum(n for verdict, n in summary["class"].items() if verdict != "succeeded")
    assert sum(summary["rule"].values()) == failed == sum(summary["failed_hosts"].values())


def test_a_hostile_marker_is_shown_as_unreadable_and_nan_is_no_json(tmp_path: Path) -> None:
    """A non-JSON marker, a link out of the store's root, NaN in a marker: the view still
    answers, each shown for what it is, in JSON that a strict parser reads; the link's
    target is never read."""
    folder = tmp_path / "store" / "sft" / "a"
    folder.mkdir(parents=True)
    secret = tmp_path / "outside.json"
    secret.write_text('{"ok": true, "rule": "completion-confirmed", "run_id": "SECRET"}')
    (tmp_path / "store" / "sft" / "c").mkdir()
    (tmp_path / "store" / "sft" / "c" / "lambda_attempt0.json").symlink_to(secret)
    (folder / "lambda_attempt0.json").write_text('{"ok": false, "ts": NaN, "retriable": true, '
                                                 '"rule": "worker-stalled", "x": Infinity}')
    (tmp_path / "store" / "sft" / "b").mkdir()
    (tmp_path / "store" / "sft" / "b" / "lambda_attempt3.json").write_text("[1, 2]")
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft", "--recursive", "--json",
                   "--store", (tmp_path / "store").as_uri())
    assert proc.returncode == 0, proc.stderr
    value = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    a, b, c = value["runs"]
    assert (a["run"], a["class"], a["ts"], a["age_s"]) == ("sft/a", "retriable", None, None)
    assert (b["run"], b["outcome"], b["class"]) == ("sft/b", "unreadable", None)
    assert (c["run"], c["outcome"]) == ("sft/c", "unreadable")
    assert c["problem"].startswith("refused: ") and "SECRET" not in proc.stdout
    assert value["summary"]["class"] == {"unreadable": 2, "retriable": 1}


def test_a_prefix_holding_more_than_the_bound_is_refused_in_one_line(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing is bounded: past MAX_LISTED files it stops and says so (exit 1)."""
    monkeypatch.setattr(fleet, "MAX_LISTED", 100)
    said: list[str] = []
    code = fleet.status(repo=REPO, prefix="sft", url=store.as_uri(), as_json=False,
                        environ={}, timeout_s=30, say=said.append, recursive=True)
    assert code == 1
    assert said == [f"status: more than 100 files under sft/ in {store.as_uri()}: "
                    "choose a narrower --prefix"]


@pytest.mark.hub
def test_the_fleet_view_on_the_hub_reads_every_page_and_each_shown_marker_once(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """150 runs (300 attempts) behind pages of 40 entries: every page is followed, the
    listing is the only one, and each marker shown is downloaded once, the others never."""
    runs = 150
    hub_server.create_repo(REPO)
    _lay_out(lambda path, text: hub_server.add_file(REPO, path, text), runs, time.time())
    hub_server.set_tree_page(40)
    hub_server.clear_requests()
    value = _hub_status(hub_server, hub_token)
    expected, classes, _ = _expected(runs)
    assert [(r["run"], r["class"], r["rule"]) for r in value["runs"]] == expected
    assert value["summary"]["class"] == dict(classes)

    requests = hub_server.requests
    trees = [r for r in requests if "/tree/" in r.path]
    entries = len(list((hub_server.repo_dir(REPO) / "sft").rglob("*")))
    assert len(trees) == math.ceil(entries / 40) > 10
    assert len({r.query for r in trees}) == len(trees)  # each page once, a cursor each
    # The library asks for a file's metadata (HEAD) before its GET: the GETs are the reads.
    gets = sorted(r.path.split("/resolve/main/", 1)[-1] for r in requests
                  if "/resolve/" in r.path and r.method == "GET")
    assert gets == sorted(f"{folder}/lambda_attempt1.json" for folder, _, _ in expected)


@pytest.mark.hub
def test_on_a_store_too_slow_for_the_timeout_what_was_read_is_shown_and_the_rest_said(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """A marker whose download hangs past --timeout: the runs before it are shown, it and
    the runs after it are rows "not read", and one line says how many (exit 1)."""
    runs = 12
    hub_server.create_repo(REPO)
    _lay_out(lambda path, text: hub_server.add_file(REPO, path, text), runs, time.time())
    order = sorted(range(runs), key=_folder)
    stuck = _folder(order[5])
    hub_server.hang("GET", f"/resolve/main/{stuck}/lambda_attempt1.json", seconds=60, times=5)
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft", "--recursive", "--json",
                   "--timeout", "4", "--store", hub_server.url, env={"HF_TOKEN": hub_token})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        "flash-bootstrap: status: --timeout 4s reached: 7 of 12 markers not read (shown as "
        "unreadable, 'not read: --timeout reached'); a longer --timeout reads them")
    rows = json.loads(proc.stdout)["runs"]
    assert [r["run"] for r in rows] == [_folder(r) for r in order]
    assert [r["outcome"] == "unreadable" for r in rows] == [False] * 5 + [True] * 7
    assert {r.get("problem") for r in rows[5:]} == {fleet.NOT_READ}


@pytest.mark.hub
def test_plain_status_on_a_store_too_slow_for_the_timeout_shows_what_it_read(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """One run's folder of many attempts, one download hanging past --timeout: the
    attempts before it are shown, the rest are rows "not read" (issue 26 item 5)."""
    hub_server.create_repo(REPO)
    now = time.time()
    for attempt in range(8):
        hub_server.add_file(REPO, f"sft/r/lambda_attempt{attempt}.json", json.dumps(
            {"ok": False, "ts": now - 60, "attempt": attempt, "retriable": True,
             "error": "x", "rule": "worker-host-fault"}))
    hub_server.hang("GET", "/resolve/main/sft/r/lambda_attempt3.json", seconds=60, times=5)
    proc = fsm_cli("status", "--repo", REPO, "--prefix", "sft/r", "--json", "--timeout", "4",
                   "--store", hub_server.url, env={"HF_TOKEN": hub_token})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "5 of 8 markers not read" in proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["attempt"] for r in rows] == list(range(8))
    assert [r["outcome"] == "unreadable" for r in rows] == [False] * 3 + [True] * 5


@pytest.mark.hub
def test_hostile_markers_on_the_hub_are_shown_unreadable_and_the_rest_read(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """On the Hub: a 2 MB marker, one that is not JSON, NaN, a look-alike name beside good
    markers (issue 26 item 5): status lists each attempt once, --json stays JSON, and
    explain still explains a good one."""
    hub_server.create_repo(REPO)
    good = {"ok": False, "ts": time.time() - 60, "attempt": 0, "retriable": True,
            "error": "worker exited 1", "rule": "worker-host-fault"}
    hub_server.add_file(REPO, "sft/r/lambda_attempt0.json", json.dumps(good))
    hub_server.add_file(REPO, "sft/r/lambda_attempt1.json",
                        '{"ok": false, "ts": NaN, "attempt": 1, "retriable": true, "error": "n"}')
    hub_server.add_file(REPO, "sft/r/lambda_attempt01.json", json.dumps({**good, "attempt": 1}))
    hub_server.add_file(REPO, "sft/r/lambda_attempt2.json", "not json {")
    hub_server.add_file(REPO, "sft/r/lambda_attempt3.json", "x" * (2 << 20))
    env = {"HF_TOKEN": hub_token}
    args = ("--repo", REPO, "--prefix", "sft/r", "--store", hub_server.url)

    listed = fsm_cli("status", *args, "--json", env=env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = json.loads(listed.stdout)
    assert [r["file"] for r in rows] == [f"lambda_attempt{i}.json" for i in range(4)]
    assert [r["outcome"] for r in rows] == ["failed", "failed", "unreadable", "unreadable"]
    assert rows[1]["ts"] is None

    explained = fsm_cli("explain", *args, "--attempt", "0", env=env)
    assert explained.returncode == 0, explained.stderr[-2000:]
    assert "worker exited 1" in explained.stdout


@pytest.mark.hub
def test_the_fleet_view_judges_leases_on_the_hub_with_one_dated_listing_per_leased_run(
    hub_server: LocalHubServer, hub_token: str
) -> None:
    """Runs whose latest attempt has a lease and no marker (CONTRACT section 10): the tree
    is listed once, each such run's folder once more with its files' commits (the tree
    carries no times), each lease is read once, no other marker is read, and the repo's
    last commit is asked for at most once. One lease renewed 2 minutes ago, one stale for
    half an hour: running, and lost (a commit landed since)."""
    now = time.time()
    runs = 12
    hub_server.create_repo(REPO)
    _lay_out(lambda path, text: hub_server.add_file(REPO, path, text, when=now - 7200), runs,
             now)

    def lease(attempt: int, host: str) -> str:
        return json.dumps({"attempt": attempt, "run_id": "r", "state": "Train", "seq": 3,
                           "host": {"id": host, "hostname": host}, "ttl_s": 900.0,
                           "renewed_at": now, "progress_at": None})

    stale, fresh = _folder(3), _folder(5)
    hub_server.add_file(REPO, f"{stale}/lambda_attempt2.lease.json", lease(2, "gpu-dead"),
                        when=now - 1800)
    hub_server.add_file(REPO, f"{fresh}/lambda_attempt2.lease.json", lease(2, "gpu-live"),
                        when=now - 120)
    hub_server.clear_requests()
    value = _hub_status(hub_server, hub_token)
    by_run = {row["run"]: row for row in value["runs"]}
    assert len(by_run) == runs
    assert (by_run[stale]["class"], by_run[stale]["host"], by_run[stale]["attempts"]) == (
        "lost", "gpu-dead", 3)
    assert (by_run[fresh]["class"], by_run[fresh]["state"]) == ("running", "Train")
    assert value["summary"]["class"]["lost"] == 1 == value["summary"]["failed_hosts"]["gpu-dead"]

    trees = [r for r in hub_server.requests if "/tree/" in r.path]
    dated = [unquote(r.path.split("/tree/main/", 1)[-1]) for r in trees
             if "expand=true" in r.query.lower()]
    assert len(trees) - len(dated) == 1  # the tree's one listing
    assert sorted(dated) == sorted([stale, fresh])
    gets = [r.path.split("/resolve/main/", 1)[-1] for r in hub_server.requests
            if "/resolve/" in r.path and r.method == "GET"]
    assert sorted(p for p in gets if p.endswith(".lease.json")) == sorted(
        [f"{stale}/lambda_attempt2.lease.json", f"{fresh}/lambda_attempt2.lease.json"])
    assert not any(p.startswith((stale, fresh)) and p.endswith("attempt1.json") for p in gets)
    infos = [r for r in hub_server.requests if r.path.endswith(f"/datasets/{REPO}")]
    assert len(infos) <= 1
