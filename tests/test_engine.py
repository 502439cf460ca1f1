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

import contextlib
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
from hubrun import HubRun

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


@contextlib.contextmanager
def dockerd() -> Iterator[Engine]:
    """A Docker daemon of its own (socket, data root and exec root under a temporary
    folder; no bridge, no iptables), stopped and removed afterwards."""
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


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("FLASH_REQUIRE_ENGINE") == "1":
            pytest.fail(f"the container engine tests must run here: {reason}")
        pytest.skip(reason)
    with dockerd() as engine:
        yield engine


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
    return build_image(engine)


def build_image(engine: Engine) -> str:
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
        return sorted(path for path in (self.store / PREFIX).glob(f"{ARM}_attempt*.json")
                      if not path.name.endswith(".lease.json"))  # a lease is no marker


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


def run_as_the_hosts_do(engine: Engine, image: str, host: Host, name: str, *flags: str) -> None:
    """The contract's line (CONTRACT section 1), without the GPUs this machine lacks;
    ``flags`` are the engine's options a case adds (a restart policy, a memory limit)."""
    engine.docker("run", "-d", "--name", name, "--network", "host", *flags,
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
    run_as_the_hosts_do(engine, image, host, container)
    status = _wait(engine, container)
    logs = engine.docker("logs", container).stderr
    marker = host.marker()
    assert marker is not None, logs[-3000:]
    assert (status, marker["ok"]) == (0, True), logs[-3000:]


def test_docker_stop_mid_training_gives_a_retriable_marker_and_75_within_its_10_s(
    engine: Engine, image: str, host: Host, container: str
) -> None:
    host.write(TRAINING)
    run_as_the_hosts_do(engine, image, host, container)
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
    run_as_the_hosts_do(engine, image, host, container)
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
    # The killed runner's lease (if it landed) went with the second runner's marker.
    assert list((host.store / PREFIX).glob("*.lease.json")) == []


def test_a_memory_limit_kills_the_worker_not_the_runner_and_the_marker_says_so(
    engine: Engine, image: str, host: Host, container: str
) -> None:
    """``--memory`` small enough that the worker exceeds it: the cgroup's OOM killer takes
    the worker (the runner lowered its own score and raised its children's), and the
    runner, alive, writes ``worker-oom-killed``."""
    host.write("""
    hog = []
    while True:
        hog.append(bytearray(16 << 20))  # zero-filled: every page touched
    """)
    run_as_the_hosts_do(engine, image, host, container, "--memory", "256m", "--memory-swap", "256m")
    status = _wait(engine, container)
    marker = host.marker()
    assert marker is not None, engine.docker("logs", container).stderr[-3000:]
    assert marker["rule"] == "worker-oom-killed", marker
    assert marker["worker"]["oom_killed"] is True
    assert (status, marker["retriable"]) == (1, False)  # fatal: the same shape kills it again


def test_the_termination_message_reaches_a_bind_mounted_file(
    engine: Engine, image: str, host: Host, container: str, tmp_path: Path
) -> None:
    """Kubernetes mounts a file at /dev/termination-log; the runner writes the attempt's
    verdict into it (only into a file that is there)."""
    message = tmp_path / "termination-log"
    message.write_text("")
    host.write("raise SystemExit(1)")
    run_as_the_hosts_do(engine, image, host, container, "-v", f"{message}:/dev/termination-log")
    assert _wait(engine, container) == 1
    said = message.read_text()
    assert "worker-failed" in said and "attempt 0 failed" in said, said


def test_orphans_are_reaped_and_nothing_is_left_when_the_container_ends(
    engine: Engine, image: str, host: Host, container: str
) -> None:
    """The worker leaves a child behind in a session of its own (a daemon), and one that
    exits as an orphan: the runner, PID 1, reaps the one (no zombie while it runs) and,
    when it exits, the kernel ends the other with the container."""
    token = f"flash-orphan-{time.monotonic_ns()}"
    host.write(f"""
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{token}"],
                     start_new_session=True)
    if os.fork() == 0:  # a child that exits once orphaned: PID 1 must reap it
        if os.fork() == 0:
            time.sleep(0.5)
            os._exit(0)
        os._exit(0)
    os.wait()
    time.sleep(1.5)
    zombies = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with open(f"/proc/{{pid}}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(pid)
    (STORE / "zombies").write_text(json.dumps(zombies))
    complete()
    """)
    run_as_the_hosts_do(engine, image, host, container)
    assert _wait(engine, container) == 0, engine.docker("logs", container).stderr[-3000:]
    assert json.loads((host.store / "zombies").read_text()) == []
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True, check=False)
    assert left.stdout.strip() == "", "a process outlived its container"


def test_restart_on_failure_publishes_the_persisted_marker_without_training_again(
    engine: Engine, image: str, host: Host, container: str, hub_run: HubRun
) -> None:
    """The Hub (the local server on loopback, reached through ``--network host``) refuses
    every commit of the marker: the attempt ends 3, its outcome persisted in the bind
    mount. ``--restart on-failure:3`` starts the container again, the Hub takes commits
    again, and the restart publishes that marker without running the worker again."""
    hub_run.write_worker("""
    with open("/root/flash/runs", "a") as runs:
        runs.write("ran\\n")
    complete()
    while not os.path.exists("/root/flash/go"):  # the test's go, once it refuses commits
        time.sleep(0.05)
    """)
    payload = hub_run.payload()
    payload["env"] = {**payload["env"], "HF_ENDPOINT": hub_run.server.url,
                      "FLASH_STORE_MAX_ATTEMPTS": "1"}
    (host.flash / "payload.json").write_text(json.dumps(payload))
    run_as_the_hosts_do(engine, image, host, container, "--restart", "on-failure:3")
    _until("the worker's DONE", hub_run.artifact("DONE").exists, bound_s=120)
    refused = hub_run.server.fail("POST", r"/commit/", status=500, times=10_000)
    (host.flash / "go").touch()
    first = _wait(engine, container)  # the first run's exit; the engine restarts it
    refused.times = refused.hits  # the Hub takes commits again
    assert first == 3, engine.docker("logs", container).stderr[-3000:]
    _until("the restart's marker", lambda: hub_run.marker() is not None, bound_s=120)
    assert _wait(engine, container) == 0
    marker = hub_run.marker()
    assert marker is not None and marker["ok"] is True
    assert (host.flash / "runs").read_text() == "ran\n", "the restart trained again"
    restarts = engine.docker("inspect", "-f", "{{.RestartCount}}", container).stdout.strip()
    assert restarts == "1"


def test_the_built_image_has_no_test_helpers_and_pip_records_what_is_there(
    engine: Engine, image: str
) -> None:
    """The image is built from a wheel without fsm/testing (.dockerignore): nothing to import,
    nothing on disk, and the distribution's RECORD names only files that exist."""
    from test_container import _HELPERS_PROBE

    done = engine.docker("run", "--rm", "--entrypoint", "python3", "-w", "/", image,
                         "-I", "-c", _HELPERS_PROBE)
    probe = json.loads(done.stdout)
    assert (probe["testing"], probe["on_disk"], probe["ours_pytest11"]) == (
        "ModuleNotFoundError: fsm.testing", False, []), probe
    assert (probe["recorded_helpers"], probe["recorded_missing"]) == ([], []), probe
