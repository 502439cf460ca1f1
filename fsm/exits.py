"""The exit statuses of ``flash-bootstrap run``: one table, which the docs and the deploy
manifests' tests are read from.

An exit status is a fact about what was published (CONTRACT section 2). The control plane
that reads the store keys on the marker, and the marker is unchanged; but an engine that
runs each attempt as a job (a Kubernetes Job's ``podFailurePolicy``, an AWS Batch
``retryStrategy``, Slurm, Docker's restart policy) decides retry or fail from the status
alone, so every class of ending has a status of its own. Each row says what the status
means, what running the same payload again does with it, and what a Kubernetes Job and an
AWS Batch job do on it (``deploy/`` holds those manifests; a test checks them against this
table). The README and ``docs/contract.md`` carry :func:`render_table` between their
``exits`` markers; a test keeps both current.

The numbers follow the conventions an operator already knows: 0 and 1 as everywhere, 2
for a usage error (argparse's), sysexits(3)'s ``EX_TEMPFAIL`` 75 ("try again later") for
a retriable failure, ``EX_SOFTWARE`` 70 for a defect, ``EX_IOERR`` 74 and ``EX_CONFIG`` 78
for a marker that could not be kept or that the store refuses, ``EX_CANTCREAT`` 73 for a
runner that cannot write the attempt's outputs because another owns them, and 124 for the
deadline, as ``timeout(1)`` exits.

A leaf module (standard library only): the rules, the runner and the watchdog read their
numbers from here.
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple


class Exit(NamedTuple):
    code: int
    name: str
    meaning: str
    #: What running the same payload again does (a restart policy ``on-failure`` does it).
    again: str
    #: What a Kubernetes Job's ``podFailurePolicy`` does with the status (None: the pod
    #: succeeded, no rule can name status 0).
    kubernetes: Literal["FailJob", "Ignore", "Count"] | None
    #: What an AWS Batch ``retryStrategy.evaluateOnExit`` entry does (None: the job succeeded).
    batch: Literal["EXIT", "RETRY"] | None


# The rows below repeat one shape on purpose: they are the table's data, one constant each
# so that the runner names the status it exits with (``exits.DEADLINE.code``), written out
# so that a reader sees every status, its meaning and each engine's action at once.
SUCCEEDED: Final = Exit(
    0, "succeeded", "the attempt succeeded (`Succeeded`) and its marker was published",
    "replays the same marker", None, None,
)
FAILED_FATAL: Final = Exit(
    1, "failed-fatal",
    "the attempt failed, fatal (`FailedFatal`: the marker's `retriable` is false), and its "
    "marker was published",
    "replays the same marker", "FailJob", "EXIT",
)
FAILED_RETRIABLE: Final = Exit(
    75, "failed-retriable",
    "the attempt failed, retriable (`FailedRetriable`: the marker's `retriable` is true, "
    "retry on a fresh host), and its marker was published",
    "replays the same marker; a fresh host runs the attempt again", "Ignore", "RETRY",
)
UNUSABLE: Final = Exit(
    2, "unusable",
    "the payload or the command line is unusable (rule `payload-invalid`); a fatal marker is "
    "published only when `hf_repo`, `hf_prefix`, `flash_arm` and `attempt` are each valid as "
    "given, otherwise no marker is written anywhere",
    "fails the same way until the payload is fixed", "FailJob", "EXIT",
)
UNPUBLISHED: Final = Exit(
    3, "unpublished",
    "the outcome was decided and persisted next to the payload, but the store did not take "
    "the marker in time, or did not say whether it had when the marker was read back (it "
    "failed, hung or throttled)",
    "publishes the persisted marker without redoing the work", "Count", "RETRY",
)
UNPERSISTED: Final = Exit(
    74, "unpersisted",
    "the outcome was decided, but the store did not take the marker and it could not be "
    "persisted next to the payload either (that directory cannot be written)",
    "runs the attempt again, in what is left of its budget", "Count", "RETRY",
)
REFUSED: Final = Exit(
    78, "refused",
    "the outcome was decided (and persisted where it could be), but the store refuses the "
    "marker for good: the token is refused or cannot be sent, the repo does not exist, the "
    "request is one the store will never take (HTTP 4xx), or the repo's `.gitignore` drops "
    "the marker; the last line says what to fix",
    "fails the same way until what the last line names is fixed; then it publishes the "
    "persisted marker", "FailJob", "EXIT",
)
DEADLINE: Final = Exit(
    124, "deadline",
    "the attempt deadline fired (rule `deadline`, fatal) and its marker was published, "
    "including when the watchdog had to end a stuck attempt; also a deadline that passed "
    "before this runner owned the attempt, which then wrote nothing",
    "replays the same marker", "FailJob", "EXIT",
)
NOT_OWNER: Final = Exit(
    73, "not-owner",
    "this runner never owned the attempt: another live runner holds its lock, and the wait "
    "for it (up to 30 s) ended by that limit or by a signal; nothing is written",
    "waits for the lock again; once the owner is done, replays its marker", "Ignore", "RETRY",
)
INTERNAL: Final = Exit(
    70, "internal", "an internal defect escaped the runner (never expected)",
    "depends on the defect", "Count", "RETRY",
)

#: Every status, in the order the docs list them.
TABLE: Final[tuple[Exit, ...]] = (
    SUCCEEDED, FAILED_FATAL, FAILED_RETRIABLE, UNUSABLE, UNPUBLISHED, UNPERSISTED, REFUSED,
    DEADLINE, NOT_OWNER, INTERNAL,
)


def failed(retriable: bool) -> Exit:
    """The status of a published failure marker: its class decides."""
    return FAILED_RETRIABLE if retriable else FAILED_FATAL


def by_code(code: int) -> Exit | None:
    """The row of ``code``, or None for a status the runner never exits with."""
    return next((e for e in TABLE if e.code == code), None)


def render_table() -> str:
    """The Markdown table of every status (README and docs/contract.md carry it)."""
    lines = ["| status | name | meaning | running the same payload again "
             "| Kubernetes `podFailurePolicy` | AWS Batch `evaluateOnExit` |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {e.code} | `{e.name}` | {e.meaning} | {e.again} "
              f"| {_action(e.kubernetes, 'the pod succeeded')} "
              f"| {_action(e.batch, 'the job succeeded')} |" for e in TABLE]
    return "\n".join(lines)


def _action(action: str | None, otherwise: str) -> str:
    return f"`{action}`" if action else otherwise
