"""The fence: an optional commit never lands once the fence is sealed, even one in flight.

The runner seals the fence before it writes the attempt marker (CONTRACT section 4: no
upload of the attempt lands after the marker, an abandoned or timed-out call included).

* Hub store (the real client against the local Hub server): an optional commit carries
  ``parent_commit=<head it read>``; a held commit that arrives after the marker landed is
  refused (412) server-side and leaves the repo as the marker left it.
* Local store: files are written aside and renamed under the fence's lock; a commit whose
  files were being written when the fence was sealed renames nothing.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Events, make_store

from fsm.clock import Deadline
from fsm.errors import StoreUnavailable
from fsm.store.base import Fence
from fsm.store.hub import HubStore, configure_transfer
from fsm.store.local import LocalStore
from fsm.testing import LocalHubServer
from fsm.testing.hubserver import RequestRecord

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

CONSOLE = "sft/r1/console_sft.txt"
MARKER = "sft/r1/lambda_attempt0.json"

def _hub_store(server: LocalHubServer, repo: str, token: str, **kw: Any) -> HubStore:
    options: dict[str, Any] = {"call_timeout_s": 10.0, "retry_max_s": 0.5, "max_attempts": 3}
    return make_store(server, repo, token, **{**options, **kw})


def _in_thread(
    commit: Callable[[], bool],
) -> tuple[threading.Thread, list[bool | BaseException]]:
    """Start ``commit`` in a daemon thread; its result (or exception) lands in the list."""
    result: list[bool | BaseException] = []

    def run() -> None:
        try:
            result.append(commit())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _local(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _commit_posts(server: LocalHubServer) -> list[RequestRecord]:
    return [r for r in server.requests if r.method == "POST" and "/commit/" in r.path]


def _held(log: list[RequestRecord]) -> bool:
    return any(r.fault == "hang" for r in log)


# --- Hub ----------------------------------------------------------------------------------


@pytest.mark.hub
def test_an_abandoned_optional_commit_arriving_after_the_marker_is_rejected(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """An optional commit held by the store is abandoned (timed out); the fence is sealed,
    the marker lands; when the held commit finally reaches the store it is refused (412)
    and the console file it carried is not in the repo."""
    hub_server.add_file(hub_dataset, CONSOLE, "tail before")
    store = _hub_store(hub_server, hub_dataset, hub_token, call_timeout_s=0.3, max_attempts=1)
    fence = Fence()
    hub_server.hang("POST", r"/commit/", seconds=3)
    with pytest.raises(StoreUnavailable, match="no answer within"):
        store.commit({CONSOLE: _local(tmp_path, "console", b"late tail")},
                     message="console tail", fence=fence)
    assert hub_server.wait_for(_held, timeout=5)
    fence.seal()
    # The marker's commit is made with the usual bound: 0.3 s (the abandoned tail's) is
    # less than a loaded CI machine takes for a commit through the real client.
    marking = _hub_store(hub_server, hub_dataset, hub_token)
    assert marking.commit({MARKER: _local(tmp_path, "marker", b'{"ok": false}')},
                          message="marker") is True
    after_marker = hub_server.commit_sha(hub_dataset)
    held = next(r for r in hub_server.requests if r.fault == "hang")
    statuses = [held.status]  # when the marker had landed, then once answered
    assert hub_server.wait_for(lambda log: held.status is not None, timeout=10)
    statuses.append(held.status)
    assert statuses == [None, 412], "the hang must outlast the marker's commit"
    repo = hub_server.repo_dir(hub_dataset)
    assert (repo / CONSOLE).read_text() == "tail before"
    assert (repo / MARKER).read_bytes() == b'{"ok": false}'
    assert hub_server.commit_sha(hub_dataset) == after_marker  # nothing landed after it


@pytest.mark.hub
def test_an_optional_commit_in_flight_when_the_marker_lands_returns_false(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """A fenced commit still waiting for its answer when the fence is sealed and the marker
    lands gets a 412, sees the fence sealed, and gives up: False, no further try, nothing
    of it in the repo."""
    store = _hub_store(hub_server, hub_dataset, hub_token)
    fence = Fence()
    hub_server.hang("POST", r"/commit/", seconds=3)
    late = _local(tmp_path, "console", b"late")
    thread, result = _in_thread(
        lambda: store.commit({CONSOLE: late}, message="console tail", fence=fence)
    )
    assert hub_server.wait_for(_held, timeout=10)
    fence.seal()
    assert store.commit({MARKER: _local(tmp_path, "marker", b"{}")}, message="marker")
    thread.join(timeout=15)
    assert not thread.is_alive()
    assert result == [False]
    held, marker = _commit_posts(hub_server)  # in arrival order: no third try
    assert (held.fault, held.status, marker.status) == ("hang", 412, 200)
    assert held.ended_at is not None and marker.ended_at is not None
    assert marker.ended_at < held.ended_at
    assert not (hub_server.repo_dir(hub_dataset) / CONSOLE).exists()
    assert (hub_server.repo_dir(hub_dataset) / MARKER).is_file()


@pytest.mark.hub
def test_a_sealed_fence_stops_an_optional_commit_before_any_request(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """Sealed before it starts: False and not a single request to the store."""
    fence = Fence()
    fence.seal()
    store = _hub_store(hub_server, hub_dataset, hub_token)
    assert store.commit({CONSOLE: _local(tmp_path, "c", b"x")}, message="c", fence=fence) is False
    assert hub_server.requests == []


@pytest.mark.hub
def test_an_optional_commit_reads_the_head_and_names_it_as_parent(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """With an open fence the commit reads the repo's head first (its refs), then commits
    on it."""
    store = _hub_store(hub_server, hub_dataset, hub_token)
    assert store.commit({CONSOLE: _local(tmp_path, "c", b"x")}, message="c", fence=Fence())
    kinds = [("head" if r.method == "GET" else r.path.split("/")[-2])
             for r in hub_server.requests]
    assert kinds == ["head", "preupload", "commit"]
    # the head from the repo's refs, not from a listing of every file in the repo
    assert hub_server.requests[0].path == f"/api/datasets/{hub_dataset}/refs"
    assert (hub_server.repo_dir(hub_dataset) / CONSOLE).read_bytes() == b"x"


@pytest.mark.hub
def test_a_412_while_the_fence_is_open_refreshes_the_head_and_lands(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """Another writer moved the repo while an optional commit was held (fence still open):
    the 412 is answered by reading the head again and trying once more, which lands."""
    store = _hub_store(hub_server, hub_dataset, hub_token)
    hub_server.hang("POST", r"/commit/", seconds=2)
    tail = _local(tmp_path, "c", b"tail")
    thread, result = _in_thread(
        lambda: store.commit({CONSOLE: tail}, message="console tail", fence=Fence())
    )
    assert hub_server.wait_for(_held, timeout=10)
    hub_server.add_file(hub_dataset, "sft/r1/heartbeat.json", "{}")  # the worker wrote
    thread.join(timeout=15)
    assert not thread.is_alive()
    assert result == [True]
    assert [r.status for r in _commit_posts(hub_server)] == [412, 200]
    assert (hub_server.repo_dir(hub_dataset) / CONSOLE).read_bytes() == b"tail"
    assert [e["event"] for e in events if e["event"] == "store.commit_conflict"] == [
        "store.commit_conflict"]


@pytest.mark.hub
def test_two_412s_give_up_with_store_unavailable(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    events: Events,
) -> None:
    """When the head moves under the retry too, the optional commit gives up: a retriable
    StoreUnavailable with a short, token-free reason, and nothing of it in the repo."""
    store = _hub_store(hub_server, hub_dataset, hub_token)
    hub_server.hang("POST", r"/commit/", seconds=2, times=2)
    tail = _local(tmp_path, "c", b"tail")
    thread, result = _in_thread(
        lambda: store.commit({CONSOLE: tail}, message="console tail", fence=Fence())
    )
    for n in (1, 2):

        def held_n(log: list[RequestRecord], n: int = n) -> bool:
            return sum(r.fault == "hang" for r in log) == n

        assert hub_server.wait_for(held_n, timeout=10)
        hub_server.add_file(hub_dataset, f"sft/r1/other{n}", "x")
    thread.join(timeout=15)
    assert not thread.is_alive()
    assert len(result) == 1 and isinstance(result[0], StoreUnavailable)
    assert result[0].retriable
    assert "412" in str(result[0]) and hub_token not in str(result[0])
    assert len(str(result[0])) < 200
    assert [r.status for r in _commit_posts(hub_server)] == [412, 412]
    assert not (hub_server.repo_dir(hub_dataset) / CONSOLE).exists()


# --- local --------------------------------------------------------------------------------


def _reader_waiting(fifo: Path, timeout: float = 10) -> int:
    """Open ``fifo`` for writing once a reader has it open (polled, bounded); the fd."""
    give_up = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > give_up:
                raise
        time.sleep(0.01)  # polling a condition with a bound, not synchronising by sleeping


def test_local_commit_being_written_when_the_fence_is_sealed_lands_nothing(
    tmp_path: Path,
) -> None:
    """The local store writes a commit's files aside first; sealed while they are being
    written, it renames none of them (False), and leaves no temp files behind."""
    root = tmp_path / "store"
    (root / "sft" / "r1").mkdir(parents=True)
    (root / CONSOLE).write_bytes(b"tail before")
    fifo = tmp_path / "slow-source"
    os.mkfifo(fifo)
    store = LocalStore(root, deadline=Deadline.after(60))
    fence = Fence()
    files = {CONSOLE: _local(tmp_path, "console", b"late tail"), "sft/r1/late": fifo}
    thread, result = _in_thread(
        lambda: store.commit(files, message="console tail", fence=fence)
    )
    fd = _reader_waiting(fifo)  # the commit is copying its second file now
    fence.seal()
    os.write(fd, b"late")
    os.close(fd)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert result == [False]
    assert (root / CONSOLE).read_bytes() == b"tail before"
    assert sorted(p.name for p in (root / "sft" / "r1").iterdir()) == ["console_sft.txt"]


def test_local_seal_waits_for_a_commit_that_is_landing(tmp_path: Path) -> None:
    """seal() takes the fence's lock: while a commit holds it (renaming), seal() waits, so
    once seal() has returned the commit has either wholly landed or not at all."""
    store = LocalStore(tmp_path / "store", deadline=Deadline.after(60))
    (tmp_path / "store").mkdir()
    fence = Fence()
    sealed = threading.Event()

    def seal() -> None:
        fence.seal()
        sealed.set()

    with fence.lock:  # what a commit holds while it renames
        threading.Thread(target=seal, daemon=True).start()
        assert not sealed.wait(0.2)
        assert not fence.sealed
    assert sealed.wait(5)
    assert store.commit({CONSOLE: _local(tmp_path, "c", b"x")}, message="c", fence=fence) is False
    assert not (tmp_path / "store" / CONSOLE).exists()


def test_local_commit_renames_in_the_mappings_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file is written aside before the first rename, and the renames follow the
    mapping's order: the last entry (the marker) lands last."""
    root = tmp_path / "store"
    root.mkdir()
    renamed: list[str] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if not renamed:  # the first rename: every file is already staged
            assert len([p for p in (root / "sft" / "r1").iterdir() if p.name.startswith(".")]) == 3
        renamed.append(Path(dst).relative_to(root).as_posix())
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    files = {CONSOLE: _local(tmp_path, "c", b"c"),
             "sft/r1/preload_result.json": _local(tmp_path, "p", b"p"),
             MARKER: _local(tmp_path, "m", b"m")}
    assert LocalStore(root, deadline=Deadline.after(60)).commit(files, message="end") is True
    assert renamed == list(files)
    assert sorted(p.name for p in (root / "sft" / "r1").iterdir()) == [
        "console_sft.txt", "lambda_attempt0.json", "preload_result.json"]
