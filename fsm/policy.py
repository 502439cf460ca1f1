"""The failure policy: which failures are retried on a fresh host and which fail the run.

Rules are objects (``fsm.rules``): each has a stable id (carried into the marker), the
state where it applies (``*`` for any), its class, its exit event and the run's exit
status. This module orders them and says what else each claims. ``classify`` walks the
rules in order and the first rule that claims the failure decides; the catch-all last
rule makes a failure nobody classified fatal, never silently retried.

A rule claims a failure when

* the failure is a typed error (``RetriableError``/``FatalError``) naming the rule:
  the handler that raised it knew the class (wherever it was raised); or, in a state
  where the rule applies,
* the failure is an instance of one of the rule's exception types; or
* the failure carries no known rule and an HTTP status on it or on its cause chain
  (``exc.response.status_code``, ``exc.status_code`` or ``exc.status``) is one of the
  rule's statuses: an untyped HTTP error is classified by its status in any state.

``flash-bootstrap policy`` prints this table; the README's failure section is generated
from it (``python -m fsm policy``) and a test proves it current.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from fsm import rules
from fsm.errors import (
    DeadlineExceeded,
    FlashError,
    Interrupted,
    PayloadError,
    StoreAuthError,
    StoreNotFound,
    StoreRefused,
    StoreUnavailable,
)
from fsm.installer import UV_NETWORK_SIGNATURES
from fsm.pip import NETWORK_SIGNATURES
from fsm.rules import ANY, Rule

__all__ = ["ANY", "CATCH_ALL", "RULES", "SUCCESS", "Rule", "claim", "classify", "rule"]

#: How far down ``__cause__``/``__context__`` an HTTP status is looked for.
MAX_CHAIN = 16

AUTH_STATUSES: tuple[int, ...] = (401, 403)
UNAVAILABLE_STATUSES: tuple[int, ...] = (408, 429, *range(500, 600))


class Claim(NamedTuple):
    """What a rule claims besides the typed errors that name it."""

    #: exception types this rule claims (in the states where it applies)
    matches: tuple[type[BaseException], ...] = ()
    #: HTTP statuses this rule claims on an untyped error or anywhere on its cause chain
    statuses: tuple[int, ...] = ()
    #: names of the pip output signatures (``fsm.pip.NETWORK_SIGNATURES``) behind the rule
    signatures: tuple[str, ...] = ()
    #: ids of the worker console signatures (``CONSOLE_SIGNATURES``) behind the rule
    console: tuple[str, ...] = ()


# --- the worker's console: host faults and the job's own faults -----------------------


class Signature(NamedTuple):
    """A line of a failed worker's console that says who is at fault."""

    id: str
    #: ``gpu``, ``driver`` or ``interconnect`` for the host's faults; ``job`` for the job's,
    #: and ``shm``, ``disk``, ``nccl-timeout`` for families whose words name no cause by
    #: themselves (decided as ``HOST_EVIDENCE`` says)
    family: str
    pattern: str
    meaning: str
    #: True: the host is at fault (``worker-host-fault``, retried on a fresh host);
    #: False: the job is, and fails on any host (``worker-failed``)
    retriable: bool
    #: a consequence rather than a cause (an NCCL watchdog's timeout): it decides only when
    #: no other row matches, so a host row beside it (an InfiniBand error) wins
    weak: bool = False


def _job(sig_id: str, pattern: str, meaning: str, *, family: str = "job",
         weak: bool = False) -> Signature:
    return Signature(sig_id, family, pattern, meaning, False, weak)


def _host(sig_id: str, family: str, pattern: str, meaning: str) -> Signature:
    return Signature(sig_id, family, pattern, meaning, True)


#: NVIDIA Xid codes of hardware, driver-firmware or fabric faults; the application Xids
#: (13, 31, 43, 45: a kernel's own exception, page fault, stop, preemption) are not here.
#: 154 is the driver's "GPU recovery action changed" (a GPU reset or node reboot required);
#: 144-150 are NVLink5's link errors (SAW, RLW, TLW, TREX, NVLPW, NETIR, MSE: NVIDIA/nccl#2241).
HOST_XIDS = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 144, 145, 146, 147, 148, 149,
             150, 154)

#: Matched (case-insensitively) against a failed worker's console, NCCL's INFO lines
#: aside. The job's rows come first and win: a job fault anywhere in the examined lines
#: makes the console's verdict fatal, whatever host rows match too (one rank's CUDA OOM
#: makes the others report NCCL errors). Among host rows the last matching line decides.
CONSOLE_SIGNATURES: tuple[Signature, ...] = (
    _job("cuda-oom", r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory",
         "the job asked its GPU for more memory than it has"),
    _job("device-side-assert", r"device-side assert(?:ion)? triggered",
         "a CUDA kernel's assertion failed (bad indices or labels)"),
    _job("illegal-memory-access", r"illegal memory access",
         "a CUDA kernel read or wrote out of bounds"),
    _job("nccl-collective-mismatch",
         r"collective mismatch error|Message truncated : receiv(?:ed|ing) \d+ bytes instead "
         r"of \d+",
         "NCCL: the ranks disagree on a collective, its sizes or their configuration (invalid "
         "usage: NVIDIA/nccl#969, #1176)"),
    _job("shm-exhausted",
         r"insufficient shared memory \(shm\)|out of shared memory\. Please try to raise your "
         r"shared memory limit|Error while creating shared memory segment|failed to extend "
         r"/dev/shm|/dev/shm[^\n]*No space left on device|posix_fallocate failed[^\n]*No space "
         r"left on device|unable to write to file </torch_",
         "shared memory (/dev/shm) ran out: the container's size for it, the same on every "
         "host the run is sent to, or the job's own use (DataLoader workers, NCCL segments)",
         family="shm"),
    _job("disk-full",
         r"No space left on device|\[Errno 28\]|\bENOSPC\b|Disk quota exceeded|\bEDQUOT\b"
         r"|PytorchStreamWriter failed writing file",
         "a filesystem ran out of space or quota; the job's fault unless the host's scratch or "
         "cache filesystem was already short before setup (see the host evidence below)",
         family="disk"),
    _job("nccl-timeout",
         r"Watchdog caught collective operation timeout|Some NCCL operations have failed or "
         r"timed out|ProcessGroupNCCL[^\n]*\bTimeout at NCCL work\b",
         "an NCCL collective timed out (the watchdog): mostly a rank that stopped calling it "
         "(unequal batches, a rank-0-only step, a dataset scan), a consequence that decides "
         "only when no host row matches",
         family="nccl-timeout", weak=True),
    _host("gpu-ecc-uncorrectable", "gpu", r"uncorrectable ECC error(?!s?\s*[:=]\s*0\b)",
          "the GPU's memory has an uncorrectable ECC error"),
    _host("gpu-fallen-off-bus", "gpu", r"fallen off the bus",
          "the GPU stopped answering on PCIe"),
    _host("gpu-lost", "gpu", r"GPU is lost", "the driver lost the GPU (reboot needed)"),
    _host("nvml-device-handle", "gpu",
          r"Unable to determine the device handle for GPU(?![^\n]*GPU is lost)",
          "NVML (nvidia-smi) can no longer reach a GPU: gone from the bus or wedged in the "
          "driver"),
    _host("cuda-contained", "gpu",
          r"Invalid access of peer GPU memory over nvlink or a hardware error"
          r"|\bcudaErrorContained\b|\bCUDA_ERROR_CONTAINED\b",
          "CUDA's contained hardware error (cudaErrorContained): an HBM or NVLink fault the "
          "GPU contained, the context is lost"),
    _host("nvrm-xid", "gpu",
          r"\bXid\b\s*(?:\([^)\n]*\))?\s*:?\s*(?:"
          + "|".join(str(x) for x in HOST_XIDS) + r")\b",
          "the kernel driver reported a hardware Xid (" + ", ".join(map(str, HOST_XIDS)) + ")"),
    _host("cuda-no-gpus", "driver", r"No CUDA GPUs are available",
          "CUDA sees no GPU in a container started with GPUs"),
    _host("cuda-no-device", "driver", r"no CUDA-capable device is detected",
          "CUDA sees no GPU in a container started with GPUs"),
    _host("cuda-driver-too-old", "driver",
          r"CUDA driver version is insufficient for CUDA runtime version"
          r"|The NVIDIA driver on your system is too old"
          r"|nvidia-container-cli: requirement error: unsatisfied condition: cuda>=",
          "the host's driver is older than the image's CUDA (hosts of a fleet differ in "
          "driver; a fresh host may have a newer one)"),
    _host("cuda-unknown-init", "driver",
          r"CUDA unknown error - this may be due to an incorrectly set up environment"
          r"|failed call to cuInit: CUDA_ERROR_UNKNOWN",
          "CUDA could not start (error 999, CUDA_ERROR_UNKNOWN): the driver's state is broken "
          "(nvidia_uvm lost, after a suspend or a driver fault); a reset or reboot cures it"),
    _host("nvml-init-failed", "driver", r"Failed to initialize NVML",
          "NVML cannot talk to the driver"),
    _host("container-nvml-error", "driver",
          r"nvidia-container-cli: detection error: nvml error",
          "the NVIDIA container runtime cannot reach the GPUs through NVML: the host's driver "
          "or NVML is broken"),
    _host("nvml-no-devices", "driver", r"^\s*No devices were found\s*$",
          "nvidia-smi lists no GPU (NVML sees none) in a container started with GPUs"),
    _host("driver-library-mismatch", "driver", r"Driver/library version mismatch",
          "the loaded kernel driver and the user-space library differ (driver upgraded "
          "without a reboot)"),
    _host("smi-no-driver", "driver",
          r"NVIDIA-SMI has failed because it couldn'?t communicate with the NVIDIA driver",
          "nvidia-smi finds no working NVIDIA kernel driver (not loaded, or lost with a "
          "kernel update)"),
    _host("nvrm-no-gpu", "driver",
          r"NVRM: No NVIDIA graphics adapter probed|NVRM: The NVIDIA probe routine was not "
          r"called",
          "the kernel driver found no NVIDIA GPU to drive"),
    _host("cuda-forward-compat", "driver",
          r"forward compatibility was attempted on non supported HW",
          "CUDA's forward-compatibility libraries on a GPU or driver that does not support "
          "them (error 804): the host's driver is too old for the image's CUDA"),
    _host("cuda-system-not-ready", "interconnect",
          r"(?:\b802\b|\bCUDA\b)[^\n]*?system not yet initialized"
          r"|\bcudaErrorSystemNotReady\b|\bCUDA_ERROR_SYSTEM_NOT_READY\b",
          "CUDA error 802: the NVSwitch fabric is not initialized (the host's fabric manager "
          "is not running)"),
    _host("nvls-fabric", "interconnect",
          r"Failed to bind NVLink SHARP \(NVLS\) Multicast memory"
          r"|error in the Fabric Manager or NVSwitches",
          "NCCL: NVLink SHARP multicast failed: the Fabric Manager or the NVSwitches are in a "
          "bad state"),
    _host("nccl-nvls-invalid-argument", "interconnect",
          r"transport/nvls\.cc:\d+ NCCL WARN Cuda failure (?:\d+ )?'invalid argument'",
          "NCCL: NVLink SHARP setup refused by the fabric (the fabric manager restarted while "
          "GPUs held resources): the node needs a GPU reset or reboot"),
    _host("nccl-graph-mismatch", "interconnect",
          r"NCCL WARN XML Import Channel : dev \d+ not found",
          "NCCL: the topology or graph file the node image sets (NCCL_GRAPH_FILE) names GPUs "
          "or NICs the host does not have"),
    _host("nccl-system-error", "interconnect", r"unhandled system error|ncclSystemError",
          "NCCL: a system call, the device or the fabric failed"),
    _host("nccl-cuda-error", "gpu", r"\bunhandled cuda error\b|\bncclUnhandledCudaError\b",
          "NCCL: a CUDA call under it failed, the GPU or its driver faulted (a job's own bad "
          "kernel shows its own row, which wins)"),
    _host("nccl-network", "interconnect",
          r"NET/(?:IB|Socket|OFI)\b[^\n]*?\b(?:error|errors|fail|failed|failure|closed"
          r"|timeout|timed out)\b|ncclRemoteError|\bibv_\w+ failed",
          "NCCL: the network or InfiniBand transport failed"),
    _host("ib-completion-error", "interconnect",
          r"\bNET/IB\w*\s*:\s*Got completion\b[^\n]*?\bwith status=\d+"
          r"|\bNET/IB\w+\s*:\s*Got completion\b",
          "NCCL (2.19 and later, or an IB net plugin): an InfiniBand work request completed "
          "with an error status (12: retries exceeded, the peer's NIC unreachable)"),
    _host("ib-retry-exceeded", "interconnect",
          r"\bIBV_WC_RETRY_EXC_ERR\b|\btransport retry count(?:er)? exceeded\b",
          "libibverbs/UCX: the InfiniBand or RoCE transport's retry counter was exceeded "
          "(IBV_WC_RETRY_EXC_ERR): the link or the fabric dropped the traffic"),
)
#: Only the console's last lines are examined: what scrolled out did not end the worker.
CONSOLE_WINDOW_LINES = 200
#: The evidence shows at most this much of the deciding line.
EVIDENCE_LINE_CHARS = 300

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
#: NCCL's informational lines (``NCCL_DEBUG=INFO``) report, they never fail: a healthy
#: start prints "NET/Plugin: Failed to find ncclNetPlugin_v8 symbol" and the like.
_INFO = re.compile(r"\bNCCL INFO\b")


class ConsoleMatch(NamedTuple):
    signature: Signature
    #: the deciding line, stripped and cut to ``EVIDENCE_LINE_CHARS`` around the match
    line: str

    def evidence(self) -> dict[str, str]:
        return {"signature": self.signature.id, "line": self.line}


@functools.cache
def _compiled() -> tuple[re.Pattern[str], tuple[re.Pattern[str], ...]]:
    """Compiled on first use (start-up does not pay for it): one pattern that finds the
    lines worth a look, and each row's own in table order."""
    rows = tuple(re.compile(sig.pattern, re.IGNORECASE) for sig in CONSOLE_SIGNATURES)
    anyone = re.compile("|".join(f"(?:{sig.pattern})" for sig in CONSOLE_SIGNATURES),
                        re.IGNORECASE)
    return anyone, rows


def console_verdict(tail: str) -> ConsoleMatch | None:
    """What the console's last ``CONSOLE_WINDOW_LINES`` lines say: a job fault if any line
    shows one (fatal rows win), else the last line showing a host fault, else the first
    weak row's line (a consequence such as an NCCL timeout), else None."""
    anyone, rows = _compiled()
    lines = _LINE_BREAK.split(tail)
    if lines and lines[-1] == "":
        lines.pop()
    job: ConsoleMatch | None = None
    host: ConsoleMatch | None = None
    weak: ConsoleMatch | None = None
    for line in lines[-CONSOLE_WINDOW_LINES:]:
        if anyone.search(line) is None or _INFO.search(line):
            continue
        for sig, row in zip(CONSOLE_SIGNATURES, rows, strict=True):
            found = row.search(line)
            if found is None:
                continue
            match = ConsoleMatch(sig, _shown_line(line, found.start()))
            if sig.weak:
                weak = weak or match
            elif sig.retriable:
                host = match
            elif job is None:
                job = match
            break
    return job or host or weak


def _shown_line(line: str, at: int) -> str:
    """The line around position ``at``, stripped, at most ``EVIDENCE_LINE_CHARS`` long."""
    text = line.strip()
    if len(text) <= EVIDENCE_LINE_CHARS:
        return text
    at -= len(line) - len(line.lstrip())  # where the match is in the stripped text
    start = max(0, min(at - 60, len(text) - EVIDENCE_LINE_CHARS))
    return text[start:start + EVIDENCE_LINE_CHARS]


class WorkerFacts(NamedTuple):
    """What is known of a worker that ended without its completion artifacts."""

    #: its own heartbeat for this attempt says ``retriable: true`` (its verdict wins)
    heartbeat_retriable: bool = False
    #: it wrote metrics.json locally, but the store lacks the completion artifacts
    upload_lost: bool = False
    #: the memory cgroup's ``oom_kill`` count rose while it ran
    oom_killed: bool = False
    #: its console's tail, redacted
    console: str = ""
    #: the runner stopped it: no progress for FLASH_STALL_S (its exit was not its own)
    stalled: bool = False
    #: the previous attempt of the run stalled in the same function of the same file
    stalled_before: bool = False
    #: the GPUs changed since the start (a GPU gone or out of reach, new uncorrectable ECC)
    gpus_changed: bool = False
    #: the job's own CUDA_VISIBLE_DEVICES names no GPU the host has
    env_hides_gpus: bool = False
    #: nvidia-smi answered before setup and after the worker died, every GPU the same
    gpus_fine: bool = False
    #: a scratch or cache filesystem was already short of space before setup
    disk_short_at_start: bool = False


def judge_worker(facts: WorkerFacts) -> tuple[Rule, ConsoleMatch | None]:
    """The rule for a worker without completion artifacts, and the console line that
    decided (or, for ``worker-failed``, the job fault it showed), if any.

    A worker the runner stopped as stalled did not end on its own: its heartbeat and its
    local metrics.json describe an attempt that never finished. What stalled it decides
    when something shows it (a kernel OOM kill of one of its processes; a host or a job
    fault in its console: one rank's CUDA OOM leaves the others waiting); otherwise the
    stall does, fatal when the previous attempt stalled in the same place."""
    if facts.stalled:
        if facts.oom_killed:
            return rules.WORKER_OOM_KILLED, None
        if facts.gpus_changed:
            return rules.WORKER_HOST_FAULT, None
        match = console_verdict(facts.console)
        if match is not None:
            return (rules.WORKER_HOST_FAULT if _the_hosts(match, facts)
                    else rules.WORKER_FAILED), match
        return (rules.WORKER_STALLED_AGAIN if facts.stalled_before
                else rules.WORKER_STALLED), None
    if facts.heartbeat_retriable:
        return rules.WORKER_HEARTBEAT_RETRIABLE, None
    if facts.upload_lost:
        return rules.WORKER_UPLOAD_LOST, None
    if facts.oom_killed:
        return rules.WORKER_OOM_KILLED, None
    if facts.gpus_changed:  # the GPUs know better than the console (a job fault included)
        return rules.WORKER_HOST_FAULT, None
    match = console_verdict(facts.console)
    if match is not None and _the_hosts(match, facts):
        return rules.WORKER_HOST_FAULT, match
    return rules.WORKER_FAILED, match


#: Console rows that say CUDA sees no GPU: the job's own doing too, when the GPUs are fine.
NO_GPU_SIGNATURES = frozenset(
    {"cuda-no-gpus", "cuda-no-device", "cuda-unknown-init", "nvml-no-devices"})


class Evidence(NamedTuple):
    """A row of the policy where the host's own evidence decides beside the console."""

    #: the console rows it applies to (``*``: whatever the console says)
    console: str
    #: the evidence, in words
    when: str
    #: ``host`` (``worker-host-fault``, retriable) or ``job`` (``worker-failed``, fatal)
    verdict: str
    why: str


#: How the GPUs' answers and the host's own facts decide beside the console (issue 24):
#: ``judge_worker`` applies them in this order; ``render_table`` prints them.
HOST_EVIDENCE: tuple[Evidence, ...] = (
    Evidence("*", "the GPUs changed since before setup: a GPU gone or out of NVML's reach, "
             "or new uncorrectable ECC errors (asked again after the worker died)", "host",
             "a sick GPU makes any job fail, in words of the job's own (an ECC error "
             "surfacing as a CUDA OOM, kubernetes/k8s-device-plugin#267): the GPUs win"),
    Evidence(", ".join(f"`{i}`" for i in sorted(NO_GPU_SIGNATURES)),
             "the job's own `CUDA_VISIBLE_DEVICES` (payload `env`) names no GPU the host has",
             "job", "the job hid the GPUs from itself: it would on any host"),
    Evidence(", ".join(f"`{i}`" for i in sorted(NO_GPU_SIGNATURES)),
             "nvidia-smi answered before setup and after the worker died, every GPU the same",
             "job", "the GPUs were there and fine: something inside the job hid them (a "
             "scheduler's own placement, ray-project/ray#37225)"),
    Evidence("`disk-full`", "a filesystem of the scratch, code, payload or cache directory "
             "had less than `FLASH_STORAGE_FLOOR_BYTES` (256 MiB) or no inode free before "
             "setup, as for the runner's own writes (`host-storage`)", "host",
             "the host came full (a previous tenant's files): a fresh host has the space"),
    Evidence("`disk-full`", "otherwise (the filesystems had room before setup, or are "
             "unknown)", "job", "the attempt wrote the disk full; a fresh host of the same "
             "kind has the same disk"),
    Evidence("`shm-exhausted`", "always; the marker's `shm` evidence gives /dev/shm's size",
             "job", "/dev/shm is the container's configuration (Docker's default is 64 MiB), "
             "the same on every host the run is sent to, or the job's own use: a fresh host "
             "changes nothing (13 of 15 threads of the corpus settled it so)"),
    Evidence("`nccl-timeout`", "no host row matched", "job", "by Meta's account most "
             "collective timeouts start on the CPU side: a rank that stopped calling the "
             "collective (every such thread of the corpus settled it in the job)"),
    Evidence("`cuda-driver-too-old`", "always", "host", "the hosts of a rented fleet differ "
             "in driver; a fresh host may have a newer one (10 of 12 threads of the corpus "
             "settled it as the host's driver), and the control plane's retry cap bounds "
             "the rest"),
)


def _the_hosts(match: ConsoleMatch, facts: WorkerFacts) -> bool:
    """Whether a console row's fault is the host's, the host's own evidence considered
    (``HOST_EVIDENCE``)."""
    sig = match.signature
    if sig.id in NO_GPU_SIGNATURES:
        return not (facts.env_hides_gpus or facts.gpus_fine)
    if sig.id == "disk-full":
        return facts.disk_short_at_start
    return sig.retriable


def _console_ids(*, retriable: bool) -> tuple[str, ...]:
    return tuple(sig.id for sig in CONSOLE_SIGNATURES if sig.retriable is retriable)


#: The rules in the order they are tried, each with what it claims.
_TABLE: tuple[tuple[Rule, Claim], ...] = (
    (rules.INTERRUPTED, Claim((Interrupted, KeyboardInterrupt))),
    (rules.DEADLINE, Claim((DeadlineExceeded,))),
    (rules.PAYLOAD_INVALID, Claim((PayloadError,))),
    (rules.HOST_GPU_MISSING, Claim()),
    (rules.HOST_GPU_UNHEALTHY, Claim()),
    (rules.HOST_GPU_UNRESPONSIVE, Claim()),
    (rules.HOST_GPU_BUSY, Claim()),
    (rules.HOST_STORAGE, Claim()),
    (rules.HOST_STORAGE_FILLED, Claim()),
    (rules.STORE_AUTH, Claim((StoreAuthError,), AUTH_STATUSES)),
    (rules.STORE_REFUSED, Claim((StoreRefused,))),
    (rules.STORE_UNAVAILABLE, Claim((StoreUnavailable,), UNAVAILABLE_STATUSES)),
    (rules.PIP_NETWORK, Claim(signatures=tuple(sig.name for sig in NETWORK_SIGNATURES))),
    (rules.PIP_FAILED, Claim()),
    (rules.CODE_MISSING, Claim((StoreNotFound,))),
    (rules.STORE_NOT_FOUND, Claim((StoreNotFound,))),
    (rules.SPEC_ABSENT, Claim()),
    (rules.SPEC_FETCH, Claim()),
    (rules.WORKER_LAUNCH, Claim((OSError,))),
    (rules.VERIFY_UNREADABLE, Claim()),
    (rules.WORKER_HEARTBEAT_RETRIABLE, Claim()),
    (rules.WORKER_UPLOAD_LOST, Claim()),
    (rules.WORKER_OOM_KILLED, Claim()),
    (rules.WORKER_HOST_FAULT, Claim(console=_console_ids(retriable=True))),
    (rules.HOST_GPU_LOST, Claim()),
    (rules.WORKER_STALLED, Claim()),
    (rules.WORKER_STALLED_AGAIN, Claim()),
    (rules.WORKER_FAILED, Claim(console=_console_ids(retriable=False))),
    (rules.STORE_UNSAFE_LINK, Claim()),
    (rules.WORKER_ENV_TOO_LARGE, Claim()),
    (rules.PRELOAD_UNMOUNTED, Claim()),
    (rules.PRELOAD_MODEL_FAILED, Claim()),
    (rules.INTERNAL_ERROR, Claim()),
    (rules.UNCLASSIFIED, Claim((BaseException,))),
)

RULES: tuple[Rule, ...] = tuple(r for r, _ in _TABLE)
_CLAIMS: dict[Rule, Claim] = dict(_TABLE)
BY_ID: dict[str, Rule] = {r.id: r for r in RULES}
CATCH_ALL = rules.UNCLASSIFIED
SUCCESS = rules.SUCCESS


def rule(rule_id: str) -> Rule:
    """The rule with this id (a persisted marker names its rule by id); KeyError if none."""
    return SUCCESS if rule_id == SUCCESS.id else BY_ID[rule_id]


def claim(r: Rule) -> Claim:
    """What ``r`` claims besides the typed errors that name it."""
    return _CLAIMS[r]


def named_rule(exc: BaseException) -> Rule | None:
    """The rule of the policy a typed error names, if it names one."""
    if isinstance(exc, FlashError) and exc.rule in _CLAIMS:
        return exc.rule
    return None


def claims(r: Rule, state: str, exc: BaseException) -> bool:
    """Whether ``r`` decides ``exc`` raised in ``state`` (order aside)."""
    named = named_rule(exc)
    if named is r:
        return True
    if not r.applies_in(state):
        return False
    what = _CLAIMS[r]
    if what.matches and isinstance(exc, what.matches):
        return True
    if what.statuses and named is None:
        return http_status(exc) in what.statuses
    return False


def http_status(exc: BaseException) -> int | None:
    """The first HTTP status found on ``exc`` or down its ``__cause__``/``__context__``
    chain: ``.response.status_code``, ``.status_code`` or ``.status``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(current))
        status = _status_of(current)
        if status is not None:
            return status
        current = current.__cause__ if current.__cause__ is not None else current.__context__
    return None


def _status_of(exc: BaseException) -> int | None:
    candidates: list[object] = []
    try:
        candidates.append(getattr(getattr(exc, "response", None), "status_code", None))
        candidates.append(getattr(exc, "status_code", None))
        candidates.append(getattr(exc, "status", None))
    except Exception:  # a property that raises: no status to be had from this one
        return None
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def classify(state: str, exc: BaseException) -> Rule:
    """The rule that decides ``exc`` raised in ``state``: the first rule that claims it.

    Total: every exception gets a rule, and the catch-all (fatal) when nothing else
    claims it. A typed error naming a rule the policy lacks is matched like an untyped
    one (so it ends fatal, never silently retried).
    """
    for candidate in RULES:
        try:
            if claims(candidate, state, exc):
                return candidate
        except Exception:  # pragma: no cover - claims() only reads attributes
            continue
    return CATCH_ALL  # pragma: no cover - the catch-all claims every BaseException


# --- the printed table ------------------------------------------------------------------


def _statuses_text(statuses: tuple[int, ...]) -> str:
    plain = [str(s) for s in statuses if not 500 <= s <= 599]
    if all(s in statuses for s in range(500, 600)):
        plain.append("5xx")
    else:
        plain += [str(s) for s in statuses if 500 <= s <= 599]
    return "HTTP " + ", ".join(plain)


def _matched_by(r: Rule) -> str:
    what = _CLAIMS[r]
    parts: list[str] = []
    if r is CATCH_ALL:
        parts.append("any exception")
    else:
        parts += [f"`{t.__name__}`" for t in what.matches]
    if what.statuses:
        parts.append(_statuses_text(what.statuses))
    if what.signatures:
        parts.append("pip output: " + ", ".join(f"`{name}`" for name in what.signatures))
    if what.console:
        parts.append("worker console: " + ", ".join(f"`{name}`" for name in what.console))
    return "; ".join(parts) or "raised by the state's handler"


def _cell(text: str) -> str:
    """``text`` inside a Markdown table cell (a bare ``|`` would end the cell)."""
    return text.replace("|", "\\|")


def render_table() -> str:
    """The policy as Markdown (printed by ``flash-bootstrap policy``, pasted in the README).

    First match wins, top to bottom; a typed error naming a rule is decided by that rule.
    """
    lines = [
        "Rules are tried top to bottom; the first that claims the failure decides. An error",
        "raised by a state naming a rule is decided by that rule; otherwise a rule claims a",
        "failure in the states where it applies by its type, or an untyped error by the HTTP",
        "status on it or its cause chain. The last rule catches everything else: fatal.",
        "",
        "| rule | where | what | matched by | class |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{r.id}` | {'any' if r.where == ANY else r.where} | {r.what} | {_matched_by(r)} "
        f"| {r.verdict} |"
        for r in RULES
    ]
    lines += [
        "",
        f"Success (rule `{SUCCESS.id}`): {SUCCESS.what}.",
        "",
        "Installer output signatures of a network failure (`pip-network`): pip's when pip ran,",
        "uv's when uv did (`FLASH_INSTALLER`, README \"Extra packages\"); a failed install whose",
        "output shows none of them is `pip-failed`. pip (console and verbose log):",
        "",
        "| signature | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{sig.name}` | {sig.meaning} |" for sig in NETWORK_SIGNATURES]
    lines += [
        "",
        "uv (`uv pip install`, its console):",
        "",
        "| signature | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{sig.name}` | {sig.meaning} |" for sig in UV_NETWORK_SIGNATURES]
    lines += [
        "",
        "Worker console signatures, matched in the last "
        f"{CONSOLE_WINDOW_LINES} lines of the redacted console of a worker",
        "that ended without completion artifacts, without a retriable heartbeat, a lost",
        "upload or an OOM kill. A `job` row anywhere in those lines wins (fatal, the job's",
        "own fault, on any host); otherwise the last line matching a host row decides",
        "(`worker-host-fault`, retried on a fresh host); a weak row (`nccl-timeout`, a",
        "consequence) decides only when no other row matches. The marker's `host_fault` (or",
        "`job_fault`) evidence names the row and the line. The host's own evidence then",
        "decides beside the console as the table after this one says.",
        "",
        "| signature | family | pattern | meaning | class |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{sig.id}` | {sig.family} | `{_cell(sig.pattern)}` | {sig.meaning} | "
        f"{'retriable' if sig.retriable else 'fatal'} |"
        for sig in CONSOLE_SIGNATURES
    ]
    lines += [
        "",
        "The host's own evidence beside the console (CONTRACT section 8), in this order; the",
        "first row that applies decides:",
        "",
        "| when | console | verdict | why |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {_cell(row.when)} | {_cell(row.console) if row.console != '*' else 'any'} | "
        f"{'`worker-host-fault`, retriable' if row.verdict == 'host' else '`worker-failed`, fatal'}"
        f" | {_cell(row.why)} |"
        for row in HOST_EVIDENCE
    ]
    return "\n".join(lines)
