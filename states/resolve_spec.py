"""ResolveSpec: find the job spec (inline or spilled to the store) and build the worker's
environment (CONTRACT section 5).

The worker is started with ``execve``, and Linux refuses (E2BIG) an environment string over
``MAX_ARG_STRLEN`` or argv plus environment over ``ARG_MAX`` (TRAPS, "Measured in the first
release"). So the spec goes inline only when it is small enough *and* the whole environment
then fits; otherwise it goes to the worker as a file. An environment that cannot fit even
then fails here, classified, naming the variable (never its value: it may be a secret),
instead of as an exec failure in Train. Everything is measured in bytes, as the kernel does.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from fsm import rules, table
from fsm.context import WORKER_ARGV, Context
from fsm.errors import FatalError, RetriableError, StoreNotFound, StoreUnavailable
from fsm.payload import Payload
from fsm.store.base import Store
from fsm.worker.console import progress_path

#: Larger specs (bytes of UTF-8) go to the worker as a file (CONTRACT section 5).
INLINE_SPEC_MAX_BYTES = 96_000
#: The kernel's cap on one argv or environment string, its NUL included (32 pages).
MAX_ARG_STRLEN = 131_072
#: Kept back from ``ARG_MAX`` for what the kernel puts on the new stack besides argv and
#: the environment (the executable's name, alignment) and for a conservative count.
ARG_MAX_MARGIN = 16 * 1024
#: The kernel never allows more than 3/4 of its 8 MiB default stack limit (``_STK_LIM``),
#: whatever ``sysconf`` derives from an unlimited stack rlimit.
_KERNEL_ARG_CAP = 6 * 1024 * 1024
#: What the kernel always allows (the legacy ``ARG_MAX``), when ``sysconf`` cannot say.
_MIN_ARG_MAX = 131_072
_POINTER = struct.calcsize("P")
#: The spec's two ways to the worker (inline or as a file): only the one chosen is set.
SPEC_VARS = ("FLASH_JOB_SPEC_JSON", "FLASH_JOB_SPEC_PATH")


def resolve_spec(ctx: Context) -> str:
    p = ctx.require_payload()
    spec = _spec(ctx, p)
    env = {k: v for k, v in ctx.merged_env().items() if k not in SPEC_VARS}
    assert p.phase is not None and p.seed is not None  # parse() requires both for training
    code_dir = ctx.settings.code_root / "code"
    env.update(
        {
            "PHASE": p.phase,
            "RUN_MODE": p.phase,
            "SEED": str(p.seed),
            "FLASH_ARM": p.dest.arm,
            "ATTEMPT": str(p.dest.attempt),
            "FLASH_RUN_DEADLINE_AT": f"{ctx.work_deadline.at:.3f}",
            "FLASH_SCRATCH_DIR": str(ctx.scratch),
            # Touched by a worker in a long silent phase: a sign of progress (CONTRACT 7).
            "FLASH_PROGRESS_FILE": str(progress_path(ctx)),
            "PYTHONPATH": os.pathsep.join(filter(None, (str(code_dir), env.get("PYTHONPATH")))),
        }
    )
    env.update(ctx.require_store().worker_env())
    argv = [ctx.python, *WORKER_ARGV]
    worker_env = {**env, "FLASH_JOB_SPEC_JSON": spec}
    if _nbytes(spec) > INLINE_SPEC_MAX_BYTES or exec_problem(argv, worker_env) is not None:
        spec_file = ctx.scratch / "job_spec.json"
        worker_env = {**env, "FLASH_JOB_SPEC_PATH": str(spec_file)}
        if (problem := exec_problem(argv, worker_env)) is not None:
            raise FatalError(problem, rule=rules.WORKER_ENV_TOO_LARGE)
        spec_file.write_text(spec, encoding="utf-8")
    ctx.worker_env = worker_env
    return table.SPEC_RESOLVED


def exec_problem(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why ``execve(argv[0], argv, env)`` would fail with E2BIG, in one line; None if it fits.

    Names the offending environment variable and the size of its value in bytes, never
    the value itself.
    """
    # No argument can be over MAX_ARG_STRLEN: argv is the interpreter's path (a path the
    # kernel can exec is under PATH_MAX) and WORKER_ARGV.
    # Each variable reaches the kernel as one "NAME=VALUE" string and its NUL.
    sizes = {name: _nbytes(value) for name, value in env.items()}
    entries = {name: _nbytes(name) + 1 + size + 1 for name, size in sizes.items()}
    for name, entry in entries.items():
        if entry > MAX_ARG_STRLEN:
            return (
                f"the worker's environment variable {name} holds {sizes[name]} "
                f"bytes; the kernel refuses any NAME=VALUE over {MAX_ARG_STRLEN - 1} bytes "
                "(MAX_ARG_STRLEN)"
            )
    # The executable's name is copied onto the new stack too.
    total = _nbytes(argv[0]) + 1 + sum(_nbytes(arg) + 1 + _POINTER for arg in argv)
    total += sum(entry + _POINTER for entry in entries.values()) + 2 * _POINTER  # NULL ends
    # The kernel's limit on argv plus environment (strings, NULs, pointers) for exec.
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):  # unknown: what the kernel always allows
        arg_max = -1
    limit = max(_MIN_ARG_MAX, min(arg_max, _KERNEL_ARG_CAP)) - ARG_MAX_MARGIN
    if total > limit:
        largest = max(entries, key=entries.__getitem__)  # the worker's env is never empty
        return (
            f"the worker's argv and environment are {total} bytes, over the kernel's limit of "
            f"{limit} bytes (ARG_MAX less a margin); the largest variable is {largest} "
            f"({sizes[largest]} bytes)"
        )
    return None


def _nbytes(text: str) -> int:
    """``text``'s size in bytes as exec receives it."""
    try:
        return len(os.fsencode(text))
    except UnicodeEncodeError:  # unencodable: exec would fail anyway; count it generously
        return len(text.encode("utf-8", "surrogatepass"))


def _spec(ctx: Context, p: Payload) -> str:
    if p.job_spec_json:
        return p.job_spec_json
    if not p.job_spec_in_hf:
        raise FatalError(
            "the payload carries no job spec: job_spec_json is empty and job_spec_in_hf is not set",
            rule=rules.SPEC_ABSENT,
        )
    if (branch := ctx.prefetch.pop(table.RESOLVE_SPEC, None)) is not None:
        text: str = branch.join()  # started by LoadPayload or FetchCode
        return text
    return download_spec(ctx, ctx.require_store())


def ahead(ctx: Context) -> Callable[[Store], str] | None:
    """A spilled spec's download, started ahead of this state (``table.PREFETCH``: by
    LoadPayload or FetchCode, beside the code's); None when the spec is inline."""
    p = ctx.require_payload()
    return partial(download_spec, ctx) if p.job_spec_in_hf and not p.job_spec_json else None


def download_spec(ctx: Context, store: Store) -> str:
    """The spilled spec's text from ``store``: this state's download, wherever it runs
    (here, or ahead of it as a prefetch branch)."""
    path = ctx.require_payload().dest.path("job_spec.json")
    try:
        local = store.download_file(path, ctx.scratch / "spilled_spec")
    except (StoreUnavailable, StoreNotFound) as exc:
        raise RetriableError(
            f"the spilled job spec {path} could not be fetched: {exc}", rule=rules.SPEC_FETCH
        ) from exc
    return local.read_text(encoding="utf-8", errors="replace")
