"""The exit statuses of ``flash-bootstrap run``: one table, which the docs are generated from.

An exit status is a fact about what was published (CONTRACT section 2), for humans, for
``docker inspect`` and for a restart policy; the control plane reads the marker, never the
status. Each row says what the status means and what running the same payload again does
with it. The README and ``docs/contract.md`` carry :func:`render_table` between their
``exits`` markers; a test keeps both current.

A leaf module (standard library only): the rules, the runner and the watchdog read their
numbers from here.
"""

from __future__ import annotations

from typing import Final, NamedTuple


class Exit(NamedTuple):
    code: int
    name: str
    meaning: str
    #: What running the same payload again does (a restart policy ``on-failure`` does it).
    again: str


SUCCEEDED: Final = Exit(
    0, "succeeded", "the attempt succeeded (`Succeeded`) and its marker was published",
    "replays the same marker",
)
FAILED: Final = Exit(
    1, "failed",
    "the attempt failed (`FailedRetriable` or `FailedFatal`) and its marker was published; "
    "the marker's `retriable` says which",
    "replays the same marker",
)
UNUSABLE: Final = Exit(
    2, "unusable",
    "the payload or the command line is unusable (rule `payload-invalid`); a fatal marker is "
    "published only when `hf_repo`, `hf_prefix`, `flash_arm` and `attempt` are each valid as "
    "given, otherwise no marker is written anywhere",
    "fails the same way until the payload is fixed",
)
UNPUBLISHED: Final = Exit(
    3, "unpublished",
    "the outcome was decided and persisted next to the payload, but the store did not take "
    "the marker in time (it failed, hung or throttled)",
    "publishes the persisted marker without redoing the work",
)
UNPERSISTED: Final = Exit(
    74, "unpersisted",
    "the outcome was decided, but the store did not take the marker and it could not be "
    "persisted next to the payload either (that directory cannot be written)",
    "runs the attempt again, in what is left of its budget",
)
REFUSED: Final = Exit(
    78, "refused",
    "the outcome was decided (and persisted where it could be), but the store refuses the "
    "marker for good: the token is refused or cannot be sent, the repo does not exist, the "
    "request is one the store will never take (HTTP 4xx), or the repo's `.gitignore` drops "
    "the marker; the last line says what to fix",
    "fails the same way until what the last line names is fixed; then it publishes the "
    "persisted marker",
)
NOT_OWNER: Final = Exit(
    75, "not-owner",
    "this runner never owned the attempt: another live runner holds its lock, and the wait "
    "for it (up to 30 s) ended by that limit or by a signal; nothing is written",
    "waits for the lock again",
)
INTERNAL: Final = Exit(
    70, "internal", "an internal defect escaped the runner (never expected)",
    "depends on the defect",
)
DEADLINE: Final = Exit(
    124, "deadline",
    "the attempt deadline fired (rule `deadline`) and its marker was published, including "
    "when the watchdog had to end a stuck attempt; also a deadline that passed before this "
    "runner owned the attempt, which then wrote nothing",
    "replays the same marker",
)

#: Every status, in the order the docs list them.
TABLE: Final[tuple[Exit, ...]] = (
    SUCCEEDED, FAILED, UNUSABLE, UNPUBLISHED, UNPERSISTED, REFUSED, DEADLINE, NOT_OWNER,
    INTERNAL,
)


def render_table() -> str:
    """The Markdown table of every status (README and docs/contract.md carry it)."""
    lines = ["| status | name | meaning | running the same payload again |",
             "|---|---|---|---|"]
    lines += [f"| {e.code} | `{e.name}` | {e.meaning} | {e.again} |" for e in TABLE]
    return "\n".join(lines)
