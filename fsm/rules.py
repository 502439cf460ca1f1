"""The failure rules as objects: everything decided from a rule travels with it.

A rule is what the marker's ``rule`` key names. It carries its class (retriable or
fatal), the exit event its state takes when the rule decides a failure, and the exit
status of the run once its marker is published. Handlers raise typed errors naming one of
these objects (``FatalError(..., rule=rules.CODE_MISSING)``); the driver and the runner
read the event and the exit status off the rule, and no code compares rule ids.

A leaf module (it imports only the table and the exit statuses): ``fsm.errors`` gives its
typed errors their default rules from here, and ``fsm.policy`` orders these rules and says
what else each one claims (exception types, HTTP statuses, pip signatures).
"""

from __future__ import annotations

from typing import Final, NamedTuple

from fsm import exits, table

ANY: Final = "*"

EXIT_FAILED: Final = exits.FAILED_FATAL.code
EXIT_RETRIABLE: Final = exits.FAILED_RETRIABLE.code


class Rule(NamedTuple):
    # A NamedTuple, not a dataclass: cheaper to define at start-up, immutable, hashable.
    id: str
    where: str  # a state of the table, or ANY
    what: str  # what the rule matches, in words
    retriable: bool
    #: the event the state takes when this rule decides its failure
    event: str
    #: the run's exit status once a marker of this rule is published
    exit_status: int = EXIT_FAILED

    @property
    def verdict(self) -> str:
        return "retriable" if self.retriable else "fatal"

    def applies_in(self, state: str) -> bool:
        return self.where in (ANY, state)


def _retriable(rule_id: str, where: str, what: str) -> Rule:
    return Rule(rule_id, where, what, True, table.FAILED_RETRIABLE_EVENT, EXIT_RETRIABLE)


def _fatal(rule_id: str, where: str, what: str, *, exit_status: int = EXIT_FAILED) -> Rule:
    return Rule(rule_id, where, what, False, table.FAILED_FATAL_EVENT, exit_status)


# The rules below repeat one shape (a name, ``_retriable``/``_fatal``, an id, a state, the
# words) on purpose: they are the policy's data, written as literals so that a reader sees
# every rule at once, and each is a module constant so that a handler names the rule it
# raises (``rules.CODE_MISSING``) and mypy and a rename find every use. A loop over a table
# of tuples would say the same with the names lost; fsm.policy orders them and renders the
# table the docs carry.
INTERRUPTED: Final = Rule(
    "interrupted", ANY,
    "a stop signal reached the runner: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGPWR or SIGXCPU "
    "(host stop, preemption)",
    True, table.INTERRUPTED, EXIT_RETRIABLE,
)
DEADLINE: Final = Rule(
    "deadline", ANY, "the attempt deadline passed: run wall deadline exceeded",
    False, table.DEADLINE_EXCEEDED, exits.DEADLINE.code,
)
PAYLOAD_INVALID: Final = _fatal(
    "payload-invalid", table.LOAD_PAYLOAD, "payload missing, unreadable or invalid (exit 2)",
    exit_status=exits.UNUSABLE.code,
)
HOST_GPU_MISSING: Final = _retriable(
    "host-gpu-missing", table.LOAD_PAYLOAD,
    "the payload's `expect_gpus` and the host disagree: `nvidia-smi --query-gpu` lists fewer "
    "GPUs, or is missing or failing (a short host; judged the moment it answers, setup "
    "stopped, the worker never started)",
)
HOST_GPU_UNHEALTHY: Final = _retriable(
    "host-gpu-unhealthy", ANY,
    "before the worker starts, a GPU reports uncorrectable ECC errors, pending page "
    "retirement or row remapping, or a row-remapping failure, or nvidia-smi reports it "
    "cannot reach it (setup stopped the moment it answered); or new uncorrectable ECC "
    "errors while the worker ran, seen on two looks (the host watch stopped it)",
)
HOST_GPU_UNRESPONSIVE: Final = _retriable(
    "host-gpu-unresponsive", ANY,
    "`nvidia-smi --query-gpu` gave no answer within FLASH_GPU_QUERY_S (default 60 s) before "
    "the worker started: the driver is not answering, and the worker could not use the GPUs "
    "either (killed with its process group; a slow answer within the bound is an answer)",
)
HOST_GPU_BUSY: Final = _retriable(
    "host-gpu-busy", ANY,
    "a GPU already holds more than 1 GiB of memory, or `--query-compute-apps` lists a "
    "compute process the attempt did not start (the previous tenant's leftover), before the "
    "worker starts; a slow or failing apps query makes no GPU busy",
)
HOST_STORAGE: Final = _retriable(
    "host-storage", ANY,
    "a write of the runner's own (code root, scratch, payload dir, cache) failed for the "
    "host's storage: read-only (EROFS), or full (ENOSPC, EDQUOT, no inode left) on a "
    "filesystem already short of room when the attempt started (FLASH_STORAGE_FLOOR_BYTES)",
)
HOST_STORAGE_FILLED: Final = _fatal(
    "host-storage-filled", ANY,
    "a write of the runner's own failed for a full filesystem (ENOSPC, EDQUOT, inodes) "
    "that had room when the attempt started: the attempt ran out of it, and a fresh host of "
    "the same shape runs out again",
)
#: The HTTP answers that mean the caller may not (fatal), and those worth another try
#: (retriable): a timeout (408), a conflict with a concurrent change to the repo (409: the
#: Hub's answer to two operations on one repo at once), too early (425), throttled (429),
#: and the server's own failures (5xx). One table for the store's own retries
#: (``fsm.hub.library.classify``) and the policy's reading of an untyped error's cause chain.
AUTH_STATUSES: Final = (401, 403)
TRANSIENT_STATUSES: Final = (408, 409, 425, 429, *range(500, 600))

STORE_AUTH: Final = _fatal("store-auth", ANY, "store answered HTTP 401 or 403")
STORE_REFUSED: Final = _fatal(
    "store-refused", ANY,
    "the store refused a request for good: the token cannot be sent in a header, the "
    "request is one it never takes (HTTP 4xx but 401, 403, 404 and those worth another "
    "try: 408, 409, 425, 429), or the repo's `.gitignore` ignores the file",
)
STORE_UNAVAILABLE: Final = _retriable(
    "store-unavailable", ANY,
    "store: connection error, timeout, HTTP 408/409/425/429/5xx after bounded retries",
)
PIP_NETWORK: Final = _retriable(
    "pip-network", table.INSTALL_EXTRAS,
    "the installer (pip or uv) failed and its output shows a network failure, after 3 tries",
)
PIP_FAILED: Final = _fatal(
    "pip-failed", table.INSTALL_EXTRAS,
    "the installer (pip or uv) failed otherwise (no such version, resolution or build "
    "error), or FLASH_INSTALLER names one that cannot run",
)
CODE_MISSING: Final = _fatal(
    "code-missing", table.FETCH_CODE, "the repo holds no code/ tree or no worker module"
)
STORE_NOT_FOUND: Final = _fatal(
    "store-not-found", ANY, "a path the runner needs is not in the store"
)
SPEC_ABSENT: Final = _fatal(
    "spec-absent", table.RESOLVE_SPEC, "neither an inline spec nor the spill flag"
)
SPEC_FETCH: Final = _retriable(
    "spec-fetch", table.RESOLVE_SPEC, "the spilled spec could not be fetched"
)
WORKER_LAUNCH: Final = _fatal(
    "worker-launch", table.TRAIN, "the worker process could not be started"
)
VERIFY_UNREADABLE: Final = _retriable(
    "verify-unreadable", table.VERIFY_REMOTE, "the store could not be read while verifying"
)
WORKER_HEARTBEAT_RETRIABLE: Final = _retriable(
    "worker-heartbeat-retriable", table.VERIFY_REMOTE,
    "no completion artifacts; the worker's heartbeat for this attempt says retriable",
)
WORKER_UPLOAD_LOST: Final = _retriable(
    "worker-upload-lost", table.VERIFY_REMOTE,
    "the worker wrote local metrics.json but the store lacks the completion artifacts",
)
WORKER_OOM_KILLED: Final = _fatal(
    "worker-oom-killed", table.VERIFY_REMOTE,
    "no completion artifacts; the cgroup's `oom_kill` count rose while the worker ran: host "
    "RAM exhausted (a fresh host of the same shape kills it again)",
)
WORKER_HOST_FAULT: Final = _retriable(
    "worker-host-fault", table.VERIFY_REMOTE,
    "no completion artifacts; the GPUs report a change since the start (a GPU gone from a "
    "listing that answered, one nvidia-smi cannot reach, new uncorrectable ECC errors; no "
    "answer is no change), which wins over the console; or the worker's last "
    "console lines show a GPU, driver or interconnect fault of the host, and no job fault",
)
HOST_GPU_LOST: Final = _retriable(
    "host-gpu-lost", table.VERIFY_REMOTE,
    "no completion artifacts; while the worker ran, nvidia-smi reported a GPU it cannot "
    "reach, or a listing that answered left a GPU out, on two looks a few seconds apart: the "
    "host watch stopped the worker (its stacks first); a look that does not answer decides "
    "nothing",
)
WORKER_STALLED: Final = _retriable(
    "worker-stalled", table.VERIFY_REMOTE,
    "no completion artifacts; the worker made no progress for FLASH_STALL_S (no console "
    "byte, no touch of FLASH_PROGRESS_FILE) and was stopped, its stacks taken first",
)
WORKER_STALLED_AGAIN: Final = _fatal(
    "worker-stalled-again", table.VERIFY_REMOTE,
    "no completion artifacts; the worker stalled, and the previous attempt of the run, on "
    "another host, stalled on the same line of the same file: the job hangs wherever it "
    "runs (the stalls' case of `fault-follows-job`)",
)
FAULT_FOLLOWS_JOB: Final = _fatal(
    "fault-follows-job", table.VERIFY_REMOTE,
    "no completion artifacts; a fault only the console or the worker witnessed (not the "
    "GPUs), the same fault (`fingerprint`) the previous attempt of the run ended retriable "
    "with on a host with another `id`: it came with the job (CONTRACT section 9)",
)
WORKER_FAILED: Final = _fatal(
    "worker-failed", table.VERIFY_REMOTE,
    "the worker exited without completion artifacts and without a sign of the host in its "
    "console or its GPUs, or with one of the job's own CUDA faults there; also when the "
    "console says CUDA sees no GPU and the job's own CUDA_VISIBLE_DEVICES names none the "
    "host has",
)
SUPERSEDED: Final = _retriable(
    "superseded", ANY,
    "renewing its lease, the runner found a later attempt of the run under the prefix (its "
    "lease or its marker, `<arm>_attempt<M>`, M > N): the control plane gave this attempt up "
    "and moved on, so the worker was killed at once and nothing of this attempt but its "
    "marker lands after that (CONTRACT section 10)",
)
STORE_UNSAFE_LINK: Final = _fatal(
    "store-unsafe-link", ANY,
    "a store entry is a link that leaves the store's root, or a dangling link",
)
WORKER_ENV_TOO_LARGE: Final = _fatal(
    "worker-env-too-large", table.RESOLVE_SPEC,
    "the worker's environment exceeds the kernel's exec limits (one variable over "
    "128 KiB, or the whole environment over ARG_MAX)",
)
PRELOAD_UNMOUNTED: Final = _fatal(
    "preload-unmounted", table.PRELOAD,
    "the weight cache is not mounted or its sentinel is missing",
)
PRELOAD_MODEL_FAILED: Final = _fatal(
    "preload-model-failed", table.PRELOAD, "a model could not be warmed"
)
INTERNAL_ERROR: Final = _fatal(
    "internal-error", ANY,
    "a defect in the runner: a handler returned an event its state does not allow, a "
    "state has no handler, or Mark itself failed",
)
UNCLASSIFIED: Final = _fatal(
    "unclassified", ANY, "anything else: exception type and message in the marker"
)

#: Not a failure rule: what a succeeded attempt's marker names.
SUCCESS: Final = Rule(
    "completion-confirmed", table.VERIFY_REMOTE,
    "`DONE` and `metrics.json` confirmed in the store, whatever the worker's exit code",
    False, table.COMPLETION_CONFIRMED, exits.SUCCEEDED.code,
)
