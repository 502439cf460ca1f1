"""InstallExtras: install the run's ``extra_pip`` requirements before anything else.

The payload's ``extra_pip`` was checked against the allow-list when it was parsed
(``fsm.extras.pip.refused_extra_pip``). ``fsm.extras.installer`` picks the installer (uv when it is
there and can do what pip would, else pip; ``FLASH_INSTALLER`` forces one); either one's
failures are reported through the attempt's redactor, and so is its output, kept in the
scratch directory (:data:`OUTPUT_LOG`) while its phases are reported as events.
"""

from __future__ import annotations

from fsm import table
from fsm.context import Context
from fsm.extras import installer

#: The installer's whole output, redacted, in the scratch directory (its phases and
#: counts are ``extras.progress`` events; its output is not the runner's stream).
OUTPUT_LOG = "extras_install.log"


def install_extras(ctx: Context) -> str:
    if requirements := ctx.require_payload().extra_pip:
        (ctx.scratch / OUTPUT_LOG).unlink(missing_ok=True)  # this attempt's output only
        with ctx.interrupts_handled():
            installer.install(
                requirements,
                env=ctx.merged_env(),
                deadline=ctx.work_deadline,
                interrupt=ctx.setup_stop,  # a signal, or a fault the GPUs report
                python=ctx.python,
                output_log=ctx.scratch / OUTPUT_LOG,
                backoff_s=ctx.tuning.pip_backoff_s,
                redactor=ctx.redactor,
            )
    return table.EXTRAS_INSTALLED
