"""The container image, proven without building it.

The Dockerfile is read, not trusted: its pip install step is run as written (the build
context copied through ``.dockerignore``, the build args at their defaults) into a fresh
virtual environment, and its ENTRYPOINT runs exactly as written as PID 1 of a new PID
namespace, with the CONTRACT section 1 paths redirected under a temporary root.

Why no init (tini) in the image, measured here:

* PID 1 of a PID namespace gets no default signal actions: a plain Python program without a
  SIGTERM handler survives SIGTERM there and dies of it elsewhere
  (``test_pid_1_ignores_a_sigterm_it_has_no_handler_for``). The runner installs its own
  handlers, so as PID 1 it still stops the worker and leaves a retriable marker.
* Measured once by hand: the installed runner with its handlers switched off
  (``_signals(ctx, False)`` in fsm/attempt/runner.py) as PID 1 was still running 8 s after SIGTERM,
  with no marker; with them it exits 1 with the retriable marker in well under a second.
* Orphans: grandchildren the worker orphans are re-parented to the runner, which reaps them
  as they die (SIGCHLD wakes its supervision loop, ``fsm.worker.procs.reap_orphans``), never taking
  the worker's own exit status; one that escaped the worker's process group with setsid is
  found and stopped with the worker, and when the runner exits the kernel kills everything
  left in the namespace anyway. So an init adds nothing that matters here
  (``test_orphans_of_the_worker_end_with_the_runner``).
* ``unshare --fork`` blocks SIGINT and SIGTERM in itself and forwards neither
  (``SigBlk: 0000000000004002`` in its /proc status, util-linux 2.38.1): signals go to its
  child, the runner, as Docker sends them to PID 1.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import Layout, read_until
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

pytestmark = pytest.mark.slow

# Dockerfile parsing ------------------------------------------------------------------------


@dataclass
class Dockerfile:
    """The instructions this test relies on, as the Dockerfile states them."""

    args: dict[str, str] = field(default_factory=dict)  # ARG name -> default
    from_: str = ""
    env: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)  # shell-form RUN, flags (--mount=...) kept
    workdir: str = ""
    stopsignal: str = ""
    entrypoint: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Dockerfile:
        parsed = cls()
        for line in _instructions(text):
            keyword, _, rest = line.partition(" ")
            keyword, rest = keyword.upper(), rest.strip()
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                parsed.args[name] = default
            elif keyword == "FROM":
                parsed.from_ = rest
            elif keyword == "ENV":
                for item in shlex.split(rest):
                    name, _, value = item.partition("=")
                    parsed.env[name] = value
            elif keyword == "RUN":
                parsed.runs.append(rest)
            elif keyword == "WORKDIR":
                parsed.workdir = rest
            elif keyword == "STOPSIGNAL":
                parsed.stopsignal = rest
            elif keyword == "ENTRYPOINT":
                parsed.entrypoint = json.loads(rest)  # exec form only: no shell as PID 1
        return parsed

    def pip_install(self) -> tuple[str, str]:
        """The one RUN step that installs the package: (its bind-mount target, its command)."""
        installs = [run for run in self.runs if "pip install" in run]
        assert len(installs) == 1, installs
        flags = re.match(r"((?:--\S+\s+)*)(.*)", installs[0], re.DOTALL)
        assert flags is not None
        mount = re.search(r"--mount=(\S+)", flags.group(1))
        assert mount is not None, "the source is bind-mounted for the install step"
        options = dict(
            opt.partition("=")[::2] for opt in mount.group(1).split(",")
        )
        assert options.get("type") == "bind" and "from" not in options, options
        return options["target"], flags.group(2)


def _instructions(text: str) -> Iterator[str]:
    """Logical lines: comments dropped, backslash continuations joined."""
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            yield current.strip()
        current = ""


# The build context ---------------------------------------------------------------------------


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (excludes, regex) in order; Docker's rules: the last match wins, and a
    pattern that matches a directory matches everything under it."""
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((not negate, re.compile(regex + "(?:/.*)?")))
    return patterns


def copy_build_context(dest: Path) -> list[str]:
    """Copy what `docker build .` would send, .dockerignore applied; returns the files."""
    patterns = _ignore_patterns()
    sent = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if d != ".git"]  # never part of a build context
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            excluded = False
            for excludes, regex in patterns:
                if regex.fullmatch(rel):
                    excluded = excludes
            if not excluded:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(dirpath) / name, target)
                sent.append(rel)
    return sorted(sent)


# The image, built as a virtual environment ---------------------------------------------------

_NETWORK = re.compile(
    r"NewConnectionError|Temporary failure in name resolution|Network is unreachable"
    r"|ConnectTimeoutError|ReadTimeoutError|Connection reset|ProxyError"
)


@dataclass(frozen=True)
class Image:
    dockerfile: Dockerfile
    venv: Path
    context_files: list[str]
    install_seconds: float

    @property
    def path_env(self) -> str:
        return f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"


def _can_unshare() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a new PID namespace"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"unshare --pid does not work here: {probe.stderr.decode().strip()}"
    return None


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The Dockerfile's install step, run as written into a fresh virtual environment."""
    reason = _can_unshare()
    if reason:
        pytest.skip(reason)
    dockerfile = Dockerfile.parse(DOCKERFILE.read_text())
    target, command = dockerfile.pip_install()
    root = tmp_path_factory.mktemp("image")
    context = root / "context"
    files = copy_build_context(context)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Docker runs RUN with /bin/sh -c and the build args in the environment; the bind mount's
    # target is the copied context.
    build_env = {
        **{k: v for k, v in os.environ.items() if k.startswith(("PIP_", "SSL_", "HOME", "LANG"))},
        **dockerfile.args,
        **dockerfile.env,
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "PIP_RETRIES": "1",  # transport settings only: fail fast when no index can be reached
        "PIP_DEFAULT_TIMEOUT": "30",
    }
    build_env.pop("BASE_IMAGE", None)
    started = time.monotonic()
    built = subprocess.run(
        ["/bin/sh", "-c", command.replace(target, str(context))],
        env=build_env,
        cwd="/",  # no WORKDIR precedes the step (a base image may set one: hence python3 -I)
        capture_output=True,
        timeout=600,
        check=False,
    )
    elapsed = time.monotonic() - started
    if built.returncode != 0:
        output = (built.stdout + built.stderr).decode(errors="replace")
        if _NETWORK.search(output):
            pytest.skip(f"the image's pinned packages cannot be fetched here: {output[-400:]}")
        pytest.fail(f"the Dockerfile's install step failed:\n{output[-3000:]}")
    return Image(dockerfile, venv, files, elapsed)


# A run laid out as CONTRACT section 1 says, under a temporary root --------------------------


class ContainerLayout(Layout):
    """/root/flash, /runcode, /tmp and the store, all under ``root``."""

    @property
    def payload_path(self) -> Path:
        return self.root / "root" / "flash" / "payload.json"

    @property
    def code_root(self) -> Path:
        return self.root / "runcode"

    @property
    def scratch(self) -> Path:
        return self.root / "tmp"


@pytest.fixture
def box(tmp_path: Path) -> ContainerLayout:
    lay = ContainerLayout(tmp_path)
    for path in (lay.store, lay.scratch, lay.code_root, lay.payload_path.parent):
        path.mkdir(parents=True)
    return lay


def _redirect(path: str, root: Path) -> Path:
    return root / path.lstrip("/")


def start_entrypoint(
    image: Image, box: ContainerLayout, cmd: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """The ENTRYPOINT argv as written (``docker run`` appends ``cmd``), as PID 1 of a new PID
    namespace, in the WORKDIR."""
    workdir = _redirect(image.dockerfile.workdir, box.root)
    assert workdir == box.payload_path.parent
    env = {
        **image.dockerfile.env,
        "PATH": image.path_env,
        "HOME": str(box.root / "root"),
        "FLASH_PAYLOAD_PATH": str(box.payload_path),
        "FLASH_STORE": box.store_url,
        "FLASH_CODE_ROOT": str(box.code_root),
        "FLASH_SCRATCH_DIR": str(box.scratch),
    }
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", *image.dockerfile.entrypoint, *cmd],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def pid_1_of(proc: subprocess.Popen[bytes], timeout: float = 10) -> int:
    """The host pid of the namespace's PID 1: the only child of ``unshare --fork``."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        children = []
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            children += (task / "children").read_text().split()
        if children:
            assert len(children) == 1, children
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("unshare started no child")


def _status(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _children_states(pid: int) -> list[str]:
    """The state letter of each child of host pid ``pid``."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                states.append(_status(int(child))["State"][0])
            except FileNotFoundError:
                continue
    return states


# The tests -----------------------------------------------------------------------------------


def test_the_dockerfile_says_what_the_contract_needs() -> None:
    """Base image overridable, WORKDIR /root/flash, exec-form `flash-bootstrap run`, SIGTERM."""
    dockerfile = Dockerfile.parse(DOCKERFILE.read_text())
    assert dockerfile.from_ == "${BASE_IMAGE}"
    assert re.fullmatch(r"python:3\.1[1-9][\w.-]*-slim[\w.-]*", dockerfile.args["BASE_IMAGE"])
    assert dockerfile.workdir == "/root/flash"
    assert dockerfile.stopsignal == "SIGTERM"
    assert dockerfile.entrypoint == ["flash-bootstrap", "run"]
    _, command = dockerfile.pip_install()
    argv = shlex.split(command)
    assert "--no-cache-dir" in argv
    assert argv[argv.index("-c") + 1].endswith("/${CONSTRAINTS}")
    assert dockerfile.args["CONSTRAINTS"] == "constraints/runtime.txt"
    assert any(arg.endswith("[fast]") for arg in argv)
    # The weight cache must be a real mount: an image that made /weight-cache (a directory or
    # an anonymous VOLUME on ephemeral disk) would let preload warm a cache that vanishes.
    lines = list(_instructions(DOCKERFILE.read_text()))
    assert not [line for line in lines if line.upper().startswith("VOLUME")], lines
    assert not [line for line in lines if "weight-cache" in line], lines


def test_the_build_context_is_the_package_and_nothing_else(image: Image) -> None:
    """.dockerignore sends the sources and the pins, never caches, git, tests or the test
    helpers (so the wheel pip builds for the image has none)."""
    files = image.context_files
    assert {"pyproject.toml", "constraints/runtime.txt", "fsm/cli.py"} <= set(files)
    assert any(f.startswith("fsm/ops/demo_tree/") for f in files)
    assert any(f.startswith("states/") for f in files)
    leaked = [f for f in files if f.startswith(("tests/", ".", "benchmarks/", "fsm/testing/"))
              or "__pycache__" in f or f.endswith(".pyc") or ".egg-info/" in f]
    assert not leaked, leaked


def test_every_installed_distribution_is_pinned(image: Image) -> None:
    """Two builds of one commit install the same versions: the constraints pin all of them."""
    frozen = subprocess.run(
        [str(image.venv / "bin" / "python"), "-m", "pip", "list", "--format=json",
         "--disable-pip-version-check"],
        capture_output=True, check=True,
    )
    installed = {
        _canonical(d["name"]): d["version"] for d in json.loads(frozen.stdout)
    }
    pins = {}
    for line in (ROOT / "constraints" / "runtime.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_canonical(name)] = version
    ours = {"flash-bootstrap", "pip", "setuptools"}  # the package, and the venv's own tools
    unpinned = {n: v for n, v in installed.items() if n not in ours and pins.get(n) != v}
    assert not unpinned, unpinned
    assert {"huggingface-hub", "hf-xet", "transitions", "structlog"} <= set(installed)
    print(f"install step: {image.install_seconds:.1f}s")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# The test helpers: in the test install, not in the image (docs/testing.md) ------------------

#: Run by an environment's interpreter: what it can import of the helpers, and what it records.
_HELPERS_PROBE = """
import importlib.metadata as md, importlib.util, json
from pathlib import Path
import fsm
dist = md.distribution("flash-bootstrap")
files = list(dist.files or ())
try:
    import fsm.testing
    testing = "importable"
except ModuleNotFoundError as exc:
    testing = f"ModuleNotFoundError: {exc.name}"
print(json.dumps({
    "testing": testing,
    "on_disk": (Path(fsm.__file__).parent / "testing").exists(),
    "pytest": importlib.util.find_spec("pytest") is not None,
    "pytest11": sorted(f"{ep.name} = {ep.value}" for ep in md.entry_points(group="pytest11")),
    "ours_pytest11": [ep.value for ep in dist.entry_points if ep.group == "pytest11"],
    "recorded_helpers": sorted(str(f) for f in files if str(f).startswith("fsm/testing/")),
    "recorded_missing": sorted(str(f) for f in files if not f.locate().exists()),
}))
"""


def _probe_helpers(python: Path | str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), "-c", _HELPERS_PROBE], capture_output=True, text=True, timeout=60,
        check=True, cwd="/",  # not the work tree: what is installed, not what is checked out
    )
    return json.loads(done.stdout)


def _ours(entry_points: list[str]) -> list[str]:
    """The ``name = value`` entry points that name a module of this project."""
    return [ep for ep in entry_points if re.search(r"= (fsm|states)\b", ep)]


def test_the_image_carries_the_runner_without_the_test_helpers(image: Image) -> None:
    """The install step leaves no fsm.testing, no pytest and no pytest11 entry point, and the
    distribution's RECORD lists exactly what is on disk; the runner still runs."""
    probe = _probe_helpers(image.venv / "bin" / "python")
    # Other distributions may declare pytest11 plugins (anyio does); none may be ours.
    pytest11 = probe.pop("pytest11")
    assert _ours(pytest11) == [], pytest11
    assert probe == {
        "testing": "ModuleNotFoundError: fsm.testing",
        "on_disk": False,
        "pytest": False,
        "ours_pytest11": [],
        "recorded_helpers": [],
        "recorded_missing": [],
    }, probe
    print(f"pytest11 entry points of other distributions in the image: {pytest11}")
    policy = subprocess.run(
        [str(image.venv / "bin" / "flash-bootstrap"), "policy"],
        capture_output=True, timeout=60, check=False,
    )
    assert policy.returncode == 0 and b"completion-confirmed" in policy.stdout, policy.stderr


def test_the_project_test_install_has_the_helpers_and_loads_them_explicitly(
    request: pytest.FixtureRequest,
) -> None:
    """`pip install -e '.[test]'` brings the helpers and pytest; no entry point loads the
    plugin, tests/conftest.py does."""
    probe = _probe_helpers(sys.executable)
    assert probe["testing"] == "importable" and probe["on_disk"] is True, probe
    assert probe["pytest"] is True
    assert probe["ours_pytest11"] == [], probe
    assert _ours(probe["pytest11"]) == [], probe
    import fsm.testing.pytest_plugin as plugin

    assert request.config.pluginmanager.get_plugin("fsm.testing.pytest_plugin") is plugin
    # pyproject: the testing extra is what the helpers need; the test extra includes it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "pytest11" not in project.get("entry-points", {})
    extras = {
        name: {_canonical(Requirement(r).name): Requirement(r) for r in reqs}
        for name, reqs in project["optional-dependencies"].items()
    }
    assert set(extras["testing"]) == {"pytest"}
    assert extras["test"]["flash-bootstrap"].extras == {"testing"}
    installed = [Requirement(r) for r in importlib.metadata.requires("flash-bootstrap") or ()]
    assert any(
        r.name == "pytest" and r.marker is not None and r.marker.evaluate({"extra": "testing"})
        for r in installed
    ), "the installed metadata is stale: pip install -e '.[test]'"


def test_a_pytest_run_gets_the_hub_fixtures_only_when_it_asks(tmp_path: Path) -> None:
    """In an environment with the helpers installed, a suite that does not load the plugin has
    no hub fixtures (a worker's own tests are left alone); `-p` or `pytest_plugins` loads it."""
    (tmp_path / "test_uses_hub.py").write_text(textwrap.dedent("""
        def test_it(hub_server, hub_dataset, hub_token):
            assert hub_server.url.startswith("http://127.0.0.1:")
    """))
    outcomes = {}
    for name, extra in {"plain": [], "-p": ["-p", "fsm.testing.pytest_plugin"]}.items():
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra,
             "--rootdir", str(tmp_path), str(tmp_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        )
        outcomes[name] = (done.returncode, "fixture 'hub_server' not found" in done.stdout)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["fsm.testing.pytest_plugin"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    outcomes["conftest"] = (done.returncode, "fixture 'hub_server' not found" in done.stdout)
    assert outcomes == {"plain": (1, True), "-p": (0, False), "conftest": (0, False)}, outcomes


def test_pid_1_ignores_a_sigterm_it_has_no_handler_for() -> None:
    """Why the runner needs its own handlers: PID 1 survives a SIGTERM that kills others."""
    reason = _can_unshare()
    if reason:
        pytest.skip(reason)
    program = "import sys; print('ready', flush=True); sys.stdin.readline(); print('survived')"
    outcomes = {}
    for prefix in ([], ["unshare", "--pid", "--fork", "--mount-proc"]):
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", program],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        read_until(proc.stdout, b"ready")
        target = pid_1_of(proc) if prefix else proc.pid
        if prefix:
            # unshare itself blocks SIGINT and SIGTERM and forwards neither: it is not the target.
            blocked = int(_status(proc.pid)["SigBlk"], 16)
            assert blocked & (1 << (signal.SIGTERM - 1)), hex(blocked)
        os.kill(target, signal.SIGTERM)
        # A default-action fatal signal is acted on when sent: by the time kill() returns the
        # ordinary process is dying, and PID 1 has had the signal dropped.
        out, _ = proc.communicate(b"go\n", timeout=10)
        outcomes["pid 1" if prefix else "ordinary"] = (proc.returncode, out.count(b"survived"))
    assert outcomes == {"ordinary": (-signal.SIGTERM, 0), "pid 1": (0, 1)}


def test_the_entrypoint_as_pid_1_runs_an_attempt_to_success(
    image: Image, box: ContainerLayout
) -> None:
    """`flash-bootstrap run` as PID 1 with the payload in /root/flash: exit 0, ok marker."""
    box.write_worker("""
        print(f"worker parent pid {os.getppid()}", flush=True)
        complete()
    """)
    box.write_payload()
    proc = start_entrypoint(image, box)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert b"worker parent pid 1\n" in out  # the runner was PID 1 of the namespace
    marker = box.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["error"]) == (True, False, "")
    assert box.artifact("DONE").exists()


#: What CONTRACT section 1's docker run line puts after the image name. Docker appends it to
#: the ENTRYPOINT as arguments.
CONTRACT_CMD = ("flash-bootstrap", "run")


def test_the_contract_docker_run_line_runs_an_attempt(image: Image, box: ContainerLayout) -> None:
    """`docker run ... "$IMAGE" flash-bootstrap run`, exactly as cloud-init says it, succeeds."""
    box.write_worker("complete()")
    box.write_payload()
    proc = start_entrypoint(image, box, CONTRACT_CMD)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    marker = box.marker()
    assert marker is not None and marker["ok"] is True


def test_a_sigterm_to_the_entrypoint_as_pid_1_leaves_a_retriable_marker_promptly(
    image: Image, box: ContainerLayout
) -> None:
    """`docker stop` during training: the worker is stopped, marker retriable, prompt exit."""
    box.write_worker("""
        print("ready", flush=True)
        time.sleep(600)
    """)
    box.write_payload()
    proc = start_entrypoint(image, box)
    runner = pid_1_of(proc)
    read_until(proc.stdout, b"ready")
    sent = time.monotonic()
    os.kill(runner, signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 75, err.decode()[-3000:]  # unshare exits with its child's status
    assert elapsed < 5, elapsed
    marker = box.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, True, "interrupted", "VerifyRemote"
    )
    assert marker["worker"]["reason"] == "interrupted"
    assert b"rule interrupted" in err


def test_orphans_of_the_worker_end_with_the_runner(image: Image, box: ContainerLayout) -> None:
    """Grandchildren orphaned to the runner (PID 1) are reaped as they die, not left as
    zombies while the attempt runs, and none outlives it: not even one that left the
    worker's process group."""
    box.write_worker(textwrap.dedent("""
        import subprocess
        # An escapee: its own session, so the supervisor's killpg never reaches it.
        escapee = subprocess.Popen(["sleep", "600"], start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"escapee {escapee.pid}", flush=True)
        # Three orphans that exit soon: each child leaves before its own child.
        orphans = []
        for _ in range(3):
            r, w = os.pipe()
            child = os.fork()
            if child == 0:
                grandchild = os.fork()
                if grandchild == 0:
                    time.sleep(0.05)
                    os._exit(0)
                os.write(w, str(grandchild).encode())
                os._exit(0)
            os.waitpid(child, 0)
            orphans.append(int(os.read(r, 64)))
        # Wait (bounded) until they are gone from /proc: reaped, not zombies of PID 1.
        give_up = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in orphans):
            if time.monotonic() > give_up:
                break
            time.sleep(0.02)
        left = sum(os.path.exists(f"/proc/{pid}") for pid in orphans)
        print(f"orphans left: {left}", flush=True)
        print("ready", flush=True)
        time.sleep(600)
    """))
    box.write_payload()
    proc = start_entrypoint(image, box)
    runner = pid_1_of(proc)
    seen = read_until(proc.stdout, b"ready")
    assert b"orphans left: 0\n" in seen  # the runner reaps them as they die
    assert _children_states(runner).count("Z") == 0
    found = re.search(rb"escapee (\d+)", seen)
    assert found is not None
    escapee = _host_pid(int(found.group(1)), runner)
    os.kill(runner, signal.SIGTERM)
    proc.communicate(timeout=15)
    assert proc.returncode == 75
    assert not Path(f"/proc/{escapee}").exists(), "the escapee outlived the runner"


def _host_pid(ns_pid: int, pid_1: int) -> int:
    """The host pid of the process that is ``ns_pid`` in the namespace whose PID 1 is ``pid_1``."""
    namespace = os.readlink(f"/proc/{pid_1}/ns/pid")
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            nspid = _status(int(name))["NSpid"].split()
            same = os.readlink(f"/proc/{name}/ns/pid") == namespace
        except (OSError, KeyError):  # gone, or not ours to look at
            continue
        if same and int(nspid[-1]) == ns_pid:
            return int(name)
    raise AssertionError(f"no process {ns_pid} in {namespace}")
