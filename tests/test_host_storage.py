"""The host's storage under the runner's own writes (issue 26 item 3): full, read-only and
inode-less filesystems (real tmpfs mounts) are named with their evidence and classed by it,
and a lock that cannot be written is never "held". Through the real runner process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import WAIT_FOR_GO, Layout, read_until
from hubrun import HubRun


def _mount_tmpfs(path: Path, options: str) -> bool:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, check=False)
    return done.returncode == 0


def _remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points to take down after the test (lazily: nothing may still hold them)."""
    taken: list[Path] = []
    yield taken
    for path in reversed(taken):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _tmpfs(mounts: list[Path], path: Path, options: str) -> None:
    if not _mount_tmpfs(path, options):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    mounts.append(path)


def _fill(directory: Path) -> None:
    """Fill the filesystem of ``directory`` to the last byte."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    try:  # and the last partial block
        with open(directory / "filler2", "wb") as f:
            while True:
                f.write(b"\0" * 512)
                f.flush()
    except OSError:
        pass


def _run(layout: Layout, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "fsm", *layout.run_args()],
                          capture_output=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})


RAN = """
(SCRATCH / "worker-ran").write_text("yes")
complete()
"""


def test_a_code_root_that_came_full_is_the_hosts_storage_retriable(
    layout: Layout, mounts: list[Path]
) -> None:
    """ENOSPC in the code root of a host whose disk was full already: rule host-storage,
    retriable, the filesystem and its free space in the marker (was: unclassified)."""
    _tmpfs(mounts, layout.code_root, "size=1m")
    _fill(layout.code_root)
    layout.write_worker(RAN)
    layout.write_payload()
    done = _run(layout)
    assert done.returncode == 75, done.stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        True, "host-storage", "FetchCode"), marker
    storage = marker["storage"]
    assert (storage["mount"], storage["fstype"], storage["errno"]) == (
        str(layout.code_root), "tmpfs", "ENOSPC")
    assert storage["free_bytes"] < 64 << 10
    assert str(layout.code_root) in marker["error"] and "tmpfs" in marker["error"]
    last = done.stderr.decode().strip().splitlines()[-1]
    assert "host-storage" in last and "Traceback" not in done.stderr.decode()


def test_a_code_root_the_attempt_fills_itself_is_fatal(
    layout: Layout, mounts: list[Path]
) -> None:
    """ENOSPC after the attempt's own code tree used up what was free at its start: a fresh
    host of the same shape fills again, so fatal (host-storage-filled)."""
    _tmpfs(mounts, layout.code_root, "size=4m")
    layout.write_worker(RAN)
    (layout.store / "code" / "weights.bin").write_bytes(os.urandom(6 << 20))
    layout.write_payload()
    done = _run(layout, {"FLASH_STORAGE_FLOOR_BYTES": "0"})
    assert done.returncode == 1, done.stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "host-storage-filled"), (
        marker["storage"]["verdict"], marker["storage"].get("at_start"),
        marker["storage"]["free_bytes"])
    assert marker["storage"]["at_start"]["free_bytes"] > 3 << 20


@pytest.mark.parametrize("how", ["read-only", "no-inodes"])
def test_a_scratch_dir_that_cannot_be_written_is_the_hosts_storage_not_a_worker_launch(
    layout: Layout, mounts: list[Path], how: str
) -> None:
    """A read-only or inode-less scratch dir: no worker was launched, and the marker says
    which filesystem refused (was: worker-launch, fatal)."""
    if how == "read-only":
        _tmpfs(mounts, layout.scratch, "size=1m")
        _remount_ro(layout.scratch)
    else:
        _tmpfs(mounts, layout.scratch, "size=8m,nr_inodes=16")
        n = 0
        try:
            while True:
                (layout.scratch / f"f{n}").touch()
                n += 1
        except OSError:
            pass
    layout.write_worker(RAN)
    layout.write_payload()
    done = _run(layout)
    assert done.returncode == 75, done.stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (True, "host-storage"), marker
    assert marker["storage"]["mount"] == str(layout.scratch)
    assert marker["storage"]["errno"] == ("EROFS" if how == "read-only" else "ENOSPC")
    if how == "no-inodes":
        assert marker["storage"]["free_inodes"] == 0


def test_a_read_only_payload_dir_without_a_lock_never_trains_as_if_it_held_one(
    layout: Layout, mounts: list[Path]
) -> None:
    """The lock cannot be made: the runner says so and trains nothing (was: "held", and
    two runners of one attempt both trained)."""
    _tmpfs(mounts, layout.payload_path.parent, "size=1m")
    layout.write_worker(RAN)
    layout.write_payload()
    _remount_ro(layout.payload_path.parent)
    done = _run(layout)
    assert done.returncode == 75, done.stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        True, "host-storage", "LoadPayload"), marker
    assert "lock cannot be written" in marker["error"]
    assert not (layout.scratch / "worker-ran").exists()


def test_a_read_only_payload_dir_with_its_lock_still_keeps_a_second_runner_off(
    layout: Layout, mounts: list[Path]
) -> None:
    """A lock file left from before is locked read-only: a second runner of the attempt
    waits for it instead of training too; the first says its result could not be kept."""
    _tmpfs(mounts, layout.payload_path.parent, "size=1m")
    layout.write_worker('(SCRATCH / "worker-ran").write_text("yes")\n' + WAIT_FOR_GO)
    layout.write_payload()
    lock = layout.payload_path.parent / ".flash-lambda_attempt0.lock"
    lock.write_text("")
    _remount_ro(layout.payload_path.parent)
    first = subprocess.Popen([sys.executable, "-m", "fsm", *layout.run_args()],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_until(first.stdout, b"ready")
    second = subprocess.Popen([sys.executable, "-m", "fsm", *layout.run_args()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        read_until(second.stderr, b"attempt.lock_wait")  # it waits: the lock is held
    finally:
        second.kill()
        second.wait()
    (layout.scratch / "go").write_text("go")
    _, first_err = first.communicate(timeout=60)
    assert first.returncode == 0, first_err.decode()[-2000:]
    last = first_err.decode().strip().splitlines()[-1]
    assert "result could not be persisted" in last, last


def test_on_the_hub_a_full_code_root_is_the_hosts_storage_too(
    hub_run: HubRun, mounts: list[Path]
) -> None:
    """The same full code root under the real Hub client against the local Hub server: the
    client's write error is the host's storage, not the store's (nor unclassified)."""
    _tmpfs(mounts, hub_run.code_root, "size=1m")
    _fill(hub_run.code_root)
    hub_run.write_worker("complete()")
    done = hub_run.cli()
    assert done.returncode == 75, done.stderr.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        True, "host-storage", "FetchCode"), marker["error"]
    assert marker["storage"]["mount"] == str(hub_run.code_root)
