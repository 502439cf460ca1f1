"""A full disk and a full /dev/shm, decided with the host's own evidence (issue 24 item 4,
``fsm.policy.HOST_EVIDENCE``), through the real runner on real filesystems: a tmpfs of a
few MiB mounted for the test holds the worker's Hugging Face cache.

"No space left on device" on the console is the host's fault (retried on a fresh host) only
when the filesystem was already short before setup (a previous tenant's files); when it had
room and the attempt filled it, the job's (it would on any host of the kind). The marker's
``disk`` evidence gives each filesystem's room before setup and now; a full /dev/shm is the
job's (the container's configuration), its ``shm`` evidence giving /dev/shm's size.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Layout

from fsm.host import storage
from fsm.host.storage import Usage

TMPFS_MIB = 32
#: What the tests count as short (FLASH_STORAGE_FLOOR_BYTES): far under the tmpfs's size.
SHORT_MIB = 4
MIB = 1 << 20

#: Writes into the cache until the filesystem is full, and dies of it as a training job
#: saving a checkpoint does: the traceback on stderr.
FILLS_THE_CACHE = """
cache = Path(os.environ["HF_HOME"])
cache.mkdir(parents=True, exist_ok=True)
print("step 1/100 | loss 2.31", flush=True)
with open(cache / "checkpoint.bin", "wb") as out:
    block = b"x" * (1 << 20)
    while True:
        out.write(block)
        out.flush()
"""


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of TMPFS_MIB MiB, mounted for the test (root with CAP_SYS_ADMIN only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "tmpfs",
                           str(mount)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def _run(layout: Layout, cache: Path, **env: str) -> dict[str, Any]:
    layout.write_worker(FILLS_THE_CACHE)
    layout.write_payload(env={"HF_HOME": str(cache),
                              "FLASH_STORAGE_FLOOR_BYTES": str(SHORT_MIB * MIB), **env})
    proc = layout.cli(*layout.run_args(), timeout=60)
    marker = layout.marker()
    assert marker is not None, proc.stderr.decode("utf-8", "replace")[-3000:]
    return marker


def _cache_entries(marker: dict[str, Any], when: str, mount: Path) -> list[dict[str, Any]]:
    return [fs for fs in marker["disk"][when] if fs["mount"] == str(mount)]


def test_a_disk_the_job_filled_is_the_jobs_fault(layout: Layout, tmpfs: Path) -> None:
    marker = _run(layout, tmpfs / "hf")

    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False,
                                                                   "worker-failed")
    assert marker["job_fault"]["signature"] == "disk-full"
    [before] = _cache_entries(marker, "before_setup", tmpfs)
    assert before["short"] is False and before["free_mib"] > SHORT_MIB
    [now] = _cache_entries(marker, "now", tmpfs)
    assert now["free_mib"] == 0 and now["total_mib"] == TMPFS_MIB
    assert "the job filled a disk" in marker["error"]


def test_a_disk_already_full_before_setup_is_the_hosts_fault(
    layout: Layout, tmpfs: Path
) -> None:
    """A previous tenant's files leave 2 MiB: the same ENOSPC is retried on a fresh host."""
    with open(tmpfs / "previous-tenant.bin", "wb") as out:
        out.write(b"y" * ((TMPFS_MIB - 2) << 20))

    marker = _run(layout, tmpfs / "hf")

    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, True,
                                                                   "worker-host-fault")
    assert marker["host_fault"]["signature"] == "disk-full"
    [before] = _cache_entries(marker, "before_setup", tmpfs)
    assert before["short"] is True and before["free_mib"] <= 2
    assert "the disk was full before the attempt wrote anything" in marker["error"]
    assert f"{tmpfs} had 2 MiB free of {TMPFS_MIB} MiB" in marker["error"]


def test_a_full_dev_shm_is_the_jobs_and_the_marker_gives_its_size(layout: Layout) -> None:
    layout.write_worker("""
print("ERROR: Unexpected bus error encountered in worker. This might be caused by "
      "insufficient shared memory (shm).", file=sys.stderr, flush=True)
sys.exit(1)
""")
    layout.write_payload()
    proc = layout.cli(*layout.run_args(), timeout=60)
    marker = layout.marker()
    assert marker is not None, proc.stderr.decode()[-3000:]

    assert (marker["retriable"], marker["rule"]) == (False, "worker-failed")
    assert marker["job_fault"]["signature"] == "shm-exhausted"
    shm = storage.usage(Path("/dev/shm"))
    assert shm is not None
    assert marker["shm"]["total_mib"] == shm.size_bytes // MIB
    assert f"/dev/shm is {marker['shm']['total_mib']} MiB" in marker["error"]


def test_a_filesystem_came_short_by_space_or_by_inodes() -> None:
    def fs(free_mib: int, total_mib: int, inodes: tuple[int, int] = (0, 0)) -> Usage:
        return Usage("/x", "/x", "tmpfs", free_mib * MIB, total_mib * MIB, inodes[0],
                     inodes[1], False)

    floor = 200 * MIB
    assert storage.came_short(fs(100, 1000), floor)
    assert not storage.came_short(fs(300, 1000), floor)
    assert storage.came_short(fs(300, 1000, inodes=(0, 10_000)), floor)  # no inode left
    assert not storage.came_short(fs(300, 1000, inodes=(5, 10_000)), floor)
