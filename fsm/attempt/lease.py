"""The lease (CONTRACT section 10): what an attempt's runner keeps in the store while it
runs, so that a host that vanished with its runner is seen within minutes.

``<arm>_attempt<N>.lease.json`` under the run's prefix::

    {"attempt": int, "run_id": str, "state": str, "host": {"id": ..., "hostname": ...},
     "seq": int, "ttl_s": float, "renewed_at": float, "progress_at": float | null}

This module holds what both sides share, the file's name and shape; the runner's keeper
(:class:`LeaseKeeper`) renews it; :mod:`fsm.attempts` reads it for the control plane.
Its age is judged by the store's own record of the file's last change, never by
``renewed_at`` (the host's clock: informational only).
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from fsm.attempt import marker
from fsm.clock import os_timeout
from fsm.files import JsonProblem, finite_number, json_object

log = structlog.get_logger("fsm.lease")

#: FLASH_LEASE_S's default, and the least period other than 0 (off).
DEFAULT_LEASE_S = 300.0
MIN_LEASE_S = 30.0
#: A lease not renewed for this many periods has expired: ``ttl_s`` = TTL_PERIODS x period.
TTL_PERIODS = 3

#: A renewal that did not land (throttled, no answer, a conflict) is tried again within
#: this many seconds (jittered down to half), whatever the console tail's backoff: a late
#: lease is renewed as soon as the store takes commits again.
LATE_RETRY_S = 15.0
#: The longest a renewal takes to land once tried: one commit's round trip.
LANDING_S = 30.0
#: The reader's grace: a commit that shows the store taking commits counts as evidence
#: against a live runner's silence only this long after it landed: time for the runner's
#: next try (LATE_RETRY_S) and its landing (LANDING_S). Without it, the first runner to
#: land after a 429 window would make the others read lost.
GRACE_S = LATE_RETRY_S + LANDING_S

#: An attempt's lease directly in the prefix, its arm and attempt as a marker's
#: (``fsm.attempt.marker.NAME_RE``).
LEASE_RE = re.compile(marker.NAME_RE.pattern.replace(r"\.json", r"\.lease\.json"), re.ASCII)
#: The longest lease the reader reads (a lease is a few hundred bytes).
LEASE_MAX_BYTES = 16_384


def lease_name(arm: str, attempt: int) -> str:
    """The lease of ``arm``'s attempt ``attempt``, beside its marker ``<arm>_attempt<N>.json``."""
    return f"{arm}_attempt{attempt}.lease.json"


def parse_lease(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(the lease, None), or (None, why it cannot be read as one): JSON, an object with an
    integer ``attempt`` and ``seq`` and a positive finite ``ttl_s``."""
    try:
        value = json_object(data)
    except JsonProblem as exc:
        return None, str(exc)
    for key in ("attempt", "seq"):
        if not isinstance(value.get(key), int) or isinstance(value.get(key), bool):
            return None, f"no integer {key!r}"
    ttl = finite_number(value.get("ttl_s"))
    if ttl is None or ttl <= 0:
        return None, "no positive number 'ttl_s'"
    return value, None


# --- the runner's side: keeping the lease ---------------------------------------------------


class LeaseKeeper:
    """Keeps one attempt's lease while its worker (or its preload) runs.

    * :meth:`start` writes it at once (``seq`` 0) and starts the keeper's thread, which
      renews it every ``period_s`` and, at each renewal, lists the prefix for a later
      attempt of the run (a lease or a marker of ``<arm>_attempt<M>``, M > N);
    * a commit the runner makes anyway (a console tail) carries the lease when it is half
      a period old (:meth:`riding`): while tails flow, the lease costs no commit of its own;
    * a renewal that does not land (throttled, no answer, a conflict) is tried again within
      :data:`LATE_RETRY_S`: late, never given up;
    * every write is fenced like a console tail: none lands after the marker, whose commit
      removes the lease (:attr:`written` says whether there may be one to remove);
    * as a supervision watch (``due``/``look``, ``fsm.worker.supervise.Watch``) it tells the
      worker's loop to stop the worker once a later attempt was found (:attr:`superseded`).

    ``write(files)`` is the fenced commit (True: landed, False: the fence was sealed; it
    raises what the store raises); ``list_names()`` lists the prefix's file names;
    ``describe()`` gives the lease's changing fields (``progress_at``);
    ``on_superseded(name)`` is told (on the keeper's thread) of the later attempt found.
    """

    def __init__(self, *, arm: str, attempt: int, period_s: float, identity: dict[str, Any],
                 write: Callable[[bytes], bool], list_names: Callable[[], frozenset[str]],
                 describe: Callable[[], dict[str, Any]],
                 on_superseded: Callable[[str], None]) -> None:
        self.arm, self.attempt, self.period_s = arm, attempt, period_s
        self.ttl_s = TTL_PERIODS * period_s
        self.name = lease_name(arm, attempt)
        #: The name of the later attempt's file found under the prefix, once found.
        self.superseded: str | None = None
        #: A lease write was tried: the marker's commit removes whatever landed.
        self.written = False
        self._identity = identity
        self._write, self._list, self._describe = write, list_names, describe
        self._on_superseded = on_superseded
        self._lock = threading.Lock()  # one lease write at a time: seq never goes back
        self._stop = threading.Event()
        self._seq = 0
        self._landed_at: float | None = None  # monotonic, the last renewal that landed
        self._thread = threading.Thread(target=self._keep, name="lease", daemon=True)
        self.renewals = 0
        self.late = 0  # renewals that did not land and were tried again
        self.rode = 0  # renewals carried by a commit made anyway

    # --- the lease's content -------------------------------------------------------------

    def body(self) -> bytes:
        """The next lease (its ``seq`` taken)."""
        value = {"attempt": self.attempt, **self._identity, **self._describe(),
                 "seq": self._seq, "ttl_s": self.ttl_s, "renewed_at": round(time.time(), 3)}
        self._seq += 1
        return json.dumps(value, sort_keys=True).encode()

    # --- writing ---------------------------------------------------------------------------

    def start(self) -> None:
        """Write the lease now and keep it from a thread of its own."""
        self._thread.start()

    def riding(self) -> bytes | None:
        """The lease for a commit made anyway, when it is at least half a period old and
        no write of it is under way (the caller then reports with :meth:`carried`); else
        None. The lock is held until :meth:`carried`."""
        landed = self._landed_at
        if (self._stop.is_set() or self.superseded is not None
                or (landed is not None and time.monotonic() - landed < self.period_s / 2)
                or not self._lock.acquire(blocking=False)):
            return None
        self.written = True
        return self.body()

    def carried(self, landed: bool) -> None:
        """The commit that carried :meth:`riding`'s lease landed (or not)."""
        if landed:
            self._landed_at = time.monotonic()
            self.rode += 1
            self.renewals += 1
        self._lock.release()

    def _renew(self) -> bool | None:
        """Write the lease: True landed, False the fence was sealed (the marker's time:
        no more), None not landed (tried again soon)."""
        with self._lock:
            self.written = True
            try:
                landed = self._write(self.body())
            except Exception as exc:  # late, not given up: tried again within LATE_RETRY_S
                self.late += 1
                log.warning("lease.renewal_late", seq=self._seq - 1,
                            error=f"{type(exc).__name__}: {exc}"[:300])
                return None
            if landed:
                self._landed_at = time.monotonic()
                self.renewals += 1
            return landed

    def _check(self) -> None:
        """Look for a later attempt of the run under the prefix."""
        try:
            names = self._list()
        except Exception as exc:  # looked at again with the next renewal
            log.warning("lease.check_failed", error=f"{type(exc).__name__}: {exc}"[:300])
            return
        later = later_attempt(names, self.arm, self.attempt)
        if later is not None:
            self.superseded = later
            log.warning("lease.superseded", later=later, attempt=self.attempt)
            self._on_superseded(later)

    def _keep(self) -> None:
        clock = time.monotonic
        next_renewal = next_check = clock()
        while not self._stop.is_set():
            # The look for a later attempt first: a runner that starts superseded writes
            # no lease at all.
            if clock() >= next_check:
                next_check = clock() + self.period_s
                self._check()
                if self.superseded is not None or self._stop.is_set():
                    return
            if clock() >= next_renewal:
                landed_at = self._landed_at
                if landed_at is not None and clock() - landed_at < self.period_s:
                    next_renewal = landed_at + self.period_s  # a commit carried it meanwhile
                else:
                    landed = self._renew()
                    if landed is False:
                        return  # sealed: the marker's commit is next
                    next_renewal = clock() + (self.period_s if landed else
                                              LATE_RETRY_S * random.uniform(0.5, 1.0))
            self._stop.wait(os_timeout(min(next_renewal, next_check) - clock()))

    def stop(self, timeout_s: float) -> None:
        """No lease write starts after this; wait up to ``timeout_s`` for one in flight."""
        self._stop.set()
        self._thread.join(timeout=max(0.0, timeout_s))

    # --- as a supervision watch --------------------------------------------------------------

    def due(self) -> float:
        return -math.inf if self.superseded is not None else math.inf

    def look(self) -> bool:
        return self.superseded is not None

    def evidence(self) -> dict[str, Any]:
        return {"seq": self._seq, "renewals": self.renewals, "rode": self.rode,
                "late": self.late, "period_s": self.period_s,
                **({"superseded_by": self.superseded} if self.superseded else {})}


def later_attempt(names: frozenset[str] | set[str], arm: str, attempt: int) -> str | None:
    """The first file among ``names`` of a later attempt of ``arm`` than ``attempt``: its
    lease or its marker (``<arm>_attempt<M>[.lease].json``, M > ``attempt``), or None."""
    for name in sorted(names):
        match = LEASE_RE.fullmatch(name) or marker.NAME_RE.fullmatch(name)
        if match is not None and match.group(1) == arm and int(match.group(2)) > attempt:
            return name
    return None
