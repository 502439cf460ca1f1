"""The Hub adapter's own client: refs, tree listings, existence, downloads, small commits.

Every attempt makes a handful of small calls: the head commit, one folder's tree, its
files, a spilled spec, the marker's commit. Importing ``huggingface_hub`` for them costs
more than making them: its HTTP stack alone (httpx2 on 2.x, requests on 0.x) takes 80 to
130 ms to import, which every attempt would pay before its worker's first instruction and
again before its marker. So the adapter makes them with this module (the standard
library's ``http.client``), and leaves to the library what its accelerators are for: a
commit the Hub wants through LFS, and large model files (``fsm.store.hub``).

A commit is what the library makes for regular files: one ``preupload`` (which says how
each file goes up: a file the Hub wants in LFS is :class:`NeedsLfs`, one the repo ignores
is :class:`Refused`), then one NDJSON commit with the files base64-encoded inline, and
``parentCommit`` for a conditional one (412 when the branch moved). Files the repo already
holds as given are left out, and a commit of nothing is not made.

What it keeps of the library's behaviour:

* the token is sent as ``Authorization: Bearer``, to the endpoint's own origin only, never
  along a redirect to another host (a CDN's presigned URL needs none);
* proxies come from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``,
  ``NO_PROXY``, credentials in the proxy URL included), the CA bundle from
  ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE`` or ``SSL_CERT_FILE``, else ``certifi``'s when
  installed (as requests and httpx do), else the system's;
* connections are kept alive: a pool per origin, shared by the adapter's threads (each
  call runs in a thread of its own); a request that meets an idle connection the server
  has closed meanwhile is sent again once, on a fresh one;
* failures read as the adapter's classifier expects: an HTTP error carries ``response``
  (``status_code``, ``headers``), a transport failure is an ``OSError`` or
  ``http.client.HTTPException``.

And one it adds: a downloaded file is checked against the store's own digest of it (the git
blob id of a regular file, the sha256 of an LFS/Xet one, and its size) before it is renamed
into place; a mismatch is :class:`ContentMismatch`, a transport failure (retried).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from email.message import Message
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode, urljoin, urlsplit

__all__ = ["ContentMismatch", "Entry", "HttpStatusError", "HubClient", "NeedsLfs", "Refused",
           "git_blob_id"]

_CHUNK = 1 << 20
_IDLE_PER_ORIGIN = 16  # idle connections kept per origin (a fetch runs 8 at once)
_MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NEXT_LINK = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')
_EMPTY_BLOB = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's id of the empty file
#: A reused keep-alive connection the server closed meanwhile: send again, once.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


@dataclass(frozen=True)
class Entry:
    """One file of a tree listing: what its download is checked against."""

    path: str
    size: int
    oid: str  # the git blob id (of the LFS pointer, for an LFS file)
    sha256: str | None = None  # the content's digest, for an LFS/Xet file


@dataclass(frozen=True)
class Response:
    """What the adapter's classifier reads from a failed request."""

    status_code: int
    headers: Message


class HttpStatusError(Exception):
    """The store answered with an HTTP error status. The message names the status only."""

    def __init__(self, response: Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


class Refused(Exception):
    """The Hub would not take a commit as asked (the message says why, secret-free)."""


class NeedsLfs(Exception):
    """The Hub wants this file uploaded through LFS: a commit for the library to make."""


class ContentMismatch(ConnectionError):
    """A download whose bytes are not the store's: cut or corrupted on the way."""


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> _Origin:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {parts.scheme}://{parts.hostname}")
        return cls(scheme, parts.hostname, parts.port or (443 if scheme == "https" else 80))


class HubClient:
    """The Hub's reads and small commits at one endpoint; thread-safe (a pool of idle
    connections)."""

    def __init__(self, endpoint: str, token: str | None, *, timeout_s: float,
                 user_agent: str) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._origin = _Origin.of(self.endpoint)
        self._token = token
        self.timeout_s = timeout_s
        self._user_agent = user_agent
        self._idle: dict[_Origin, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    # --- the Hub's reads ---------------------------------------------------------------------

    def main_commit(self, repo_type: str, repo_id: str) -> str | None:
        """The commit ``main`` points at (the repo's refs), or None when it names none."""
        refs = self.get_json(f"/api/{repo_type}s/{repo_id}/refs")
        branches = refs.get("branches", []) if isinstance(refs, dict) else []
        return next((str(b["targetCommit"]) for b in branches
                     if isinstance(b, dict) and b.get("name") == "main"), None)

    def tree(self, repo_type: str, repo_id: str, folder: str, *, revision: str,
             recursive: bool, limit: int | None = None) -> list[Entry]:
        """The files of ``folder`` (below it too when ``recursive``), every page (with
        ``limit``: no further page once more than that many were found)."""
        url: str | None = (
            f"{self.endpoint}/api/{repo_type}s/{repo_id}/tree/{quote(revision, safe='')}"
            + (f"/{quote(folder, safe='')}" if folder else "") + "?"
            + urlencode({"recursive": "true" if recursive else "false", "expand": "false"})
        )
        entries: list[Entry] = []
        while url is not None:
            with self._open("GET", url) as response:
                page = json.loads(response.read())
                link = response.getheader("Link")
            entries += [_entry(item) for item in page
                        if isinstance(item, dict) and item.get("type") == "file"]
            found = _NEXT_LINK.search(link or "")
            url = urljoin(url, found.group(1)) if found else None
            if limit is not None and len(entries) > limit:
                break
        return entries

    def exists(self, repo_type: str, repo_id: str, path: str, *, revision: str) -> bool:
        """Whether the file is there: a HEAD of its resolve URL (a redirect to its content
        counts as there; a 404 raises, for the caller to read)."""
        with self._open("HEAD", self._resolve_url(repo_type, repo_id, path, revision),
                        follow=False):
            return True

    def download(self, repo_type: str, repo_id: str, path: str, dest: Path, *,
                 revision: str, expect: Entry | None = None,
                 check: Callable[[], None] = lambda: None) -> int:
        """Fetch one file to ``dest`` (atomically, checked); return its size.

        ``expect`` (from a tree listing) gives the digest and size to check; without it they
        are taken from the answer's own headers (``X-Linked-Etag``/``X-Linked-Size`` for an
        LFS file, else the ``ETag``, the git blob id). ``check()`` runs between chunks and
        may raise to stop the download (a signal, a cancelled branch).
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        if expect is not None and expect.size == 0 and expect.oid == _EMPTY_BLOB:
            dest.write_bytes(b"")
            return 0
        url = self._resolve_url(repo_type, repo_id, path, revision)
        part = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            answer = self._open("GET", url, identity=True)
            with answer as response, part.open("wb") as out:
                want = expect or _expected_from(answer.first_headers, path)
                digest = _Digest(want)
                for chunk in _chunks(response):
                    check()
                    digest.update(chunk)
                    out.write(chunk)
            digest.verify(path)
            os.replace(part, dest)
            return digest.size
        finally:
            part.unlink(missing_ok=True)

    def commit(self, repo_type: str, repo_id: str, files: Mapping[str, bytes], *,
               message: str, parent: str | None = None, revision: str = "main") -> bool:
        """One commit of ``files`` (path in repo -> content), inline, as the Hub's commit
        API takes regular files: ``preupload`` asks how each file goes up, then the NDJSON
        commit carries them base64-encoded (with ``parentCommit`` when ``parent`` is given:
        the Hub answers 412 when the branch moved). Returns False, committing nothing, when
        the repo already holds every file as given (as the library skips a no-op commit).
        Raises :class:`NeedsLfs` when the Hub wants a file through LFS."""
        base = f"/api/{repo_type}s/{repo_id}"
        rev = quote(revision, safe="")
        asked = self._post(f"{base}/preupload/{rev}", json.dumps({"files": [
            {"path": path, "sample": base64.b64encode(data[:512]).decode(), "size": len(data)}
            for path, data in files.items()]}).encode(), "application/json")
        modes = {str(f.get("path")): f for f in asked.get("files", []) if isinstance(f, dict)}
        changed = []
        for path, data in files.items():
            mode = modes.get(path, {})
            if mode.get("shouldIgnore"):
                raise Refused(f"{path} is ignored by the repo's .gitignore")
            if mode.get("uploadMode") == "lfs" and data:
                raise NeedsLfs(path)
            if mode.get("oid") != git_blob_id(data):
                changed.append(path)
        if not changed:
            return False
        header: dict[str, str] = {"summary": message, "description": ""}
        if parent is not None:
            header["parentCommit"] = parent
        lines = [{"key": "header", "value": header}] + [
            {"key": "file", "value": {"content": base64.b64encode(files[path]).decode(),
                                      "path": path, "encoding": "base64"}}
            for path in changed]
        body = "".join(json.dumps(line) + "\n" for line in lines).encode()
        self._post(f"{base}/commit/{rev}", body, "application/x-ndjson")
        return True

    def get_json(self, path: str) -> Any:
        with self._open("GET", f"{self.endpoint}{path}") as response:
            return json.loads(response.read())

    def _post(self, path: str, body: bytes, content_type: str) -> Any:
        with self._open("POST", f"{self.endpoint}{path}", follow=False,
                        body=body, content_type=content_type) as response:
            return json.loads(response.read() or b"{}")

    # --- plumbing ------------------------------------------------------------------------

    def _resolve_url(self, repo_type: str, repo_id: str, path: str, revision: str) -> str:
        prefix = "" if repo_type == "model" else f"/{repo_type}s"
        return (f"{self.endpoint}{prefix}/{repo_id}/resolve/{quote(revision, safe='')}/"
                f"{quote(path)}")

    def _open(self, method: str, url: str, *, follow: bool = True, identity: bool = False,
              body: bytes | None = None, content_type: str | None = None) -> _Answer:
        """The answer to ``method url`` (redirects followed when ``follow``), status < 400,
        else :class:`HttpStatusError`. The caller reads its body inside ``with``."""
        first: Message | None = None
        for _ in range(_MAX_REDIRECTS + 1):
            origin = _Origin.of(url)
            headers = {"User-Agent": self._user_agent}
            if identity:
                headers["Accept-Encoding"] = "identity"
            if content_type is not None:
                headers["Content-Type"] = content_type
            if self._token and origin == self._origin:
                headers["Authorization"] = f"Bearer {self._token}"
            answer = self._send(origin, method, url, headers, body)
            response = answer.response
            first = first or response.msg
            location = response.getheader("Location")
            if follow and response.status in _REDIRECTS and location:
                with answer:
                    response.read()
                url = urljoin(url, location)
                method = "GET" if response.status == 303 else method
                continue
            if response.status >= 400:
                with answer:
                    response.read()  # the connection stays usable
                raise HttpStatusError(Response(response.status, response.msg))
            answer.first_headers = first
            return answer
        raise HttpStatusError(Response(310, first or Message()))  # a redirect loop

    def _send(self, origin: _Origin, method: str, url: str, headers: dict[str, str],
              body: bytes | None = None) -> _Answer:
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        with self._lock:
            idle = self._idle.get(origin)
            conn = idle.pop() if idle else None
        for try_ in range(2):
            reused = conn is not None
            if conn is None:
                conn = self._connect(origin)
            sent = dict(headers)
            if isinstance(conn, _ProxiedHTTP):  # plain HTTP through a proxy: absolute URLs
                sent |= conn.proxy.headers
            try:
                conn.request(method, url if isinstance(conn, _ProxiedHTTP) else target,
                             body=body, headers=sent)
                return _Answer(conn.getresponse(), partial(self._release, origin, conn))
            except _STALE:
                conn.close()
                conn = None
                if reused and try_ == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _release(self, origin: _Origin, conn: http.client.HTTPConnection,
                 reusable: bool) -> None:
        """Back to the pool when its answer was read to the end, else closed."""
        if reusable and conn.sock is not None:
            with self._lock:
                idle = self._idle.setdefault(origin, [])
                if len(idle) < _IDLE_PER_ORIGIN:
                    idle.append(conn)
                    return
        conn.close()

    def _connect(self, origin: _Origin) -> http.client.HTTPConnection:
        proxy = _proxy_for(origin)
        if origin.scheme == "http":
            if proxy is None:
                return http.client.HTTPConnection(origin.host, origin.port,
                                                  timeout=self.timeout_s)
            return _ProxiedHTTP(proxy, timeout=self.timeout_s)
        context = _tls_context()
        if proxy is None:
            return http.client.HTTPSConnection(origin.host, origin.port,
                                               timeout=self.timeout_s, context=context)
        conn = http.client.HTTPSConnection(proxy.origin.host, proxy.origin.port,
                                           timeout=self.timeout_s, context=context)
        conn.set_tunnel(origin.host, origin.port, headers=dict(proxy.headers))
        return conn


class _Answer:
    """A response to read inside ``with``. Read to its end, its connection goes back to the
    pool; left unread (an error, a stop mid-body) the connection is closed, so no later
    request reads its leftovers."""

    def __init__(self, response: http.client.HTTPResponse,
                 release: Callable[[bool], None]) -> None:
        self.response = response
        self.first_headers: Message = response.msg  # of the first hop, before redirects
        self._release = release

    def __enter__(self) -> http.client.HTTPResponse:
        return self.response

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        response = self.response
        if not response.isclosed() and exc_type is None and response.length == 0:
            response.read()  # a HEAD, or an empty body
        self._release(response.isclosed() and not response.will_close)
        response.close()


def _chunks(response: http.client.HTTPResponse) -> Iterator[bytes]:
    while chunk := response.read(_CHUNK):
        yield chunk


def _entry(item: Mapping[str, Any]) -> Entry:
    lfs = item.get("lfs")
    sha = lfs.get("oid") if isinstance(lfs, dict) else None
    return Entry(str(item["path"]), int(item.get("size") or 0), str(item.get("oid") or ""),
                 str(sha) if sha else None)


def _expected_from(headers: Message, path: str) -> Entry | None:
    """The digest and size a resolve answer announces for its file, if it does."""
    size_text = headers.get("X-Linked-Size") or headers.get("Content-Length") or ""
    size = int(size_text) if size_text.isdigit() else -1
    linked = _etag(headers.get("X-Linked-Etag"))
    if linked and len(linked) == 64:
        return Entry(path, size, "", linked)
    etag = _etag(headers.get("ETag"))
    if etag and len(etag) == 40:
        return Entry(path, size, etag)
    return None


def _etag(value: str | None) -> str | None:
    if not value or value.startswith("W/"):
        return None
    return value.strip().strip('"').lower()


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub's ``oid``) gives a file's content."""
    digest = hashlib.sha1(f"blob {len(data)}\0".encode(), usedforsecurity=False)
    digest.update(data)
    return digest.hexdigest()


class _Digest:
    """Size and digest of the bytes seen, checked against an :class:`Entry`."""

    def __init__(self, want: Entry | None) -> None:
        self.want = want
        self.size = 0
        self._hash: Any = None
        if want is not None and want.sha256:
            self._hash = hashlib.sha256()
        elif want is not None and want.oid and want.size >= 0:  # git hashes a size header
            self._hash = hashlib.sha1(f"blob {want.size}\0".encode(), usedforsecurity=False)

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._hash is not None:
            self._hash.update(chunk)

    def verify(self, path: str) -> None:
        want = self.want
        if want is None:
            return
        if want.size >= 0 and self.size != want.size:
            raise ContentMismatch(
                f"{path}: {self.size} bytes arrived, the store has {want.size}")
        if self._hash is not None and self._hash.hexdigest() != (want.sha256 or want.oid):
            raise ContentMismatch(f"{path}: the bytes that arrived are not the store's")


# --- proxies and TLS, from the environment --------------------------------------------------


@dataclass(frozen=True)
class _Proxy:
    origin: _Origin
    headers: Mapping[str, str]  # Proxy-Authorization, when the proxy URL has credentials


class _ProxiedHTTP(http.client.HTTPConnection):
    """A plain-HTTP connection to a proxy, which takes absolute URLs."""

    def __init__(self, proxy: _Proxy, *, timeout: float) -> None:
        super().__init__(proxy.origin.host, proxy.origin.port, timeout=timeout)
        self.proxy = proxy


def _proxy_for(origin: _Origin) -> _Proxy | None:
    """The proxy the environment names for ``origin``, or None (``NO_PROXY`` honoured)."""
    if not any(key.lower().endswith("_proxy") for key in os.environ):
        return None  # the common case, without importing urllib.request
    import urllib.request

    proxies = urllib.request.getproxies()
    url = proxies.get(origin.scheme) or proxies.get("all")
    if not url or urllib.request.proxy_bypass(origin.host):
        return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    headers: dict[str, str] = {}
    if parts.username:
        user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
    return _Proxy(_Origin("http", parts.hostname or "", parts.port or 80), headers)


_tls: list[Any] = []


def _tls_context() -> Any:
    """One TLS context for every connection, with the CA bundle the libraries would use."""
    if not _tls:
        import ssl

        cafile = next((os.environ[key] for key in
                       ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")
                       if os.environ.get(key)), None)
        if cafile is None and not os.environ.get("SSL_CERT_DIR"):
            try:
                import certifi  # type: ignore[import-not-found, unused-ignore]

                cafile = certifi.where()
            except ImportError:
                pass
        _tls.append(ssl.create_default_context(cafile=cafile))
    return _tls[0]
