"""InstallExtras with uv (issue 15): real uv against a local index on 127.0.0.1, no mocks.

Every uv run here installs into a fresh virtual environment's interpreter made in the
test's own directory (``--python``), with its own cache, ``HOME`` and no configuration
(the installer adds ``--no-config``), and is pointed at the local index, a closed port or
``--no-index``: nothing leaves 127.0.0.1. The tests that run uv are skipped, with the
reason, when uv is not installed (``pip install uv``; the ``test`` extra has it).

The network failures below were measured with uv 0.13.9 against the four broken indexes
the live tests build (a closed port, a server that resets connections, an index answering
503 and one that never answers); ``UV_OUTPUTS`` keeps the messages uv printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import TRAIN_PATH, Layout, closed_port, hanging_project, survivors
from pypi_server import PypiServer, build_wheel
from structlog.testing import capture_logs

from fsm import rules
from fsm.attempt.runner import run_attempt
from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, FatalError, Interrupted, RetriableError
from fsm.extras import installer
from fsm.extras.installer import (
    UV_NETWORK_SIGNATURES,
    UV_RETRIES,
    UV_SPELLINGS,
    UvRefusal,
    choose,
    classify_uv_output,
    find_uv,
    uv_arguments,
    uv_env,
    uv_network_signature,
)
from fsm.extras.pip import EXTRA_PIP_OPTIONS, MESSAGE_CHARS, STOP_GRACE_S, InstallSteps
from fsm.interrupt import InterruptFlag
from fsm.output.redact import Redactor

UV = find_uv(os.environ)
needs_uv = pytest.mark.skipif(
    UV is None, reason="uv is not installed here (pip install uv, or the test extra)"
)
SECRET = "hf_s3cr3t-value-never-logged"


# --- the local index, and what uv needs of it ------------------------------------------------


def wheel_requiring(directory: Path, name: str, version: str, *requires: str) -> Path:
    """``build_wheel``'s wheel with ``Requires-Dist`` lines added to its METADATA."""
    import base64
    import hashlib
    import zipfile

    plain = build_wheel(directory, name, version)
    with zipfile.ZipFile(plain) as zf:
        files = {n: zf.read(n) for n in zf.namelist() if not n.endswith("/RECORD")}
    info = next(n for n in files if n.endswith("/METADATA")).rpartition("/")[0]
    files[f"{info}/METADATA"] += "".join(f"Requires-Dist: {r}\n" for r in requires).encode()
    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{path},sha256={digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(plain, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return plain


class Resetter:
    """A server on 127.0.0.1 that reads each request and resets the connection (RST)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/simple/"
        self.hits = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self.sock.close()


def events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


def fresh_venv(path: Path) -> Path:
    """A new virtual environment (no pip in it); its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


def site_packages(python: Path) -> Path:
    found = list(python.parent.parent.glob("lib/python3*/site-packages"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheels"), "flashdemo", "1.0")


@pytest.fixture
def index(wheel: Path) -> Iterator[PypiServer]:
    server = PypiServer([wheel], hang_limit_s=30)
    with server:
        yield server


@pytest.fixture
def marker() -> str:
    """A value put in uv's environment, to find any process uv left behind."""
    return uuid.uuid4().hex


class Uv:
    """Runs ``fsm.extras.installer.install`` into a fresh venv, with an isolated environment
    (``FLASH_INSTALLER=uv`` unless the test says otherwise)."""

    def __init__(self, tmp_path: Path, marker: str) -> None:
        self.python = fresh_venv(tmp_path / "venv")
        self.console = tmp_path / "console.txt"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp_path),
            "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
            "FLASH_INSTALLER": "uv",
            "HF_TOKEN": SECRET,
            "FLASH_PIP_TEST_MARK": marker,
        }

    def __call__(
        self,
        requirements: Sequence[str],
        *,
        deadline: Deadline | None = None,
        interrupt: InterruptFlag | None = None,
        tries: int = 3,
        backoff_s: float = 0.05,
        env: Mapping[str, str] | None = None,
        **more_env: str,
    ) -> str | None:
        return installer.install(
            requirements,
            env={**self.env, **(env or {}), **more_env},
            deadline=deadline or Deadline.after(60),
            interrupt=interrupt or InterruptFlag(),
            python=str(self.python),
            tries=tries,
            backoff_s=backoff_s,
            output_log=self.console,
            redactor=Redactor([SECRET]),
        )

    def installed(self, module: str) -> str:
        """The version installed, by its metadata: importing it could read a stale
        ``__pycache__`` (uv leaves the replaced version's bytecode, and two test wheels'
        modules have the same size and the same zip timestamp)."""
        return subprocess.run(
            [str(self.python), "-c",
             f"import importlib.metadata as m; print(m.version({module!r}))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()


@pytest.fixture
def uv(tmp_path: Path, marker: str) -> Uv:
    return Uv(tmp_path, marker)


def assert_one_line(message: str) -> None:
    assert "\n" not in message
    assert 0 < len(message) <= MESSAGE_CHARS


# --- success ---------------------------------------------------------------------------------


@needs_uv
def test_installs_from_the_local_index_into_the_workers_interpreter(
    uv: Uv, index: PypiServer
) -> None:
    """uv installs into the interpreter it is given, from the index; the log names uv."""
    with capture_logs() as logs:
        assert uv(["--index-url", index.url, "flashdemo==1.0"]) == "uv"
    assert uv.installed("flashdemo") == "1.0"
    assert (site_packages(uv.python) / "flashdemo.py").is_file()
    assert "/simple/flashdemo/" in index.paths
    assert "/files/flashdemo-1.0-py3-none-any.whl" in index.paths
    chosen = events(logs, "pip.installer")
    assert [(e["installer"], e["uv"]) for e in chosen] == [("uv", UV)]
    assert [(e["installer"], e["try"]) for e in events(logs, "pip.installed")] == [("uv", 1)]
    assert "Installed 1 package" in uv.console.read_text()
    assert SECRET not in repr(logs)


@needs_uv
def test_uvs_phases_are_reported_as_extras_progress_events(uv: Uv, index: PypiServer) -> None:
    """uv says little (a summary line per phase): the events follow it, from resolving to
    installed with the packages it counted; its output is kept, not passed on."""
    with capture_logs() as logs:
        uv(["--index-url", index.url, "flashdemo==1.0"])
    reports = events(logs, "extras.progress")
    assert [(e["report"], e["phase"]) for e in (reports[0], reports[-1])] == [
        ("start", "resolving"), ("end", "installed")]
    assert {k: reports[-1][k] for k in ("installer", "resolved", "downloaded", "installed",
                                        "ok")} == {
        "installer": "uv", "resolved": 1, "downloaded": 1, "installed": 1, "ok": True}
    assert "--- flash-bootstrap: uv pip install, try 1 of 3 ---" in uv.console.read_text()


def test_uvs_console_reads_as_phases_and_counts() -> None:
    """The summary lines of uv 0.13 (``tests/test_uv.py`` runs the real one above)."""
    steps = InstallSteps()
    seen = []
    for line in ("Using Python 3.11.7 environment at: /tmp/v", "Resolved 2 packages in 7ms",
                 "   Building flashx @ file:///tmp/flashx", "      Built flashx @ file:///tmp/x",
                 "Prepared 2 packages in 4ms", "Uninstalled 1 package in 1ms",
                 "Installed 2 packages in 2ms", " + flashextra==1.0", " ~ flashx==0.1"):
        installer.read_uv_line(line, steps)
        seen.append(steps.phase)
    assert seen == ["resolving", "downloading", "building", "building", "installing",
                    "installing", "installed", "installed", "installed"]
    assert steps.fields() == {"phase": "installed", "resolved": 2, "downloaded": 2,
                              "installed": 2}
    installer.read_uv_line("Audited 3 packages in 1ms", nothing := InstallSteps())
    assert (nothing.phase, nothing.installed) == ("installed", 0)


@needs_uv
def test_installs_a_local_wheel_file_without_an_index(uv: Uv, wheel: Path) -> None:
    uv(["--no-index", str(wheel)])
    assert uv.installed("flashdemo") == "1.0"


# --- network failures: retried, then retriable ------------------------------------------------

#: Each broken index the live test builds: (the extra env, the signature uv's output shows).
BROKEN = {
    "refused": ({}, "connection-refused"),
    "reset": ({}, "connection-reset"),
    "503": ({}, "server-error"),
    "hang": ({"UV_HTTP_TIMEOUT": "1"}, "timeout"),
}


@needs_uv
@pytest.mark.parametrize("kind", list(BROKEN))
def test_each_network_failure_is_retried_then_retriable(
    uv: Uv, index: PypiServer, kind: str
) -> None:
    """A refusing, resetting, failing (503) or silent index: uv's output is network-shaped
    by the expected signature, the install is tried ``tries`` times, then pip-network."""
    extra, expected = BROKEN[kind]
    resetter = Resetter() if kind == "reset" else None
    url = {
        "refused": f"http://127.0.0.1:{closed_port()}/simple/",
        "reset": resetter.url if resetter else "",
        "503": index.url,
        "hang": index.url,
    }[kind]
    index.mode = "unavailable" if kind == "503" else "hang" if kind == "hang" else "healthy"
    try:
        with capture_logs() as logs, pytest.raises(RetriableError) as err:
            # UV_HTTP_RETRIES=0: one request per try, so the tries are ours to count
            uv(["--index-url", url, "flashdemo"], tries=2, env={"UV_HTTP_RETRIES": "0", **extra})
    finally:
        if resetter:
            resetter.close()
    assert err.value.rule is rules.PIP_NETWORK
    failed = events(logs, "pip.failed")
    assert [(e["installer"], e["failure_class"], e["signature"]) for e in failed] == [
        ("uv", "network", expected)
    ] * 2
    meaning = next(s.meaning for s in UV_NETWORK_SIGNATURES if s.name == expected)
    assert err.value.message.startswith(
        f"uv pip install failed (network: {meaning}) after 2 tries: "
    )
    assert "error: Failed to fetch: http://127.0.0.1:" in err.value.message
    assert_one_line(err.value.message)
    if kind in ("503", "hang"):
        assert index.hits == 2
    if resetter:
        assert resetter.hits == 2


@needs_uv
def test_uvs_own_retries_are_bounded_when_env_does_not_choose(uv: Uv, index: PypiServer) -> None:
    """Without UV_HTTP_RETRIES (or PIP_RETRIES), uv retries a failing request UV_RETRIES
    times, not its default 3, and says so."""
    index.mode = "unavailable"
    with pytest.raises(RetriableError, match=r"after 1 try: error: Request failed after 2 retr"):
        uv(["--index-url", index.url, "flashdemo"], tries=1)
    assert index.hits == 1 + UV_RETRIES


# --- other failures: fatal at once -----------------------------------------------------------


@needs_uv
@pytest.mark.parametrize(
    ("requirement", "says"),
    [("flashdemo==9.9", "there is no version of flashdemo==9.9"),
     ("nosuchproject", "nosuchproject was not found in the package registry")],
    ids=["no-such-version", "no-such-project"],
)
def test_a_missing_package_is_fatal_on_the_first_try(
    uv: Uv, index: PypiServer, requirement: str, says: str
) -> None:
    with capture_logs() as logs, pytest.raises(FatalError) as err:
        uv(["--index-url", index.url, requirement])
    assert err.value.rule is rules.PIP_FAILED
    assert len(events(logs, "pip.try")) == 1
    assert [(e["installer"], e["failure_class"]) for e in events(logs, "pip.failed")] == [
        ("uv", "other")
    ]
    assert err.value.message.startswith("uv pip install failed (exit status 1): error: No solution")
    assert says in err.value.message
    assert_one_line(err.value.message)


@needs_uv
def test_a_failing_build_is_fatal_and_says_why(uv: Uv, tmp_path: Path) -> None:
    project = tmp_path / "broken"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "failbackend"\nbackend-path = ["."]\n'
    )
    (project / "failbackend.py").write_text(
        "def get_requires_for_build_wheel(config_settings=None):\n"
        "    raise RuntimeError('this project cannot be built')\n"
    )
    with pytest.raises(FatalError) as err:
        uv(["--no-index", str(project)])
    assert err.value.rule is rules.PIP_FAILED
    assert err.value.message.endswith("RuntimeError: this project cannot be built")
    assert_one_line(err.value.message)


# --- time and signals ------------------------------------------------------------------------


@needs_uv
def test_sigterm_stops_uv_and_its_build_subprocess(
    uv: Uv, index: PypiServer, marker: str, tmp_path: Path
) -> None:
    """SIGTERM while uv's build hook hangs: Interrupted promptly, no process of uv's
    group survives."""
    index.mode = "hang"
    project = hanging_project(tmp_path / "hangs", index.url + "hook")
    flag = InterruptFlag()
    fired: list[float] = []

    def send_sigterm() -> None:
        if index.first_hit.wait(30):  # the build hook (uv's grandchild) is blocked now
            fired.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: flag.trigger(signum))
    try:
        threading.Thread(target=send_sigterm, daemon=True).start()
        with capture_logs() as logs, pytest.raises(Interrupted) as err:
            uv(["--no-index", str(project)], interrupt=flag)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert err.value.signum == signal.SIGTERM
    assert fired, "the build hook never reached the index"
    assert time.monotonic() - fired[0] < STOP_GRACE_S + 1.5
    assert survivors(marker) == []
    assert [e["installer"] for e in events(logs, "pip.try")] == ["uv"]


@needs_uv
def test_the_deadline_stops_a_hung_uv(uv: Uv, index: PypiServer, marker: str) -> None:
    index.mode = "hang"
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="uv pip install did not finish"):
        uv(["--index-url", index.url, "flashdemo"], deadline=Deadline.after(2.0),
           UV_HTTP_TIMEOUT="60")
    assert 2.0 <= time.monotonic() - started < 2.0 + STOP_GRACE_S + 1.5
    assert survivors(marker) == []


# --- uv's messages, as measured ---------------------------------------------------------------

#: What uv 0.13.9 printed (stderr, verbatim but for ports) for each failure, and the
#: signature it must get (None: not network-shaped). The refused, reset, 503 and hang rows
#: were measured against the same broken indexes the live tests above build (with
#: UV_HTTP_RETRIES=0, unless the name says uv's own retries ran); the rest against one-off
#: servers (a full accept queue, a body cut short, a server closing without an answer, an
#: index without HEAD), a .invalid host and an IPv6 documentation address, which depend on
#: this host's network, so only their messages are kept here.
UV_OUTPUTS: dict[str, tuple[str | None, str]] = {
    "closed port": ("connection-refused", """\
error: Failed to fetch: http://127.0.0.1:58529/simple/flashdemo/
  cause: error sending request for url (http://127.0.0.1:58529/simple/flashdemo/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: Connection refused (os error 111)
"""),
    "closed port, uv's own 3 retries": ("connection-refused", """\
error: Request failed after 3 retries in 10.8s
  cause: Failed to fetch: http://127.0.0.1:58529/simple/flashdemo/
  cause: error sending request for url (http://127.0.0.1:58529/simple/flashdemo/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: Connection refused (os error 111)
"""),
    "connection reset after the request": ("connection-reset", """\
error: Failed to fetch: http://127.0.0.1:44451/simple/flashdemo/
  cause: error sending request for url (http://127.0.0.1:44451/simple/flashdemo/)
  cause: client error (SendRequest)
  cause: connection error
  cause: Connection reset by peer (os error 104)
"""),
    "connection closed without an answer": ("connection-reset", """\
error: Failed to fetch: http://127.0.0.1:34967/simple/flashdemo/
  cause: error sending request for url (http://127.0.0.1:34967/simple/flashdemo/)
  cause: client error (SendRequest)
  cause: connection closed before message completed
"""),
    "index answers 503": ("server-error", """\
error: Failed to fetch: http://127.0.0.1:33121/simple/flashdemo/
  cause: HTTP status server error (503 Service Unavailable) for url (http://127.0.0.1:33121/simple/flashdemo/)
"""),
    "index answers 503, uv's own 3 retries": ("server-error", """\
error: Request failed after 3 retries in 11.4s
  cause: Failed to fetch: http://127.0.0.1:33121/simple/flashdemo/
  cause: HTTP status server error (503 Service Unavailable) for url (http://127.0.0.1:33121/simple/flashdemo/)
"""),
    "index never answers (UV_HTTP_TIMEOUT=2)": ("timeout", """\
error: Failed to fetch: http://127.0.0.1:34543/simple/flashdemo/
  cause: error sending request for url (http://127.0.0.1:34543/simple/flashdemo/)
  cause: operation timed out
"""),
    "connect never accepted (UV_HTTP_CONNECT_TIMEOUT=2)": ("connect-timeout", """\
error: Failed to fetch: http://127.0.0.1:43079/simple/flashdemo/
  cause: error sending request for url (http://127.0.0.1:43079/simple/flashdemo/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: deadline has elapsed
"""),
    "wheel body cut short": ("connection-broken", """\
Resolved 1 package in 3ms
error: Failed to download `flashdemo==1.0`
  cause: Failed to write to the distribution cache
  cause: error decoding response body
  cause: request or response body error
  cause: error reading a body from connection
  cause: end of file before message length reached
"""),
    "host name does not resolve": ("name-resolution", """\
error: Failed to fetch: http://no-such-host.invalid/simple/flashdemo/
  cause: error sending request for url (http://no-such-host.invalid/simple/flashdemo/)
  cause: client error (Connect)
  cause: dns error
  cause: error resolving DNS
  cause: failed to lookup address information: Name or service not known
"""),
    "no route to the host": ("network-unreachable", """\
error: Failed to fetch: http://[2001:db8::1]/simple/flashdemo/
  cause: error sending request for url (http://[2001:db8::1]/simple/flashdemo/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: No route to host (os error 113)
"""),
    "retries alone": ("uv-retrying", "error: Request failed after 2 retries in 3.7s\n"),
    # --- not network-shaped: fatal on any host
    "no such version": (None, """\
error: No solution found when resolving dependencies
  cause: Because there is no version of flashdemo==9.9 and you require flashdemo==9.9, we can conclude that your requirements are unsatisfiable.
"""),  # noqa: E501
    "no such project": (None, """\
error: No solution found when resolving dependencies
  cause: Because nosuchproject was not found in the package registry and you require nosuchproject, we can conclude that your requirements are unsatisfiable.
"""),  # noqa: E501
    "failed build": (None, """\
error: The build backend returned an error
  cause: Call to `failbackend.get_requires_for_build_wheel` failed (exit status: 1)

         [stderr]
         Traceback (most recent call last):
           File "<string>", line 14, in <module>
           File "/tmp/uvx/broken/failbackend.py", line 2, in get_requires_for_build_wheel
             raise RuntimeError('this project cannot be built')
         RuntimeError: this project cannot be built
"""),
    "invalid requirement": (None, """\
error: Failed to parse: `not a requirement!`
  cause: Expected one of `@`, `(`, `<`, `=`, `>`, `~`, `!`, `;`, found `a`
         not a requirement!
             ^
"""),
    "git cannot reach its host (git's own failure, fatal as with pip)": (None, """\
error: Failed to download and build `flashx @ git+https://oauth2:****@127.0.0.1:58529/ppp/x.git`
  cause: Git operation failed
  cause: failed to clone into: c7/git-v2/db/ebf38b7980fc0405
  cause: process didn't exit successfully: `/usr/bin/git fetch --force --update-head-ok 'https://oauth2:****@127.0.0.1:58529/ppp/x.git' '+HEAD:refs/remotes/origin/HEAD'` (exit status: 128)
         --- stderr
         fatal: unable to access 'https://127.0.0.1:58529/ppp/x.git/': Failed to connect to 127.0.0.1 port 58529 after 0 ms: Couldn't connect to server
"""),  # noqa: E501
    # why the test index answers HEAD (PypiServer): a 501 is a 5xx like any other to uv
    "index without HEAD (501)": ("server-error", """\
error: Failed to fetch: http://127.0.0.1:37955/files/flashdemo-1.0-py3-none-any.whl
  cause: HTTP status server error (501 Unsupported method ('HEAD')) for url (http://127.0.0.1:37955/files/flashdemo-1.0-py3-none-any.whl)
"""),
}


@pytest.mark.parametrize(("expected", "text"), UV_OUTPUTS.values(), ids=list(UV_OUTPUTS))
def test_uvs_measured_messages_are_classified(expected: str | None, text: str) -> None:
    found = uv_network_signature(text)
    assert (found.name if found else None) == expected
    assert classify_uv_output(text) == ("other" if expected is None else "network")


def test_every_uv_signature_has_a_measured_message() -> None:
    names = [sig.name for sig in UV_NETWORK_SIGNATURES]
    assert len(names) == len(set(names))
    assert set(names) == {expected for expected, _ in UV_OUTPUTS.values() if expected}
    for sig in UV_NETWORK_SIGNATURES:
        assert sig.meaning and sig.pattern and sig.witness == "uv"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (UV_OUTPUTS["closed port"][1], "error: Failed to fetch: http://127.0.0.1:58529/simple/"
         "flashdemo/: Connection refused (os error 111)"),
        (UV_OUTPUTS["index answers 503, uv's own 3 retries"][1],
         "error: Request failed after 3 retries in 11.4s: Failed to fetch: http://127.0.0.1:"
         "33121/simple/flashdemo/: HTTP status server error (503 Service Unavailable) for url "
         "(http://127.0.0.1:33121/simple/flashdemo/)"),
        (UV_OUTPUTS["failed build"][1], "error: The build backend returned an error: Call to "
         "`failbackend.get_requires_for_build_wheel` failed (exit status: 1): RuntimeError: "
         "this project cannot be built"),
        ("Using Python 3.11.7 environment at: venv\nsomething odd\n", "something odd"),
    ],
    ids=["root-cause", "retried: the fetch kept", "build output", "no error line"],
)
def test_the_telling_line_is_uvs_error_with_its_root_cause(text: str, line: str) -> None:
    assert installer._uv_error_line(text) == line


# --- extra_pip in uv's words -----------------------------------------------------------------


def test_every_allowed_pip_option_has_a_uv_spelling_or_a_refusal() -> None:
    assert list(UV_SPELLINGS) == [option.names[0] for option in EXTRA_PIP_OPTIONS]
    refused = [name for name, spelling in UV_SPELLINGS.items() if spelling.args is None]
    assert refused == ["--prefer-binary"]


@pytest.mark.parametrize(
    ("entries", "args"),
    [
        (["-i", "https://h/simple", "torch"], ["--index-url", "https://h/simple", "torch"]),
        (["--index-url=https://h/simple", "--extra-index-url", "file:///srv/i", "x"],
         ["--index-url", "https://h/simple", "--extra-index-url", "file:///srv/i", "x"]),
        (["-f", "file:///w", "--no-index", "x"], ["--find-links", "file:///w", "--no-index", "x"]),
        (["--pre", "--no-deps", "x"], ["--prerelease", "allow", "--no-deps", "x"]),
        (["--force-reinstall", "x"], ["--reinstall", "x"]),
        (["--only-binary", ":all:", "--no-binary=a,b", "x"],
         ["--only-binary", ":all:", "--no-binary", "a,b", "x"]),
        (["--trusted-host", "h:8080", "x"], ["--allow-insecure-host", "h:8080", "x"]),
        (["-U", "x[y]>=1", "z @ https://h/z-1.0-py3-none-any.whl", "./a-1.0.whl"],
         ["--upgrade-package", "x", "--upgrade-package", "z", "x[y]>=1",
          "z @ https://h/z-1.0-py3-none-any.whl", "./a-1.0.whl"]),
        (["--upgrade", "--upgrade-strategy", "only-if-needed", "x"],
         ["--upgrade-package", "x", "x"]),
        (["--upgrade-strategy=eager", "-U", "x"], ["--upgrade", "x"]),
        (["--upgrade-strategy", "eager", "x"], ["x"]),  # without -U pip ignores it too
    ],
    ids=["index", "index=,extra", "find-links", "pre,no-deps", "force-reinstall", "binary",
         "trusted-host", "upgrade", "upgrade only-if-needed", "upgrade eager",
         "strategy alone"],
)
def test_allowed_options_translate(entries: list[str], args: list[str]) -> None:
    assert uv_arguments(entries) == args


@pytest.mark.parametrize(
    ("entries", "option"),
    [(["--prefer-binary", "x"], "--prefer-binary"), (["--target", "/t", "x"], "--target"),
     (["-r", "/etc/shadow"], "-r"), (["--pre=yes"], "--pre"), (["x", "-i"], "-i")],
)
def test_what_uv_cannot_take_is_refused_with_a_reason(entries: list[str], option: str) -> None:
    refusal = uv_arguments(entries)
    assert isinstance(refusal, UvRefusal)
    assert refusal.option == option and refusal.reason
    if option == "--prefer-binary":
        assert refusal.reason == "uv pip install has no --prefer-binary"


def test_the_readmes_uv_column_is_uv_spellings() -> None:
    """docs/running.md's table of allowed options says, row by row, what uv is given."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "running.md").read_text()
    section = readme.split("## Extra packages (`extra_pip`)", 1)[1].split("\n#", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines()
            if line.startswith("| `-")]
    assert [row[-1].strip() for row in rows] == [
        UV_SPELLINGS[option.names[0]].note for option in EXTRA_PIP_OPTIONS
    ]


@needs_uv
def test_every_translated_option_is_accepted_by_real_uv(uv: Uv, index: PypiServer) -> None:
    """All allowed options but --prefer-binary at once, as the payload gives them: uv
    takes their translation and installs from the local index."""
    uv(["--index-url", index.url, f"--extra-index-url={index.url}", "--trusted-host",
        "127.0.0.1", "--pre", "--no-deps", "-U", "--upgrade-strategy", "only-if-needed",
        "--only-binary=:all:", "--no-binary", ":none:", "--force-reinstall",
        "-f", index.url, "flashdemo==1.0"])
    assert uv.installed("flashdemo") == "1.0"


@needs_uv
def test_upgrade_is_pips_only_if_needed_unless_eager(uv: Uv, tmp_path: Path) -> None:
    """pip's -U upgrades the named package, its dependencies only if needed; uv's own
    --upgrade would upgrade them all. The translation keeps pip's meaning."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("1.0", "2.0"):
        wheel_requiring(wheels, "alpha", version, "beta>=1")
        build_wheel(wheels, "beta", version)
    links = ["--no-index", "-f", wheels.as_uri()]
    uv([*links, "alpha==1.0", "beta==1.0"])
    uv([*links, "-U", "alpha"])
    assert (uv.installed("alpha"), uv.installed("beta")) == ("2.0", "1.0")
    uv([*links, "-U", "--upgrade-strategy", "eager", "alpha"])
    assert (uv.installed("alpha"), uv.installed("beta")) == ("2.0", "2.0")


# --- which installer: FLASH_INSTALLER and auto ----------------------------------------------


@pytest.fixture
def no_pip_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """An environment in which pip has no configuration (this machine's /etc/pip.conf
    aside, which the installer is told to look for elsewhere)."""
    monkeypatch.setattr(installer, "_GLOBAL_PIP_CONFIG", tmp_path / "etc" / "pip.conf")
    return {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "home"),
            "XDG_CONFIG_DIRS": str(tmp_path / "xdg")}


@needs_uv
def test_auto_chooses_uv_when_found_and_nothing_configures_pip(
    no_pip_config: dict[str, str], tmp_path: Path
) -> None:
    python = str(tmp_path / "venv" / "bin" / "python")
    choice = choose(["x"], no_pip_config, python)
    assert (choice.installer, choice.uv, choice.reason) == ("uv", UV, "uv found")
    assert choose(["x"], {**no_pip_config, "FLASH_INSTALLER": " AUTO "}, python) == choice


@needs_uv
@pytest.mark.parametrize(
    ("setting", "entries", "says"),
    [
        ({"FLASH_INSTALLER": "pip"}, ["x"], "FLASH_INSTALLER=pip"),
        ({"PIP_TARGET": "/srv/site"}, ["x"], "pip is configured (PIP_TARGET)"),
        ({"PIP_INDEX_URL": "https://mirror/simple"}, ["x"], "(PIP_INDEX_URL)"),
        ({}, ["--prefer-binary", "x"], "uv cannot take --prefer-binary: uv pip install has no"),
    ],
    ids=["forced pip", "PIP_TARGET", "PIP_INDEX_URL", "--prefer-binary"],
)
def test_auto_keeps_pip_when_uv_would_not_do_what_pip_would(
    no_pip_config: dict[str, str], tmp_path: Path, setting: dict[str, str],
    entries: list[str], says: str,
) -> None:
    choice = choose(entries, {**no_pip_config, **setting}, str(tmp_path / "python"))
    assert choice.installer == "pip"
    assert says in choice.reason


@needs_uv
def test_a_pip_configuration_file_keeps_pip_under_auto(
    no_pip_config: dict[str, str], tmp_path: Path
) -> None:
    conf = Path(no_pip_config["XDG_CONFIG_DIRS"], "pip", "pip.conf")
    conf.parent.mkdir(parents=True)
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\n")
    choice = choose(["x"], no_pip_config, str(tmp_path / "python"))
    assert choice.installer == "pip" and str(conf) in choice.reason
    # transport and cosmetic pip settings carry over to uv: no reason to keep pip
    neutral = {"PIP_RETRIES": "0", "PIP_TIMEOUT": "5", "PIP_NO_CACHE_DIR": "1",
               "PIP_REQUIREMENT": "/etc/shadow"}  # (the last is never given to pip)
    conf.unlink()
    assert choose(["x"], {**no_pip_config, **neutral}, str(tmp_path / "py")).installer == "uv"


@needs_uv
def test_a_pip_configuration_file_of_transport_settings_carries_over_to_uv(
    no_pip_config: dict[str, str], tmp_path: Path
) -> None:
    """An image's pip.conf that only names its CA bundle, timeout and retries does not keep
    pip: uv gets the same as its own settings (the environment's own win); an unreadable
    file keeps pip, as one with any other option does."""
    conf = Path(no_pip_config["XDG_CONFIG_DIRS"], "pip", "pip.conf")
    conf.parent.mkdir(parents=True)
    conf.write_text("[global]\ncert = /etc/ssl/corp.pem\ntimeout = 7\n"
                    "[install]\nretries = 2\nno-cache-dir = true\n")
    python = str(tmp_path / "python")
    assert choose(["x"], no_pip_config, python).installer == "uv"
    carried = installer.uv_env({**installer.pip_file_settings(no_pip_config, python),
                                **no_pip_config})
    assert (carried["SSL_CERT_FILE"], carried["UV_HTTP_TIMEOUT"], carried["UV_HTTP_RETRIES"]) \
        == ("/etc/ssl/corp.pem", "7", "2")
    own = {**no_pip_config, "SSL_CERT_FILE": "/mine.pem"}
    assert installer.uv_env({**installer.pip_file_settings(own, python), **own})[
        "SSL_CERT_FILE"] == "/mine.pem"
    conf.write_bytes(b"[global\n\xff")
    assert choose(["x"], no_pip_config, python).installer == "pip"


@needs_uv
def test_forced_uv_uses_uv_whatever_configures_pip(no_pip_config: dict[str, str]) -> None:
    with capture_logs() as logs:
        choice = choose(["x"], {**no_pip_config, "FLASH_INSTALLER": "uv", "PIP_TARGET": "/t"},
                        "/nowhere/python")
    assert (choice.installer, choice.reason) == ("uv", "FLASH_INSTALLER=uv")
    assert events(logs, "pip.settings_ignored")[0]["keys"] == ["PIP_TARGET"]


@needs_uv
@pytest.mark.parametrize(
    ("env", "entries", "says"),
    [
        ({"FLASH_INSTALLER": "fast"}, ["x"], "FLASH_INSTALLER='fast' is not pip, uv or auto"),
        ({"FLASH_INSTALLER": "uv"}, ["--prefer-binary", "x"],
         "uv cannot install extra_pip: --prefer-binary: uv pip install has no --prefer-binary"
         " (FLASH_INSTALLER=uv; auto would use pip)"),
    ],
    ids=["not an installer", "forced uv, untranslatable"],
)
def test_an_impossible_choice_is_fatal_before_anything_runs(
    uv: Uv, env: dict[str, str], entries: list[str], says: str
) -> None:
    with capture_logs() as logs, pytest.raises(FatalError) as err:
        uv(entries, env=env)
    assert err.value.rule is rules.PIP_FAILED
    assert err.value.message == says
    assert events(logs, "pip.try") == []


def test_forced_uv_without_uv_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installer, "find_uv", lambda env: None)
    with pytest.raises(FatalError, match=r"^FLASH_INSTALLER=uv, but no uv executable was found"):
        choose(["x"], {"FLASH_INSTALLER": "uv"}, sys.executable)
    assert choose(["x"], {}, sys.executable) == ("pip", "no uv executable found", None, ())


@needs_uv
def test_forced_pip_runs_pip_with_uv_installed(uv: Uv, wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    uv.python = Path(sys.executable)  # the fresh venv has no pip; PIP_TARGET says where
    with capture_logs() as logs:
        assert uv(["--no-index", str(wheel)], FLASH_INSTALLER="pip",
                  PIP_TARGET=str(target), PIP_CONFIG_FILE=os.devnull) == "pip"
    assert (target / "flashdemo.py").is_file()
    ours = ("pip.installer", "pip.settings_dropped", "pip.try", "pip.installed")
    assert [(e["event"], e["installer"]) for e in logs if e["event"] in ours] == [
        (event, "pip") for event in ours
    ]


def test_find_uv_looks_on_path_last(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing beside the interpreter nor in a uv package: the PATH's uv, if any."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setitem(sys.modules, "uv", None)  # import uv -> ImportError
    assert find_uv({"PATH": str(tmp_path / "empty")}) is None
    fake = tmp_path / "elsewhere" / "uv"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_uv({"PATH": f"{tmp_path / 'empty'}:{fake.parent}"}) == str(fake)


# --- uv reads nothing of the host -------------------------------------------------------------

HOST_CANARY = "root:$6$uv-host-file-canary-never-leaves$"


def test_uv_env_drops_settings_that_read_host_files() -> None:
    env = {"UV_CONFIG_FILE": "/etc/x", "UV_CONSTRAINT": "/etc/c", "UV_OVERRIDE": "/o",
           "UV_BUILD_CONSTRAINT": "/b", "UV_EXCLUDE": "/e", "UV_WORKING_DIR": "/w",
           "UV_PROJECT": "/p", "UV_PYTHON": "/usr/bin/python3", "UV_SYSTEM_PYTHON": "1",
           "UV_KEYRING_PROVIDER": "subprocess", "PIP_REQUIREMENT": "/etc/r",
           "UV_INDEX_URL": "https://mirror/simple", "PATH": "/bin"}
    with capture_logs() as logs:
        got = uv_env(env)
    assert got == {"UV_INDEX_URL": "https://mirror/simple", "PATH": "/bin", "UV_NO_CONFIG": "1",
                   "PYTHONUNBUFFERED": "1", "UV_HTTP_RETRIES": str(UV_RETRIES),
                   "UV_HTTP_TIMEOUT": "15"}
    assert events(logs, "pip.settings_dropped")[0]["keys"] == sorted(
        set(env) - {"UV_INDEX_URL", "PATH"}
    )


def test_pips_transport_settings_carry_over_unless_uvs_are_set() -> None:
    pip_env = {"PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "2.5", "PIP_CERT": "/ca.pem"}
    got = uv_env(pip_env)
    assert (got["UV_HTTP_RETRIES"], got["UV_HTTP_TIMEOUT"], got["SSL_CERT_FILE"]) == (
        "0", "3", "/ca.pem")
    own = uv_env({**pip_env, "UV_HTTP_RETRIES": "5", "UV_HTTP_TIMEOUT": "9",
                  "SSL_CERT_FILE": "/mine.pem"})
    assert (own["UV_HTTP_RETRIES"], own["UV_HTTP_TIMEOUT"], own["SSL_CERT_FILE"]) == (
        "5", "9", "/mine.pem")


@needs_uv
def test_uv_reads_no_configuration_file(
    uv: Uv, index: PypiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A uv.toml where uv would look (the user's, the working directory's, a project's
    pyproject.toml) and one named by UV_CONFIG_FILE, each turning the index off, moving the
    install elsewhere and holding a key uv does not know (uv quotes such a line in its
    error: here, a canary). uv installs from the payload's index into the worker's
    interpreter, and the canary is nowhere."""
    moved = tmp_path / "moved"
    config = f'[pip]\nno-index = true\ntarget = "{moved}"\n"{HOST_CANARY}" = 1\n'
    user = tmp_path / ".config" / "uv" / "uv.toml"
    user.parent.mkdir(parents=True)
    user.write_text(config)
    named = tmp_path / "named.toml"
    named.write_text(config)
    project = tmp_path / "project"
    project.mkdir()
    (project / "uv.toml").write_text(config)
    (project / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "0"\n[tool.uv.pip]\nno-index = true\n'
        f'target = "{moved}"\n'
    )
    monkeypatch.chdir(project)
    with capture_logs() as logs:
        uv(["--index-url", index.url, "flashdemo==1.0"], UV_CONFIG_FILE=str(named),
           XDG_CONFIG_HOME=str(tmp_path / ".config"))
    assert uv.installed("flashdemo") == "1.0"
    assert not moved.exists()
    assert HOST_CANARY not in uv.console.read_text() + repr(logs)
    assert events(logs, "pip.settings_dropped")[0]["keys"] == ["UV_CONFIG_FILE"]


# --- secrets: uv's output is redacted as pip's ---------------------------------------------------

FAKE_UV = """\
#!{python}
# Stands in for uv: prints FAKE_UV_OUT and fails as uv does (exit status 2).
import os, sys
sys.stderr.write(os.environ["FAKE_UV_OUT"])
sys.exit(2)
"""
LONG_SECRET = "ghp_0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b"


@pytest.mark.parametrize("pad", range(380, 440, 8))
def test_uvs_error_is_redacted_before_it_is_cut(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pad: int
) -> None:
    """A secret across the message's cut leaves no piece of itself, as with pip."""
    fake = tmp_path / "uv"
    fake.write_text(FAKE_UV.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(installer, "find_uv", lambda env: str(fake))
    out = f"error: Failed to fetch: https://h/{'x' * pad}{LONG_SECRET}/simple/\n  cause: boom\n"
    with pytest.raises(FatalError) as err:
        installer.install(["flashdemo"], env={"FLASH_INSTALLER": "uv", "FAKE_UV_OUT": out},
                          deadline=Deadline.after(30), interrupt=InterruptFlag(), tries=1,
                          output_log=tmp_path / "out.txt", redactor=Redactor([LONG_SECRET]))
    message = err.value.message
    assert message.startswith("uv pip install failed (exit status 2): error: Failed to fetch")
    assert_one_line(message)
    pieces = [LONG_SECRET[i : i + 10] for i in range(len(LONG_SECRET) - 9)]
    assert [p for p in pieces if p in message] == []


# --- through the whole runner ---------------------------------------------------------------


@pytest.fixture
def runner_env(no_pip_config: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The runner's environment: this one, without pip's settings, in a clean home."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "UV_", "FLASH_", "XDG_"))}
    return {**env, **no_pip_config, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}


@needs_uv
def test_a_run_installs_its_extras_with_uv_into_the_workers_interpreter(
    layout: Layout, tmp_path: Path, runner_env: dict[str, str],
    captured_logs: list[dict[str, Any]],
) -> None:
    """The real runner, FLASH_INSTALLER unset: uv is chosen, installs the extra into the
    worker's interpreter (a fresh venv), and the worker imports it from there."""
    python = fresh_venv(tmp_path / "worker-venv")
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    layout.write_worker("""
        import flashextra
        (SCRATCH / "saw.json").write_text(json.dumps(
            {"version": flashextra.VERSION, "file": flashextra.__file__}))
        complete()
    """)
    with PypiServer([wheel]) as index:
        layout.write_payload(extra_pip=["--index-url", index.url, "flashextra==1.0"])
        with open(layout.root / "stdout.bin", "ab") as out:
            outcome = run_attempt(layout.settings(), runner_env, out_fd=out.fileno(),
                                  python=str(python), handle_signals=False)
        assert "/files/flashextra-1.0-py3-none-any.whl" in index.paths
    assert outcome.exit_code == 0, outcome.reason
    assert outcome.context.path == TRAIN_PATH
    saw = json.loads((layout.scratch / "saw.json").read_text())
    assert saw == {"version": "1.0",
                   "file": str(site_packages(python) / "flashextra.py")}
    chosen = events(captured_logs, "pip.installer")
    assert [(e["installer"], e["reason"]) for e in chosen] == [("uv", "uv found")]
    assert [e["installer"] for e in events(captured_logs, "pip.installed")] == ["uv"]
    kept = (layout.scratch / "extras_install.log").read_bytes()  # uv's output, not stdout's
    assert kept.count(b"+ flashextra==1.0") == 1
    assert b"flashextra" not in (layout.root / "stdout.bin").read_bytes()


@needs_uv
def test_a_run_whose_index_refuses_uv_ends_retriable(
    layout: Layout, tmp_path: Path, runner_env: dict[str, str],
    captured_logs: list[dict[str, Any]],
) -> None:
    python = fresh_venv(tmp_path / "worker-venv")
    layout.write_worker("complete()")
    layout.write_payload(
        extra_pip=["--index-url", f"http://127.0.0.1:{closed_port()}/simple/", "flashextra"],
        env={"HF_TOKEN": SECRET, "FLASH_PIP_BACKOFF_S": "0.05", "UV_HTTP_RETRIES": "0"},
    )
    with open(layout.root / "stdout.bin", "ab") as out:
        outcome = run_attempt(layout.settings(), runner_env, out_fd=out.fileno(),
                              python=str(python), handle_signals=False)
    assert outcome.exit_code == 75
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["path"]) == (
        True, "pip-network", ["LoadPayload", "InstallExtras", "Mark"])
    assert marker["error"].startswith(
        "uv pip install failed (network: connection refused to the package index) after 3 "
        "tries: error: Failed to fetch: http://127.0.0.1:")
    assert [e["installer"] for e in events(captured_logs, "pip.try")] == ["uv"] * 3

