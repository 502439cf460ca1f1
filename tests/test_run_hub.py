"""Whole attempts on the Hub adapter: the runner and a real worker process against the
local Hub API server, both speaking through the real ``huggingface_hub`` client.

The worker uploads its artifacts with ``HfApi(...).upload_file(..., repo_type="dataset")``
to ``HF_ENDPOINT`` (which the runner hands it, from ``HubStore.worker_env``). The code
tree and spilled specs are put into the dataset repo with the server's ``add_file``.

Every test carries a per-test canary token (the plugin's ``hub_token``) that the server
checks. The ``hub_run`` fixture fails the test if that token shows up in a structlog
event, a stdlib log record, the runner's stderr, an outcome's reason or failure, a marker,
or any file under the test's directory (the server's repos included) other than the
payload that carries it.

In-process runs use ``run_attempt(..., handle_signals=False, hard_exit=...)`` with a
``hard_exit`` that records the call, so a watchdog firing fails the test instead of
killing pytest. Retry and backoff knobs are set small so the file runs in seconds.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TRAIN_PATH, read_until
from hubrun import ARM, CALL_TIMEOUT_S, PREFIX, REPO, HubRun

from fsm.store.base import PRELOAD_IGNORE_PATTERNS
from fsm.testing import LocalHubServer
from fsm.testing.hubserver import RequestRecord

pytestmark = pytest.mark.hub

MARKER = f"{ARM}_attempt0.json"
SENTINEL = ".cache-mounted"
#: The dataset repo's head (its refs): the code fetch's first request.
LISTING = rf"^/api/datasets/{REPO}/refs$"
#: The file downloads of the code tree.
CODE_GETS = r"/resolve/[^/]+/code/"

# --- helpers -------------------------------------------------------------------------------


def _let_through(server: LocalHubServer, method: str, path_regex: str, times: int) -> None:
    """Serve the next ``times`` matching requests normally (a zero-second hang), so that a
    fault added after this one hits only the requests that come after them."""
    server.hang(method, path_regex, seconds=0, times=times)


def _statuses(server: LocalHubServer, method: str, path_regex: str) -> list[int | None]:
    """The statuses of the requests matching ``method`` and ``path_regex``, in order."""
    pattern = re.compile(path_regex)
    return [r.status for r in server.requests
            if r.method == method and pattern.search(r.path)]


def _no_lease(hub_run: HubRun) -> dict[str, str]:
    """The fixture's payload env without the lease: these tests count and fault the
    commits in order, and the lease's first write races the worker's (tests/test_lease.py
    tests the lease with the marker's commit)."""
    return {**hub_run.payload()["env"], "FLASH_LEASE_S": "0"}


def _commits(server: LocalHubServer) -> list[RequestRecord]:
    return [r for r in server.requests if r.method == "POST" and "/commit/" in r.path]


# --- success ---------------------------------------------------------------------------------


def test_a_worker_uploading_through_the_hub_client_succeeds_and_the_marker_lands_last(
    hub_run: HubRun,
) -> None:
    hub_run.write_worker("print('training', flush=True); complete()")
    outcome = hub_run.run()
    assert outcome.exit_code == 0, outcome.reason
    assert outcome.context.path == TRAIN_PATH
    assert json.loads(hub_run.artifact("metrics.json").read_text()) == {"loss": 0.25}
    assert float(hub_run.artifact("DONE").read_text()) > 0
    marker = hub_run.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["error"], marker["rule"]) == (
        True, False, "", "completion-confirmed")
    assert marker["worker"]["exit_code"] == 0
    assert marker == hub_run.local_marker()
    # Four commits: the lease as the worker starts, the worker's metrics.json and DONE,
    # then the runner's marker, last, which removed the lease.
    assert [r.status for r in _commits(hub_run.server)] == [200, 200, 200, 200]
    assert not hub_run.artifact(f"{ARM}_attempt0.lease.json").exists()
    assert marker["lease"]["renewals"] == 1
    landed = hub_run.artifact(MARKER).stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= landed for p in hub_run.artifact("").iterdir())
    assert b"training" in (hub_run.root / "stdout.bin").read_bytes()


def test_the_runner_as_a_process_succeeds_against_the_hub_server(hub_run: HubRun) -> None:
    hub_run.write_worker("complete()")
    proc = hub_run.cli()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"attempt 0 succeeded" in proc.stderr
    assert hub_run.artifact("DONE").is_file()
    assert hub_run.artifact("metrics.json").is_file()
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["path"] == TRAIN_PATH[:-1]


def test_a_spilled_spec_is_fetched_from_the_hub_and_reaches_the_worker(
    hub_run: HubRun,
) -> None:
    hub_run.server.add_file(
        REPO,
        f"{PREFIX}/job_spec.json",
        json.dumps({"hf_repo": REPO, "hf_prefix": PREFIX, "spilled": True}),
    )
    hub_run.write_worker("assert SPEC['spilled'] is True, SPEC; complete()")
    outcome = hub_run.run(job_spec_json=None, job_spec_in_hf=True)
    assert outcome.exit_code == 0, outcome.reason
    assert _statuses(hub_run.server, "GET", f"/resolve/main/{PREFIX}/job_spec.json$") == [200]
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True


# --- an unavailable store --------------------------------------------------------------------


def test_the_code_fetch_recovers_from_transient_503s(hub_run: HubRun) -> None:
    server = hub_run.server
    hub_run.write_worker("complete()")
    # The fetch's requests: the repo's head, the listing of code/ at that commit, and the
    # file GETs of code/**. Each fails twice, then is served.
    listing, snapshot, files = LISTING, r"^/api/datasets/.+/tree/", CODE_GETS
    for pattern in (listing, snapshot, files):
        server.fail("GET", pattern, status=503, times=2)
    outcome = hub_run.run()
    assert outcome.exit_code == 0, outcome.reason
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["path"] == TRAIN_PATH[:-1]
    for pattern in (listing, snapshot, files):
        seen = _statuses(server, "GET", pattern)
        assert seen[:2] == [503, 503] and seen[-1] == 200, (pattern, seen)
    # The adapter logged its own retries; the library retries some requests itself (2.x:
    # the listing, 1 s then 2 s), which the adapter's bound may cut short (no status).
    retries = [e for e in hub_run.logs if e.get("event") == "store.retry"]
    assert retries and {e["status"] for e in retries} <= {503, None}
    assert {e["op"] for e in retries} & {"head", "list", "fetch"}


def test_a_store_answering_503_to_the_code_fetch_is_retriable_and_the_marker_still_lands(
    hub_run: HubRun,
) -> None:
    hub_run.write_worker("complete()")
    # Every GET fails: the code fetch cannot proceed. Uploads (POST) still work.
    hub_run.server.fail("GET", r".", status=503, times=10_000)
    outcome = hub_run.run()
    assert outcome.exit_code == 75
    marker = hub_run.marker()
    assert marker is not None, "the marker upload does not use the failing GETs"
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, True, "store-unavailable", "FetchCode")
    assert "HTTP 503" in marker["error"]
    assert marker == hub_run.local_marker()
    # Bounded: FLASH_STORE_MAX_ATTEMPTS tries of the listing, no more.
    assert _statuses(hub_run.server, "GET", LISTING) == [503, 503, 503]
    assert not hub_run.artifact("DONE").exists()


# --- a wrong token ---------------------------------------------------------------------------


def test_a_wrong_token_is_fatal_store_auth_and_the_marker_stays_local(hub_run: HubRun) -> None:
    """The server refuses the wrong token for every request, the marker upload included:
    the marker never reaches the repo, and no rerun of the payload can change that, so the
    run exits 78 (refused for good) and its last line says what to fix. What is left to
    check is the runner's local copy in ``<scratch>/<arm>_attempt<N>.json``, its exit
    status and its one stderr line."""
    wrong = f"hf_wrong_{hub_run.token}"
    hub_run.secrets.append(wrong)
    hub_run.write_worker("complete()")
    proc = hub_run.cli(env={"HF_TOKEN": wrong, "FLASH_STOP_GRACE_S": "2"})
    assert proc.returncode == 78, proc.stderr.decode()[-3000:]
    last_line = proc.stderr.decode().strip().splitlines()[-1]
    assert "fatal, rule store-auth" in last_line
    assert "marker NOT published: the store refuses it for good" in last_line
    assert "give HF_TOKEN a token that may write to org/flash-runs" in last_line
    assert "running the same payload again publishes it" not in last_line
    local = hub_run.local_marker()
    assert local is not None
    assert (local["ok"], local["retriable"], local["rule"], local["state"]) == (
        False, False, "store-auth", "FetchCode")
    assert "401" in local["error"]
    hub_run.texts.append(json.dumps(local))
    assert hub_run.marker() is None
    # Refused at once, not retried: one listing request, one marker commit attempt at most.
    statuses = [r.status for r in hub_run.server.requests]
    assert set(statuses) == {401}
    assert _statuses(hub_run.server, "GET", LISTING) == [401]
    assert len([r for r in hub_run.server.requests if "/preupload/" in r.path]) == 1


@pytest.mark.parametrize("problem", ["line-break", "oversized"])
def test_a_token_no_request_can_carry_is_refused_for_good_and_says_what_to_fix(
    hub_run: HubRun, problem: str
) -> None:
    """A token read with its newline is never sent (every call refuses at once); one too
    large for a header is answered 431. Either way no rerun can publish the marker: exit 78,
    the last line names the fix and never promises that running again publishes it; the
    result is kept next to the payload, and a rerun with the token fixed publishes it."""
    bad = hub_run.token + ("\n" if problem == "line-break" else "x" * 70_000)
    hub_run.secrets.append(bad)
    hub_run.write_worker("complete()")
    proc = hub_run.cli(env={"HF_TOKEN": bad, "FLASH_STOP_GRACE_S": "2"})
    assert proc.returncode == 78, proc.stderr.decode()[-3000:]
    last = _last_line(proc.stderr)
    assert "marker NOT published: the store refuses it for good" in last
    assert "fatal, rule store-refused" in last
    assert "running the same payload again publishes it" not in last
    if problem == "line-break":
        assert "the token (HF_TOKEN) holds a line break" in last
        assert hub_run.server.requests == []  # nothing was sent with it
    else:
        assert "HTTP 431" in last and "give it the token alone" in last
    kept = hub_run.payload_path.parent / f".flash-{ARM}_attempt0.result.json"
    assert f"the result is kept at {kept}" in last
    assert json.loads(kept.read_text())["marker"]["rule"] == "store-refused"
    assert hub_run.marker() is None
    rerun = hub_run.cli()  # the token fixed: the persisted outcome is what gets published
    assert rerun.returncode == 1, rerun.stderr.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and marker["rule"] == "store-refused"


def test_a_replay_that_cannot_publish_either_says_the_result_is_still_persisted(
    hub_run: HubRun,
) -> None:
    """The store fails every commit: the first run exits 3, and so does the replay, whose
    last line says where the result still is (never that it could not be persisted)."""
    hub_run.write_worker("complete()")
    hub_run.server.fail("POST", r"/commit/", status=503, times=1000)
    first = hub_run.cli()
    assert first.returncode == 3, first.stderr.decode()[-3000:]
    kept = hub_run.payload_path.parent / f".flash-{ARM}_attempt0.result.json"
    replay = hub_run.cli()
    assert replay.returncode == 3, replay.stderr.decode()[-3000:]
    assert b'"marker.replay"' in replay.stderr
    last = _last_line(replay.stderr)
    assert f"the result is persisted at {kept} and running the same payload again" in last
    assert "could not be persisted" not in last


def test_an_outcome_neither_published_nor_persisted_exits_74_and_says_so(hub_run: HubRun) -> None:
    """The store fails every commit and the result cannot be written next to the payload:
    exit 74, and the last line says a rerun runs the attempt again (no promise of a replay)."""
    kept = hub_run.payload_path.parent / f".flash-{ARM}_attempt0.result.json"
    (kept / "in-the-way").mkdir(parents=True)  # a directory where the result would go
    hub_run.write_worker("complete()")
    hub_run.server.fail("POST", r"/commit/", status=503, times=1000)
    proc = hub_run.cli()
    assert proc.returncode == 74, proc.stderr.decode()[-3000:]
    last = _last_line(proc.stderr)
    assert "could not be persisted next to the payload either" in last
    assert "running the same payload again runs the attempt again" in last


# --- hung store calls ------------------------------------------------------------------------


def test_a_hung_listing_during_the_code_fetch_is_bounded_and_retriable(
    hub_run: HubRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang_s = 30.0
    tries = 2
    monkeypatch.setenv("FLASH_STORE_MAX_ATTEMPTS", str(tries))
    hub_run.write_worker("complete()")
    hub_run.server.hang("GET", r"^/api/datasets/", seconds=hang_s, times=100)
    started = time.monotonic()
    outcome = hub_run.run(max_wall_s=60)
    elapsed = time.monotonic() - started
    # Each try is abandoned after FLASH_STORE_CALL_TIMEOUT_S; the backoffs are short. The
    # run ends long before the hang (or the 60 s deadline) would have ended it.
    assert tries * CALL_TIMEOUT_S <= elapsed < tries * CALL_TIMEOUT_S + 3, elapsed
    assert elapsed < hang_s / 2
    assert outcome.exit_code == 75
    marker = hub_run.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, True, "store-unavailable", "FetchCode")
    # The adapter's bound and the HTTP client's own read timeout are the same length:
    # whichever fires first names the failure (both say the call timed out).
    assert "no answer within" in marker["error"] or "TimeoutError" in marker["error"]
    hung = [r for r in hub_run.server.requests if r.fault == "hang"]
    assert len(hung) == tries and all(r.status is None for r in hung)


def test_a_hung_first_marker_commit_is_abandoned_and_retried_so_the_marker_lands(
    hub_run: HubRun,
) -> None:
    hang_s = 30.0
    hub_run.write_worker("complete()")
    # The worker's two commits (metrics.json, DONE) go through; the next one, the
    # runner's marker, hangs far longer than the call timeout.
    _let_through(hub_run.server, "POST", r"/commit/", times=2)
    hub_run.server.hang("POST", r"/commit/", seconds=hang_s, times=1)
    started = time.monotonic()
    outcome = hub_run.run(max_wall_s=60, env=_no_lease(hub_run))
    elapsed = time.monotonic() - started
    assert outcome.exit_code == 0, outcome.reason
    assert CALL_TIMEOUT_S <= elapsed < hang_s / 2, elapsed
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    commits = _commits(hub_run.server)
    assert [(r.fault, r.status) for r in commits] == [
        ("hang", 200), ("hang", 200), ("hang", None), (None, 200)]


def test_a_marker_commit_failing_twice_with_503_is_retried_until_it_lands(
    hub_run: HubRun,
) -> None:
    hub_run.write_worker("complete()")
    _let_through(hub_run.server, "POST", r"/commit/", times=2)  # the worker's two commits
    hub_run.server.fail("POST", r"/commit/", status=503, times=2)
    outcome = hub_run.run(env=_no_lease(hub_run))
    assert outcome.exit_code == 0, outcome.reason
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert [r.status for r in _commits(hub_run.server)] == [200, 200, 503, 503, 200]
    retried = [e for e in hub_run.logs if e.get("event") == "store.retry"]
    assert [(e["path"], e["status"]) for e in retried] == [(f"{PREFIX}/{MARKER}", 503)] * 2


# --- preload ---------------------------------------------------------------------------------


def _add_model(server: LocalHubServer, repo_id: str) -> None:
    server.add_file(repo_id, "config.json", json.dumps({"model": repo_id}), "model")
    server.add_file(repo_id, "model.safetensors", b"\x00" * 4096, "model")
    server.add_file(repo_id, "original/consolidated.pth", b"skip me", "model")
    server.add_file(repo_id, "weights.gguf", b"skip me too", "model")


def test_preload_warms_two_models_from_the_hub_and_a_second_preload_finds_them_cached(
    hub_run: HubRun,
) -> None:
    from huggingface_hub import snapshot_download

    models = ["org/alpha", "org/beta"]
    for repo_id in models:
        _add_model(hub_run.server, repo_id)
    mount = hub_run.root / "mnt"
    mount.mkdir()
    (mount / SENTINEL).write_text("")
    hf_home = mount / "hf"
    preload: dict[str, Any] = {
        "mode": "preload",
        "models": models,
        "phase": None,
        "seed": None,
        "job_spec_json": None,
        "cache_mount_marker": SENTINEL,
        "env": {"HF_TOKEN": hub_run.token, "HF_HOME": str(hf_home)},
    }

    first = hub_run.run(**preload)
    assert first.exit_code == 0, first.reason
    assert first.context.path == ["LoadPayload", "Preload", "Mark", "Succeeded"]
    result = json.loads(hub_run.artifact("preload_result.json").read_text())
    assert result == {"preloaded": models, "already_cached": [], "failed": {}}
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    for repo_id in models:
        snapshot = Path(snapshot_download(
            repo_id,
            cache_dir=str(hf_home / "hub"),
            ignore_patterns=list(PRELOAD_IGNORE_PATTERNS),
            local_files_only=True,
        ))
        assert json.loads((snapshot / "config.json").read_text()) == {"model": repo_id}
        assert (snapshot / "model.safetensors").stat().st_size == 4096
        assert not (snapshot / "original").exists()
        assert not (snapshot / "weights.gguf").exists()
    # Nothing the preload skips was ever downloaded.
    assert not [r for r in hub_run.server.requests
                if r.method == "GET" and r.path.endswith((".pth", ".gguf"))]

    second = hub_run.run(**preload, attempt=1)
    assert second.exit_code == 0, second.reason
    result = json.loads(hub_run.artifact("preload_result.json").read_text())
    assert result == {"preloaded": [], "already_cached": models, "failed": {}}
    marker = hub_run.marker(attempt=1)
    assert marker is not None and marker["ok"] is True


# --- after a signal, the marker first; exit 3 when it cannot land; the process leaves ------


def _last_line(stderr: bytes) -> str:
    return stderr.decode().strip().splitlines()[-1]


def test_after_sigterm_a_hung_console_tail_neither_holds_the_marker_back_nor_lands_after_it(
    hub_run: HubRun,
) -> None:
    """The first periodic console tail's commit hangs past Docker's stop timeout. A SIGTERM
    then still gets the marker out within 10 s, and when the hung tail commit finally
    reaches the repo it is refused: nothing of the attempt lands after the marker."""
    hang_s = 12.0
    hub_run.write_worker("""
        print("ready", flush=True)
        time.sleep(600)
    """)
    hub_run.server.hang("POST", r"/commit/", seconds=hang_s, times=1)
    env = {"HF_TOKEN": hub_run.token, "FLASH_STOP_GRACE_S": "2", "FLASH_UPLOAD_CONSOLE": "1",
           "FLASH_CONSOLE_UPLOAD_INTERVAL_S": "5"}
    proc = hub_run.start(env=env)
    read_until(proc.stdout, b"ready")
    assert hub_run.server.wait_for(
        lambda reqs: any(r.fault == "hang" and "/commit/" in r.path for r in reqs), timeout=20
    ), "the periodic tail never started"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    err = hub_run.finish(proc)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 75, err.decode()[-3000:]
    assert elapsed < 10, elapsed
    marker = hub_run.marker()
    assert marker is not None and (marker["retriable"], marker["rule"]) == (True, "interrupted")
    tail = hub_run.artifact("console_sft.txt").read_bytes()
    assert b"runner got SIGTERM" in tail  # the final tail, from the marker's own commit
    # The hung tail commit is answered after the marker, and refused.
    assert hub_run.server.wait_for(
        lambda reqs: any(r.fault == "hang" and r.ended_at is not None for r in reqs),
        timeout=hang_s + 5,
    )
    hung = next(r for r in _commits(hub_run.server) if r.fault == "hang")
    assert hung.status == 412
    assert hub_run.artifact("console_sft.txt").read_bytes() == tail
    assert hub_run.marker() == marker


def test_a_marker_that_cannot_land_after_sigterm_exits_3_in_time_and_a_rerun_publishes_it(
    hub_run: HubRun,
) -> None:
    """Every commit hangs: the outcome is persisted at once, the runner exits 3 within
    Docker's stop timeout saying why, and running the same payload again publishes it."""
    hub_run.write_worker("""
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = hub_run.start()
    read_until(proc.stdout, b"ready")
    hub_run.server.hang("POST", r"/commit/", seconds=60, times=100)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    err = hub_run.finish(proc)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 3, err.decode()[-3000:]
    assert elapsed < 10, elapsed
    last = _last_line(err)
    assert "marker NOT published" in last and "rule interrupted" in last
    assert hub_run.marker() is None
    hub_run.server.clear_faults()
    rerun = subprocess.run(hub_run.args(), env=hub_run.environ(), capture_output=True,
                           timeout=60, check=False)
    hub_run.stderr.append(rerun.stderr)
    assert rerun.returncode == 75, rerun.stderr.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and (marker["retriable"], marker["rule"]) == (True, "interrupted")
    assert b'"marker.replay"' in rerun.stderr


def test_a_preload_whose_hub_hangs_leaves_the_process_promptly_after_its_marker(
    hub_run: HubRun,
) -> None:
    """huggingface_hub's download pool threads are not daemon threads: the process must
    still be gone right after the deadline marker is out."""
    _add_model(hub_run.server, "org/tiny")
    hub_run.server.hang("GET", r"/resolve/", seconds=120, times=100)
    mount = hub_run.root / "mnt"
    mount.mkdir()
    preload: dict[str, Any] = {
        "mode": "preload", "models": ["org/tiny"], "phase": None, "seed": None,
        "job_spec_json": None, "max_wall_s": 4,
        "env": {"HF_TOKEN": hub_run.token, "HF_HOME": str(mount / "hf")},
    }
    started = time.monotonic()
    proc = hub_run.start(**preload)
    err = hub_run.finish(proc, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 124, err.decode()[-3000:]
    assert elapsed < 4 + 3, elapsed
    marker = hub_run.marker()
    assert marker is not None and marker["rule"] == "deadline"


def test_a_hub_endpoint_named_only_in_the_payload_env_is_the_runners_store_too(
    hub_run: HubRun,
) -> None:
    """No ``--store`` and no ``HF_ENDPOINT`` in the runner's own environment (no ``-e``
    flags in production): the payload's env points runner and worker at the same Hub."""
    hub_run.write_worker("complete()")
    hub_run.write_payload(env={"HF_TOKEN": hub_run.token, "HF_ENDPOINT": hub_run.server.url,
                               "FLASH_STOP_GRACE_S": "2"})
    environ = {k: v for k, v in hub_run.environ().items()
               if k not in ("HF_ENDPOINT", "FLASH_STORE")}
    proc = subprocess.run(hub_run.args(store=False), env=environ, capture_output=True,
                          timeout=60, check=False)
    hub_run.stderr.append(proc.stderr)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert _statuses(hub_run.server, "GET", LISTING)[0] == 200


# --- a fleet shares one quota: tails are paced, the marker counts what the attempt spent ----

PACED_ENV = {"FLASH_STOP_GRACE_S": "2", "FLASH_UPLOAD_CONSOLE": "1",
             "FLASH_CONSOLE_UPLOAD_INTERVAL_S": "5", "FLASH_LEASE_S": "0"}


def test_an_unchanged_console_tail_is_not_committed_again(hub_run: HubRun) -> None:
    """The worker prints once and stays ~12 s: of the periodic ticks (5 s, 10 s) only the
    first has news; the second commits nothing. The marker counts one commit."""
    hub_run.write_worker("""
        print("one line, then silence", flush=True)
        time.sleep(12)
        sys.exit(1)
    """)
    outcome = hub_run.run(env={"HF_TOKEN": hub_run.token, **PACED_ENV})
    marker = hub_run.marker()
    assert marker is not None, outcome.reason
    commits = _commits(hub_run.server)
    assert len(commits) == 2, [(r.path, r.status) for r in commits]  # one tail, the marker
    assert marker["store"] == {"commits": 1, "throttled": 0}
    assert b"one line, then silence" in hub_run.artifact("console_sft.txt").read_bytes()


def test_a_throttled_tail_backs_off_past_retry_after_and_the_marker_still_lands(
    hub_run: HubRun,
) -> None:
    """The first periodic tail meets 429: the interval doubles (the next tick, 5 s later,
    makes no call although the console changed), the marker lands, and its evidence
    counts the 429."""
    hub_run.write_worker("""
        for i in range(65):
            print(f"step {i}", flush=True)
            time.sleep(0.2)
        sys.exit(1)
    """)
    hub_run.server.fail("POST", r"/commit/", status=429, times=1, retry_after=1)
    outcome = hub_run.run(env={"HF_TOKEN": hub_run.token, **PACED_ENV})
    marker = hub_run.marker()
    assert marker is not None, outcome.reason
    assert (marker["rule"], marker["retriable"]) == ("worker-failed", False)
    commits = _commits(hub_run.server)
    # the throttled tail, then (no second tail during the back-off) the marker's commit
    assert [r.status for r in commits] == [429, 200], [(r.path, r.status) for r in commits]
    assert marker["store"] == {"commits": 0, "throttled": 1}
    assert b"step 64" in hub_run.artifact("console_sft.txt").read_bytes()
