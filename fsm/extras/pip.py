"""InstallExtras' work: ``pip install`` the payload's ``extra_pip``, classified and bounded.

pip runs as ``<python> -m pip install ...`` through :func:`fsm.worker.supervise.supervise`, like
the worker: in its own process group, stopped (SIGTERM, :data:`STOP_GRACE_S`, SIGKILL) at
the deadline or on SIGTERM/SIGINT. :func:`run_installer` is that loop, shared with uv
(``fsm.extras.installer``, which decides which of the two installs a payload's extras: issue 15).

Its output is not the runner's: it is read as it comes for the installer's phase
(resolving, downloading, building, installing, with the packages counted where the
installer says), reported as ``extras.progress`` events (:class:`InstallSteps`), and kept
whole, redacted, in a file (the scratch directory's ``extras_install.log`` in a run).

A failed pip is classified by its output (DESIGN, policy rows ``pip-network`` and
``pip-failed``): network-shaped failures are tried again with exponential backoff; any
other failure (no such version, conflicting requirements, a build error) is fatal at once.

Why pip also writes ``--log``: at its default verbosity pip reports an unreachable or
failing index only as "Could not find a version that satisfies the requirement" (the page
fetch error, 503s included, is logged at debug level; TRAPS, "pip"), which reads exactly
like a real resolution failure. The ``--log`` file is always verbose, so its tail is
classified together with the console tail, while the console stays readable. (A quirk of
``--log``: pip then keeps a failing build's own output out of the console, so after a
failure the end of the log is copied to the kept output.)

What may be installed is decided before pip runs (issue 11): :func:`refused_extra_pip`
checks ``extra_pip`` against :data:`EXTRA_PIP_OPTIONS`, so pip is never told to read a
file of the host (``-r``, ``-c``) and print its lines in an error. Every text built here
from pip's output (the error message, the copy of its log) is redacted whole before it is
collapsed to one line or cut: a secret cut through first would leave a prefix no redactor
recognises.
"""

from __future__ import annotations

import re
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any, Literal, NamedTuple
from urllib.parse import urlsplit

import structlog

from fsm import rules
from fsm.budget import Budget, GaveUp, backoff
from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, FatalError, Interrupted, RetriableError
from fsm.interrupt import InterruptFlag
from fsm.output.log import Progress
from fsm.output.redact import Redactor
from fsm.policy.signatures import PIP_NETWORK, Signature, Table
from fsm.worker.supervise import supervise

# pip's own retries and socket timeout. pip's defaults (5 retries, 15 s) cost ~6 x 15 s
# per request against a black-holed index, times every request, times our ``tries``. We
# retry the whole install ourselves, so pip only rides out a short blip inside one run:
# at most ~46 s per stuck request per try. Passed (overriding a pip.conf in the image)
# only when the environment sets neither PIP_RETRIES nor PIP_TIMEOUT/PIP_DEFAULT_TIMEOUT:
# a user who set them knows their index.
PIP_RETRIES = 2
PIP_TIMEOUT_S = 15

TAIL_BYTES = 256 * 1024  # how much of pip's console output and log is kept for classification
MESSAGE_CHARS = 500  # the error message's bound
STOP_GRACE_S = 2.0  # SIGTERM -> SIGKILL
_REPORT_LINES = 40  # lines of pip's verbose log shown on the console after a failure
_REPORT_LINE_CHARS = 400
_LOG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d+ ")
_BOX = ("\N{BOX DRAWINGS LIGHT VERTICAL}", "\N{BOX DRAWINGS LIGHT ARC UP AND RIGHT}")
# pip's bookkeeping in the verbose log, left out of the copy shown after a failure
_LOG_CHATTER = re.compile(
    r"^\s*(?:Created temporary directory|Initialized build tracking|.*build tracker)"
)
_CROSS = "\N{MULTIPLICATION SIGN}"  # pip marks a failed subprocess's headline with it


#: pip's network signatures (``fsm.policy.signatures``, where every signature table lives).
NETWORK_SIGNATURES: Table = PIP_NETWORK
#: The first of :data:`NETWORK_SIGNATURES` found in a text, if any.
network_signature = NETWORK_SIGNATURES.first


def classify_pip_output(text: str) -> Literal["network", "other"]:
    """``network`` when a failed pip's output shows a network failure, else ``other``."""
    return "network" if network_signature(text) is not None else "other"


# --- what extra_pip may hold (issue 11) ---------------------------------------------------

#: What an allowed option's value must be: ``url`` an http(s) or file URL; ``formats``
#: ``:all:``, ``:none:`` or a comma list of package names; ``strategy`` ``eager`` or
#: ``only-if-needed``; ``host`` a host name or address, optionally with ``:port``.
ValueKind = Literal["url", "formats", "strategy", "host"]


class PipOption(NamedTuple):
    """A pip option ``extra_pip`` may carry: its spellings, its value (None: a flag)."""

    names: tuple[str, ...]
    value: ValueKind | None


#: The only pip options ``extra_pip`` may hold (docs/running.md, "Extra packages"). A value
#: is given as the next entry (``["--index-url", URL]``) or, for the long spelling, attached
#: (``"--index-url=URL"``). Every other option is refused, above all those that make pip
#: read a file of the host (``-r``, ``-c``) or install somewhere else (``--target``).
EXTRA_PIP_OPTIONS: tuple[PipOption, ...] = (
    PipOption(("--index-url", "-i"), "url"),
    PipOption(("--extra-index-url",), "url"),
    PipOption(("--find-links", "-f"), "url"),
    PipOption(("--no-index",), None),
    PipOption(("--pre",), None),
    PipOption(("--no-deps",), None),
    PipOption(("--upgrade", "-U"), None),
    PipOption(("--force-reinstall",), None),
    PipOption(("--upgrade-strategy",), "strategy"),
    PipOption(("--only-binary",), "formats"),
    PipOption(("--no-binary",), "formats"),
    PipOption(("--prefer-binary",), None),
    PipOption(("--trusted-host",), "host"),
)

#: What a path or a plain URL in ``extra_pip`` must end with: a wheel or an sdist.
ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".tgz", ".zip", ".tar.bz2", ".tar.xz")

_OPTIONS = {name: option for option in EXTRA_PIP_OPTIONS for name in option.names}
#: Why the options most often asked for are refused (any other option: not allowed).
_REFUSED_OPTIONS = {
    **dict.fromkeys(("-r", "--requirement", "-c", "--constraint"),
                    "makes pip read a file on the host"),
    **dict.fromkeys(("-e", "--editable"), "installs a local tree or a checkout in editable mode"),
    **dict.fromkeys(("-t", "--target", "--prefix", "--root", "--user", "--src"),
                    "changes where pip installs"),
    **dict.fromkeys(("-C", "--config-settings"), "passes settings to build backends"),
}
_PACKAGE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
    r"[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_UNSAFE_IN_PATH = re.compile(r"[\s;#@\[\]]")


class Refusal(NamedTuple):
    """Why ``extra_pip`` is refused: the entry (its position in the list) and the reason."""

    position: int
    entry: str
    reason: str


def refused_extra_pip(entries: Sequence[str]) -> Refusal | None:
    """The first entry of ``extra_pip`` that pip must not be given, or None if all are fine.

    Entries are requirement specifiers (PEP 508, ``name @ url`` included), URLs
    (http/https/file of a wheel or sdist, or ``git+https``), paths of wheels and sdists
    (:data:`ARCHIVE_SUFFIXES`), and the options of :data:`EXTRA_PIP_OPTIONS` with their
    values. Anything else is refused: no entry may make pip read a file of the host.
    """
    pending = iter(enumerate(entries))
    for i, entry in pending:
        if not entry.startswith("-"):
            if (problem := _requirement_problem(entry)) is not None:
                return Refusal(i, entry, problem)
            continue
        name, eq, attached = entry.partition("=") if entry.startswith("--") else (entry, "", "")
        option = _OPTIONS.get(name)
        if option is None:
            return Refusal(i, entry, _option_refusal(name))
        if option.value is None:
            if eq:
                return Refusal(i, entry, f"{name} takes no value")
            continue
        at, value = (i, attached) if eq else next(pending, (i, None))
        if value is None:
            return Refusal(i, entry, f"{name} needs a value (the next entry)")
        if (problem := _value_problem(option.value, value)) is not None:
            return Refusal(at, value if at != i else entry, f"the value of {name} {problem}")
    return None


def _option_refusal(name: str) -> str:
    # pip reads "-r/etc/x" as "-r /etc/x": a short option is its first two characters
    key = name if name in _REFUSED_OPTIONS or name.startswith("--") else name[:2]
    if reason := _REFUSED_OPTIONS.get(key):
        return f"pip option {key} {reason}"
    allowed = ", ".join("/".join(option.names) for option in EXTRA_PIP_OPTIONS)
    return f"not an allowed pip option (allowed: {allowed})"


def _value_problem(kind: ValueKind, value: str) -> str | None:
    if kind == "url":
        return _url_problem(value, ("http", "https", "file"), archive=False)
    if kind == "strategy":
        return None if value in ("eager", "only-if-needed") else "must be eager or only-if-needed"
    if kind == "host":
        return None if _HOST.fullmatch(value) else "must be a host name or address"
    names = all(_PACKAGE_NAME.fullmatch(name) for name in value.split(","))
    if names or value in (":all:", ":none:"):
        return None
    return "must be :all:, :none: or a comma list of package names"


def _requirement_problem(entry: str) -> str | None:
    """Why ``entry`` is not a requirement, a URL or a wheel/sdist path (None: it is)."""
    if _SCHEME.match(entry):
        return _package_url_problem(entry)
    path = entry.isprintable() and not _UNSAFE_IN_PATH.search(entry)
    if path and entry.lower().endswith(ARCHIVE_SUFFIXES):
        return None  # a wheel or an sdist on this host
    from packaging.requirements import InvalidRequirement, Requirement  # only when needed

    try:
        requirement = Requirement(entry)
    except InvalidRequirement:
        return (
            "not a requirement (PEP 508), a URL, or the path of a wheel or sdist "
            f"({', '.join(ARCHIVE_SUFFIXES)}; no spaces or any of ; # @ [ ])"
        )
    return None if requirement.url is None else _package_url_problem(requirement.url)


def _package_url_problem(url: str) -> str | None:
    problem = _url_problem(url, ("http", "https", "git+https", "file"), archive=True)
    return None if problem is None else f"a package URL {problem}"


def _url_problem(url: str, schemes: Sequence[str], *, archive: bool) -> str | None:
    """Why ``url`` is not one pip may be given (None: it is).

    http(s) needs a host; file needs an absolute path on this host; with ``archive``
    (a package, not an index) an http(s) or file URL must name a wheel or an sdist.
    """
    shown = "/".join(schemes)
    if not url.isprintable() or any(char.isspace() for char in url):
        return f"must be an {shown} URL without spaces or control characters"
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        return f"must be a well-formed {shown} URL"
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        return f"must be an {shown} URL"
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            return "must be a file URL of an absolute path on this host (file:///...)"
    elif not host:
        return f"must be an {shown} URL with a host"
    if archive and scheme != "git+https" and not parts.path.lower().endswith(ARCHIVE_SUFFIXES):
        return f"must name a wheel or an sdist ({', '.join(ARCHIVE_SUFFIXES)})"
    return None


#: pip settings from the environment that would make pip read (and quote in its errors) a
#: file of the host, or read its options from one: the environment twins of the options
#: extra_pip may not carry (-r, -c, -e, a config file). pip runs without them; the worker's
#: own environment keeps them.
_HOST_READING_SETTINGS = frozenset({
    "PIP_REQUIREMENT", "PIP_REQUIREMENTS", "PIP_CONSTRAINT", "PIP_CONSTRAINTS",
    "PIP_BUILD_CONSTRAINT", "PIP_EDITABLE", "PIP_CONFIG_FILE", "PIP_SRC",
})


def _installer_env(
    env: Mapping[str, str], installer: str = "pip", reading: frozenset[str] = _HOST_READING_SETTINGS
) -> dict[str, str]:
    """The installer's environment: ``env`` less the settings (``reading``) that make it read
    host files (the image's own pip configuration, a mirror say, is trusted; a file the
    payload names is not), with ``PYTHONUNBUFFERED=1`` unless set, so the output streams."""
    kept = {k: v for k, v in env.items() if k.upper() not in reading}
    if dropped := sorted(env.keys() - kept.keys()):
        structlog.get_logger().warning("pip.settings_dropped", installer=installer, keys=dropped,
                                       reason=f"they make {installer} read host files")
    kept.setdefault("PYTHONUNBUFFERED", "1")
    return kept


def install(
    requirements: Sequence[str],
    *,
    env: Mapping[str, str],
    deadline: Deadline,
    interrupt: InterruptFlag,
    python: str = sys.executable,
    extra_args: Sequence[str] = (),
    tries: int = 3,
    backoff_s: float = 2.0,
    output_log: Path | None = None,
    redactor: Redactor | None = None,
) -> None:
    """``pip install`` ``requirements`` into ``python``'s environment, or raise.

    ``env`` is pip's environment, less the settings that make pip read host files
    (``PYTHONUNBUFFERED=1`` is added unless set, so the output streams). ``extra_args`` go
    before the requirements (``--index-url URL``). Raises :class:`RetriableError` (rule
    ``pip-network``) after ``tries`` network-shaped failures, :class:`FatalError` (rule
    ``pip-failed``) on any other failure, :class:`DeadlineExceeded` when ``deadline`` passes
    and :class:`Interrupted` when ``interrupt`` is triggered; pip is stopped in every case.
    ``redactor`` (the attempt's) redacts every text built from pip's output, and its whole
    output, kept in ``output_log`` (appended to) when given.
    """
    if not requirements:
        return
    child_env = _installer_env(env)
    # pip's own retries and timeout, unless the environment chooses them (see PIP_RETRIES)
    own_limits = [] if env.get("PIP_RETRIES") else ["--retries", str(PIP_RETRIES)]
    if not (env.get("PIP_TIMEOUT") or env.get("PIP_DEFAULT_TIMEOUT")):
        own_limits += ["--timeout", str(PIP_TIMEOUT_S)]

    def argv(log_path: Path) -> list[str]:
        return [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
                "--progress-bar", "off", "--log", str(log_path), *own_limits, *extra_args,
                *requirements]

    run_installer(Tool("pip", "pip install", argv, _evidence, read_pip_line),
                  requirements=len(requirements), env=child_env, deadline=deadline,
                  interrupt=interrupt, tries=tries, backoff_s=backoff_s, output_log=output_log,
                  redactor=Redactor() if redactor is None else redactor)


# --- what the installer is doing -------------------------------------------------------------


@dataclass
class InstallSteps:
    """What an installer's console says it is doing, as the ``extras.progress`` events
    carry it: its phase (``resolving``, ``downloading``, ``building``, ``installing``,
    ``installed``) and the packages it counted so far."""

    phase: str = "resolving"
    resolved: int = 0
    downloaded: int = 0
    installed: int = 0

    def fields(self) -> dict[str, Any]:
        return asdict(self)


_PIP_RESOLVING = re.compile(r"^(?:Collecting|Processing|Obtaining|Requirement already satisfied)\b")
_PIP_DOWNLOADING = re.compile(r"^\s*(?:Downloading|Using cached)\b")
_PIP_BUILDING = re.compile(r"^\s*(?:Building wheels? for|Building editable for|Preparing metadata)")
_PIP_INSTALLING = re.compile(r"^Installing collected packages: (.*)")
_PIP_INSTALLED = re.compile(r"^Successfully installed (.*)")


def read_pip_line(line: str, steps: InstallSteps) -> None:
    """pip's console: each requirement it collects, each archive it fetches, the list it
    installs, the list it installed."""
    if _PIP_RESOLVING.match(line):
        steps.phase, steps.resolved = "resolving", steps.resolved + 1
    elif _PIP_DOWNLOADING.match(line):
        steps.phase, steps.downloaded = "downloading", steps.downloaded + 1
    elif _PIP_BUILDING.match(line):
        steps.phase = "building"
    elif match := _PIP_INSTALLING.match(line):
        steps.phase = "installing"
        steps.resolved = max(steps.resolved, len(match[1].split(",")))
    elif match := _PIP_INSTALLED.match(line):
        steps.phase, steps.installed = "installed", len(match[1].split())


class _LineFeed:
    """Splits an installer's output, as the pump reads it, into lines for ``on_line`` (a
    line redrawn after a carriage return counts each time; one over 64 KiB is cut)."""

    _MAX = 64 * 1024

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self._on_line = on_line
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        *lines, rest = re.split(rb"[\r\n]", self._partial + chunk)
        self._partial = rest[-self._MAX :]
        for line in filter(None, lines):
            self._on_line(line[: self._MAX].decode("utf-8", "replace"))


# --- one installer, tried until it succeeds ----------------------------------------------------


class Tool(NamedTuple):
    """An installer as :func:`run_installer` runs it: pip here, uv in ``fsm.extras.installer``."""

    #: ``pip`` or ``uv``: the ``installer`` field of the ``pip.*`` events, the process's name
    name: str
    #: what the messages call it: ``pip install``, ``uv pip install``
    command: str
    #: one try's command line, given a path it may write a log to
    argv: Callable[[Path], list[str]]
    #: What a failed try left: its network signature (None: not network-shaped) and the
    #: line that best says what failed. Called with the exit status, the console file, the
    #: path the try could log to (``argv`` got it too), the file the output is kept in
    #: (None: not kept) and the attempt's redactor.
    evidence: Callable[
        [int | None, Path, Path, Path | None, Redactor], tuple[Signature | None, str]
    ]
    #: reads its console's lines into its phase and counts (``extras.progress``)
    read_line: Callable[[str, InstallSteps], None]


def run_installer(
    tool: Tool,
    *,
    requirements: int,
    env: Mapping[str, str],
    deadline: Deadline,
    interrupt: InterruptFlag,
    tries: int,
    backoff_s: float,
    output_log: Path | None,
    redactor: Redactor,
) -> None:
    """Run ``tool`` until it succeeds, as both installers are run: supervised in its own
    process group (:func:`fsm.worker.supervise.supervise`), bounded by ``deadline``, stopped on
    ``interrupt``, a failure classified by ``tool.evidence`` and a network-shaped one tried
    again (``tries`` in all, exponential backoff from ``backoff_s``). ``env`` is the
    process's environment as it is. Its phase is reported as ``extras.progress`` events,
    its output kept in ``output_log`` (redacted; None: not kept). Raises as
    :func:`install` says."""
    log = structlog.get_logger().bind(installer=tool.name)
    what = tool.command
    shown_log = None if output_log is None else str(output_log)
    progress = Progress("extras", installer=tool.name, requirements=requirements,
                        **InstallSteps().fields())
    with tempfile.TemporaryDirectory(prefix=f"flash-{tool.name}-") as tmp:

        def once(attempt: int) -> None:
            log_path = Path(tmp, f"attempt{attempt}.log")
            argv = tool.argv(log_path)
            log.info("pip.try", **{"try": attempt}, tries=tries, requirements=requirements)
            console_path = Path(tmp, f"attempt{attempt}.console")
            steps = InstallSteps()
            progress.set(**steps.fields(), **{"try": attempt})

            def read(line: str) -> None:
                tool.read_line(line, steps)
                progress.set(**steps.fields())

            try:
                run = supervise(
                    argv, cwd=Path.cwd(), env=env, console_path=console_path, deadline=deadline,
                    stop_by=Deadline.never(),  # the grace is the installer's own, deadline or not
                    interrupt=interrupt, grace_s=STOP_GRACE_S, name=tool.name,
                    out_fd=None,  # not the runner's stream: summarised, and kept below
                    on_output=_LineFeed(read).feed,
                )
            except OSError as exc:
                raise FatalError(
                    _bounded(f"{what} failed: cannot start {argv[0]}: {exc}", redactor),
                    rule=rules.PIP_FAILED,
                ) from exc
            finally:
                _keep(output_log, console_path, f"{what}, try {attempt} of {tries}", redactor)
            if run.reason == "interrupted":
                raise Interrupted(interrupt.signum or signal.SIGTERM)
            if run.reason == "deadline":
                raise DeadlineExceeded(f"{what} did not finish before the run deadline")
            returncode = run.returncode if run.signal is None else -run.signal
            seconds = round(run.duration_s, 3)
            if returncode == 0:
                log.info("pip.installed", **{"try": attempt}, seconds=seconds,
                         packages=steps.installed, output=shown_log)
                return
            sig, line = tool.evidence(returncode, console_path, log_path, output_log, redactor)
            log.warning("pip.failed", **{"try": attempt},
                        failure_class="other" if sig is None else "network",
                        signature=None if sig is None else sig.name,
                        returncode=returncode, seconds=seconds, output=shown_log)
            if sig is None:
                raise FatalError(
                    _bounded(f"{what} failed (exit status {returncode}): {line}", redactor),
                    rule=rules.PIP_FAILED,
                )
            raise _NetworkFailure(sig, line)

        def delay(attempt: int, exc: Exception) -> float | None:
            if not isinstance(exc, _NetworkFailure):
                return None  # decided already: a build error is not retried
            wait = backoff(attempt, base_s=backoff_s, max_s=float("inf"), jitter=False)
            log.info("pip.backoff", **{"try": attempt}, seconds=wait)
            return wait

        # silent stretches (a big download) still report; the end event says ok=False on a raise
        with progress, progress.watch():
            try:
                Budget(deadline, interrupt).retry(once, tries=tries, delay=delay, what=what)
            except GaveUp as gave_up:
                last = gave_up.last
                if not isinstance(last, _NetworkFailure):
                    raise last from None
                if gave_up.why == "interrupted":
                    raise Interrupted(interrupt.signum or signal.SIGTERM) from None
                tried = f"{gave_up.tries} {'try' if gave_up.tries == 1 else 'tries'}"
                if gave_up.why == "deadline":
                    tried += " (no time left for another)"
                message = f"{what} failed (network: {last.sig.meaning}) after {tried}: {last.line}"
                raise RetriableError(_bounded(message, redactor), rule=rules.PIP_NETWORK) from None


def _keep(output_log: Path | None, console_path: Path, title: str, redactor: Redactor) -> None:
    """Append one try's console, redacted, to ``output_log`` (when kept; never raises)."""
    if output_log is None:
        return
    try:
        data = console_path.read_bytes()
    except FileNotFoundError:
        data = b""  # the installer never started
    except OSError as exc:
        data = f"(its output could not be read: {exc.strerror})\n".encode()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    _append(output_log, f"--- flash-bootstrap: {title} ---\n".encode() + redactor.bytes(data))


def _append(path: Path, data: bytes) -> None:
    try:
        with path.open("ab") as out:
            out.write(data)
    except OSError as exc:
        structlog.get_logger().warning("pip.output_not_kept", path=str(path),
                                       error=exc.strerror)


class _NetworkFailure(Exception):
    """One try of pip failed the way a network does: worth another."""

    def __init__(self, sig: Signature, line: str) -> None:
        super().__init__(sig.name)
        self.sig, self.line = sig, line


def _evidence(
    returncode: int | None, console_path: Path, log_path: Path, output_log: Path | None,
    redactor: Redactor,
) -> tuple[Signature | None, str]:
    """A failed run's network signature (None: not network-shaped) and its telling line,
    from the redacted ends of pip's console and log; copies the log's end to the kept
    output (``output_log``)."""
    console, log_text = _tail_text(console_path, redactor), _tail_text(log_path, redactor)
    # pip's verbose log without timestamps, cut before pip's own traceback
    log_lines = [_LOG_TIMESTAMP.sub("", line, count=1) for line in log_text.splitlines()]
    if "Exception information:" in log_lines:
        del log_lines[log_lines.index("Exception information:") :]
    if output_log is not None:
        _report_log(output_log, log_lines)
    line = _last_error_line(console, log_lines) or f"pip exited with status {returncode}"
    return network_signature(console + "\n" + log_text), line


def _tail_text(path: Path, redactor: Redactor) -> str:
    """The redacted last TAIL_BYTES of a file ("" when unreadable) from its first whole line
    when its start was cut: that line may begin inside a secret no redactor recognises."""
    try:
        data = redactor.tail_of(path, TAIL_BYTES)
        if path.stat().st_size > TAIL_BYTES:
            data = data.partition(b"\n")[2]
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _last_error_line(console: str, log_lines: Sequence[str]) -> str:
    """The line that best says what failed ("" if none): pip's last ``ERROR:`` console line;
    else a failed build subprocess's headline (the console line pip marks with a
    multiplication sign) and the last line it printed, looked up in the log too (with
    ``--log`` pip sends that output to the log only, "See above for output")."""
    lines = [line.strip() for line in console.splitlines()]
    if error := next((ln for ln in reversed(lines) if ln.startswith("ERROR:")), ""):
        return error
    headline = next((ln[1:].strip() for ln in reversed(lines) if ln.startswith(_CROSS)), "")
    if headline:
        cause = _subprocess_cause(lines) or _subprocess_cause(log_lines)
        return f"{headline}: {cause}" if cause else headline
    noise = ("note:", "hint:", "[notice]", "WARNING:", *_BOX)
    return next((ln for ln in reversed(lines) if ln and not ln.startswith(noise)), "")


def _subprocess_cause(lines: Sequence[str]) -> str:
    """The last line a failed subprocess printed, in pip's console or its log."""
    stripped = [line.strip() for line in lines]
    if "[end of output]" in stripped:  # the console's boxed copy of the output
        output = stripped[: len(stripped) - 1 - stripped[::-1].index("[end of output]")]
    elif starts := [i for i, ln in enumerate(stripped) if ln.startswith("Running command ")]:
        # the log: the output, then pip's ERROR line
        output = list(takewhile(lambda ln: not ln.startswith("ERROR:"), stripped[starts[-1] + 1 :]))
    else:
        return ""
    return next((ln for ln in reversed(output) if ln), "")


def _report_log(output_log: Path, log_lines: Sequence[str]) -> None:
    """Keep the end of pip's verbose log with its output: it holds what pip's console omits
    at its default verbosity (failed index fetches, a failed build's own output).
    ``log_lines`` are redacted already: here they are only cut."""
    telling = [line for line in log_lines if not _LOG_CHATTER.match(line)]
    tail = [line[:_REPORT_LINE_CHARS] for line in telling[-_REPORT_LINES:]]
    if not tail:
        return
    banner = "[flash-bootstrap] pip failed; the end of its verbose log:"
    _append(output_log, "\n".join([banner, *("  " + line for line in tail), ""]).encode(
        "utf-8", "replace"))


def _bounded(message: str, redactor: Redactor, limit: int = MESSAGE_CHARS) -> str:
    """``message`` redacted, on one line, at most ``limit`` characters, "..." where it was cut
    (``Redactor.line``: redacted before it is collapsed and cut, so no cut goes through a
    secret)."""
    line = redactor.line(message, limit + 1)
    return line if len(line) <= limit else line[: limit - 3] + "..."
