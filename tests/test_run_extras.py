"""InstallExtras through the whole runner: real pip, local wheels, a local index."""

from __future__ import annotations

import socket
from pathlib import Path

from conftest import CANARY, Layout
from pypi_server import PypiServer, build_wheel

#: pip must not see this machine's own configuration (find-links, extra indexes).
ISOLATED = {"PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
            "FLASH_PIP_BACKOFF_S": "0.05", "HF_TOKEN": CANARY}


def test_extras_from_a_local_wheel_are_installed_before_the_worker_runs(
    layout: Layout, tmp_path: Path
) -> None:
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    layout.write_worker(f"""
        sys.path.insert(0, {str(target)!r})
        import flashextra
        complete()
    """)
    outcome = layout.run(
        extra_pip=["--no-index", "--target", str(target), str(wheel)], env=ISOLATED
    )
    assert outcome.exit_code == 0, outcome.reason
    assert any(target.glob("flashextra*"))


def test_extras_from_a_local_index_are_installed(layout: Layout, tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    layout.write_worker("complete()")
    with PypiServer([wheel]) as index:
        outcome = layout.run(
            extra_pip=["--index-url", index.url, "--target", str(tmp_path / "site"),
                       "flashextra==1.0"],
            env=ISOLATED,
        )
    assert outcome.exit_code == 0, outcome.reason


def test_a_version_that_does_not_exist_fails_the_run_without_retrying(
    layout: Layout, tmp_path: Path
) -> None:
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    layout.write_worker("complete()")
    with PypiServer([wheel]) as index:
        outcome = layout.run(
            extra_pip=["--index-url", index.url, "--target", str(tmp_path / "site"),
                       "flashextra==9.9"],
            env=ISOLATED,
        )
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        False, "pip-failed", "InstallExtras"
    )
    assert outcome.exit_code == 1


def test_an_index_that_cannot_be_reached_is_retried_then_retriable(
    layout: Layout, tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout.write_worker("complete()")
    layout.run(
        extra_pip=["--index-url", f"http://127.0.0.1:{port}/simple",
                   "--target", str(tmp_path / "site"), "flashextra"],
        env=ISOLATED,
    )
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (True, "pip-network")
    assert "3 tries" in marker["error"]
