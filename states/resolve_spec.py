"""ResolveSpec: find the job spec (inline or spilled to the store) and build the worker's
environment (CONTRACT section 5)."""

from __future__ import annotations

import os

from fsm import table
from fsm.context import Context
from fsm.errors import FatalError, RetriableError, StoreNotFound, StoreUnavailable
from fsm.payload import Payload

#: Larger specs go to the worker as a file: execve refuses environments this big.
INLINE_SPEC_MAX_CHARS = 96_000


def resolve_spec(ctx: Context) -> str:
    p = ctx.require_payload()
    spec = _spec(ctx, p)
    env = ctx.merged_env()
    env.pop("FLASH_JOB_SPEC_JSON", None)
    env.pop("FLASH_JOB_SPEC_PATH", None)
    if len(spec) > INLINE_SPEC_MAX_CHARS:
        spec_file = ctx.scratch / "job_spec.json"
        spec_file.write_text(spec, encoding="utf-8")
        env["FLASH_JOB_SPEC_PATH"] = str(spec_file)
    else:
        env["FLASH_JOB_SPEC_JSON"] = spec
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
            "PYTHONPATH": os.pathsep.join(
                [str(code_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            ),
        }
    )
    env.update(ctx.require_store().worker_env())
    ctx.worker_env = env
    return table.SPEC_RESOLVED


def _spec(ctx: Context, p: Payload) -> str:
    if p.job_spec_json:
        return p.job_spec_json
    if not p.job_spec_in_hf:
        raise FatalError(
            "the payload carries no job spec: job_spec_json is empty and job_spec_in_hf is not set",
            rule="spec-absent",
        )
    path = p.dest.path("job_spec.json")
    try:
        local = ctx.require_store().download_file(path, ctx.scratch / "spilled_spec")
    except (StoreUnavailable, StoreNotFound) as exc:
        raise RetriableError(
            f"the spilled job spec {path} could not be fetched: {exc}", rule="spec-fetch"
        ) from exc
    return local.read_text(encoding="utf-8", errors="replace")
