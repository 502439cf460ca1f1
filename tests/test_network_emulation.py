"""Network conditions on the local Hub server and the local package index.

A bandwidth cap per connection and a latency per request (issue 15 item 4), for
benchmarks. Timing assertions are lower bounds (the pacing guarantees them) or generous
upper bounds that only a shared cap, a serialised wait or a stuck stop would exceed.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pypi_server import PypiServer, build_wheel

from fsm.store.hub import configure_transfer
from fsm.testing import LocalHubServer, RequestRecord
from fsm.testing.hubserver import Network, main

configure_transfer(os.environ, accelerate=False)  # before huggingface_hub is imported

pytestmark = pytest.mark.hub

MiB = 1 << 20


def _request(
    url: str, path: str, token: str | None, *, method: str = "GET",
    headers: dict[str, str] | None = None, timeout: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, headers={
            **({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


def _download(hub: LocalHubServer, repo: str, filename: str, token: str, dest: Path) -> bytes:
    from huggingface_hub import hf_hub_download

    got = hf_hub_download(repo, filename, repo_type="dataset", local_dir=dest, token=token,
                          endpoint=hub.url)
    return Path(got).read_bytes()


def _settled(hub: LocalHubServer) -> list[RequestRecord]:
    """The request log once every answer has ended (a client can finish reading first)."""
    assert hub.wait_for(lambda rs: all(r.ended_at is not None for r in rs))
    return hub.requests


def _gets(hub: LocalHubServer, name: str) -> list[RequestRecord]:
    return [r for r in _settled(hub) if r.method == "GET" and r.path.endswith(name)]


def _duration(record: RequestRecord) -> float:
    assert record.ended_at is not None
    return record.ended_at - record.at


def _in_threads(*calls: Callable[[], Any]) -> tuple[list[Any], float]:
    """Run the calls in parallel; their results (or exceptions) and the wall time."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as err:  # handed back to the test
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wall = time.monotonic() - started
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results, wall


# --- the Hub server -------------------------------------------------------------------------


def test_a_capped_download_takes_its_size_over_the_cap(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path
) -> None:
    """At 1 MiB/s, hf_hub_download of 2 MiB takes at least ~2 s, and gets the right bytes."""
    data = os.urandom(2 * MiB)
    hub_server.add_file(hub_dataset, "big.bin", data)
    assert hub_server.set_network(bandwidth_bps=MiB) == Network(bandwidth_bps=MiB)
    assert hub_server.network == Network(bandwidth_bps=MiB, latency_s=0.0)
    started = time.monotonic()
    assert _download(hub_server, hub_dataset, "big.bin", hub_token, tmp_path / "dl") == data
    elapsed = time.monotonic() - started
    assert elapsed >= 1.8
    [get] = _gets(hub_server, "/big.bin")
    assert get.status == 200 and _duration(get) >= 1.9


def test_parallel_connections_each_get_the_whole_cap(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path
) -> None:
    """Two 1 MiB downloads at 1 MiB/s in parallel: ~1 s each, overlapping, not 2 s."""
    files = {name: os.urandom(MiB) for name in ("a.bin", "b.bin")}
    for name, data in files.items():
        hub_server.add_file(hub_dataset, name, data)
    hub_server.set_network(bandwidth_bps=MiB)
    got, wall = _in_threads(*(
        (lambda name=name: _download(hub_server, hub_dataset, name, hub_token,
                                     tmp_path / name))
        for name in files))
    assert got == list(files.values())
    a, b = (_gets(hub_server, f"/{name}")[0] for name in files)
    for record in (a, b):
        # Paced to the cap, each alone; a cap shared by the two would take >= 2 s each.
        assert 0.95 <= _duration(record) < 1.8
    assert max(a.at, b.at) < min(a.ended_at or 0, b.ended_at or 0)  # they overlapped
    assert wall < 2.0  # one after the other would take at least 2 s


def test_ranged_gets_are_paced_each_on_its_own_connection(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """Two ranged halves of 2 MiB at 1 MiB/s in parallel: the whole in ~1 s, as a CDN."""
    data = os.urandom(2 * MiB)
    hub_server.add_file(hub_dataset, "big.bin", data)
    hub_server.set_network(bandwidth_bps=MiB)
    path = f"/datasets/{hub_dataset}/resolve/main/big.bin"
    halves, wall = _in_threads(*(
        (lambda r=r: _request(hub_server.url, path, hub_token,
                              headers={"Range": r}))
        for r in (f"bytes=0-{MiB - 1}", f"bytes={MiB}-")))
    assert [status for status, _, _ in halves] == [206, 206]
    assert halves[0][2] + halves[1][2] == data
    for record in _gets(hub_server, "/big.bin"):
        assert 0.95 <= _duration(record) < 1.8
    assert wall < 2.0


def test_latency_delays_every_answer_in_parallel(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str
) -> None:
    """With 0.2 s of latency a HEAD and an API call take >= 0.2 s; parallel ones wait together."""
    hub_server.add_file(hub_dataset, "a.txt", b"a")
    hub_server.set_network(latency_s=0.2)
    head = f"/datasets/{hub_dataset}/resolve/main/a.txt"
    for method, path in (("HEAD", head), ("GET", f"/api/datasets/{hub_dataset}")):
        started = time.monotonic()
        status, _, _ = _request(hub_server.url, path, hub_token, method=method)
        assert status == 200
        assert time.monotonic() - started >= 0.2
    assert all(_duration(r) >= 0.2 for r in _settled(hub_server))

    hub_server.clear_requests()
    answers, wall = _in_threads(*(
        (lambda: _request(hub_server.url, head, hub_token, method="HEAD")) for _ in range(4)))
    assert [status for status, _, _ in answers] == [200] * 4
    records = _settled(hub_server)
    assert len(records) == 4 and all(_duration(r) >= 0.2 for r in records)
    # Every request was in its wait before any answered: no lock serialises them.
    assert max(r.at for r in records) < min(r.ended_at or 0 for r in records)
    assert wall < 0.8  # four in a row would take 0.8 s


def test_the_defaults_change_nothing(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No network by default: no latency wait, no pacing (the unpaced paths run)."""

    def forbidden(*args: object, **kwargs: object) -> bool:
        raise AssertionError("pacing code ran with the default network")

    monkeypatch.setattr(Network, "send", forbidden)
    monkeypatch.setattr(Network, "delay", forbidden)
    assert hub_server.network == Network() and Network().unlimited
    data = os.urandom(2 * MiB)
    hub_server.add_file(hub_dataset, "big.bin", data)
    started = time.monotonic()
    assert _download(hub_server, hub_dataset, "big.bin", hub_token, tmp_path / "dl") == data
    assert time.monotonic() - started < 1.0  # paced at 1 MiB/s it would take 2 s
    status, _, body = _request(hub_server.url, f"/datasets/{hub_dataset}/resolve/main/big.bin",
                               hub_token, headers={"Range": "bytes=1-"})
    assert status == 206 and body == data[1:]
    assert _request(hub_server.url, f"/api/datasets/{hub_dataset}", hub_token)[0] == 200
    # set_network() lifts the conditions again.
    hub_server.set_network(bandwidth_bps=1000, latency_s=5)
    assert hub_server.set_network() == Network()
    assert _request(hub_server.url, f"/api/datasets/{hub_dataset}", hub_token)[0] == 200


def test_stop_cuts_a_paced_transfer_and_a_latency_wait_short(tmp_path: Path) -> None:
    """stop() returns at once while a body is paced or an answer waits; clients see it."""
    hub = LocalHubServer(tmp_path / "hub", network=Network(bandwidth_bps=256 << 10)).start()
    hub.add_file("org/data", "big.bin", os.urandom(4 * MiB))  # 16 s at this cap
    hub.add_file("org/data", "a.txt", b"a")
    url = hub.url
    outcomes: dict[str, object] = {}

    def fetch(name: str, method: str) -> None:
        try:
            outcomes[name] = _request(url, f"/datasets/org/data/resolve/main/{name}", None,
                                      method=method)
        except (OSError, http.client.HTTPException) as err:
            outcomes[name] = err

    body = threading.Thread(target=fetch, args=("big.bin", "GET"))
    body.start()
    assert hub.wait_for(lambda rs: any(r.status == 200 for r in rs))  # headers sent
    hub.set_network(latency_s=30.0)
    waiting = threading.Thread(target=fetch, args=("a.txt", "HEAD"))
    waiting.start()
    assert hub.wait_for(lambda rs: len(rs) == 2)
    time.sleep(0.3)

    started = time.monotonic()
    hub.stop()
    assert time.monotonic() - started < 1.0
    body.join(3)
    waiting.join(3)
    assert not body.is_alive() and not waiting.is_alive()
    assert time.monotonic() - started < 3.0
    # The body was cut short (http.client raises IncompleteRead) and the HEAD got no answer.
    assert isinstance(outcomes["big.bin"], http.client.IncompleteRead)
    assert isinstance(outcomes["a.txt"], (OSError, http.client.HTTPException))
    big, head = _settled(hub)
    assert (big.status, head.status) == (200, None)  # the HEAD was dropped


def test_network_values_are_checked() -> None:
    bad_bandwidths: list[Any] = [0, -1.0, float("nan"), float("inf"), True, "1"]
    for bad in bad_bandwidths:
        with pytest.raises(ValueError, match="bandwidth_bps"):
            Network(bandwidth_bps=bad)
    bad_latencies: list[Any] = [-0.1, float("nan"), float("inf"), True, None]
    for bad in bad_latencies:
        with pytest.raises(ValueError, match="latency_s"):
            Network(latency_s=bad)
    assert Network(bandwidth_bps=1, latency_s=0).bandwidth_bps == 1


def test_the_command_line_sets_the_network(tmp_path: Path) -> None:
    """--bandwidth and --latency reach the served conditions."""
    repo = tmp_path / "root" / "datasets" / "org" / "data"
    repo.mkdir(parents=True)
    (repo / "blob.bin").write_bytes(os.urandom(256 << 10))
    code = "from fsm.testing.hubserver import main; main()"
    with subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "root"), "--bandwidth", str(512 << 10),
         "--latency", "0.2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            path = "/datasets/org/data/resolve/main/blob.bin"
            started = time.monotonic()
            assert _request(url, path, None, method="HEAD")[0] == 200
            assert time.monotonic() - started >= 0.2
            started = time.monotonic()
            status, _, body = _request(url, path, None)
            assert status == 200 and len(body) == 256 << 10
            assert time.monotonic() - started >= 0.2 + 0.5  # latency, then 256 KiB at 512 KiB/s
        finally:
            assert proc.stdin is not None
            proc.stdin.close()  # the server stops when its stdin closes
            proc.wait(timeout=10)
    assert proc.returncode == 0
    for bad in (["--bandwidth", "0"], ["--latency", "-1"]):
        with pytest.raises(SystemExit):
            main([str(tmp_path / "root"), *bad])


# --- the package index ----------------------------------------------------------------------


def test_pip_downloading_a_wheel_is_slowed_by_the_cap(tmp_path: Path) -> None:
    """Real pip installing a ~1 MiB wheel from an index capped at 512 KiB/s takes >= ~2 s."""
    payload = os.urandom(MiB)
    wheel = build_wheel(tmp_path, "flashbig", "1.0", payload=payload)
    size = wheel.stat().st_size
    bps = 512 << 10
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,  # no machine pip configuration: only the local index
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    with PypiServer([wheel], network=Network(bandwidth_bps=bps)) as index:
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-input", "--retries", "0",
             "--timeout", "30", "--index-url", index.url, "--target", str(tmp_path / "t"),
             "flashbig"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "t" / "flashbig_payload.bin").read_bytes() == payload
    [download] = [t for t in index.transfers if t.path.startswith("/files/")]
    assert download.nbytes == size
    assert download.seconds >= 0.95 * size / bps
    assert elapsed >= size / bps


def test_the_index_latency_and_its_defaults(tmp_path: Path) -> None:
    """Latency delays each index answer; with no network the body is not paced."""
    wheel = build_wheel(tmp_path, "flashbig", "1.0", payload=os.urandom(2 * MiB))
    with PypiServer([wheel]) as index:
        assert index.network == Network()
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{index.port}/files/{wheel.name}",
                                    timeout=10) as response:
            assert len(response.read()) == wheel.stat().st_size
        assert time.monotonic() - started < 1.0  # paced at 1 MiB/s it would take 2 s
        index.set_network(latency_s=0.2)
        started = time.monotonic()
        with urllib.request.urlopen(index.url, timeout=10) as response:
            assert b"flashbig" in response.read()
        assert time.monotonic() - started >= 0.2


def test_closing_the_index_cuts_a_paced_body_short(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, "flashbig", "1.0", payload=os.urandom(4 * MiB))
    index = PypiServer([wheel], network=Network(bandwidth_bps=256 << 10)).__enter__()
    outcome: list[object] = []

    def fetch() -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{index.port}/files/{wheel.name}",
                                        timeout=30) as response:
                outcome.append(response.read())
        except (OSError, http.client.HTTPException) as err:
            outcome.append(err)

    thread = threading.Thread(target=fetch)
    thread.start()
    assert index.first_hit.wait(5)
    time.sleep(0.3)
    started = time.monotonic()
    index.close()
    assert time.monotonic() - started < 1.0
    thread.join(3)
    assert not thread.is_alive()
    assert isinstance(outcome[0], (http.client.IncompleteRead, urllib.error.URLError, OSError))
    assert index.transfers == []  # the body was not sent in full
