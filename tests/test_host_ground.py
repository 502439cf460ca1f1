"""The runner holds its ground on the host (issue 26): escapees, orphans, every signal,
the OOM killer, full and read-only disks, its own files. Through the real runner process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import WAIT_FOR_GO, Layout, read_until, survivors

UNSHARE = shutil.which("unshare")


def _start(layout: Layout, prefix: list[str] | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "fsm", *layout.run_args()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


def _can_unshare_pid() -> bool:
    if UNSHARE is None:
        return False
    done = subprocess.run([UNSHARE, "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True, check=False)
    return done.returncode == 0


AS_PID_1 = [UNSHARE or "unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
needs_pidns = pytest.mark.skipif(
    not _can_unshare_pid(), reason="no PID namespace here (unshare --pid needs privilege)"
)

#: A worker that starts a helper in a session of its own, waits until the helper is up,
#: and fails at once without completion artifacts. The helper waits for the worker's end,
#: then for a while (long enough for the marker to be out), then uploads DONE.
ESCAPEE = '''
import subprocess
MARK = os.environ["ESCAPEE_MARK"]
helper = """
import os, sys, time, json, shutil
from pathlib import Path
worker = int(sys.argv[1])
Path(sys.argv[2]).write_text("up")
while True:
    try:
        os.kill(worker, 0)
    except ProcessLookupError:
        break
    if open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
        break
    time.sleep(0.02)
time.sleep(3)
target = Path(sys.argv[3])
target.parent.mkdir(parents=True, exist_ok=True)
target.write_text(str(time.time()))
"""
up = SCRATCH / "helper-up"
via = "@VIA@"
argv = [sys.executable, "-c", helper, str(os.getpid()), str(up), str(STORE / PREFIX / "DONE")]
if via == "grandchild":
    # The helper's parent leaves at once: the helper is orphaned as well as out of the group.
    starter = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)"
    subprocess.run([sys.executable, "-c", starter, *argv], check=True)
else:
    subprocess.Popen(argv, start_new_session=True)
for _ in range(500):
    if up.exists():
        break
    time.sleep(0.02)
print("helper up", flush=True)
@THEN@
'''


@pytest.mark.parametrize("via", ["child", "grandchild"])
def test_a_setsid_escapee_is_stopped_with_the_worker_and_never_uploads_after_the_marker(
    layout: Layout, via: str
) -> None:
    """A helper that left the worker's process group (setsid) dies with the worker: its
    late DONE never contradicts the fatal marker."""
    mark = uuid.uuid4().hex
    layout.write_worker(ESCAPEE.replace("@VIA@", via).replace("@THEN@", "sys.exit(1)"))
    layout.write_payload(env={"FLASH_STOP_GRACE_S": "2", "ESCAPEE_MARK": mark})
    proc = _start(layout)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "worker-failed", marker
    assert survivors(mark, settle_s=6) == []
    assert not layout.artifact("DONE").exists(), "the escapee uploaded DONE after the marker"


def test_a_setsid_escapee_is_stopped_when_a_signal_stops_the_attempt(layout: Layout) -> None:
    """On SIGTERM the helper outside the group is stopped too: nothing outlives the runner."""
    mark = uuid.uuid4().hex
    layout.write_worker(ESCAPEE.replace("@VIA@", "child").replace("@THEN@", "time.sleep(600)"))
    layout.write_payload(env={"FLASH_STOP_GRACE_S": "2", "ESCAPEE_MARK": mark})
    proc = _start(layout)
    read_until(proc.stdout, b"helper up")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 75, stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "interrupted", marker
    assert survivors(mark, settle_s=6) == []
    assert not layout.artifact("DONE").exists()


#: A worker whose 300 children each leave a short-lived grandchild behind (orphaned: it is
#: re-parented to the runner), then counts the runner's zombie children and exits 7.
ORPHANS = '''
def zombies():
    me, count = os.getppid(), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            count += 1
    return count

# One orphan that says who adopted it: its parent leaves, it looks at its new parent.
child = os.fork()
if child == 0:
    if os.fork() == 0:
        first = os.getppid()
        for _ in range(500):
            if os.getppid() != first:
                break
            time.sleep(0.01)
        (SCRATCH / "adopted_by").write_text(str(os.getppid()))
        os._exit(0)
    time.sleep(0.2)
    os._exit(0)
os.waitpid(child, 0)
for _ in range(500):
    if (SCRATCH / "adopted_by").exists():
        break
    time.sleep(0.01)
(SCRATCH / "runner").write_text(str(os.getppid()))

for _ in range(300):
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            os._exit(0)  # the grandchild: orphaned once its parent leaves, then dies
        os._exit(0)
    os.waitpid(child, 0)
left = zombies()
for _ in range(200):  # the runner reaps as they die: give it a bounded while
    if left <= 5:
        break
    time.sleep(0.05)
    left = zombies()
(SCRATCH / "zombies").write_text(str(left))
print("zombies", left, flush=True)
sys.exit(7)
'''


def _orphans_run(layout: Layout, prefix: list[str] | None) -> None:
    layout.write_worker(ORPHANS)
    layout.write_payload()
    proc = _start(layout, prefix)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    # The orphans were reaped, the worker's own exit status was not taken with them.
    assert marker["worker"]["exit_code"] == 7, marker["worker"]
    assert int((layout.scratch / "zombies").read_text()) <= 5
    # The orphans were the runner's to reap: it adopted them (PID 1, or a subreaper).
    assert (layout.scratch / "adopted_by").read_text() == (layout.scratch / "runner").read_text()


@needs_pidns
def test_as_pid_1_the_runner_reaps_the_workers_orphans_and_keeps_its_exit_status(
    layout: Layout,
) -> None:
    """As PID 1 of a namespace, 300 orphaned grandchildren do not stay zombies."""
    _orphans_run(layout, AS_PID_1)


def test_behind_an_init_the_runner_adopts_and_reaps_the_workers_orphans(layout: Layout) -> None:
    """Not PID 1 (a subreaper instead): the orphans are the runner's, reaped as they die."""
    _orphans_run(layout, None)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT, signal.SIGPWR])
def test_every_stop_signal_ends_the_attempt_like_sigterm(layout: Layout, signum: int) -> None:
    """Not PID 1: SIGHUP, SIGQUIT or SIGPWR stop the worker and leave a retriable marker,
    instead of killing the runner with the worker training on."""
    mark = uuid.uuid4().hex
    layout.write_worker(WAIT_FOR_GO)
    layout.write_payload(env={"FLASH_STOP_GRACE_S": "2", "SIGNAL_MARK": mark})
    proc = _start(layout)
    read_until(proc.stdout, b"ready")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 75, stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, True, "interrupted")
    assert signal.Signals(signum).name.encode() in layout.artifact("console_sft.txt").read_bytes()
    assert survivors(mark) == []


@pytest.mark.parametrize(
    "signum", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPROF, signal.SIGRTMIN]
)
def test_a_signal_the_table_ignores_leaves_the_attempt_running(
    layout: Layout, signum: int
) -> None:
    """SIGUSR1, SIGUSR2, SIGALRM and the like neither kill the runner nor stop the worker:
    the attempt finishes and succeeds."""
    layout.write_worker(WAIT_FOR_GO)
    layout.write_payload()
    proc = _start(layout)
    read_until(proc.stdout, b"ready")
    proc.send_signal(signum)
    proc.send_signal(signum)
    (layout.scratch / "go").write_text("go")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    name = signal.Signals(signum).name
    # Two sent; a standard signal still pending when the next comes is delivered once.
    assert set(marker["signals_ignored"]) == {name}, marker.get("signals_ignored")
    assert 1 <= marker["signals_ignored"][name] <= 2


@needs_pidns
def test_as_pid_1_a_sighup_stops_the_attempt_too(layout: Layout) -> None:
    """PID 1 of a namespace drops signals without a handler: the runner has one for every
    stop signal, SIGHUP included."""
    layout.write_worker(WAIT_FOR_GO)
    layout.write_payload()
    proc = _start(layout, AS_PID_1)
    read_until(proc.stdout, b"ready")
    # unshare forwards nothing: signal the namespace's PID 1 (unshare's only child).
    inner = _child_of(proc.pid)
    os.kill(inner, signal.SIGHUP)
    _, stderr = proc.communicate(timeout=30)
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "interrupted", stderr.decode()[-3000:]


def _child_of(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_the_worker_is_the_oom_killers_first_choice(layout: Layout) -> None:
    """Every process of the worker starts with the highest ``oom_score_adj``; the runner
    keeps its own (lowered where permitted)."""
    layout.write_worker("""
        import subprocess
        mine = open("/proc/self/oom_score_adj").read().strip()
        child = subprocess.run(["cat", "/proc/self/oom_score_adj"], capture_output=True,
                               text=True).stdout.strip()
        runner = open(f"/proc/{os.getppid()}/oom_score_adj").read().strip()
        (SCRATCH / "oom.json").write_text(json.dumps([mine, child, runner]))
        complete()
    """)
    layout.write_payload()
    proc = _start(layout)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    mine, child, runner = json.loads((layout.scratch / "oom.json").read_text())
    assert (mine, child) == ("1000", "1000")
    assert int(runner) <= 0


MEMORY_ROOT = Path("/sys/fs/cgroup/memory")


def _memory_cgroup(tmp_name: str, limit: int) -> Path | None:
    """A fresh cgroup v1 memory group under this process's own, or None."""
    try:
        own = next(line.split(":", 2)[2] for line in
                   Path("/proc/self/cgroup").read_text().splitlines()
                   if line.split(":", 2)[1] == "memory")
        group = MEMORY_ROOT / own.lstrip("/") / tmp_name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        with open(group / "memory.memsw.limit_in_bytes", "w") as f:
            f.write(str(limit))
    except (OSError, StopIteration, IndexError):
        return None
    return group


def test_an_oom_in_the_container_kills_the_worker_not_the_runner(layout: Layout) -> None:
    """A real memory cgroup, the worker's memory spread over processes smaller than the
    runner: the OOM kill takes the worker's processes, and the runner writes its marker."""
    group = _memory_cgroup(f"flash-oom-{uuid.uuid4().hex[:8]}", 160 << 20)
    if group is None:
        pytest.skip("no writable cgroup v1 memory controller with swap accounting here")
    try:
        layout.write_worker("""
            # Many small processes, each well under the runner's size, together past the limit.
            kids = []
            for _ in range(40):
                pid = os.fork()
                if pid == 0:
                    block = bytearray(12 << 20)
                    for i in range(0, len(block), 4096):
                        block[i] = 1
                    time.sleep(60)
                    os._exit(0)
                kids.append(pid)
            for pid in kids:
                os.waitpid(pid, 0)
            sys.exit(3)
        """)
        layout.write_payload()
        cmd = [sys.executable, "-m", "fsm", *layout.run_args()]
        proc = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        _, stderr = proc.communicate(timeout=120)
        marker = layout.marker()
        assert proc.returncode == 1, (proc.returncode, stderr.decode()[-3000:])
        assert marker is not None
        assert marker["rule"] == "worker-oom-killed", marker
    finally:
        _empty_and_remove(group)


def _empty_and_remove(group: Path) -> None:
    """Remove a cgroup this test made, first killing what the run left in it (nothing, when
    the runner did its job: a runner killed by the OOM killer leaves its worker behind)."""
    end = time.monotonic() + 10
    while (left := (group / "cgroup.procs").read_text().split()) and time.monotonic() < end:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)
    group.rmdir()


@pytest.mark.parametrize("how", ["emptied", "replaced"])
def test_a_worker_that_empties_its_scratch_dir_cannot_change_the_verdict(
    layout: Layout, how: str
) -> None:
    """The console is read back through the descriptor the runner holds, not by its path:
    a worker that deletes (or replaces) everything in its scratch dir on exit leaves the
    host fault its console showed the verdict (was: fatal worker-failed)."""
    action = ('shutil.rmtree(entry) if entry.is_dir() else entry.unlink()' if how == "emptied"
              else '(entry.unlink(), entry.write_text("all good\\n")) if entry.is_file() else None')
    layout.write_worker(f"""
        print("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
              flush=True)
        for entry in SCRATCH.iterdir():
            {action}
        sys.exit(1)
    """)
    layout.write_payload()
    proc = _start(layout)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr.decode()[-3000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (True, "worker-host-fault"), marker
    assert b"fallen off the bus" in layout.artifact("console_sft.txt").read_bytes()


PIDS_ROOT = Path("/sys/fs/cgroup/pids")

#: A worker that forks 300 children, each leaving an orphaned grandchild that exits at
#: once; a fork the pids limit refuses is tried again (bounded), and the worker exits 7
#: only when all 300 went through.
FORKS_UNDER_A_LIMIT = '''
def one_orphan():
    # A child that leaves a grandchild behind; False when the pids limit refused a fork.
    try:
        child = os.fork()
    except BlockingIOError:  # EAGAIN: the pids limit
        return False
    if child == 0:
        try:
            if os.fork() == 0:
                os._exit(0)
        except BlockingIOError:
            os._exit(1)
        os._exit(0)
    return os.waitpid(child, 0)[1] == 0

refused = 0
for _ in range(300):
    for attempt in range(300):
        if one_orphan():
            break
        refused += 1
        time.sleep(0.01)  # a bounded retry, as a worker under a limit would
    else:
        print(f"forks refused for good after {refused} refusals", flush=True)
        sys.exit(9)
print(f"all forks done, {refused} refused on the way", flush=True)
sys.exit(7)
'''


@needs_pidns
def test_under_a_pids_limit_the_workers_orphans_do_not_eat_its_forks(layout: Layout) -> None:
    """A real pids cgroup, the runner PID 1 of its namespace: orphaned grandchildren reaped
    as they die leave the worker room to fork (unreaped, their zombies fill the limit and
    every fork after fails)."""
    group = PIDS_ROOT / f"flash-pids-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "pids.max").write_text("120")
    except OSError:
        pytest.skip("no writable cgroup v1 pids controller here")
    try:
        layout.write_worker(FORKS_UNDER_A_LIMIT)
        layout.write_payload()
        cmd = [*AS_PID_1, sys.executable, "-m", "fsm", *layout.run_args()]
        proc = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        out, stderr = proc.communicate(timeout=180)
        marker = layout.marker()
        assert marker is not None, stderr.decode()[-3000:]
        assert marker["worker"]["exit_code"] == 7, out.decode()[-2000:]
    finally:
        _empty_and_remove(group)
