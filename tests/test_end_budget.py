"""The end of the attempt has its own budget, split into tries (issue 22, item 2), through
the real runner against the local Hub server with the store's default 60 s call timeout:
a worker that runs to its deadline is still verified and marked when one listing or one
commit hangs; after SIGTERM a hung listing or commit is given up for a fresh try within
Docker's stop timeout; a replay gets several tries; the deadline watchdog has at least the
time Mark has. Each of these got exactly one try before (the budget left was under the
call timeout), and so a wrong marker or none."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import read_until
from hubrun import ARM, HubRun

from fsm import table
from fsm.attempt.runner import run_attempt
from fsm.context import END_MIN_S, Context
from states import HANDLERS

pytestmark = pytest.mark.hub

#: The verification's listing of the run's folder (the code fetch lists code/ instead).
VERIFY_LISTING = r"/tree/main/sft"  # the folder is quoted whole: sft%2Frun-1%2Fseed3
COMMIT = r"/commit/"

#: Completes (metrics.json, then DONE), says so, waits for the test's "go", then runs to
#: a second before the deadline it was given (as the contract allows; its interpreter's
#: exit, huggingface_hub's included, takes some of that second).
RUNS_TO_ITS_DEADLINE = """
complete()
print("uploaded", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
time.sleep(max(0.0, float(os.environ["FLASH_RUN_DEADLINE_AT"]) - time.time() - 1.0))
"""


def _env(hub_run: HubRun, **extra: str) -> dict[str, str]:
    """The payload's env: the store's own default call timeout (60 s), not the fixture's
    short one, so a hung call is bounded by the runner's sizing of its tries alone. No
    lease: its first write would take a place in the commits these tests count."""
    return {"HF_TOKEN": hub_run.token, "FLASH_STOP_GRACE_S": "2",
            "FLASH_STORE_CALL_TIMEOUT_S": "60", "FLASH_LEASE_S": "0", **extra}


def _hung_once(hub_run: HubRun, method: str, path: str) -> None:
    hub_run.server.hang(method, path, seconds=120, times=1)


def _statuses(hub_run: HubRun, method: str, path: str) -> list[int | None]:
    return [r.status for r in hub_run.server.requests if r.method == method and path in r.path]


@pytest.mark.parametrize(("method", "path"), [("GET", "/tree/main/sft"), ("POST", COMMIT)],
                         ids=["hung-listing", "hung-commit"])
def test_a_worker_that_runs_to_its_deadline_is_verified_and_marked_though_a_call_hangs(
    hub_run: HubRun, method: str, path: str
) -> None:
    """The worker finishes a second before its deadline; the verification's listing (or the
    marker's commit) then hangs once. The end's own budget gives the call a fresh try:
    success, exit 0, the marker in the store."""
    hub_run.write_worker(RUNS_TO_ITS_DEADLINE)
    proc = hub_run.start(max_wall_s=8, env=_env(hub_run))
    read_until(proc.stdout, b"uploaded", timeout=30)
    _hung_once(hub_run, method, VERIFY_LISTING if method == "GET" else COMMIT)
    (hub_run.scratch / "go").write_text("")
    err = hub_run.finish(proc, timeout=40)
    assert proc.returncode == 0, err.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and (marker["ok"], marker["rule"]) == (True, "completion-confirmed")
    assert marker["worker"]["reason"] == "exited"
    assert None in _statuses(hub_run, method, path)  # the hung try, abandoned


def test_after_sigterm_a_hung_listing_is_tried_again_and_confirms_the_completion(
    hub_run: HubRun,
) -> None:
    """The worker uploaded DONE and metrics.json; SIGTERM comes, and the verification's
    listing hangs once: a second try confirms the completion within Docker's stop
    timeout, so the attempt succeeded (exit 0) instead of ending interrupted."""
    hub_run.write_worker("complete()\nprint('uploaded', flush=True)\ntime.sleep(600)\n")
    proc = hub_run.start(env=_env(hub_run))
    read_until(proc.stdout, b"uploaded", timeout=30)
    _hung_once(hub_run, "GET", VERIFY_LISTING)
    hub_run.stopped_within_docker(proc, 0)
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["worker"]["reason"] == "interrupted"


def test_after_sigterm_a_hung_marker_commit_is_abandoned_for_a_fresh_try_that_lands(
    hub_run: HubRun,
) -> None:
    """SIGTERM stops a worker that had not completed; the marker's first commit hangs. A
    second try, on a fresh connection, lands the retriable marker within Docker's stop
    timeout (exit 1), where one hung try used to take the whole stop budget (exit 3)."""
    hub_run.write_worker("print('ready', flush=True)\ntime.sleep(600)\n")
    proc = hub_run.start(env=_env(hub_run))
    read_until(proc.stdout, b"ready", timeout=30)
    _hung_once(hub_run, "POST", COMMIT)
    hub_run.interrupted_within_stop(proc)
    assert _statuses(hub_run, "POST", COMMIT) == [None, 200]


def test_a_replay_whose_first_commit_hangs_publishes_on_a_fresh_try(hub_run: HubRun) -> None:
    """The first runner decided and persisted the outcome but the store refused its marker;
    the replay's first commit hangs: a second try within the replay's bound lands it."""
    hub_run.write_worker(
        "complete()\nprint('uploaded', flush=True)\n"
        "while not (SCRATCH / 'go').exists():\n    time.sleep(0.02)\n")
    proc = hub_run.start(env=_env(hub_run))
    read_until(proc.stdout, b"uploaded", timeout=30)
    hub_run.server.fail("POST", COMMIT, status=403, times=1000)  # the marker's commit only
    (hub_run.scratch / "go").write_text("")
    err = hub_run.finish(proc, timeout=30)
    assert proc.returncode in (3, 78), err.decode()[-3000:]  # persisted, not published
    hub_run.server.clear_faults()
    _hung_once(hub_run, "POST", COMMIT)
    replay = hub_run.start(env=_env(hub_run))
    err = hub_run.finish(replay, timeout=60)
    assert replay.returncode == 0, err.decode()[-3000:]
    assert b'"marker.replay"' in err
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True


def test_the_watchdog_publishes_with_tries_too_when_a_state_is_stuck_past_the_deadline(
    hub_run: HubRun,
) -> None:
    """A state stuck past the attempt deadline (planted: it ignores every bound) leaves
    the marker to the deadline watchdog; its first commit hangs, and a second try within
    the watchdog's own window lands the deadline marker (124), not exit 3."""
    released = threading.Event()
    exits: list[int] = []

    def hard_exit(code: int) -> None:
        exits.append(code)
        released.set()

    def stuck(ctx: Context) -> str:
        released.wait(120)
        raise SystemExit(99)  # the process would be gone by now

    hub_run.write_worker("complete()")
    hub_run.write_payload(max_wall_s=3, env=_env(hub_run))
    _hung_once(hub_run, "POST", COMMIT)
    with open(hub_run.root / "stdout.bin", "ab") as out, pytest.raises(SystemExit):
        run_attempt(hub_run.settings(), hub_run.environ(), out_fd=out.fileno(),
                    handle_signals=False, hard_exit=hard_exit,
                    handlers={**HANDLERS, table.FETCH_CODE: stuck})
    assert exits == [124]
    marker = hub_run.marker()
    assert marker is not None
    assert (marker["rule"], marker["state"], marker.get("watchdog")) == (
        "deadline", "FetchCode", True)
    hub_run.texts.append(json.dumps(marker))
    assert _statuses(hub_run, "POST", COMMIT) == [None, 200]


def test_when_every_commit_hangs_the_end_tries_several_times_and_ends_within_its_floor(
    hub_run: HubRun,
) -> None:
    """With a 1 s exit reserve the end of the attempt still gets its 10 s (the marker's
    time is never cut below that): every commit hangs, the marker gets several tries, the
    result stays persisted (exit 3), and the process is gone within that floor past the
    attempt deadline."""
    hub_run.write_worker(RUNS_TO_ITS_DEADLINE)
    started = time.monotonic()
    proc = hub_run.start(max_wall_s=8, env=_env(hub_run))
    read_until(proc.stdout, b"uploaded", timeout=30)
    hub_run.server.hang("POST", COMMIT, seconds=120, times=1000)
    (hub_run.scratch / "go").write_text("")
    err = hub_run.finish(proc, timeout=40)
    elapsed = time.monotonic() - started
    assert proc.returncode == 3, err.decode()[-3000:]
    assert elapsed < 8 + END_MIN_S + 3, elapsed  # the budget, the end's floor, the exit
    assert _statuses(hub_run, "POST", COMMIT).count(None) >= 3
    assert (hub_run.payload_path.parent / f".flash-{ARM}_attempt0.result.json").is_file()


def test_after_sigterm_slow_commits_and_a_hung_listing_leave_the_marker_two_tries(
    hub_run: HubRun,
) -> None:
    """The Hub's preupload and commit take 1.2 s each, as the console tails showed; SIGTERM
    comes and the verification's listing hangs. Verification stops in time to leave the
    marker two whole tries at that speed and its read-back: the retriable marker lands
    within Docker's 10 s (exit 75), where verification's fixed 6 s left the marker 2 s,
    less than one commit (exit 3 at 8 s, "the attempt deadline passed")."""
    hub_run.write_worker("print('ready', flush=True)\ntime.sleep(600)\n")
    hub_run.server.hang("POST", r"/preupload/", seconds=1.2, times=1000)
    hub_run.server.hang("POST", COMMIT, seconds=1.2, times=1000)
    proc = hub_run.start(env=_env(hub_run, FLASH_UPLOAD_CONSOLE="1",
                                  FLASH_CONSOLE_UPLOAD_INTERVAL_S="5"))
    read_until(proc.stdout, b"ready", timeout=30)
    console = hub_run.artifact("console_sft.txt")
    give_up = time.monotonic() + 30
    while not console.exists():  # a tail landed: the runner has timed a commit here
        assert time.monotonic() < give_up, "no console tail landed"
        time.sleep(0.05)
    hub_run.server.hang("GET", VERIFY_LISTING, seconds=120, times=1000)
    hub_run.interrupted_within_stop(proc)
