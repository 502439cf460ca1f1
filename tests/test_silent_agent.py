"""A Hub agent that lives but stops answering is replaced (issue 38, item 2), through the
real runner against the local Hub server.

The agent is stopped with SIGSTOP, as a process wedged in the kernel or in a library
looks from outside: alive, silent. Before the fix every retry went to it, and the marker
was lost (exit 3) though the Hub was healthy; when the marker's commit had been sent
before it fell silent, exit 3 said "not published" while the marker was in the store.
Now a call whose bound passes without an answer takes the agent away (SIGKILL) and a
fresh one takes the call; and a marker whose tries failed after one may have landed is
read back before the runner says either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import read_until
from hubrun import HubRun, agent_of

from fsm.testing.hubserver import RequestRecord

pytestmark = pytest.mark.hub

COMMIT = r"/commit/"
PREUPLOAD_OR_COMMIT = r"/(preupload|commit)/"
#: One try per store call and a short bound: the marker's own tries are what is tested
#: (2.x retries a 503 inside the call, with waits of its own that the bound cuts).
QUICK_TRIES = {"FLASH_STORE_MAX_ATTEMPTS": "1", "FLASH_STORE_CALL_TIMEOUT_S": "1"}
#: The code fetch's downloads (at the listing's commit) of the worker's files.
CODE_DOWNLOAD = r"/resolve/[0-9a-f]{40}/code/"


@pytest.fixture
def stop_agent() -> Iterator[Callable[[int], int]]:
    """Stops a runner's agent (SIGSTOP); any still there after the test is killed (a
    stopped process would hold the server's connection, and its teardown, for ever)."""
    stopped: list[int] = []

    def stop(runner: int) -> int:
        agent = agent_of(runner)
        os.kill(agent, signal.SIGSTOP)
        stopped.append(agent)
        return agent

    yield stop
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _events(err: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]


def _replaced(err: bytes) -> list[int]:
    return [e["pid"] for e in _events(err) if e["msg"] == "hub.agent_replaced"]


def _env(hub_run: HubRun, **extra: str) -> dict[str, str]:
    return {"HF_TOKEN": hub_run.token, "FLASH_STOP_GRACE_S": "2", **extra}


def _completed_waiting_for_go(hub_run: HubRun) -> subprocess.Popen[bytes]:
    """A runner whose worker has completed (DONE and metrics.json uploaded) and exits once
    the test writes ``go``: the end of the attempt is the test's to set up. One try per
    store call (:data:`QUICK_TRIES`)."""
    hub_run.write_worker("""
complete()
print("uploaded", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
""")
    proc = hub_run.start(env=_env(hub_run, **QUICK_TRIES))
    read_until(proc.stdout, b"uploaded", timeout=30)
    return proc


def _commits(requests: list[RequestRecord]) -> int:
    return sum(1 for r in requests if r.method == "POST" and "/commit/" in r.path)


def test_an_agent_stopped_during_the_code_download_is_replaced_and_the_attempt_succeeds(
    hub_run: HubRun, stop_agent: Callable[[int], int],
) -> None:
    """The agent is stopped while the code fetch's first download is on its way: the
    download's bound passes, the agent is killed, a fresh one fetches the code (no part
    file of the silent one is left in the worker's tree), the worker runs, exit 0."""
    hub_run.write_worker("complete()\n")
    hub_run.server.hang("GET", CODE_DOWNLOAD, seconds=1.0, times=1)
    proc = hub_run.start(env=_env(hub_run, FLASH_STORE_TRANSFER_TIMEOUT_S="3"))
    assert hub_run.server.wait_for(lambda reqs: any(
        r.method == "GET" and "/code/" in r.path and "/resolve/" in r.path for r in reqs),
        timeout=30)
    agent = stop_agent(proc.pid)
    err = hub_run.finish(proc, timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert _replaced(err) == [agent]
    assert not list(hub_run.code_root.rglob("*.part"))


def test_an_agent_stopped_before_the_marker_is_replaced_within_the_stop_timeout(
    hub_run: HubRun, stop_agent: Callable[[int], int],
) -> None:
    """The agent falls silent while the worker trains; SIGTERM comes. Verification's and
    the marker's calls meet the silent agent: the first one's bound takes it away, and the
    retriable marker lands through a fresh one within Docker's 10 s (exit 75), where every
    try used to wait on the silent one (exit 3)."""
    hub_run.write_worker("print('ready', flush=True)\ntime.sleep(600)\n")
    proc = hub_run.start(env=_env(hub_run, FLASH_STORE_CALL_TIMEOUT_S="60"))
    read_until(proc.stdout, b"ready", timeout=30)
    agent = stop_agent(proc.pid)
    err = hub_run.interrupted_within_stop(proc)
    assert _replaced(err) == [agent]


def test_an_agent_stopped_after_the_marker_was_sent_ends_published_not_3(
    hub_run: HubRun, stop_agent: Callable[[int], int],
) -> None:
    """The marker's commit reaches the Hub, and the agent falls silent before the answer
    comes back; the Hub then refuses every other write (503). The marker is in the store:
    the runner reads it back and exits 0 with the marker's own words, where it used to
    say "marker NOT published" with exit 3."""
    proc = _completed_waiting_for_go(hub_run)
    before = _commits(hub_run.server.requests)
    hub_run.server.hang("POST", COMMIT, seconds=1.0, times=1)
    (hub_run.scratch / "go").write_text("")
    assert hub_run.server.wait_for(lambda reqs: _commits(reqs) > before, timeout=30)
    agent = stop_agent(proc.pid)
    # Every other write refused (the library finds an unchanged file by its preupload
    # and makes no commit: that is a read-back of its own, refused here too).
    hub_run.server.fail("POST", PREUPLOAD_OR_COMMIT, status=503, times=1000)
    err = hub_run.finish(proc, timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and (marker["ok"], marker["rule"]) == (True, "completion-confirmed")
    events = _events(err)
    assert [e["landed"] for e in events if e["msg"] == "marker.readback"] == [True]
    assert _replaced(err) == [agent]
    assert "NOT published" not in err.decode().strip().splitlines()[-1]


def test_a_marker_whose_commits_all_fail_is_read_back_and_said_not_published(
    hub_run: HubRun, tmp_path: Path,
) -> None:
    """The sibling: every marker commit is refused 503 (none landed). The read-back finds
    no marker, and exit 3 says so, with the result persisted for a rerun."""
    proc = _completed_waiting_for_go(hub_run)
    hub_run.server.fail("POST", PREUPLOAD_OR_COMMIT, status=503, times=1000)
    (hub_run.scratch / "go").write_text("")
    err = hub_run.finish(proc, timeout=60)
    assert proc.returncode == 3, err.decode()[-3000:]
    assert hub_run.marker() is None
    events = _events(err)
    assert [e["landed"] for e in events if e["msg"] == "marker.readback"] == [False]
    assert "marker NOT published" in err.decode().strip().splitlines()[-1]
