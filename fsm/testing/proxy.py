"""A plain-HTTP forward proxy on ``127.0.0.1``, for tests of what goes through a proxy.

Clients send it absolute URLs (``GET http://host:port/path``), as they do to any HTTP
proxy named by ``HTTP_PROXY``; it forwards each request with its body and passes the
answer back, and records what it saw. ``hosts`` maps names to addresses only it knows:
a store named ``http://hub.invalid:PORT`` is then reachable through the proxy and nowhere
else. Standard library only.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ForwardProxy", "Seen"]

#: Hop-by-hop headers (RFC 9110 section 7.6.1): the proxy's own, never forwarded.
_HOP = {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te",
        "trailer", "transfer-encoding", "upgrade"}


@dataclass(frozen=True)
class Seen:
    """One request the proxy forwarded."""

    method: str
    url: str
    #: it carried ``Proxy-Authorization``
    proxy_auth: bool
    #: it carried the target's ``Authorization``
    auth: bool
    status: int


class ForwardProxy:
    """Start on construction; :meth:`close` (or leaving the ``with``) stops it."""

    def __init__(self, hosts: dict[str, str] | None = None) -> None:
        self.seen: list[Seen] = []
        self.hosts = dict(hosts or {})
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks: list[bytes] = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                target = urlsplit(self.path)
                body = self._body()
                host = target.hostname or ""
                upstream = http.client.HTTPConnection(proxy.hosts.get(host, host),
                                                      target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("POST", "PUT", "PATCH"):
                    headers["Content-Length"] = str(len(body))
                try:
                    upstream.request(self.command, target.path + (
                        f"?{target.query}" if target.query else ""), body=body or None,
                        headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                except OSError:
                    self.send_error(502)
                    proxy._record(self, 502)
                    return
                finally:
                    upstream.close()
                proxy._record(self, answer.status)
                self.send_response(answer.status)
                head = self.command == "HEAD"  # its Content-Length is the file's: kept
                for key, value in answer.getheaders():
                    if key.lower() not in _HOP and (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            # http.server's own names for the handlers of each method.
            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward  # noqa: N815

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _record(self, handler: Any, status: int) -> None:
        with self._lock:
            self.seen.append(Seen(handler.command, handler.path,
                                  "Proxy-Authorization" in handler.headers,
                                  "Authorization" in handler.headers, status))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ForwardProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
