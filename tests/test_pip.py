"""InstallExtras' pip: real pip against a local index on 127.0.0.1, no mocks.

Every pip run here is isolated from the machine's pip configuration (``PIP_CONFIG_FILE``
is the null device, the environment is built from scratch) and is pointed at the local
index or ``--no-index``, so nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import closed_port, hanging_project, survivors
from pypi_server import PypiServer, build_wheel
from structlog.testing import capture_logs

from fsm import rules
from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, FatalError, Interrupted, RetriableError
from fsm.extras.pip import (
    MESSAGE_CHARS,
    NETWORK_SIGNATURES,
    PIP_RETRIES,
    STOP_GRACE_S,
    TAIL_BYTES,
    classify_pip_output,
    install,
    network_signature,
)
from fsm.interrupt import InterruptFlag
from fsm.output.redact import Redactor

SECRET = "hf_s3cr3t-value-never-logged"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheels"), "flashdemo", "1.0")


@pytest.fixture
def index(wheel: Path) -> Iterator[PypiServer]:
    with PypiServer([wheel], hang_limit_s=30) as server:
        yield server


@pytest.fixture
def marker() -> str:
    """A value put in pip's environment, to find any process pip left behind."""
    return uuid.uuid4().hex


class Pip:
    """Runs ``install`` into a throwaway ``--target`` with an isolated pip environment."""

    def __init__(self, tmp_path: Path, marker: str) -> None:
        self.target = tmp_path / "target"
        self.console = tmp_path / "console.txt"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp_path),
            "PIP_CONFIG_FILE": os.devnull,  # no /etc/xdg/pip: no find-links, extra index
            "PIP_NO_CACHE_DIR": "1",
            "HF_TOKEN": SECRET,
            "FLASH_PIP_TEST_MARK": marker,
        }

    def __call__(
        self,
        requirements: Sequence[str],
        *args: str,
        deadline: Deadline | None = None,
        interrupt: InterruptFlag | None = None,
        tries: int = 3,
        backoff_s: float = 0.05,
        **env: str,
    ) -> None:
        install(
            requirements,
            env={**self.env, **env},
            deadline=deadline or Deadline.after(60),
            interrupt=interrupt or InterruptFlag(),
            python=sys.executable,
            extra_args=["--target", str(self.target), *args],
            tries=tries,
            backoff_s=backoff_s,
            output_log=self.console,
            redactor=Redactor([SECRET]),
        )


@pytest.fixture
def pip(tmp_path: Path, marker: str) -> Pip:
    return Pip(tmp_path, marker)


def events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


def assert_one_line(message: str) -> None:
    assert "\n" not in message
    assert 0 < len(message) <= MESSAGE_CHARS


# --- success ---------------------------------------------------------------------------


def test_no_requirements_runs_nothing(tmp_path: Path) -> None:
    """An empty extra_pip returns at once: no pip is started (this python does not exist)."""
    with capture_logs() as logs:
        install(
            [],
            env={},
            deadline=Deadline.after(10),
            interrupt=InterruptFlag(),
            python=str(tmp_path / "no-such-python"),
        )
    assert logs == []


def test_installs_a_local_wheel_file(pip: Pip, wheel: Path) -> None:
    """A wheel path installs; pip's output is kept; env values never reach the log."""
    with capture_logs() as logs:
        pip([str(wheel)], "--no-index")
    assert (pip.target / "flashdemo.py").read_text() == 'VERSION = "1.0"\n'
    assert "Successfully installed flashdemo-1.0" in pip.console.read_text()
    assert [e["try"] for e in events(logs, "pip.try")] == [1]
    assert len(events(logs, "pip.installed")) == 1
    assert SECRET not in repr(logs)


def test_installs_from_the_local_index(pip: Pip, index: PypiServer) -> None:
    """A requirement resolves against the index and installs from it."""
    pip(["flashdemo==1.0"], "--index-url", index.url)
    assert (pip.target / "flashdemo.py").exists()
    assert "/simple/flashdemo/" in index.paths
    assert "/files/flashdemo-1.0-py3-none-any.whl" in index.paths


# --- network failures: retried, then retriable -------------------------------------------


def test_unavailable_index_is_tried_tries_times_then_retriable(pip: Pip, index: PypiServer) -> None:
    """An index answering 503 is network-shaped: pip runs `tries` times, then pip-network."""
    index.mode = "unavailable"
    with capture_logs() as logs, pytest.raises(RetriableError) as err:
        # PIP_RETRIES=0 in the env: pip makes one request per run, and install() keeps it.
        pip(["flashdemo"], "--index-url", index.url, tries=3, PIP_RETRIES="0")
    assert err.value.rule is rules.PIP_NETWORK
    assert index.hits == 3
    assert [e["try"] for e in events(logs, "pip.try")] == [1, 2, 3]
    assert {e["failure_class"] for e in events(logs, "pip.failed")} == {"network"}
    assert "(network: the package index answered 5xx) after 3 tries" in err.value.message
    assert "No matching distribution found for flashdemo" in err.value.message
    assert_one_line(err.value.message)


def test_pip_own_retries_are_bounded_when_env_does_not_choose(pip: Pip, index: PypiServer) -> None:
    """Without PIP_RETRIES, pip retries a failing request PIP_RETRIES times, not its 5."""
    index.mode = "unavailable"
    with pytest.raises(RetriableError, match=r"after 1 try: "):
        pip(["flashdemo"], "--index-url", index.url, tries=1)
    assert index.hits == 1 + PIP_RETRIES


def test_closed_port_is_network_and_retriable(pip: Pip) -> None:
    """Connection refused ends as pip-network, although pip's last line reads 'not found'."""
    url = f"http://127.0.0.1:{closed_port()}/simple/"
    with capture_logs() as logs, pytest.raises(RetriableError) as err:
        pip(["flashdemo"], "--index-url", url, tries=2, PIP_RETRIES="0")
    assert err.value.rule is rules.PIP_NETWORK
    assert "connection refused" in err.value.message
    assert len(events(logs, "pip.try")) == 2


def test_no_time_for_another_try_ends_retriable_at_once(pip: Pip) -> None:
    """When the backoff would outlast the deadline, the network failure is raised now."""
    url = f"http://127.0.0.1:{closed_port()}/simple/"
    started = time.monotonic()
    with pytest.raises(RetriableError, match=r"after 1 try \(no time left for another\)"):
        pip(["flashdemo"], "--index-url", url, deadline=Deadline.after(20), backoff_s=30)
    assert time.monotonic() - started < 10


# --- other failures: fatal at once -------------------------------------------------------


def test_missing_version_is_fatal_on_the_first_try(pip: Pip, index: PypiServer) -> None:
    """A version the healthy index does not have is pip-failed, without retries."""
    with capture_logs() as logs, pytest.raises(FatalError) as err:
        pip(["flashdemo==9.9"], "--index-url", index.url)
    assert err.value.rule is rules.PIP_FAILED
    assert not err.value.retriable
    assert len(events(logs, "pip.try")) == 1
    assert events(logs, "pip.failed")[0]["failure_class"] == "other"
    assert "No matching distribution found for flashdemo==9.9" in err.value.message
    assert_one_line(err.value.message)


def test_failing_build_is_fatal(pip: Pip, tmp_path: Path) -> None:
    """A source tree whose build fails is pip-failed, and the message says why."""
    project = tmp_path / "broken"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "failbackend"\nbackend-path = ["."]\n'
    )
    (project / "failbackend.py").write_text(
        "def get_requires_for_build_wheel(config_settings=None):\n"
        "    raise RuntimeError('this project cannot be built')\n"
    )
    with capture_logs() as logs, pytest.raises(FatalError) as err:
        pip([str(project)], "--no-index")
    assert err.value.rule is rules.PIP_FAILED
    assert len(events(logs, "pip.try")) == 1
    # pip's wording differs between releases; it always names the failed build.
    assert err.value.message.startswith("pip install failed")
    assert "build" in err.value.message.lower()
    assert_one_line(err.value.message)
    assert "RuntimeError: this project cannot be built" in pip.console.read_text()


def test_invalid_requirement_is_fatal(pip: Pip) -> None:
    """A requirement pip cannot parse is pip-failed on the first try."""
    with pytest.raises(FatalError, match=r"Invalid requirement") as err:
        pip(["not a requirement!"], "--no-index")
    assert err.value.rule is rules.PIP_FAILED


# --- time and signals ----------------------------------------------------------------------


def test_deadline_stops_a_hung_pip(pip: Pip, index: PypiServer, marker: str) -> None:
    """An index that never answers cannot hold the run past its deadline."""
    index.mode = "hang"
    started = time.monotonic()
    with capture_logs() as logs, pytest.raises(DeadlineExceeded):
        pip(["flashdemo"], "--index-url", index.url, deadline=Deadline.after(2.0))
    elapsed = time.monotonic() - started
    # Whether pip reached the hanging index within 2 s depends on the machine's load (a
    # loaded CI machine had not): either way, the deadline stops it.
    assert 2.0 <= elapsed < 2.0 + STOP_GRACE_S + 1.5
    assert len(events(logs, "pip.try")) == 1
    assert survivors(marker) == []


def test_sigterm_stops_pip_and_its_build_subprocess(
    pip: Pip, index: PypiServer, marker: str, tmp_path: Path
) -> None:
    """SIGTERM while a build hook hangs: Interrupted promptly, no pip process survives."""
    index.mode = "hang"
    project = hanging_project(tmp_path / "hangs", index.url + "hook")
    flag = InterruptFlag()
    fired: list[float] = []

    def send_sigterm() -> None:
        if index.first_hit.wait(30):  # the build hook (pip's grandchild) is blocked now
            fired.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: flag.trigger(signum))
    try:
        threading.Thread(target=send_sigterm, daemon=True).start()
        with pytest.raises(Interrupted) as err:
            pip([str(project)], "--no-index", interrupt=flag)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert err.value.signum == signal.SIGTERM
    assert fired, "the build hook never reached the index"
    assert time.monotonic() - fired[0] < STOP_GRACE_S + 1.5
    assert survivors(marker) == []


def test_interrupt_cuts_the_backoff_short(pip: Pip) -> None:
    """An interrupt during the wait between tries raises Interrupted without sleeping it out."""
    url = f"http://127.0.0.1:{closed_port()}/simple/"
    flag = InterruptFlag()
    timer = threading.Timer(3.0, flag.trigger, args=(signal.SIGINT,))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(Interrupted) as err:
            pip(
                ["flashdemo"],
                "--index-url",
                url,
                deadline=Deadline.after(600),
                interrupt=flag,
                backoff_s=60,
                PIP_RETRIES="0",
            )
    finally:
        timer.cancel()
    assert err.value.signum == signal.SIGINT
    assert time.monotonic() - started < 10


def test_already_stopped_runs_nothing(tmp_path: Path) -> None:
    """A set interrupt or a passed deadline raises before pip is started."""
    flag = InterruptFlag()
    flag.trigger(signal.SIGTERM)
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(Interrupted):
        install(["x"], env={}, deadline=Deadline.after(10), interrupt=flag, python=missing)
    with pytest.raises(DeadlineExceeded):
        install(
            ["x"], env={}, deadline=Deadline.after(-1), interrupt=InterruptFlag(), python=missing
        )


# --- classification of pip's output ----------------------------------------------------------

# Real lines printed by pip 23.2 (console, or its --log file), shortened where long.
REFUSED_RETRY = (
    "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) "
    "after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection."
    "HTTPConnection object at 0x7fad815e2510>: Failed to establish a new connection: "
    "[Errno 111] Connection refused')': /simple/flashdemo/"
)
NOT_FOUND = (
    "ERROR: Could not find a version that satisfies the requirement flashdemo "
    "(from versions: none)\nERROR: No matching distribution found for flashdemo\n"
)
NETWORK_OUTPUTS = {
    "traps-retry-then-not-found": ("connection-refused", f"{REFUSED_RETRY}\n{NOT_FOUND}"),
    "index-503-in-log": (
        "server-error",
        "Could not fetch URL http://127.0.0.1:42641/simple/flashdemo/: HTTPConnectionPool("
        "host='127.0.0.1', port=42641): Max retries exceeded with url: /simple/flashdemo/ "
        "(Caused by ResponseError('too many 503 error responses')) - skipping\n" + NOT_FOUND,
    ),
    "file-503": (
        "server-error",
        "ERROR: Could not install packages due to an OSError: HTTPConnectionPool(host="
        "'127.0.0.1', port=44487): Max retries exceeded with url: /files/flashdemo-1.0-py3-none"
        "-any.whl (Caused by ResponseError('too many 503 error responses'))",
    ),
    "http-error-502": (
        "server-error",
        "ERROR: HTTP error 502 while getting https://files.example/x-1.0-py3-none-any.whl",
    ),
    "503-reason": ("server-error", "503 Service Unavailable"),
    "read-timeout": (
        "read-timeout",
        "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None))"
        " after connection broken by 'ReadTimeoutError(\"HTTPConnectionPool(host='127.0.0.1', "
        "port=44509): Read timed out. (read timeout=2.0)\")': /simple/flashdemo/\n" + NOT_FOUND,
    ),
    "connect-timeout": (
        "connect-timeout",
        "after connection broken by 'ConnectTimeoutError(<pip._vendor.urllib3.connection."
        "HTTPSConnection object at 0x7f>, 'Connection to pypi.org timed out. "
        "(connect timeout=15)')': /simple/torch/",
    ),
    "reset": (
        "connection-reset",
        "after connection broken by 'ProtocolError('Connection aborted.', "
        "ConnectionResetError(104, 'Connection reset by peer'))': /simple/torch/",
    ),
    "dns": (
        "name-resolution",
        "after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection."
        "HTTPSConnection object at 0x7f>: Failed to establish a new connection: [Errno -3] "
        "Temporary failure in name resolution')': /simple/torch/",
    ),
    "incomplete-read": (
        "connection-broken",
        "ERROR: Exception: ... pip._vendor.urllib3.exceptions.ProtocolError: ('Connection "
        "broken: IncompleteRead(1048576 bytes read, 2097152 more expected)', IncompleteRead(...))",
    ),
    "bare-retrying": ("pip-retrying", "WARNING: Retrying (Retry(total=4, connect=None)) after x"),
}
OTHER_OUTPUTS = {
    "not-found-alone (TRAPS: this alone is not evidence of a network failure)": NOT_FOUND,
    "no-such-version": (
        "ERROR: Could not find a version that satisfies the requirement flashdemo==9.9 "
        "(from versions: 1.0)\nERROR: No matching distribution found for flashdemo==9.9"
    ),
    "conflict": (
        "ERROR: Cannot install a==1.0 and b==2.0 because these package versions have "
        "conflicting dependencies.\nERROR: ResolutionImpossible: for help visit "
        "https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-"
        "conflicts"
    ),
    "invalid": "ERROR: Invalid requirement: 'not a requirement!'",
    "build": (
        "  error: subprocess-exited-with-error\n"
        "  \N{MULTIPLICATION SIGN} Getting requirements to build wheel did not run successfully.\n"
        "  │ exit code: 1\n      RuntimeError: this project cannot be built\n"
        "      [end of output]\n  note: This error originates from a subprocess, and is likely "
        "not a problem with pip."
    ),
    "hashes": "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.",
    "resolution-traceback-in-log": (
        "pip._vendor.resolvelib.resolvers.RequirementsConflicted: Requirements conflict: "
        "SpecifierRequirement('flashdemo')\npip._internal.exceptions.DistributionNotFound: "
        "No matching distribution found for flashdemo"
    ),
}


@pytest.mark.parametrize(("signature", "text"), NETWORK_OUTPUTS.values(), ids=list(NETWORK_OUTPUTS))
def test_network_shaped_output_is_network(signature: str, text: str) -> None:
    """Each network failure pip reports is classified network, by the expected signature."""
    assert classify_pip_output(text) == "network"
    found = network_signature(text)
    assert found is not None
    assert found.name == signature


@pytest.mark.parametrize("text", OTHER_OUTPUTS.values(), ids=list(OTHER_OUTPUTS))
def test_other_failures_are_other(text: str) -> None:
    """Resolution, parse and build failures are not network-shaped."""
    assert classify_pip_output(text) == "other"


def test_signatures_are_printable_data() -> None:
    """The signatures are a table the policy docs can print: unique names, a meaning each."""
    names = [s.name for s in NETWORK_SIGNATURES]
    assert len(names) == len(set(names))
    for sig in NETWORK_SIGNATURES:
        assert sig.meaning
        assert sig.pattern and sig.witness == "pip"


# --- redaction: the whole text first, then collapsed and cut (issue 11) ----------------------

FAKE_PIP = """\
#!{python}
# Stands in for ``python -m pip install ...``: prints what the test left in FAKE_PIP_DIR
# (console.txt to stdout, log.txt to the --log file) and fails.
import os, sys
from pathlib import Path

here = Path(os.environ["FAKE_PIP_DIR"])
args = sys.argv[1:]
Path(args[args.index("--log") + 1]).write_bytes((here / "log.txt").read_bytes())
sys.stdout.buffer.write((here / "console.txt").read_bytes())
sys.exit(1)
"""

#: A secret for these tests: long enough that a cut leaves a telling piece of it.
LONG_SECRET = "ghp_0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b"


def fragments(secret: str, size: int = 10) -> list[str]:
    """Every ``size``-character piece of ``secret``: a cut through it leaves one of them."""
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


def assert_no_fragment(text: str, secret: str = LONG_SECRET) -> None:
    leaked = [piece for piece in fragments(secret) if piece in text]
    assert leaked == [], f"pieces of the secret leaked: {leaked[:3]} in {text[-300:]!r}"


class FakePip:
    """A stand-in pip that prints a given console and log, then fails (exit status 1)."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "fakepip"
        self.dir.mkdir()
        self.python = self.dir / "python"
        self.python.write_text(FAKE_PIP.format(python=sys.executable))
        self.python.chmod(0o755)
        self.out = tmp_path / "out.txt"

    def fail(self, console: str, log: str = "", secret: str = LONG_SECRET) -> FatalError:
        (self.dir / "console.txt").write_text(console)
        (self.dir / "log.txt").write_text(log)
        self.out.unlink(missing_ok=True)  # what this failure kept, only
        with pytest.raises(FatalError) as err:
            install(
                ["flashdemo"],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                     "FAKE_PIP_DIR": str(self.dir)},
                deadline=Deadline.after(30),
                interrupt=InterruptFlag(),
                python=str(self.python),
                tries=1,
                output_log=self.out,
                redactor=Redactor([secret]),
            )
        return err.value


@pytest.fixture
def fake_pip(tmp_path: Path) -> FakePip:
    return FakePip(tmp_path)


@pytest.mark.parametrize("pad", range(380, 440, 4))
def test_a_secret_where_the_message_is_cut_is_redacted_before_the_cut(
    fake_pip: FakePip, pad: int
) -> None:
    """pip's error line is redacted whole before it is cut to MESSAGE_CHARS: a secret
    across the cut leaves no piece of itself in the message."""
    line = f"ERROR: Invalid requirement: '{'x' * pad}{LONG_SECRET}@127.0.0.1/{'y' * 100}.git'"
    error = fake_pip.fail(f"Collecting something\n{line}\n")
    assert len(error.message) == MESSAGE_CHARS  # the cut happened, inside the secret or after
    assert_one_line(error.message)
    assert "***" in error.message or error.message.endswith("x...")
    assert_no_fragment(error.message)


def test_a_secret_holding_whitespace_is_redacted_before_the_line_is_collapsed(
    fake_pip: FakePip,
) -> None:
    """A secret with a run of spaces is masked before whitespace is collapsed (collapsed
    first, it would no longer match)."""
    secret = "tok  en\twith   spaces-0123456789abcdef"
    error = fake_pip.fail(f"ERROR: could not use {secret} here\n", secret=secret)
    assert "ERROR: could not use *** here" in error.message
    assert_no_fragment(error.message, " ".join(secret.split()))


def test_the_copy_of_pips_log_is_redacted_before_its_lines_are_cut(fake_pip: FakePip) -> None:
    """The end of pip's verbose log kept with its output cuts long lines: never through a
    secret."""
    log = "".join(
        f"2026-01-01T00:00:00,000 Looking at {'y' * pad}{LONG_SECRET}/simple/\n"
        for pad in range(360, 400, 4)
    )
    error = fake_pip.fail("ERROR: boom\n", log=log)
    shown = fake_pip.out.read_text()
    assert "pip failed; the end of its verbose log:" in shown
    assert "Looking at yyy" in shown
    assert_no_fragment(shown)
    assert_no_fragment(error.message)


def test_a_tail_that_begins_inside_a_secret_shows_none_of_it(fake_pip: FakePip) -> None:
    """Only the last TAIL_BYTES of pip's output are kept: a line cut at their start (it may
    begin inside a secret) is dropped, not reported."""
    keep = 12  # characters of the secret that fall inside the kept tail
    console = "z" * 5000 + LONG_SECRET + "q" * (TAIL_BYTES - keep)
    error = fake_pip.fail(console, log=console)
    assert_no_fragment(error.message)
    assert_no_fragment(fake_pip.out.read_text().split(console)[-1])
    assert error.message == "pip install failed (exit status 1): pip exited with status 1"
