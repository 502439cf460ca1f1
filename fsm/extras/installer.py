"""Which installer puts the payload's ``extra_pip`` in place, and uv's side of it (issue 15).

``uv pip install`` resolves, downloads and installs several times faster than pip. When
uv is there (:func:`find_uv`) and can do what pip would, InstallExtras runs
``uv pip install --python <the worker's interpreter> ...``; otherwise pip, as before.
``FLASH_INSTALLER`` (the runner's environment merged with the payload's ``env``) forces
one: ``pip``, ``uv`` or ``auto`` (the default).

Both installers get the same guarantees from :func:`fsm.extras.pip.run_installer`: a supervised
process group bounded by the deadline and stopped on a signal, output classified into
``pip-network`` (retried, then retriable) and ``pip-failed`` (fatal at once), every text
built from the output redacted by the attempt's redactor before it is cut. Each has its
own table of network signatures: :data:`fsm.extras.pip.NETWORK_SIGNATURES` for pip,
:data:`UV_NETWORK_SIGNATURES` for uv (measured against a local index that refuses, resets,
answers 503 and hangs; ``tests/test_uv.py`` keeps the messages).

What ``auto`` checks before it picks uv:

* ``extra_pip`` translates (:func:`uv_arguments`): every allowed pip option has a uv
  spelling (:data:`UV_SPELLINGS`) but ``--prefer-binary``, which uv lacks;
* pip is not configured in a way uv would ignore (:func:`pip_configuration`): uv reads
  neither pip's configuration files nor its ``PIP_*`` settings, so an image whose pip.conf
  names a mirror, or a payload that sets ``PIP_TARGET`` or ``PIP_INDEX_URL``, keeps pip.
  (pip's transport settings carry over, from the environment or a pip.conf that sets
  nothing else (:func:`pip_file_settings`): ``retries``, ``timeout`` and ``cert`` become
  ``UV_HTTP_RETRIES``, ``UV_HTTP_TIMEOUT`` and ``SSL_CERT_FILE`` unless those are set.)

``FLASH_INSTALLER=uv`` skips the second check (uv's own ``UV_*`` settings are the
operator's to give) and turns a failed first one into a fatal ``pip-failed`` naming the
option. uv never reads a configuration file (``--no-config``, ``UV_NO_CONFIG=1``), and
its settings that read host files are dropped like pip's (:func:`uv_env`).
"""

from __future__ import annotations

import configparser
import importlib
import math
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import structlog

from fsm import rules
from fsm.clock import Deadline
from fsm.errors import FatalError
from fsm.extras.pip import (
    _HOST_READING_SETTINGS,
    _OPTIONS,
    _SCHEME,
    ARCHIVE_SUFFIXES,
    InstallSteps,
    Tool,
    _bounded,
    _installer_env,
    _tail_text,
    run_installer,
)
from fsm.extras.pip import install as pip_install
from fsm.interrupt import InterruptFlag
from fsm.output.redact import Redactor
from fsm.policy.signatures import UV_NETWORK, Signature, Table

#: The environment variable that forces an installer: ``pip``, ``uv`` or ``auto``.
INSTALLER_SETTING = "FLASH_INSTALLER"
InstallerName = Literal["pip", "uv"]

# uv's own retries and read timeout, as pip's (fsm.extras.pip.PIP_RETRIES): uv's defaults (3
# retries with backoff, 30 s) cost ~11 s per request against a refusing index before our
# own tries; we retry the whole install, so uv only rides out a blip. Set (through
# UV_HTTP_RETRIES / UV_HTTP_TIMEOUT) unless the environment chooses: UV_* first, then pip's
# PIP_RETRIES / PIP_TIMEOUT / PIP_DEFAULT_TIMEOUT. uv's timeout is a read timeout: a long
# download that keeps moving is not cut by it (measured).
UV_RETRIES = 2
UV_TIMEOUT_S = 15


#: uv's network signatures (``fsm.policy.signatures``, where every signature table lives; tests/
#: test_uv.py keeps the real messages they were measured on).
UV_NETWORK_SIGNATURES: Table = UV_NETWORK
#: The first of :data:`UV_NETWORK_SIGNATURES` found in a text, if any.
uv_network_signature = UV_NETWORK_SIGNATURES.first


def classify_uv_output(text: str) -> Literal["network", "other"]:
    """``network`` when a failed uv's output shows a network failure, else ``other``."""
    return "network" if uv_network_signature(text) is not None else "other"


# --- finding uv -----------------------------------------------------------------------------


def find_uv(env: Mapping[str, str]) -> str | None:
    """The uv executable to run, or None: ``uv`` next to the runner's interpreter (where
    ``pip install 'flash-bootstrap[fast]'`` puts it), else the ``uv`` package's
    ``find_uv_bin()``, else ``uv`` on the ``PATH`` of ``env``."""
    beside = Path(sys.executable).parent / "uv"
    if _runnable(beside):
        return str(beside)
    try:
        found = importlib.import_module("uv").find_uv_bin()
    except (ImportError, AttributeError, OSError):
        found = None
    if isinstance(found, str) and _runnable(Path(found)):
        return found
    return shutil.which("uv", path=env.get("PATH", os.defpath))


def _runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# --- extra_pip in uv's words ------------------------------------------------------------------


class UvRefusal(NamedTuple):
    """An ``extra_pip`` entry uv cannot be given, and why (one line)."""

    option: str
    reason: str


class UvSpelling(NamedTuple):
    """How an allowed pip option is said to ``uv pip install``."""

    #: uv's arguments, ``{}`` standing for the option's value; empty for ``--upgrade`` and
    #: ``--upgrade-strategy`` (translated together); None: uv has no such option
    args: tuple[str, ...] | None
    #: what docs/running.md's table says of it (a test keeps the two in step)
    note: str


#: Each allowed pip option (:data:`fsm.extras.pip.EXTRA_PIP_OPTIONS`, by its first name) in uv's
#: words, checked against uv's real command line (uv takes most of pip's spellings as
#: hidden aliases; the translation uses uv's own names).
UV_SPELLINGS: dict[str, UvSpelling] = {
    "--index-url": UvSpelling(("--index-url", "{}"), "the same"),
    "--extra-index-url": UvSpelling(
        ("--extra-index-url", "{}"),
        "the same; the best version across all indexes wins, as with pip "
        "(`--index-strategy unsafe-best-match` unless `UV_INDEX_STRATEGY` is set)",
    ),
    "--find-links": UvSpelling(("--find-links", "{}"), "the same"),
    "--no-index": UvSpelling(("--no-index",), "the same"),
    "--pre": UvSpelling(("--prerelease", "allow"), "`--prerelease allow`"),
    "--no-deps": UvSpelling(("--no-deps",), "the same"),
    "--upgrade": UvSpelling(
        (),
        "`--upgrade-package NAME` for each named requirement: pip's `only-if-needed` "
        "(uv's own `--upgrade` would upgrade every dependency)",
    ),
    "--force-reinstall": UvSpelling(("--reinstall",), "`--reinstall`"),
    "--upgrade-strategy": UvSpelling(
        (), "`eager` with `--upgrade`: uv's `--upgrade`; `only-if-needed`: as above"
    ),
    "--only-binary": UvSpelling(("--only-binary", "{}"), "the same"),
    "--no-binary": UvSpelling(("--no-binary", "{}"), "the same"),
    "--prefer-binary": UvSpelling(
        None, "none: auto uses pip, `FLASH_INSTALLER=uv` fails (`pip-failed`)"
    ),
    "--trusted-host": UvSpelling(("--allow-insecure-host", "{}"), "`--allow-insecure-host`"),
}


def uv_arguments(entries: Sequence[str]) -> list[str] | UvRefusal:
    """``extra_pip`` as ``uv pip install`` arguments (options first, then the
    requirements as given), or why uv cannot take it."""
    options: list[str] = []
    requirements: list[str] = []
    upgrade = eager = False
    pending = iter(entries)
    for entry in pending:
        if not entry.startswith("-"):
            requirements.append(entry)
            continue
        name, eq, value = entry.partition("=") if entry.startswith("--") else (entry, "", "")
        option = _OPTIONS.get(name)
        if option is None:
            return UvRefusal(name, "not an allowed pip option")
        if option.value is None and eq:
            return UvRefusal(name, f"{name} takes no value")
        if option.value is not None and not eq:
            if (following := next(pending, None)) is None:
                return UvRefusal(name, f"{name} needs a value")
            value = following
        canonical = option.names[0]
        spelling = UV_SPELLINGS[canonical].args
        if spelling is None:
            return UvRefusal(name, f"uv pip install has no {canonical}")
        if canonical == "--upgrade":
            upgrade = True
        elif canonical == "--upgrade-strategy":
            eager = value == "eager"  # its values were checked with the payload (refused_extra_pip)
        else:
            options += [value if arg == "{}" else arg for arg in spelling]
    if upgrade and eager:
        options.append("--upgrade")
    elif upgrade:
        for project in _named_projects(requirements):
            options += ["--upgrade-package", project]
    return [*options, *requirements]


def _named_projects(requirements: Sequence[str]) -> list[str]:
    """The project names of the PEP 508 requirements (``name @ url`` included) among
    ``requirements``; plain URLs and paths name none."""
    from packaging.requirements import InvalidRequirement, Requirement  # only when needed

    names: list[str] = []
    for entry in requirements:
        if _SCHEME.match(entry) or ("@" not in entry and entry.lower().endswith(ARCHIVE_SUFFIXES)):
            continue  # a URL or a path: no name to upgrade
        try:
            names.append(Requirement(entry).name)
        except InvalidRequirement:
            continue  # uv will say what is wrong with it
    return names


# --- the environment ----------------------------------------------------------------------------

#: uv settings that would make uv read (and quote in its errors) a file of the host, run in
#: another directory or look for a project, or pick another interpreter: the twins of what
#: extra_pip may not carry. uv runs without them (and with UV_NO_CONFIG=1).
_UV_HOST_READING_SETTINGS = _HOST_READING_SETTINGS | frozenset({
    "UV_CONFIG_FILE", "UV_CONSTRAINT", "UV_OVERRIDE", "UV_EXCLUDE", "UV_BUILD_CONSTRAINT",
    "UV_WORKING_DIR", "UV_PROJECT", "UV_ENV_FILE", "UV_KEYRING_PROVIDER", "UV_PYTHON",
    "UV_SYSTEM_PYTHON",
})
#: pip settings that uv honours through its own (see :func:`uv_env`), or that change nothing
#: about what is installed where: their presence does not keep auto from choosing uv.
_PIP_NEUTRAL_SETTINGS = frozenset({
    "PIP_RETRIES", "PIP_TIMEOUT", "PIP_DEFAULT_TIMEOUT", "PIP_CERT",
    "PIP_NO_CACHE_DIR", "PIP_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_NO_INPUT",
    "PIP_ROOT_USER_ACTION", "PIP_PROGRESS_BAR", "PIP_NO_COLOR", "PIP_NO_WARN_SCRIPT_LOCATION",
    "PIP_QUIET", "PIP_VERBOSE", "PIP_LOG", "PIP_LOG_FILE",
})
#: pip's configuration file for the whole machine, besides the XDG ones (pip's own list).
_GLOBAL_PIP_CONFIG = Path("/etc/pip.conf")


def uv_env(env: Mapping[str, str]) -> dict[str, str]:
    """uv's environment: ``env`` less the settings that make uv (or pip) read host files,
    with ``UV_NO_CONFIG=1``, uv's retries and read timeout (:data:`UV_RETRIES`,
    :data:`UV_TIMEOUT_S`, or pip's settings of them) and pip's CA bundle unless set."""
    kept = _installer_env(env, "uv", _UV_HOST_READING_SETTINGS)
    kept["UV_NO_CONFIG"] = "1"
    if not kept.get("UV_HTTP_RETRIES"):
        retries = env.get("PIP_RETRIES", "").strip()
        kept["UV_HTTP_RETRIES"] = retries if retries.isdigit() else str(UV_RETRIES)
    if not kept.get("UV_HTTP_TIMEOUT"):
        timeout = _seconds(env.get("PIP_TIMEOUT") or env.get("PIP_DEFAULT_TIMEOUT"))
        kept["UV_HTTP_TIMEOUT"] = str(timeout or UV_TIMEOUT_S)
    if env.get("PIP_CERT") and not kept.get("SSL_CERT_FILE"):
        kept["SSL_CERT_FILE"] = env["PIP_CERT"]
    return kept


def _seconds(value: str | None) -> int | None:
    """A positive number of seconds as uv takes it (whole, rounded up), or None."""
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        return None
    return math.ceil(seconds) if 0 < seconds < float("inf") else None


def pip_configuration(env: Mapping[str, str], python: str) -> list[str]:
    """What configures pip here that uv would not read: ``PIP_*`` settings that change what
    is installed or where (``PIP_TARGET``, ``PIP_INDEX_URL``, ...; not the transport and
    cosmetic ones, nor those pip is not given anyway), and the configuration files pip
    would load (XDG and /etc, the user's, the interpreter's prefix) that set any such
    option, or cannot be read."""
    ignored = _HOST_READING_SETTINGS | _PIP_NEUTRAL_SETTINGS
    found = sorted(k for k in env if k.startswith("PIP_") and k not in ignored)
    files = [str(path) for path, settings in _pip_files(env, python).items()
             if settings is None or set(settings) - ignored]
    return found + files


def pip_file_settings(env: Mapping[str, str], python: str) -> dict[str, str]:
    """The transport and cosmetic settings pip's configuration files give (an image's
    ``cert``, ``timeout``, ``retries``), as ``PIP_*`` names, the later file winning as in
    pip: what :func:`uv_env` carries over to uv."""
    return {k: v for settings in _pip_files(env, python).values()
            for k, v in (settings or {}).items() if k in _PIP_NEUTRAL_SETTINGS}


def _pip_files(env: Mapping[str, str], python: str) -> dict[Path, dict[str, str] | None]:
    """pip's configuration files that exist here, in pip's order, each with its options
    as ``PIP_*`` names (None: it cannot be read or parsed)."""
    xdg_dirs = env.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d, "pip", "pip.conf") for d in xdg_dirs.split(":") if d]
    files.append(_GLOBAL_PIP_CONFIG)
    home = env.get("HOME")
    if home:
        files.append(Path(home, ".pip", "pip.conf"))
    config_home = env.get("XDG_CONFIG_HOME") or (f"{home}/.config" if home else "")
    if config_home:
        files.append(Path(config_home, "pip", "pip.conf"))
    files.append(Path(python).parent.parent / "pip.conf")
    return {path: _pip_options(path) for path in files if path.is_file()}


def _pip_options(path: Path) -> dict[str, str] | None:
    """The options a pip configuration file sets, as ``PIP_*`` names (None: unreadable)."""
    parser = configparser.RawConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except (OSError, UnicodeError, configparser.Error):
        return None
    return {"PIP_" + key.upper().replace("-", "_"): value
            for section in parser.sections() for key, value in parser[section].items()}


# --- the choice -----------------------------------------------------------------------------------


class Choice(NamedTuple):
    """The installer InstallExtras runs, and why."""

    installer: InstallerName
    reason: str
    #: the uv executable (uv only)
    uv: str | None = None
    #: ``extra_pip`` in uv's words (uv only)
    args: tuple[str, ...] = ()


def choose(requirements: Sequence[str], env: Mapping[str, str], python: str) -> Choice:
    """The installer for ``requirements`` (``extra_pip``) under ``env``'s
    ``FLASH_INSTALLER``; raises :class:`FatalError` (rule ``pip-failed``) when that names
    no installer, or forces uv and uv is missing or cannot take an entry."""
    raw = env.get(INSTALLER_SETTING, "")
    setting = raw.strip().lower() or "auto"
    if setting not in ("auto", "pip", "uv"):
        raise FatalError(f"{INSTALLER_SETTING}={raw!r} is not pip, uv or auto",
                         rule=rules.PIP_FAILED)
    if setting == "pip":
        return Choice("pip", f"{INSTALLER_SETTING}=pip")
    uv = find_uv(env)
    if uv is None:
        if setting == "uv":
            raise FatalError(
                f"{INSTALLER_SETTING}=uv, but no uv executable was found (next to "
                f"{sys.executable}, in the uv package, on PATH)",
                rule=rules.PIP_FAILED,
            )
        return Choice("pip", "no uv executable found")
    args = uv_arguments(requirements)
    if isinstance(args, UvRefusal):
        if setting == "uv":
            raise FatalError(
                f"uv cannot install extra_pip: {args.option}: {args.reason} "
                f"({INSTALLER_SETTING}=uv; auto would use pip)",
                rule=rules.PIP_FAILED,
            )
        return Choice("pip", f"uv cannot take {args.option}: {args.reason}")
    configured = pip_configuration(env, python)
    if setting == "auto" and configured:
        return Choice("pip", f"pip is configured ({', '.join(configured)}), and uv does not "
                             "read pip's configuration")
    if configured:
        structlog.get_logger().warning("pip.settings_ignored", installer="uv", keys=configured,
                                       reason="uv does not read pip's configuration")
    reason = f"{INSTALLER_SETTING}=uv" if setting == "uv" else "uv found"
    return Choice("uv", reason, uv, tuple(args))


# --- the install ----------------------------------------------------------------------------------


def install(
    requirements: Sequence[str],
    *,
    env: Mapping[str, str],
    deadline: Deadline,
    interrupt: InterruptFlag,
    python: str = sys.executable,
    tries: int = 3,
    backoff_s: float = 2.0,
    output_log: Path | None = None,
    redactor: Redactor | None = None,
) -> InstallerName | None:
    """Install ``requirements`` (``extra_pip``) into ``python``'s environment with the
    installer :func:`choose` picks, and return its name (None: nothing to install).

    Its keyword arguments repeat :func:`fsm.extras.pip.install`'s on purpose: this is the front
    that picks the installer and forwards them unchanged, and ``fsm.extras.pip.install`` stays a
    whole pip installer on its own (its tests and the benchmarks call it). What the two
    installers share is not repeated: both run through :func:`fsm.extras.pip.run_installer`, the
    one loop of tries, backoff, deadline, interrupt, progress and output log, each with its
    :class:`fsm.extras.pip.Tool` (argv, evidence, console reader).

    Raises as :func:`fsm.extras.pip.install` does, whichever installer ran: :class:`RetriableError`
    (``pip-network``) after ``tries`` network-shaped failures, :class:`FatalError`
    (``pip-failed``) on any other failure or an impossible choice,
    :class:`DeadlineExceeded` and :class:`Interrupted`, the installer stopped in each case.
    Either one's whole output is kept in ``output_log`` (redacted, appended) when given.
    """
    if not requirements:
        return None
    redactor = Redactor() if redactor is None else redactor
    try:
        choice = choose(requirements, env, python)
    except FatalError as exc:
        raise FatalError(_bounded(exc.message, redactor), rule=rules.PIP_FAILED) from None
    structlog.get_logger().info("pip.installer", installer=choice.installer,
                                reason=_bounded(choice.reason, redactor), uv=choice.uv)
    if choice.installer == "pip":
        pip_install(requirements, env=env, deadline=deadline, interrupt=interrupt, python=python,
                    tries=tries, backoff_s=backoff_s, output_log=output_log, redactor=redactor)
        return "pip"
    assert choice.uv is not None
    uv_argv = [choice.uv, "pip", "install", "--python", python, "--no-config", "--color", "never"]
    if not env.get("UV_INDEX_STRATEGY"):
        uv_argv += ["--index-strategy", "unsafe-best-match"]  # pip's: the best across indexes
    uv_argv += choice.args
    # An image's pip.conf (its CA bundle, timeout, retries) carries over, the environment's
    # own settings first.
    uv_environ = uv_env({**pip_file_settings(env, python), **env})
    uv_tool = Tool("uv", "uv pip install", lambda _log_path: uv_argv, _uv_evidence, read_uv_line)
    run_installer(uv_tool, requirements=len(requirements), env=uv_environ, deadline=deadline,
                  interrupt=interrupt, tries=tries, backoff_s=backoff_s, output_log=output_log,
                  redactor=redactor)
    return "uv"


# uv's console at its default verbosity: one summary line per phase, as it ends.
_UV_STEP = re.compile(r"^(Resolved|Prepared|Uninstalled|Installed|Audited) (\d+) packages?\b")
_UV_BUILDING = re.compile(r"^\s*Buil(?:ding|t) ")
#: Each summary line's step: the phase that follows it, and the count it gives (None: none;
#: ``Audited``: everything was there already).
_UV_STEPS: dict[str, tuple[str, str | None]] = {
    "Resolved": ("downloading", "resolved"), "Prepared": ("installing", "downloaded"),
    "Uninstalled": ("installing", None), "Installed": ("installed", "installed"),
    "Audited": ("installed", None),
}


def read_uv_line(line: str, steps: InstallSteps) -> None:
    """uv's console: ``Resolved N packages`` (then it downloads), ``Prepared N packages``
    (then it installs), ``Installed N packages`` or ``Audited N packages`` (done)."""
    if _UV_BUILDING.match(line):
        steps.phase = "building"
    elif match := _UV_STEP.match(line):
        steps.phase, counted = _UV_STEPS[match[1]]
        if counted is not None:
            setattr(steps, counted, int(match[2]))


_CAUSE = re.compile(r"^\s*(?:cause|Caused by):\s*(.*?)\s*$")
_SUBPROCESS_OUTPUT = ("[stderr]", "--- stderr", "[stdout]", "--- stdout")


def _uv_evidence(
    returncode: int | None, console_path: Path, _log_path: Path, _output_log: Path | None,
    redactor: Redactor,
) -> tuple[Signature | None, str]:
    """A failed uv's network signature and telling line, from its redacted console."""
    console = _tail_text(console_path, redactor)
    line = _uv_error_line(console) or f"uv exited with status {returncode}"
    return uv_network_signature(console), line


def _uv_error_line(console: str) -> str:
    """uv's last ``error:`` with what explains it, on one line: the URL it failed to fetch
    (when the headline lacks it), the root cause, and the last line a failed build or git
    printed. "" when uv printed no error."""
    lines = console.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    if not starts:
        noise = ("Using Python", "hint:", "warning:")
        return next((ln.strip() for ln in reversed(lines)
                     if ln.strip() and not ln.strip().startswith(noise)), "")
    head = lines[starts[-1]].strip()
    causes: list[str] = []
    output_last, in_output = "", False
    for line in lines[starts[-1] + 1 :]:
        if cause := _CAUSE.match(line):
            causes.append(cause.group(1))
            in_output = False
            continue
        text = line.strip()
        if text.startswith("hint:"):
            break
        if text in _SUBPROCESS_OUTPUT:
            in_output = True
        elif in_output and text:
            output_last = text
    parts = [head]
    fetch = next((c for c in causes if c.startswith("Failed to ")), None)
    if fetch and "Failed to " not in head and fetch != causes[-1]:
        parts.append(fetch)
    parts += causes[-1:]
    if output_last:
        parts.append(output_last)
    return ": ".join(parts)
