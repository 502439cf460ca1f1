"""InstallExtras through the whole runner: real pip, local wheels, a local index.

``extra_pip`` may not move the install (``--target`` is refused, issue 11), so these runs
point pip at a throwaway directory with ``PIP_TARGET`` in the payload's env.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import CANARY, TRAIN_PATH, Layout, closed_port
from pypi_server import PypiServer, build_wheel

from fsm.extras.pip import MESSAGE_CHARS

#: pip must not see this machine's own configuration (find-links, extra indexes).
ISOLATED = {"PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
            "FLASH_PIP_BACKOFF_S": "0.05", "HF_TOKEN": CANARY}


def isolated(target: Path, **extra: str) -> dict[str, str]:
    """The payload env: isolated pip, installing into ``target``."""
    return {**ISOLATED, "PIP_TARGET": str(target), **extra}


def run_cli(layout: Layout, **payload: Any) -> subprocess.CompletedProcess[bytes]:
    """``python -m fsm run`` on this payload, as the container runs it."""
    layout.write_payload(**payload)
    return layout.cli(*layout.run_args())


def everything_written(layout: Layout, proc: subprocess.CompletedProcess[bytes],
                       *skip: Path) -> dict[str, bytes]:
    """What the run left anywhere: its stdout and stderr, and every file under the run's
    root (store, scratch, code root, the state next to the payload) but ``skip``."""
    out = {"stdout": proc.stdout, "stderr": proc.stderr}
    for path in sorted(layout.root.rglob("*")):
        if path.is_file() and path not in skip:
            out[str(path)] = path.read_bytes()
    return out


def pieces(secret: str, size: int = 10) -> list[bytes]:
    """Every ``size``-character piece of ``secret``: a cut through it leaves one."""
    return [secret[i : i + size].encode() for i in range(len(secret) - size + 1)]


def assert_nowhere(secret: str, places: dict[str, bytes]) -> None:
    leaks = {where: p for where, text in places.items() for p in pieces(secret) if p in text}
    assert leaks == {}, f"pieces of the secret leaked: {dict(list(leaks.items())[:3])}"


#: The states of an attempt that pip failed: the worker never ran.
PIP_FAILED_PATH = ["LoadPayload", "InstallExtras", "Mark"]


def write_importing_worker(layout: Layout, target: Path) -> None:
    """A worker that imports ``flashextra`` from ``target`` and writes down what it saw."""
    layout.write_worker(f"""
        sys.path.insert(0, {str(target)!r})
        import flashextra
        (SCRATCH / "saw.json").write_text(json.dumps(
            {{"version": flashextra.VERSION, "file": flashextra.__file__}}))
        complete()
    """)


def assert_worker_imported(layout: Layout, target: Path, version: str = "1.0") -> None:
    """pip installed ``flashextra`` into ``target`` and the worker imported it from there."""
    assert (target / "flashextra.py").read_text() == f'VERSION = "{version}"\n'
    saw = json.loads((layout.scratch / "saw.json").read_text())
    assert saw == {"version": version, "file": str(target / "flashextra.py")}


def assert_not_installed(target: Path) -> None:
    assert not (target / "flashextra.py").exists()


def named(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


def stderr_events(proc: subprocess.CompletedProcess[bytes], event: str) -> list[dict[str, Any]]:
    """The runner's JSON log lines on stderr for ``event``."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(b"{")]
    return [e for e in map(json.loads, lines) if e.get("msg", e.get("event")) == event]


def test_extras_from_a_local_wheel_are_installed_before_the_worker_runs(
    layout: Layout, tmp_path: Path, captured_logs: list[dict[str, Any]]
) -> None:
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    write_importing_worker(layout, target)
    outcome = layout.run(extra_pip=["--no-index", str(wheel)], env=isolated(target))
    assert outcome.exit_code == 0, outcome.reason
    assert outcome.context.path == TRAIN_PATH
    assert_worker_imported(layout, target)
    assert [e["try"] for e in named(captured_logs, "pip.installed")] == [1]


def test_extras_from_a_local_index_are_installed(
    layout: Layout, tmp_path: Path, captured_logs: list[dict[str, Any]]
) -> None:
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    write_importing_worker(layout, target)
    with PypiServer([wheel]) as index:
        outcome = layout.run(
            extra_pip=["--index-url", index.url, "flashextra==1.0"], env=isolated(target)
        )
    assert outcome.exit_code == 0, outcome.reason
    assert "/files/flashextra-1.0-py3-none-any.whl" in index.paths  # from this index
    assert_worker_imported(layout, target)
    assert len(named(captured_logs, "pip.installed")) == 1


def test_a_finished_attempt_started_again_does_not_run_pip_again(
    layout: Layout, tmp_path: Path, captured_logs: list[dict[str, Any]]
) -> None:
    """A restarted container replays the attempt's result: pip does not run a second time."""
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    write_importing_worker(layout, target)
    with PypiServer([wheel]) as index:
        payload: dict[str, Any] = {"extra_pip": ["--index-url", index.url, "flashextra==1.0"],
                                   "env": isolated(target)}
        assert layout.run(**payload).exit_code == 0
        hits, tries = index.hits, len(named(captured_logs, "pip.try"))
        assert hits and tries == 1
        again = layout.run(**payload)
        assert again.exit_code == 0
        assert again.context.path == ["LoadPayload", "Mark", "Succeeded"]
        assert (index.hits, len(named(captured_logs, "pip.try"))) == (hits, tries)


def test_a_run_without_extras_does_not_run_pip(
    layout: Layout, tmp_path: Path, captured_logs: list[dict[str, Any]]
) -> None:
    layout.write_worker("complete()")
    outcome = layout.run(env=isolated(tmp_path / "site"))
    assert outcome.exit_code == 0, outcome.reason
    assert "InstallExtras" in outcome.context.path
    assert named(captured_logs, "pip.try") == []
    assert not (tmp_path / "site").exists()


def test_a_version_that_does_not_exist_fails_the_run_without_retrying(
    layout: Layout, tmp_path: Path, captured_logs: list[dict[str, Any]]
) -> None:
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    layout.write_worker("complete()")
    with PypiServer([wheel]) as index:
        outcome = layout.run(
            extra_pip=["--index-url", index.url, "flashextra==9.9"], env=isolated(target)
        )
    assert outcome.exit_code == 1
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, "pip-failed", "InstallExtras"
    )
    assert marker["path"] == PIP_FAILED_PATH and "worker" not in marker  # the worker never ran
    assert marker["error"].startswith("pip install failed (exit status 1): ")
    assert "No matching distribution found for flashextra==9.9" in marker["error"]
    # pip ran once: a failure that is not network-shaped is not tried again
    assert len(named(captured_logs, "pip.try")) == 1
    assert [(e["failure_class"], e["signature"]) for e in named(captured_logs, "pip.failed")] == [
        ("other", None)
    ]
    assert index.paths.count("/simple/flashextra/") == 1
    assert_not_installed(target)


def test_an_index_that_cannot_be_reached_is_retried_then_retriable(
    layout: Layout, tmp_path: Path, captured_logs: list[dict[str, Any]]
) -> None:
    target = tmp_path / "site"
    layout.write_worker("complete()")
    outcome = layout.run(
        extra_pip=["--index-url", f"http://127.0.0.1:{closed_port()}/simple", "flashextra"],
        env=isolated(target),
    )
    assert outcome.exit_code == 75
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, True, "pip-network", "InstallExtras"
    )
    assert marker["path"] == PIP_FAILED_PATH and "worker" not in marker
    assert marker["error"].startswith(
        "pip install failed (network: connection refused to the package index) after 3 tries: "
    )
    assert [e["try"] for e in named(captured_logs, "pip.try")] == [1, 2, 3]
    assert {(e["failure_class"], e["signature"]) for e in named(captured_logs, "pip.failed")} == {
        ("network", "connection-refused")
    }
    assert_not_installed(target)


# --- allowed options still install --------------------------------------------------------


def test_the_allowed_options_install_from_the_local_index(layout: Layout, tmp_path: Path) -> None:
    """Every kind of allowed option at once, through the runner process: the package is
    installed from the local index and the worker imports it."""
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    write_importing_worker(layout, target)
    with PypiServer([wheel]) as index:
        proc = run_cli(
            layout,
            extra_pip=["--index-url", index.url, f"--extra-index-url={index.url}",
                       "--trusted-host", "127.0.0.1", "--pre", "--no-deps", "-U",
                       "--upgrade-strategy", "only-if-needed", "--only-binary=:all:",
                       "--prefer-binary", "--force-reinstall", "flashextra==1.0"],
            env=isolated(target),
        )
        assert "/files/flashextra-1.0-py3-none-any.whl" in index.paths
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert len(stderr_events(proc, "pip.installed")) == 1
    assert_worker_imported(layout, target)


def test_find_links_to_a_local_directory_installs_without_an_index(
    layout: Layout, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "flashextra", "1.0")
    target = tmp_path / "site"
    write_importing_worker(layout, target)
    proc = run_cli(
        layout,
        extra_pip=["--no-index", "-f", wheels.as_uri(), "--no-binary", ":none:", "flashextra"],
        env=isolated(target),
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert len(stderr_events(proc, "pip.installed")) == 1
    assert_worker_imported(layout, target)


# --- extra_pip cannot read the host (issue 11) ---------------------------------------------

#: The first line of a host file pip printed into the marker before issue 11.
SHADOW_LINE = "root:$6$Fl4shCanaryLine0xC0FFEE$sh4d0w:19000:0:99999:7:::"


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    """A host file that must never be read: its first line is a canary."""
    path = tmp_path / "host" / "shadow"
    path.parent.mkdir()
    path.write_text(SHADOW_LINE + "\ndaemon:*:19000:0:99999:7:::\n")
    return path


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda f: ["-r", f], "'-r'"),
        (lambda f: ["torch", f"-r{f}"], "'-r/"),
        (lambda f: [f"--requirement={f}"], "'--requirement=/"),
        (lambda f: ["-c", f, "torch"], "'-c'"),
        (lambda f: ["--constraint", f, "torch"], "'--constraint'"),
        (lambda f: ["-i", "https://mirror.example/simple", "-e", f], "'-e'"),
        (lambda f: ["--target", f, "torch"], "'--target'"),
    ],
    ids=["-r FILE", "-rFILE", "--requirement=FILE", "-c FILE", "--constraint FILE", "-e PATH",
         "--target PATH"],
)
def test_an_option_that_reads_the_host_is_refused_before_pip_runs(
    layout: Layout, tmp_path: Path, host_file: Path, make: Any, named: str
) -> None:
    """The runner process exits 2 with a fatal marker naming the refused entry; pip never
    runs; the host file's line appears nowhere (stdout, stderr, marker, store, scratch)."""
    layout.write_worker("complete()")
    target = tmp_path / "site"
    proc = run_cli(layout, extra_pip=make(str(host_file)), env=isolated(target))

    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "payload-invalid")
    assert marker["path"] == ["LoadPayload", "Mark"]  # InstallExtras never ran
    assert marker["error"].startswith("payload key 'extra_pip' entry ")
    assert named in marker["error"]
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert named in last and "extra_pip" in last
    # pip never ran: none of its output, no pip event, nothing installed
    assert b"pip" not in proc.stdout.lower()
    assert stderr_events(proc, "pip.try") == []
    assert not target.exists()
    assert_nowhere(SHADOW_LINE, everything_written(layout, proc, host_file))
    assert SHADOW_LINE.encode() not in json.dumps(marker).encode()


# --- pip's error text: redacted, then shortened (issue 11) ----------------------------------

#: A token as GitHub prints them (lowercase: pip lowercases the URL in its last error line).
GIT_TOKEN = "ghp_0123456789abcdefghijklmnopqrstuvwxyz"


def _git_requirement(token: str, port: int, pad: int, in_path: str) -> str:
    return f"flashx @ git+https://oauth2:{token}@127.0.0.1:{port}/{'p' * pad}/{in_path}/x.git"


def test_a_token_in_a_failing_git_requirement_appears_nowhere(
    layout: Layout, tmp_path: Path
) -> None:
    """``git+https://oauth2:TOKEN@...`` that fails (closed port): the token (a payload env
    secret) is in no output: marker, stderr lines, logs, stdout, store or scratch files."""
    layout.write_worker("complete()")
    requirement = _git_requirement(GIT_TOKEN, closed_port(), 420, "x")
    proc = run_cli(layout, extra_pip=[requirement],
                   env=isolated(tmp_path / "site", GIT_TOKEN=GIT_TOKEN))
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["rule"], marker["state"], marker["path"]) == (
        "pip-failed", "InstallExtras", PIP_FAILED_PATH
    )
    assert marker["error"].startswith("pip install failed")
    assert len(stderr_events(proc, "pip.try")) == 1
    assert_nowhere(GIT_TOKEN, everything_written(layout, proc, layout.payload_path))


def test_a_token_where_pips_error_is_cut_leaves_no_piece_of_itself(
    layout: Layout, tmp_path: Path
) -> None:
    """pip echoes a failing URL's path in its error line; with a long padding before it the
    token straddles the message's cut (MESSAGE_CHARS). Cut first, then redacted, a prefix of
    the token reached the marker, ``state.failed`` and the final stderr line. Redacted
    first, no piece of it does."""
    layout.write_worker("complete()")
    port = closed_port()
    stand_in = "s" * len(GIT_TOKEN)  # not a secret: shows where the token will stand
    run_cli(layout, extra_pip=[_git_requirement(stand_in, port, 1, stand_in)],
            env=isolated(tmp_path / "site"))
    probe = layout.marker()
    assert probe is not None and stand_in in probe["error"], probe
    # the padding that puts the token's first 20 characters before the cut
    pad = 1 + (MESSAGE_CHARS - 3 - 20) - probe["error"].index(stand_in)

    proc = run_cli(layout, attempt=1, extra_pip=[_git_requirement(GIT_TOKEN, port, pad, GIT_TOKEN)],
                   env=isolated(tmp_path / "site", GIT_TOKEN=GIT_TOKEN))
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    marker = layout.marker(attempt=1)
    assert marker is not None and marker["rule"] == "pip-failed"
    places = everything_written(layout, proc, layout.payload_path)
    # pip's output is kept in the scratch directory, redacted, with the end of its log
    kept = layout.scratch / "extras_install.log"
    assert b"pip failed; the end of its verbose log:" in places[str(kept)]
    assert_nowhere(GIT_TOKEN, places)
    # the token stood across the cut, and was masked whole before it
    assert "p" * pad + "/***" in marker["error"]
    assert len(marker["error"]) == MESSAGE_CHARS
    failed = [json.loads(line) for line in proc.stderr.splitlines() if b'"state.failed"' in line]
    assert len(failed) == 1 and failed[0]["error"] == marker["error"]
    assert proc.stderr.decode().strip().splitlines()[-1].endswith(marker["error"])
