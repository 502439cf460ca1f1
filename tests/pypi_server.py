"""A tiny PEP 503 "simple" package index on 127.0.0.1, and a hand-made wheel to serve.

Real pip talks to it over real HTTP, so the pip tests need no mocks and no network::

    wheel = build_wheel(tmp_path, "flashdemo", "1.0")
    with PypiServer([wheel]) as index:
        ...  # pip install --index-url index.url flashdemo
        index.hits  # requests the index received so far (index.paths: their paths)

Modes (``index.mode`` may be changed at any time):

- ``healthy``: serves ``/simple/``, ``/simple/<project>/`` and ``/files/<wheel>``;
- ``unavailable``: answers every request with ``503 Service Unavailable``;
- ``hang``: accepts the connection, reads the request and never answers, until the
  server is closed (bounded by ``hang_limit_s``, so a forgotten client cannot pin a thread).

Network conditions, for benchmarks (:class:`fsm.testing.hubserver.Network`, as on the
local Hub server; none by default, and then no pacing code runs at all)::

    with PypiServer([wheel], network=Network(bandwidth_bps=1 << 20, latency_s=0.05)) as index:
        index.set_network(bandwidth_bps=512 << 10)  # or change them at any time
        ...
        index.transfers  # [Transfer(path, nbytes, seconds), ...]: each body and its time

- ``bandwidth_bps`` caps every response body (the wheels under ``/files/`` and the pages)
  per connection: each is sent in chunks paced so that bytes / elapsed stays within the
  cap; parallel connections each get the whole cap.
- ``latency_s`` delays every answer once, before anything is sent (in every mode).
- Both wait on the server's closing: ``close()`` cuts a paced body or a wait short.

``build_wheel(..., payload=os.urandom(n))`` adds an ``n``-byte data file to the wheel, to
make its download take measurable time.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import re
import socket
import threading
import time
import zipfile
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Literal, NamedTuple

from fsm.testing.hubserver import Network

Mode = Literal["healthy", "unavailable", "hang"]


class Transfer(NamedTuple):
    """One response body the index sent: its request path, size and sending time."""

    path: str
    nbytes: int
    seconds: float


def normalize(name: str) -> str:
    """PEP 503 project name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_wheel(directory: Path, name: str, version: str, *, payload: bytes = b"") -> Path:
    """Write a minimal pure-Python wheel ``<name>-<version>-py3-none-any.whl`` by hand.

    It holds one module ``<name>.py`` with ``VERSION = "<version>"``, and the dist-info
    files pip checks (METADATA, WHEEL, and a RECORD with real hashes). A non-empty
    ``payload`` is added, stored uncompressed, as ``<name>_payload.bin`` (random bytes
    make a wheel of about their size).
    """
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}.py": f'VERSION = "{version}"\n'.encode(),
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            "Summary: a test wheel served by the local index\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: pypi_server\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    if payload:
        files[f"{dist}_payload.bin"] = payload
    record_lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(data)}")
    record_lines.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record_lines) + "\n").encode()

    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            stored = path.endswith("_payload.bin")
            zf.writestr(path, data, zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
    return wheel


class PypiServer:
    """A PEP 503 index of the given wheel files, served from a thread on 127.0.0.1.

    ``network``: a bandwidth cap per connection and a latency per request (none when
    None); see :meth:`set_network`.
    """

    def __init__(
        self,
        wheels: Iterable[Path] = (),
        *,
        mode: Mode = "healthy",
        hang_limit_s: float = 60.0,
        network: Network | None = None,
    ) -> None:
        self.mode: Mode = mode
        self.hang_limit_s = hang_limit_s
        self.network = Network() if network is None else network
        self.hits = 0
        self.paths: list[str] = []
        self.transfers: list[Transfer] = []  # every response body sent in full
        self.first_hit = threading.Event()  # set by the first request
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._wheels = {w.name: w for w in wheels}
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="pypi-server", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The index URL to hand to ``pip --index-url``."""
        return f"http://127.0.0.1:{self.port}/simple/"

    def __enter__(self) -> PypiServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def set_network(
        self, bandwidth_bps: float | None = None, latency_s: float = 0.0
    ) -> Network:
        """Cap each connection's response bodies at ``bandwidth_bps`` bytes per second
        (None: unlimited) and delay every answer by ``latency_s`` seconds; requests that
        arrive afterwards see them. ``set_network()`` lifts both."""
        self.network = Network(bandwidth_bps=bandwidth_bps, latency_s=latency_s)
        return self.network

    def close(self) -> None:
        self._closing.set()  # releases hanging handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _projects(self) -> dict[str, list[str]]:
        projects: dict[str, list[str]] = {}
        for filename in sorted(self._wheels):
            projects.setdefault(normalize(filename.split("-")[0]), []).append(filename)
        return projects

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no delayed-ACK stall between headers and body

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output clean

            network = Network()  # this request's conditions, taken when it arrives

            def do_HEAD(self) -> None:
                # uv asks HEAD /files/<wheel> before a ranged metadata read; the stdlib's
                # 501 for a missing method reads to uv as a server error (it retries, then
                # fails). A 405, as many indexes answer, makes it download the wheel.
                self.send_response(405)
                self.send_header("Allow", "GET")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                with server._lock:
                    server.hits += 1
                    server.paths.append(self.path)
                server.first_hit.set()
                self.network = network = server.network
                if network.latency_s and not network.delay(server._closing):
                    self.close_connection = True  # the server is closing
                    return
                if server.mode == "hang":
                    server._closing.wait(server.hang_limit_s)
                    self.close_connection = True
                    return
                if server.mode == "unavailable":
                    self._send(503, b"index unavailable\n", "text/plain")
                    return
                self._serve()

            def _serve(self) -> None:
                path = self.path.split("?", 1)[0]
                projects = server._projects()
                if path in ("/simple", "/simple/"):
                    links = "".join(
                        f'<a href="/simple/{p}/">{html.escape(p)}</a>\n' for p in projects
                    )
                    self._page(links)
                    return
                m = re.fullmatch(r"/simple/([^/]+)/?", path)
                if m:
                    files = projects.get(normalize(m.group(1)))
                    if files is None:
                        self._send(404, b"no such project\n", "text/plain")
                        return
                    links = ""
                    for name in files:
                        digest = hashlib.sha256(server._wheels[name].read_bytes()).hexdigest()
                        links += f'<a href="/files/{name}#sha256={digest}">{name}</a>\n'
                    self._page(links)
                    return
                m = re.fullmatch(r"/files/([^/]+)", path)
                if m and m.group(1) in server._wheels:
                    data = server._wheels[m.group(1)].read_bytes()
                    self._send(200, data, "application/octet-stream")
                    return
                self._send(404, b"not found\n", "text/plain")

            def _page(self, body: str) -> None:
                doc = f"<!DOCTYPE html>\n<html><body>\n{body}</body></html>\n"
                self._send(200, doc.encode(), "text/html")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                started = time.monotonic()
                if self.network.bandwidth_bps is None:
                    self.wfile.write(body)
                elif not self.network.send(self.wfile.write, body, server._closing):
                    self.close_connection = True  # closing: cut the body short
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                transfer = Transfer(self.path, len(body), time.monotonic() - started)
                with server._lock:
                    server.transfers.append(transfer)

        return Handler
