"""The Hub as it behaves, through the real runner process and the real ``huggingface_hub``
(both lines: CI runs the ``hub`` marker on 0.x too).

The local Hub server answers as the service does where a hand-written client went wrong
(issue 25): a repo id in another case, or an old name, is ``307`` with a path-only
``Location`` and a text body for every method; a throttled request is ``429`` with only
``RateLimit``/``RateLimit-Policy``; preupload honours the repo's ``.gitignore``; an
``http://`` endpoint redirects to ``https://`` on the same host. And the runner's own
store calls do not obey a payload's ``HF_HUB_OFFLINE`` (the worker still gets it), and
``huggingface_hub`` is imported by the agent process, forked at the runner's first instruction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hubrun import ARM, PREFIX, REPO, HubRun

from fsm.testing import LocalHubServer

pytestmark = pytest.mark.hub

MARKER = f"{PREFIX}/{ARM}_attempt0.json"
CONSOLE = f"{PREFIX}/console_sft.txt"


def _events(proc: subprocess.CompletedProcess[bytes]) -> list[dict[str, Any]]:
    events = []
    for line in proc.stderr.decode(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "msg" in event:
            events.append(event)
    return events


def _last_line(proc: subprocess.CompletedProcess[bytes]) -> str:
    return proc.stderr.decode(errors="replace").strip().splitlines()[-1]


# --- 307: a repo id in another case, an old name ---------------------------------------------


@pytest.mark.parametrize("how", ["another case", "an old name"])
def test_a_repo_named_otherwise_is_followed_on_every_method_and_the_marker_lands(
    hub_run: HubRun, how: str,
) -> None:
    """The payload names the repo as the Hub redirects it (``307``, path-only ``Location``,
    text body, POSTs too): the code fetch, the tail and the marker's commit follow it, and
    the run ends 0 with its marker in the repo."""
    hub_run.write_worker("print('training', flush=True); complete()")
    if how == "another case":
        named = REPO.upper()
    else:
        named = "org/old-flash-runs"
        hub_run.server.rename_repo(REPO, "org/old-flash-runs")
        hub_run.server.rename_repo("org/old-flash-runs", REPO)  # old -> REPO answers 307
    proc = hub_run.cli(hf_repo=named)
    assert proc.returncode == 0, _last_line(proc)
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    redirected = {(r.method, r.path.split("/")[2] if r.path.startswith("/api/") else "resolve")
                  for r in hub_run.server.requests if r.status == 307}
    assert ("POST", "datasets") in redirected, redirected  # the commits were redirected too
    assert ("GET", "datasets") in redirected, redirected


# --- 429 with RateLimit only -------------------------------------------------------------


def test_a_throttle_named_only_by_ratelimit_is_waited_out_and_the_run_lands(
    hub_run: HubRun,
) -> None:
    """The request quota answers ``429`` with ``RateLimit: "api";r=0;t=N`` and no
    ``Retry-After``: the runner waits for the window instead of retrying into it (its own
    backoff, 0.05 to 0.2 s over 3 tries, would give up), and the run lands its marker. (The
    worker uploads nothing: 0.x's own commits do not retry a 429, the worker's affair.)"""
    hub_run.write_worker("print('no upload', flush=True)")
    hub_run.server.set_quota(requests=3, window_s=2.0, retry_after=False)
    proc = hub_run.cli(env={"HF_TOKEN": hub_run.token, "FLASH_STOP_GRACE_S": "2",
                            "FLASH_STORE_RETRY_MAX_S": "5", "FLASH_STORE_CALL_TIMEOUT_S": "10"})
    marker = hub_run.marker()
    assert marker is not None, _last_line(proc)
    assert (proc.returncode, marker["rule"]) == (1, "worker-failed"), _last_line(proc)
    throttled = [r for r in hub_run.server.requests if r.throttled]
    assert throttled, "the quota never answered 429"
    waits = [e for e in _events(proc) if e["msg"] == "store.retry" and e["status"] == 429]
    # Whoever waited (the adapter, or 2.x inside its own retry), it waited for the window.
    assert all(e["delay_s"] >= 1.0 for e in waits), waits


# --- .gitignore ----------------------------------------------------------------------------


def test_a_console_tail_the_repo_ignores_is_left_out_and_the_marker_lands(
    hub_run: HubRun,
) -> None:
    """The repo's ``.gitignore`` matches the console tail: preupload says ``shouldIgnore``,
    the tail (periodic, and in the final commit of a failed worker) is left out, and the
    marker, which it does not match, lands."""
    hub_run.server.add_file(REPO, ".gitignore", "*.txt\n")
    hub_run.write_worker("print('training', flush=True); sys.exit(1)")
    proc = hub_run.cli()
    marker = hub_run.marker()
    assert marker is not None, _last_line(proc)
    assert (proc.returncode, marker["rule"]) == (1, "worker-failed"), _last_line(proc)
    assert not (hub_run.repo_dir / CONSOLE).exists()


def test_a_marker_the_repo_ignores_is_refused_naming_gitignore_never_dropped(
    hub_run: HubRun,
) -> None:
    """The repo's ``.gitignore`` matches the marker: the library would leave it out and
    report a commit; the runner ends refused (78, CONTRACT: the repo's ``.gitignore``
    drops the marker), its last line naming the repo's ``.gitignore``, nothing retried."""
    hub_run.server.add_file(REPO, ".gitignore", "*_attempt*.json\n")
    hub_run.write_worker("complete()")
    proc = hub_run.cli()
    assert proc.returncode == 78, _last_line(proc)
    assert ".gitignore" in _last_line(proc)
    assert hub_run.marker() is None
    marker_commits = [e for e in _events(proc) if e["msg"] == "retry"
                      and "marker" in str(e.get("what"))]
    assert not marker_commits


# --- HF_HUB_OFFLINE is the worker's ----------------------------------------------------------


def test_a_payloads_hf_hub_offline_reaches_the_worker_not_the_runners_store_calls(
    hub_run: HubRun,
) -> None:
    """``HF_HUB_OFFLINE=1`` in the payload's env: the runner still fetches the code and
    publishes its marker through the library; the worker sees the setting."""
    hub_run.write_worker("print('offline=' + os.environ.get('HF_HUB_OFFLINE', ''), flush=True)")
    proc = hub_run.cli(env={"HF_TOKEN": hub_run.token, "FLASH_STOP_GRACE_S": "2",
                            "HF_HUB_OFFLINE": "1"})
    marker = hub_run.marker()
    assert marker is not None, _last_line(proc)
    assert marker["rule"] == "worker-failed"  # exited 0 without DONE: the worker's doing
    assert b"offline=1" in hub_run.artifact("console_sft.txt").read_bytes()


# --- the library loaded beside the runner's start --------------------------------------------


def test_huggingface_hub_is_imported_before_the_payload_is_read_and_done_by_fetchcode(
    hub_run: HubRun,
) -> None:
    """The log says when the import started (before the payload was read) and when it
    ended: the payload is read and the host checked meanwhile (FetchCode's first store
    call waits only for what is left of it)."""
    hub_run.write_worker("complete()")
    proc = hub_run.cli()
    assert proc.returncode == 0, _last_line(proc)
    events = _events(proc)
    started = next(e for e in events if e["msg"] == "hub.import_started")
    finished = next(e for e in events if e["msg"] == "hub.import_finished")
    assert finished["error"] is None
    changes = [e for e in events if e["msg"] == "state.changed"]
    first = changes[0]  # LoadPayload -> the next state: the payload was read by then
    assert started["at"] < finished["at"]
    assert started["at"] < _epoch(first["timestamp"]) - first["seconds"]
    assert finished["seconds"] == pytest.approx(finished["at"] - started["at"], abs=1e-3)


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# --- an http endpoint redirecting to https ---------------------------------------------------


@pytest.fixture
def tls_hub(tmp_path: Path) -> Any:
    """A Hub server speaking TLS (a self-signed certificate for 127.0.0.1), with a plain
    HTTP endpoint on the same host redirecting to it. Anonymous: both lines (requests,
    httpx2) keep the token across an http->https redirect only between the default ports
    (80 -> 443), which a test cannot bind; on other ports they drop it."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with LocalHubServer(tmp_path / "tls-hub", tls=(cert, key)) as server:
        yield server, cert


_THROUGH_HTTP = """
import sys
from pathlib import Path
from fsm.clock import Deadline
from fsm.store.hub import HubStore

store = HubStore("org/data", token=None, deadline=Deadline.after(30), endpoint=sys.argv[1],
                 max_attempts=1)
local = Path(sys.argv[2])
local.write_text("{}")
assert store.commit({"run/m.json": local}, message="marker") is True
print(sorted(store.list_folder("run")))
"""


def test_an_http_endpoint_that_redirects_to_https_is_followed_by_the_api_calls(
    tmp_path: Path, tls_hub: Any,
) -> None:
    """An ``http://`` endpoint answered ``308`` to ``https://`` on the same host: the
    listing and the commit (preupload and commit POSTs) follow it, trusting the CA the
    environment names (``SSL_CERT_FILE`` for 2.x's truststore, ``REQUESTS_CA_BUNDLE`` for
    0.x's requests). (A file's resolve is not followed across origins by either line:
    give such an endpoint as its ``https://`` URL; docs/running.md, "Options".)"""
    server, cert = tls_hub
    server.create_repo("org/data")
    env = {**os.environ, "SSL_CERT_FILE": str(cert), "REQUESTS_CA_BUNDLE": str(cert),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", _THROUGH_HTTP, server.http_url,
                           str(tmp_path / "m.json")], env=env, capture_output=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().strip().splitlines()[-1] == "['m.json']"
    assert (server.repo_dir("org/data") / "run/m.json").read_text() == "{}"
    assert {r.method for r in server.requests if r.status == 200} >= {"GET", "POST"}
