"""InstallExtras: install the run's ``extra_pip`` requirements before anything else."""

from __future__ import annotations

from fsm import pip, table
from fsm.context import Context


def install_extras(ctx: Context) -> str:
    requirements = ctx.require_payload().extra_pip
    if requirements:
        with ctx.interrupts_handled():
            pip.install(
                requirements,
                env=ctx.merged_env(),
                deadline=ctx.work_deadline,
                interrupt=ctx.interrupt,
                python=ctx.python,
                out_fd=ctx.out_fd,
                backoff_s=ctx.tuning.pip_backoff_s,
            )
    return table.EXTRAS_INSTALLED
