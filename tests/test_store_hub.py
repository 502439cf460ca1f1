"""HubStore against the local Hub server: bounded, retried, classified, and token-free.

Every test runs with the plugin's canary token; the ``leak_check`` fixture captures every
structlog event and fails the test if the token shows up in one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Events, make_store

from fsm.clock import Deadline
from fsm.errors import (
    DeadlineExceeded,
    PayloadError,
    StoreAuthError,
    StoreNotFound,
    StoreUnavailable,
)
from fsm.store import open_store
from fsm.store.hub import HubStore, classify, configure_transfer
from fsm.testing import LocalHubServer

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

pytestmark = pytest.mark.hub



def _commits(server: LocalHubServer) -> list[int | None]:
    return [r.status for r in server.requests if "/commit/" in r.path]


def _write(tmp_path: Path, data: bytes = b"{}") -> Path:
    path = tmp_path / "payload.bin"
    path.write_bytes(data)
    return path


def _put(store: HubStore, local: Path, path_in_repo: str) -> bool:
    """A one-file commit: how the runner writes one artifact."""
    return store.commit({path_in_repo: local}, message=f"upload {path_in_repo}")


def test_upload_survives_transient_503s(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """Two 503s on commit are retried with backoff; the file lands; each retry is logged."""
    hub_server.fail("POST", r"/commit/", status=503, times=2)
    store = make_store(hub_server, hub_dataset, hub_token)
    _put(store, _write(tmp_path, b"m"), "run/metrics.json")
    assert (hub_server.repo_dir(hub_dataset) / "run" / "metrics.json").read_bytes() == b"m"
    assert _commits(hub_server) == [503, 503, 200]
    retries = [e for e in events if e["event"] == "store.retry"]
    assert [(e["status"], e["try"], e["path"]) for e in retries] == [
        (503, 1, "run/metrics.json"), (503, 2, "run/metrics.json")]


def test_persistent_503_raises_store_unavailable_after_bounded_attempts(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A store that keeps answering 503 ends in StoreUnavailable (retriable) after N tries."""
    hub_server.fail("POST", r"/commit/", status=503, times=100)
    store = make_store(hub_server, hub_dataset, hub_token, max_attempts=3)
    with pytest.raises(StoreUnavailable) as info:
        _put(store, _write(tmp_path), "run/DONE")
    assert info.value.retriable
    assert "HTTP 503" in str(info.value)
    assert hub_token not in str(info.value)
    assert _commits(hub_server) == [503, 503, 503]


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502])
def test_other_transient_statuses_are_retried(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    status: int, events: Events,
) -> None:
    """408, 409, 425, 429 and 5xx are retried like 503 (fsm.rules.TRANSIENT_STATUSES)."""
    hub_server.fail("POST", r"/commit/", status=status, times=1)
    _put(make_store(hub_server, hub_dataset, hub_token), _write(tmp_path), "a.json")
    assert _commits(hub_server) == [status, 200]


def test_wrong_token_raises_store_auth_error_at_once(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """401 is fatal and not retried: one request per call, no retry logged."""
    hub_server.add_file(hub_dataset, "a.json", "{}")
    store = make_store(hub_server, hub_dataset, hub_token + "x")
    for call in (lambda: _put(store, _write(tmp_path), "b.json"),
                 lambda: store.exists("a.json"),
                 lambda: store.download_file("a.json", tmp_path / "dl")):
        hub_server.clear_requests()
        with pytest.raises(StoreAuthError) as info:
            call()
        assert not info.value.retriable
        assert [r.status for r in hub_server.requests] == [401]
        assert hub_token not in str(info.value)
    assert not [e for e in events if e["event"] == "store.retry"]


def test_403_raises_store_auth_error_at_once(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """403 is fatal and not retried."""
    hub_server.fail("*", r"/commit/", status=403, times=5)
    with pytest.raises(StoreAuthError):
        _put(make_store(hub_server, hub_dataset, hub_token), _write(tmp_path), "a.json")
    assert _commits(hub_server) == [403]


def test_exists_answers_false_on_404_and_true_after_upload(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A 404 is an answer to exists(), not an error."""
    store = make_store(hub_server, hub_dataset, hub_token)
    assert store.exists("run/DONE") is False
    _put(store, _write(tmp_path), "run/DONE")
    assert store.exists("run/DONE") is True
    assert make_store(hub_server, "flash/no-such-repo", hub_token).exists("run/DONE") is False


def test_download_of_a_missing_file_raises_store_not_found(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A 404 on a download is StoreNotFound (fatal), not retried."""
    with pytest.raises(StoreNotFound):
        make_store(hub_server, hub_dataset, hub_token).download_file("job_spec.json", tmp_path)
    assert len(hub_server.requests) == 1


def test_hung_commit_is_bounded_by_the_call_timeout(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A commit the server never answers is abandoned after call_timeout_s, retried, then
    StoreUnavailable — the library itself has no timeout on commit."""
    hub_server.hang("POST", r"/commit/", seconds=10, times=10)
    store = make_store(hub_server, hub_dataset, hub_token, call_timeout_s=0.3, max_attempts=2)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no answer within"):
        _put(store, _write(tmp_path), "run/DONE")
    assert time.monotonic() - started < 2.5
    assert len([r for r in hub_server.requests if "/commit/" in r.path]) == 2


def test_hung_commit_never_waits_past_the_deadline(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """With a long call timeout, the attempt deadline cuts the wait: DeadlineExceeded."""
    hub_server.hang("POST", r"/commit/", seconds=10, times=10)
    store = make_store(hub_server, hub_dataset, hub_token, call_timeout_s=30,
                       deadline=Deadline.after(0.8))
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        _put(store, _write(tmp_path), "run/DONE")
    assert time.monotonic() - started < 1.8


def test_expired_deadline_raises_before_any_request(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, events: Events,
) -> None:
    """No store call starts once the deadline has passed."""
    store = make_store(hub_server, hub_dataset, hub_token, deadline=Deadline.after(-1))
    with pytest.raises(DeadlineExceeded):
        store.exists("run/DONE")
    assert hub_server.requests == []


def test_retry_after_is_honoured(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """The retry waits at least what Retry-After asked."""
    hub_server.fail("POST", r"/commit/", status=429, times=1, retry_after=0.5)
    _put(make_store(hub_server, hub_dataset, hub_token), _write(tmp_path), "a.json")
    first, second = [r for r in hub_server.requests if "/commit/" in r.path]
    assert second.at - first.at >= 0.5
    assert [e["delay_s"] for e in events if e["event"] == "store.retry"] == [0.5]


def test_retry_after_beyond_the_limit_gives_up_at_once(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A Retry-After longer than retry_max_s ends the call with StoreUnavailable, no wait."""
    hub_server.fail("POST", r"/commit/", status=503, times=5, retry_after=120)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="asked to wait"):
        _put(make_store(hub_server, hub_dataset, hub_token), _write(tmp_path), "a.json")
    assert time.monotonic() - started < 2
    assert _commits(hub_server) == [503]


def test_dropped_connection_is_retried(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A connection closed without an answer is a transport error: retried."""
    hub_server.drop("POST", r"/commit/", times=1)
    _put(make_store(hub_server, hub_dataset, hub_token), _write(tmp_path), "a.json")
    assert _commits(hub_server) == [None, 200]
    assert (hub_server.repo_dir(hub_dataset) / "a.json").is_file()


def test_token_never_appears_in_describe_repr_or_worker_env(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, events: Events,
) -> None:
    """What the runner prints about the store carries no secret."""
    store = make_store(hub_server, hub_dataset, hub_token)
    shown = store.describe() + repr(store) + repr(dict(store.worker_env()))
    assert hub_token not in shown
    assert store.worker_env() == {"HF_ENDPOINT": hub_server.url}


def test_classify_walks_the_cause_chain() -> None:
    """A transport error wrapped by the library is still recognised as retriable."""
    outer = ValueError("wrapped")
    outer.__cause__ = ConnectionResetError("reset")
    assert classify(outer).kind == "retriable"
    assert classify(ValueError("plain")).kind == "unknown"


def test_open_store_selects_the_adapter(tmp_path: Path, hub_token: str) -> None:
    """file:/// selects the local store; None the Hub at HF_ENDPOINT; junk is a usage error."""
    from fsm.store.local import LocalStore

    deadline = Deadline.after(60)
    local = open_store(tmp_path.as_uri(), repo_id="o/r", token=None, deadline=deadline,
                       environ={})
    assert isinstance(local, LocalStore)
    hub = open_store(None, repo_id="o/r", token=hub_token, deadline=deadline,
                     environ={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert isinstance(hub, HubStore)
    assert hub.describe() == "http://127.0.0.1:9/datasets/o/r"
    with pytest.raises(PayloadError):
        open_store("s3://bucket", repo_id="o/r", token=None, deadline=deadline, environ={})


def test_open_store_obeys_the_environment_it_is_given_not_the_process_one(
    monkeypatch: pytest.MonkeyPatch, hub_token: str
) -> None:
    """HF_ENDPOINT and the FLASH_STORE_* knobs come from ``environ`` (the runner's merged
    with the payload's env); the same settings in os.environ are ignored."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("FLASH_STORE_MAX_ATTEMPTS", "9")
    monkeypatch.setenv("FLASH_STORE_CALL_TIMEOUT_S", "99")
    environ = {"HF_ENDPOINT": "http://127.0.0.1:2", "FLASH_STORE_MAX_ATTEMPTS": "2",
               "FLASH_STORE_RETRY_BASE_S": "0"}
    hub = open_store(None, repo_id="o/r", token=hub_token, deadline=Deadline.after(60),
                     environ=environ)
    assert isinstance(hub, HubStore)
    assert hub.endpoint == "http://127.0.0.1:2"
    assert (hub.max_attempts, hub.retry_base_s, hub.call_timeout_s) == (2, 0.0, 60.0)
    assert hub.worker_env() == {"HF_ENDPOINT": "http://127.0.0.1:2"}
    monkeypatch.delenv("HF_ENDPOINT")
    public = open_store(None, repo_id="o/r", token=None, deadline=Deadline.after(60),
                        environ={})
    assert public.describe() == "https://huggingface.co/datasets/o/r"


@pytest.mark.parametrize("knob", [
    "FLASH_STORE_MAX_ATTEMPTS=0", "FLASH_STORE_MAX_ATTEMPTS=two", "FLASH_STORE_CALL_TIMEOUT_S=0",
    "FLASH_STORE_TRANSFER_TIMEOUT_S=inf", "FLASH_STORE_RETRY_MAX_S=-1",
    "FLASH_STORE_RETRY_BASE_S=nan",
])
def test_an_unusable_tuning_knob_is_a_payload_error(knob: str) -> None:
    """A knob that is not a number, not finite, negative, or a zero bound is refused with a
    line naming it (PayloadError), not a crash deep inside the adapter."""
    var, _, value = knob.partition("=")
    with pytest.raises(PayloadError, match=var):
        open_store("http://127.0.0.1:9", repo_id="o/r", token=None,
                   deadline=Deadline.after(60), environ={var: value})


def test_hub_settings_come_from_the_adapters_environment(tmp_path: Path) -> None:
    """In a fresh process, the HF_HUB_* settings of the environment a HubStore was given
    reach huggingface_hub in the agent process; other keys (a token) are copied into
    neither process's environment, and the adapter's own process never imports the
    library."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from fsm.clock import Deadline
        from fsm.hub import agent
        from fsm.store.hub import HubStore
        store = HubStore("o/r", token=None, deadline=Deadline.after(60),
                         endpoint="http://127.0.0.1:9",
                         environ={"HF_HUB_ETAG_TIMEOUT": "7", "HF_TOKEN": "hf_not_copied"})
        store._client()
        held = agent.current().probe(["HF_HUB_ETAG_TIMEOUT", "HF_TOKEN"])
        print(json.dumps({"etag_timeout": held["HF_HUB_ETAG_TIMEOUT"]["constant"],
                          "agent_token_env": held["HF_TOKEN"]["environ"],
                          "token_env": os.environ.get("HF_TOKEN"),
                          "library_here": "huggingface_hub" in sys.modules}))
    """))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_HUB_", "HF_XET_")) and k != "HF_TOKEN"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert json.loads(done.stdout.decode().splitlines()[-1]) == {
        "etag_timeout": 7, "agent_token_env": None, "token_env": None, "library_here": False}


def test_hub_settings_read_after_the_library_loaded_are_set_in_its_constants(
    tmp_path: Path,
) -> None:
    """The agent loads huggingface_hub before the payload is read: a payload's HF_HUB_*
    setting the library keeps under its own name is set in its frozen constants (typed as
    they are), HF_HUB_OFFLINE is not obeyed by the runner's calls, and a setting the
    library has no constant for is logged as frozen."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import structlog
        from fsm.clock import Deadline
        from fsm.hub import agent
        from fsm.store import hub
        agent.start().ready.wait(60)  # what fsm.hub.spawn does from the first instruction
        with structlog.testing.capture_logs() as logs:
            store = hub.HubStore("o/r", token=None, deadline=Deadline.after(60),
                                 endpoint="http://127.0.0.1:9",
                                 environ={"HF_HUB_ETAG_TIMEOUT": "7", "HF_HUB_OFFLINE": "1",
                                          "HF_HUB_NO_SUCH_SETTING": "1"})
            store._client()
        held = agent.current().probe(["HF_HUB_ETAG_TIMEOUT", "HF_HUB_OFFLINE"])
        print(json.dumps({"etag_timeout": held["HF_HUB_ETAG_TIMEOUT"]["constant"],
                          "offline": held["HF_HUB_OFFLINE"]["constant"],
                          "frozen": [e.get("ignored") for e in logs
                                     if e["event"] == "store.settings_frozen"]}))
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_", "HF_XET_"))}
    env["HF_HUB_OFFLINE"] = "1"  # the runner's own, too: its store calls reach the store
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert json.loads(done.stdout.decode().splitlines()[-1]) == {
        "etag_timeout": 7, "offline": False, "frozen": [["HF_HUB_NO_SUCH_SETTING"]]}


def test_a_commit_of_several_files_is_one_commit_request(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """commit() sends every file in a single create_commit: one commit request, all landed."""
    files = {}
    for name in ("console_sft.txt", "preload_result.json", "lambda_attempt0.json"):
        (tmp_path / name).write_bytes(name.encode())
        files[f"run/{name}"] = tmp_path / name
    store = make_store(hub_server, hub_dataset, hub_token)
    assert store.commit(files, message="end of attempt") is True
    assert _commits(hub_server) == [200]
    for path_in_repo, local in files.items():
        assert (hub_server.repo_dir(hub_dataset) / path_in_repo).read_bytes() == local.read_bytes()


def test_a_commit_without_a_fence_is_retried_like_an_upload(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A must-land commit survives a 503 (retried), and a 412 on it is not a conflict to
    resolve: it sends no parent commit, so the store has nothing to compare."""
    hub_server.fail("POST", r"/commit/", status=503, times=1)
    store = make_store(hub_server, hub_dataset, hub_token)
    assert store.commit({"a.json": _write(tmp_path), "b.json": _write(tmp_path)},
                        message="m") is True
    assert _commits(hub_server) == [503, 200]
    assert [r.method for r in hub_server.requests if r.method == "GET"] == []  # no head read
