"""FetchCode: bring the worker's source tree (``code/**``) from the store to the code root.

When the run has extras, LoadPayload started this download already (``table.PREFETCH``,
through :func:`ahead`): the state then joins it, and its failure is raised (and
classified) here. Otherwise it starts a spilled spec's download (ResolveSpec joins it)
and fetches the code itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import partial

import structlog

from fsm import rules, table
from fsm.context import Context
from fsm.errors import FatalError
from fsm.store.base import Store

WORKER_MODULE = ("flash", "engine", "worker", "__main__.py")
log = structlog.get_logger("states.fetch_code")


def fetch_code(ctx: Context) -> str:
    if (branch := ctx.prefetch.pop(table.FETCH_CODE, None)) is not None:
        branch.join()  # started by LoadPayload, under the extras install
    else:
        ctx.start_ahead(table.FETCH_CODE)  # a spilled spec downloads beside the code
        fetch(ctx, ctx.require_store())
    return table.CODE_FETCHED


def ahead(ctx: Context) -> Callable[[Store], int]:
    """The code tree, downloaded ahead of this state (``table.PREFETCH``)."""
    return partial(fetch, ctx)


def fetch(ctx: Context, store: Store) -> int:
    """The code tree from ``store`` to the code root, checked: this state's work, wherever
    it runs (here, or ahead of it as a prefetch branch)."""
    code_root = ctx.settings.code_root
    # A restarted container may hold an older tree: start from a clean one.
    shutil.rmtree(code_root / "code", ignore_errors=True)
    code_root.mkdir(parents=True, exist_ok=True)
    count = store.fetch_folder("code", code_root)
    if not code_root.joinpath("code", *WORKER_MODULE).is_file():
        raise FatalError(
            f"the code tree has no worker module code/{'/'.join(WORKER_MODULE)}",
            rule=rules.CODE_MISSING,
        )
    log.info("code.fetched", files=count, code_root=str(code_root))
    return count
