"""The image in a real container engine (issue 41): built from the repository's
Dockerfile and run through the contract's exact ``docker run`` line, as the hosts do.

Docker Engine (Debian's ``docker.io``) runs here as its own daemon on a socket, data root
and exec root under a temporary folder, with ``--bridge=none --iptables=false``: every
container runs with ``--network host``, as the contract's line does, and no bridge hands
out private addresses. No registry is reachable, so the base image is made here: Debian
bookworm by ``debootstrap --variant=minbase`` with python3 (3.11) and pip, its
``EXTERNALLY-MANAGED`` removed as a python base image has none, and the host's CA bundle in
it (the build's pip reaches its index through whatever TLS the host trusts). The rootfs is
cached under ``~/.cache/flash-bootstrap`` between runs on one machine.

The build uses BuildKit (built into Docker 20.10's daemon: no buildx, no registry). The
Dockerfile has no ``# syntax=`` line: that line makes BuildKit pull its frontend from
Docker Hub, which a builder without a registry cannot, and the built-in frontend already
takes ``RUN --mount``.

Skipped where the engine cannot run (no ``dockerd`` or ``debootstrap``, not root), unless
``FLASH_REQUIRE_ENGINE=1`` (``.ci/run`` sets it): then that is a failure. ``-m "not
engine"`` leaves them out locally.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import WORKER_PRELUDE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flash-bootstrap"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
MIRROR = os.environ.get("FLASH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_TAG = "flash-test-base:bookworm"
IMAGE_TAG = "flash-worker:test"
ARM = "instance"
PREFIX = "engine/run/0"
#: The engine's own client (Debian's docker.io): a newer client found first on PATH wants
#: the buildx plugin for BuildKit, which Debian does not package; this one builds through
#: the daemon's BuildKit.
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
#: ``docker stop``'s default: SIGTERM, then SIGKILL 10 s later.
STOP_S = 10


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (dockerd, debootstrap)"
    for tool in ("dockerd", DOCKER, "debootstrap"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian packages docker.io, debootstrap)"
    return None


@dataclass
class Engine:
    sock: str

    def docker(self, *args: str, timeout: float = 120, check: bool = True,
               **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([DOCKER, "-H", f"unix://{self.sock}", *args], text=True,
                              capture_output=True, timeout=timeout, check=check,
                              env={**os.environ, **env})


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("FLASH_REQUIRE_ENGINE") == "1":
            pytest.fail(f"the container engine tests must run here: {reason}")
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="flash-dockerd-"))
    sock = str(root / "docker.sock")
    log = (root / "dockerd.log").open("wb")
    daemon = subprocess.Popen(
        ["dockerd", "--host", f"unix://{sock}", "--data-root", str(root / "data"),
         "--exec-root", str(root / "exec"), "--pidfile", str(root / "docker.pid"),
         "--bridge=none", "--iptables=false", "--ip6tables=false"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    engine = Engine(sock)
    try:
        deadline = time.monotonic() + 60
        while engine.docker("version", check=False, timeout=10).returncode != 0:
            assert daemon.poll() is None, (root / "dockerd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "dockerd did not answer within 60 s"
            time.sleep(0.2)
        yield engine
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(30)
        log.close()
        subprocess.run(["umount", "-R", str(root / "data")], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def _base_rootfs() -> Path:
    """The base's root filesystem as a tarball, made once per machine (and host CA)."""
    ca = hashlib.sha256(HOST_CA.read_bytes()).hexdigest()[:12] if HOST_CA.exists() else "none"
    tarball = CACHE / f"base-bookworm-{ca}.tar"
    if tarball.exists():
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flash-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(
            ["debootstrap", "--variant=minbase",
             "--include=python3,python3-pip,python3-venv,ca-certificates",
             "bookworm", str(rootfs), MIRROR],
            capture_output=True, check=True, timeout=900,
        )
        for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        if HOST_CA.exists():
            shutil.copyfile(HOST_CA, rootfs / "etc/ssl/certs/ca-certificates.crt")
        partial = tarball.with_suffix(".part")
        with tarfile.open(partial, "w") as tar:
            tar.add(rootfs, arcname=".")
        partial.replace(tarball)
    return tarball


@pytest.fixture(scope="session")
def image(engine: Engine) -> str:
    """The image, built from the repository's Dockerfile on the locally made base."""
    tarball = _base_rootfs()
    with tarball.open("rb") as f:
        subprocess.run([DOCKER, "-H", f"unix://{engine.sock}", "import", "-", BASE_TAG],
                       stdin=f, capture_output=True, check=True, timeout=300)
    built = engine.docker("build", "--network", "host", "--build-arg",
                          f"BASE_IMAGE={BASE_TAG}", "-t", IMAGE_TAG, str(ROOT),
                          timeout=900, check=False, DOCKER_BUILDKIT="1")
    assert built.returncode == 0, built.stderr[-4000:]
    return IMAGE_TAG


@dataclass
class Host:
    """A host's ``/opt/flash`` (the payload directory) with a local store inside it."""

    flash: Path

    @property
    def store(self) -> Path:
        return self.flash / "store"

    def write(self, worker: str, **payload: Any) -> None:
        code = self.store / "code" / "flash" / "engine" / "worker"
        code.mkdir(parents=True, exist_ok=True)
        (code / "__main__.py").write_text(WORKER_PRELUDE + "\n" + textwrap.dedent(worker))
        (self.flash / "payload.json").write_text(json.dumps({
            "hf_repo": "org/runs", "hf_prefix": PREFIX, "phase": "sft", "seed": 0,
            "job_spec_json": json.dumps({"hf_repo": "org/runs", "hf_prefix": PREFIX}),
            **payload,
            "env": {"FLASH_STORE": "file:///root/flash/store", "FLASH_HOST_WATCH_S": "0",
                    **payload.get("env", {})},
        }))

    def marker(self) -> dict[str, Any] | None:
        path = self.store / PREFIX / f"{ARM}_attempt0.json"
        return json.loads(path.read_text()) if path.exists() else None

    def markers(self) -> list[Path]:
        return sorted((self.store / PREFIX).glob(f"{ARM}_attempt*.json"))


@pytest.fixture
def host(tmp_path: Path) -> Host:
    flash = tmp_path / "opt-flash"
    flash.mkdir()
    return Host(flash)


@pytest.fixture
def container(engine: Engine, image: str, host: Host) -> Iterator[str]:
    """The container's name; removed afterwards, whatever happened to it."""
    name = f"flashrun-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    engine.docker("rm", "-f", name, check=False)


def _run(engine: Engine, image: str, host: Host, name: str) -> None:
    """The contract's line (CONTRACT section 1), without the GPUs this machine lacks."""
    engine.docker("run", "-d", "--name", name, "--network", "host",
                  "-v", f"{host.flash}:/root/flash", "-w", "/root/flash",
                  image, "flash-bootstrap", "run")


def _wait(engine: Engine, name: str, timeout: float = 120) -> int:
    return int(engine.docker("wait", name, timeout=timeout).stdout.strip())


def _until(what: str, ready: Any, bound_s: float = 60) -> None:
    deadline = time.monotonic() + bound_s
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {bound_s} s"
        time.sleep(0.05)


TRAINING = """
(SCRATCH / "training").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def test_an_attempt_succeeds_and_docker_wait_reports_0(
    engine: Engine, image: str, host: Host, container: str
) -> None:
    host.write("complete()")
    _run(engine, image, host, container)
    status = _wait(engine, container)
    logs = engine.docker("logs", container).stderr
    marker = host.marker()
    assert marker is not None, logs[-3000:]
    assert (status, marker["ok"]) == (0, True), logs[-3000:]


def test_docker_stop_mid_training_gives_a_retriable_marker_and_75_within_its_10_s(
    engine: Engine, image: str, host: Host, container: str
) -> None:
    host.write(TRAINING)
    _run(engine, image, host, container)
    _until("the worker trains",
           lambda: "worker.started" in engine.docker("logs", container).stderr)
    started = time.monotonic()
    engine.docker("stop", container, timeout=STOP_S + 30)
    took = time.monotonic() - started
    status = _wait(engine, container)
    marker = host.marker()
    assert marker is not None, engine.docker("logs", container).stderr[-3000:]
    assert (status, marker["ok"], marker["retriable"]) == (75, False, True), marker
    assert took < STOP_S, f"docker stop took {took:.1f} s: the SIGKILL came first"


def test_a_container_killed_and_started_again_continues_the_attempt_with_one_marker(
    engine: Engine, image: str, host: Host, container: str
) -> None:
    host.write("""
    runs = STORE / "runs"  # the host's bind mount: it outlives the container
    with open(runs, "a") as f:
        f.write(os.environ["FLASH_RUN_DEADLINE_AT"] + "\\n")
    if len(runs.read_text().splitlines()) == 1:
        while True:
            time.sleep(0.1)
    complete()
    """, max_wall_s=120)
    _run(engine, image, host, container)
    runs = host.store / "runs"
    _until("the first run", runs.exists)
    engine.docker("kill", "-s", "KILL", container)
    assert _wait(engine, container) == 137
    assert host.markers() == []
    engine.docker("start", container)
    status = _wait(engine, container)
    deadlines = runs.read_text().split()
    marker = host.marker()
    assert marker is not None, engine.docker("logs", container).stderr[-3000:]
    assert (status, marker["ok"]) == (0, True)
    assert len(deadlines) == 2 and deadlines[0] == deadlines[1], "the budget continued"
    assert len(host.markers()) == 1
