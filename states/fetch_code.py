"""FetchCode: bring the worker's source tree (``code/**``) from the store to the code root."""

from __future__ import annotations

import shutil

import structlog

from fsm import rules, table
from fsm.context import Context
from fsm.errors import FatalError

WORKER_MODULE = ("flash", "engine", "worker", "__main__.py")
log = structlog.get_logger("states.fetch_code")


def fetch_code(ctx: Context) -> str:
    code_root = ctx.settings.code_root
    # A restarted container may hold an older tree: start from a clean one.
    shutil.rmtree(code_root / "code", ignore_errors=True)
    code_root.mkdir(parents=True, exist_ok=True)
    count = ctx.require_store().fetch_folder("code", code_root)
    worker = code_root.joinpath("code", *WORKER_MODULE)
    if not worker.is_file():
        raise FatalError(
            f"the code tree has no worker module code/{'/'.join(WORKER_MODULE)}",
            rule=rules.CODE_MISSING,
        )
    log.info("code.fetched", files=count, code_root=str(code_root))
    return table.CODE_FETCHED
