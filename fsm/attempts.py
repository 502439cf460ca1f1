"""The control plane's reader of attempts: what an attempt is *now* (CONTRACT section 10).

``read_attempt(store, prefix, arm, attempt)`` answers one :class:`AttemptView`;
``read_attempts(store, prefixes)`` every attempt with a marker or a lease under the
prefixes, in one reading. :func:`judge` is the pure rule both apply to what a reading
found; the kinds it answers, and what a control plane does on each:

* ``succeeded``, ``retriable``, ``fatal``: the attempt's marker says so (done; retry on a
  fresh host; fail the run);
* ``running``: the attempt's lease is younger than its ``ttl_s`` (wait);
* ``lost``: the lease expired and the repo took commits since, and while it was due
  (start the next attempt);
* ``unknown``: none of these can be said, and ``why`` says which fact is missing (wait).

The rules (CONTRACT section 10, restated):

1. An attempt with a marker (``<arm>_attempt<N>.json``, read as ``fsm.attempt.marker.parse``
   reads it) is its marker: ``ok`` true is *succeeded*; else ``retriable`` true is
   *retriable*; else *fatal*; ``rule`` is the marker's. A lease beside a marker is ignored:
   the marker's commit removes the lease, and once there is a marker it is the truth. A
   marker that cannot be read is *unknown*, and ``why`` names the problem.
2. No marker, a lease (``fsm.attempt.lease.LEASE_RE``, read with
   ``fsm.attempt.lease.parse_lease``): one that cannot be read (or names another attempt
   than its file) is *unknown*. Its age is ``now - changed``, where ``changed`` is the
   store's own time of the lease file's last change (the Hub's last commit of the file, a
   local file's modification time; never the host's ``renewed_at``), and it expires at ``E =
   changed + ttl_s``. ``now <= E``: *running*.
3. An expired lease (``now > E``) is *lost*, since ``E``, only when all three hold:

   a. the store took a commit after ``E`` (CONTRACT section 10): a change time known to
      the reading (any file's in the reading's listings, other attempts' files included,
      or the repo's newest commit, ``head_time()``);
   b. the store took a commit while this lease's renewal was late, early enough that a
      live runner's renewal would have landed since: a change time ``t`` with
      ``D + LANDING_S <= t <= now - GRACE_S``, where ``D = changed + ttl_s / 3`` is when
      the renewal fell due (the listings' times, or the repo's newest commit at or before
      ``now - GRACE_S``, ``head_time(until=...)``: read from its history, so a repo that
      never stops taking commits still shows the one that matters). A live runner tries
      its renewal at ``D`` and, refused, again within ``LATE_RETRY_S``; a try lands within
      ``LANDING_S``. So a store open at ``t`` (and, as stores do, for ``GRACE_S`` after it
      opened) has taken the renewal by ``t + GRACE_S``: its try at ``D`` if the store was
      open from before it (``t`` is ``LANDING_S`` past it), a retry if the store opened
      later. With the default period the witness is older than ``E``, and a dead runner
      reads lost at the first commit after ``E``; at periods under 37.5 s
      (``LANDING_S + GRACE_S > 2 x period``) it is ``D + LANDING_S + GRACE_S``, up to 15 s
      after ``E``;
   c. the reading does not show most leases expired together: when it holds two or more
      readable leases of attempts without markers and more than half of them have
      expired, every expired one is *unknown*. That is the store's outage (a throttled
      repo), not the hosts': Kubernetes' node controller stops evicting when most nodes of
      a zone go unready at once, for the same reason.

   Otherwise it is *unknown*, and ``why`` says which condition failed.
4. An attempt with neither a marker nor a lease is *unknown* ("no lease or marker yet").
   A store that cannot be read makes :func:`read_attempt` answer *unknown* with the error
   (redacted), never raise; :func:`read_attempts` raises it (the caller decides).
5. Cost of a reading: one ``changes()`` listing per prefix, one read of each marker and of
   each lease of an attempt without a marker, and ``head_time()`` and ``head_time(until)``
   at most once each, only when an expired lease is not already shown lost or unknown by
   the listings.

``now`` is the reader's clock, taken before the first listing (so every age is at most
what it is when the listing answers); a caller may pass a later one to ask about the
future without waiting. Times of the store and of the reader are both epoch seconds.
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fsm.attempt import marker as marker_format
from fsm.attempt.lease import (
    GRACE_S,
    LANDING_S,
    LEASE_MAX_BYTES,
    LEASE_RE,
    TTL_PERIODS,
    lease_name,
    parse_lease,
)
from fsm.attempt.marker import MARKER_MAX_BYTES
from fsm.errors import DeadlineExceeded, FatalError, FlashError, StoreAuthError, StoreNotFound
from fsm.output.redact import Redactor
from fsm.store.base import Store

__all__ = [
    "NEITHER", "TOGETHER", "AttemptView", "Found", "Kind", "attempt_files", "decide", "found_in",
    "human_age", "judge", "read_attempt", "read_attempts",
]

Kind = Literal["running", "succeeded", "retriable", "fatal", "lost", "unknown"]

#: A file read as a marker or a lease: (its value, None), or (None, why it cannot be read).
Parsed = tuple[dict[str, Any] | None, str | None]

#: The why of an attempt the store holds nothing of.
NEITHER = "no lease or marker yet: setup, or not started"
#: The why of an expired lease when most leases of the reading expired together.
TOGETHER = "most leases expired together: the store's outage, not the hosts'"


def human_age(seconds: float | None) -> str:
    """``45s``, ``3m12s``, ``2h05m``, ``4d``; ``-`` when unknown; a marker from the future
    (a clock ahead of ours) gets a minus sign."""
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + human_age(-seconds)
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86_400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86_400}d"


@dataclass(frozen=True)
class AttemptView:
    """What one attempt is now, and the facts that say so."""

    arm: str
    attempt: int
    kind: Kind
    #: One human line: why this kind (always set; for ``unknown`` the missing fact).
    why: str
    #: retriable, fatal (and succeeded): the marker's ``rule``.
    rule: str | None = None
    #: running, lost, unknown with a lease: the lease's ``state`` (the runner's machine
    #: state); a marker's view: the state the attempt ended in.
    state: str | None = None
    #: ``now`` - the lease's last change by the store's clock.
    lease_age_s: float | None = None
    #: lost: when the lease expired (store clock, epoch seconds).
    since: float | None = None
    #: the lease's (or the marker's) ``host``.
    host: dict[str, Any] | None = None
    marker: dict[str, Any] | None = None
    lease: dict[str, Any] | None = None
    #: the folder (hf_prefix) the attempt's files are in.
    prefix: str = ""

    @property
    def hostname(self) -> str | None:
        return _text(self.host.get("hostname")) if self.host is not None else None


@dataclass(frozen=True)
class Found:
    """What one reading found of one attempt: the input of :func:`judge`.

    ``marker_problem`` / ``lease_problem``: the file is there but cannot be read as one
    (why). ``lease_changed``: the store's time of the lease file's last change.
    """

    arm: str
    attempt: int
    prefix: str = ""
    marker: Mapping[str, Any] | None = None
    marker_problem: str | None = None
    lease: Mapping[str, Any] | None = None
    lease_problem: str | None = None
    lease_changed: float | None = None


# --- the rule -------------------------------------------------------------------------------


def judge(
    found: Iterable[Found], *, changes: Iterable[float] = (), head_time: float | None,
    last_commit: float | None = None, now: float,
) -> list[AttemptView]:
    """What each attempt of one reading is at ``now`` (the rules of the module), in the
    order found. ``changes``: the change times (store clock) of the files the reading
    listed; the leases' own times are added. ``head_time``: the repo's newest commit at or
    before ``now - GRACE_S``; ``last_commit``: its newest commit; either None when not
    asked or unknown. Pure and deterministic."""
    return _judge(list(found), changes, head_time, last_commit, now)[0]


#: What a reading may still ask the store for (:func:`decide`): the repo's newest commit
#: (rule 3a), its newest commit at or before ``now - GRACE_S`` (rule 3b).
Wants = frozenset[Literal["last_commit", "head_time"]]


def _judge(
    found: list[Found], changes: Iterable[float], head_time: float | None,
    last_commit: float | None, now: float,
) -> tuple[list[AttemptView], Wants]:
    """The views, and what the store could still tell that might turn an unknown lost."""
    alone = [_alone(f, now) for f in found]
    expiries = [(index, *at) for index, at in enumerate(alone) if isinstance(at, tuple)]
    # leases of attempts without markers whose expiry is known: running or expired
    readable = len(expiries) + sum(isinstance(v, AttemptView) and v.kind == "running"
                                   for v in alone)
    together = readable >= 2 and 2 * len(expiries) > readable
    times = [*changes, head_time, last_commit, *(f.lease_changed for f in found)]
    known = sorted({t for t in times if t is not None and math.isfinite(t)})
    wants: set[Literal["last_commit", "head_time"]] = set()
    late: dict[int, AttemptView] = {}  # the expired leases, against the whole reading
    for index, expires, due in expiries:
        ago = human_age(now - expires)
        at = bisect.bisect_right(known, expires)
        after = known[at] if at < len(known) else None  # the first commit after the expiry
        # A commit a live runner, retrying since its renewal fell due, would have followed
        # with its own by now: the last one landed after that try could land, GRACE_S ago
        # or more.
        at = bisect.bisect_right(known, now - GRACE_S)
        witness = known[at - 1] if at and known[at - 1] >= due + LANDING_S else None
        kind: Kind = "unknown"
        if together:
            why = (f"{TOGETHER} ({len(expiries)} of {readable} leases of this reading "
                   f"expired; this one {ago} ago)")
        elif after is not None and witness is not None:
            kind = "lost"
            why = (f"the lease expired {ago} ago, and the repo took commits since (one "
                   f"{human_age(now - after)} ago) and while its renewal was late (one "
                   f"{human_age(now - witness)} ago): the host went silent")
        elif after is None:
            if last_commit is None:
                wants.add("last_commit")
            why = (f"the lease expired {ago} ago and no commit has landed in the repo since: "
                   "the store may be throttled or down")
        else:
            if head_time is None:
                wants.add("head_time")
            why = (f"the lease expired {ago} ago; the repo took a commit since "
                   f"({human_age(now - after)} ago), but none yet that a live runner's late "
                   f"renewal would have followed within the grace of {GRACE_S:g}s")
        late[index] = _lease_view(found[index], kind, why, now,
                                  since=expires if kind == "lost" else None)
    views = [late[index] if isinstance(v, tuple) else v for index, v in enumerate(alone)]
    return views, frozenset(wants)


def _alone(f: Found, now: float) -> AttemptView | tuple[float, float]:
    """The attempt's view by its own files, or for an expired lease (judged against the
    whole reading) when it expired and when its renewal fell due."""
    if f.marker is not None or f.marker_problem is not None:
        return _marker_view(f)
    if f.lease is None and f.lease_problem is None:
        return _view(f, "unknown", NEITHER)
    lease, changed = f.lease, f.lease_changed
    if lease is None or f.lease_problem is not None:
        why = f"the lease is unreadable: {f.lease_problem}"
    elif lease.get("attempt") != f.attempt:
        why = (f"the lease is unreadable: it names attempt {lease.get('attempt')!r}, its "
               f"file {f.attempt}")
    elif changed is None or not math.isfinite(changed):
        why = "the store gave no time for the lease's last change"
    else:
        ttl = float(lease["ttl_s"])
        if now <= changed + ttl:
            return _lease_view(f, "running", f"the lease changed {human_age(now - changed)} "
                                             f"ago, within its ttl_s {ttl:g}", now)
        return changed + ttl, changed + ttl / TTL_PERIODS
    return _lease_view(f, "unknown", why, now)


def _view(f: Found, kind: Kind, why: str, **facts: Any) -> AttemptView:
    return AttemptView(f.arm, f.attempt, kind, why, prefix=f.prefix, **facts)


def _marker_view(f: Found) -> AttemptView:
    marker = f.marker
    if marker is None or f.marker_problem is not None:
        return _view(f, "unknown", f"the marker is unreadable: {f.marker_problem}")
    rule = marker.get("rule") if isinstance(marker.get("rule"), str) else None
    kind = marker_format.verdict(marker)  # rule 1
    why = {"succeeded": "the marker says ok",
           "retriable": "the marker says failed, retriable: retry on a fresh host",
           "fatal": "the marker says failed, not retriable: fail the run"}[kind]
    return _view(f, kind, why + (f" (rule {rule})" if rule else ""), rule=rule,
                 state=_text(marker.get("state")), host=_dict(marker.get("host")),
                 marker=dict(marker))


def _lease_view(f: Found, kind: Kind, why: str, now: float,
                since: float | None = None) -> AttemptView:
    lease = f.lease or {}
    changed = f.lease_changed
    age = round(now - changed, 3) if changed is not None and math.isfinite(changed) else None
    return _view(f, kind, why, state=_text(lease.get("state")), lease_age_s=age,
                 since=since, host=_dict(lease.get("host")),
                 lease=dict(f.lease) if f.lease is not None else None)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _dict(value: Any) -> dict[str, Any] | None:
    return dict(value) if isinstance(value, dict) else None


# --- reading the store ----------------------------------------------------------------------


def attempt_files(names: Iterable[str]) -> list[tuple[str, int, bool]]:
    """The attempts a folder's names hold a marker or a lease of, by attempt then arm, as
    (arm, attempt, whether it has a marker)."""
    names = list(names)
    marked = {(m.arm, m.attempt) for m in marker_format.listed(names)}
    leased = [LEASE_RE.fullmatch(name) for name in names]
    every = marked | {(match[1], int(match[2])) for match in leased if match is not None}
    return [(arm, n, (arm, n) in marked) for arm, n in sorted(every, key=lambda a: (a[1], a[0]))]


def _path(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _read(
    store: Store, path: str, limit: int, parse: Callable[[bytes], Parsed],
    gone: str = "listed, then not found when read",
) -> Parsed:
    """The file read once and parsed: (its value, None), or (None, why it cannot be read):
    a file gone since the listing (``gone``), one the store refuses (a link out of its root)
    or too long is a problem of that file alone; the store's failures (unavailable, the
    token refused, the deadline) are raised."""
    try:
        data = store.read_file(path, limit)
    except StoreNotFound:
        return None, gone
    except StoreAuthError:
        raise
    except FatalError as exc:
        return None, f"refused: {' '.join(exc.message.split())[:300]}"
    if len(data) > limit:
        return None, f"larger than {limit:,} bytes"
    return parse(data)


def found_in(store: Store, folder: str, listing: Mapping[str, float], arm: str,
             attempt: int) -> Found:
    """What ``listing`` (``store.changes(folder)``) holds of the attempt: its marker, read
    once, or else its lease, read once, with the store's time of its last change; nothing
    when it holds neither."""
    marker_name, lease = marker_format.name(arm, attempt), lease_name(arm, attempt)
    if marker_name in listing:
        marker, problem = _read(store, _path(folder, marker_name), MARKER_MAX_BYTES,
                                marker_format.parse)
        return Found(arm, attempt, folder, marker=marker, marker_problem=problem)
    if lease not in listing:
        return Found(arm, attempt, folder)
    value, problem = _read(store, _path(folder, lease), LEASE_MAX_BYTES, parse_lease, gone=(
        "listed, then gone when read (the attempt's marker may have landed since: read again)"))
    return Found(arm, attempt, folder, lease=value, lease_problem=problem,
                 lease_changed=listing[lease])


def decide(store: Store, found: list[Found], changes: Collection[float],
           now: float) -> list[AttemptView]:
    """:func:`judge` of one reading, asking the store for its newest commit
    (``head_time()``) and its newest at or before ``now - GRACE_S``
    (``head_time(until=...)``) at most once each, only when an expired lease is neither
    lost nor unknown by the listings alone."""
    views, wants = _judge(found, changes, None, None, now)
    if not wants:
        return views
    last = store.head_time() if "last_commit" in wants else None
    head = last if last is not None and last <= now - GRACE_S else None
    views, wants = _judge(found, changes, head, last, now)
    if "head_time" in wants and head is None:
        head = store.head_time(until=now - GRACE_S)
        views = _judge(found, changes, head, last, now)[0]  # the same views when still None
    return views


def read_attempts(
    store: Store, prefixes: Sequence[str] | str, *, now: float | None = None,
) -> list[AttemptView]:
    """Every attempt with a marker or a lease directly under each of ``prefixes``, judged
    in one reading: by prefix (as given), then attempt, then arm. One ``changes()`` listing
    per prefix; the store's failures are raised (``StoreUnavailable``, ``StoreAuthError``,
    ``DeadlineExceeded``)."""
    folders = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    now = time.time() if now is None else now
    found: list[Found] = []
    changes: list[float] = []
    for folder in dict.fromkeys(p.strip("/") for p in folders):
        listing = store.changes(folder)
        changes += listing.values()
        found += [found_in(store, folder, listing, arm, n)
                  for arm, n, _ in attempt_files(listing)]
    return decide(store, found, changes, now)


def read_attempt(
    store: Store, prefix: str, arm: str, attempt: int, *, now: float | None = None,
    redactor: Redactor | None = None,
) -> AttemptView:
    """What ``<arm>_attempt<attempt>`` under ``prefix`` is now: one listing, its marker or
    its lease read, and only when its lease has expired the other leases of the prefix
    (rule 3b) and perhaps ``head_time()``. Never raises for a store failure: that is an
    *unknown* view whose ``why`` carries the error, redacted by ``redactor`` (by default
    one that knows the secret-looking values of the environment and the store's token).
    A name that is no attempt's (``arm``, ``attempt``) is a ``ValueError``."""
    marker_name = marker_format.name(arm, attempt)
    if isinstance(attempt, bool) or not marker_format.NAME_RE.fullmatch(marker_name):
        raise ValueError(f"not an attempt: arm {arm!r}, attempt {attempt!r}")
    folder = prefix.strip("/")
    now = time.time() if now is None else now
    try:
        listing = store.changes(folder)
        target = found_in(store, folder, listing, arm, attempt)
        found = [target]
        if isinstance(_alone(target, now), tuple):  # expired: the rest of the reading matters
            found += [found_in(store, folder, listing, other, n)
                      for other, n, marked in attempt_files(listing)
                      if not marked and (other, n) != (arm, attempt)]
        return decide(store, found, listing.values(), now)[0]
    except (FlashError, DeadlineExceeded) as exc:
        return AttemptView(arm, attempt, "unknown", _unreadable(store, exc, redactor),
                           prefix=folder)


def _unreadable(store: Store, exc: BaseException, redactor: Redactor | None) -> str:
    if redactor is None:
        token = getattr(store, "_token", None)  # the Hub store's, when it has one
        redactor = Redactor([token] if isinstance(token, str) else [])
        redactor.learn(os.environ)
    text = " ".join(str(exc).split())[:500] or type(exc).__name__
    if isinstance(exc, DeadlineExceeded):
        text = f"no answer in time ({text})"
    return redactor.text(f"the store cannot be read ({type(exc).__name__}): {text}")
