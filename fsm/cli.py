"""The command line of CONTRACT section 2: run, validate, demo, diagram, policy, and the
operator's status and explain.

Bad input never shows a traceback: it ends with exit status 2 and one line on stderr
naming the problem.

The process starts in ``fsm.launch`` (descriptors 0, 1 and 2 reopened, and for ``run`` the
signal handlers and the early starts, before this module is imported). ``run`` writes its
stdout and stderr through outlets that never block or raise, and leaves with ``os._exit``
once its last line is written (within a short bound): a library's lingering non-daemon threads
(huggingface_hub's download pool) cannot keep a finished runner alive.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from fsm import exits, interrupt
from fsm.output import outlet

PROG = "flash-bootstrap"
EXIT_INTERNAL = exits.INTERNAL.code  # a defect escaped the runner (never expected)
#: The demo's scenarios (fsm.ops.demo.SCENARIOS; a test keeps the two in step). Named here so
#: that ``run`` does not pay for importing the demo.
DEMO_SCENARIOS = (
    "crash", "crash-after-done", "deadline", "gpu-fault", "heartbeat-retriable", "preload",
    "spilled-spec", "success", "upload-lost",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Bootstrap one training attempt on a GPU host.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run one attempt (the container entrypoint)")
    run.add_argument(
        "--payload", help="payload file [FLASH_PAYLOAD_PATH, /root/flash/payload.json]"
    )
    run.add_argument("--store", help="file:///abs/dir for a local store [FLASH_STORE, the Hub]")
    run.add_argument("--code-root", help="where code/** is fetched [FLASH_CODE_ROOT, /runcode]")
    run.add_argument(
        "--scratch-dir", help="console, spec and marker copies [FLASH_SCRATCH_DIR, /tmp]"
    )

    demo = sub.add_parser("demo", help="run a real attempt on a temporary local store")
    demo.add_argument("--scenario", default="success", choices=DEMO_SCENARIOS)
    demo.add_argument("--keep", metavar="DIR", help="lay the demo out in DIR and keep it")

    validate = sub.add_parser("validate", help="check a payload against the contract")
    validate.add_argument("payload")

    diagram = sub.add_parser("diagram", help="draw the machine")
    diagram.add_argument("--format", default="mermaid", choices=["mermaid", "dot", "svg", "png"])
    diagram.add_argument("-o", "--output", metavar="FILE")
    diagram.add_argument("--marker", metavar="MARKER_JSON", help="highlight one attempt's path")

    sub.add_parser("policy", help="print the failure-classification table")

    status = sub.add_parser("status", help="list the attempts under a run's prefix")
    _fleet_options(status)
    status.add_argument("--json", action="store_true", help="JSON instead of a table")
    status.add_argument(
        "--recursive", action="store_true",
        help="the latest attempt of every run in a folder below the prefix, and a summary",
    )

    explain = sub.add_parser("explain", help="one attempt: its marker, rule, console tail and path")
    _fleet_options(explain)
    explain.add_argument("--attempt", required=True, type=_attempt_number, metavar="N")
    explain.add_argument("--arm", help="the arm, when several ran attempt N")
    return parser


#: The default ``--timeout`` of status and explain: the bound of all their store calls.
FLEET_DEFAULT_TIMEOUT_S = 60.0


def _fleet_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", required=True, help="the dataset repo, org/name")
    parser.add_argument("--prefix", required=True, help="the run's folder in it (hf_prefix)")
    parser.add_argument("--store", help="file:///abs/dir for a local store [FLASH_STORE, the Hub]")
    parser.add_argument(
        "--timeout", type=_seconds, default=FLEET_DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help=f"bound of all store calls together [{FLEET_DEFAULT_TIMEOUT_S:g}]",
    )


def _attempt_number(text: str) -> int:
    from fsm.payload import MAX_ATTEMPT

    if not (text.isascii() and text.isdigit()) or int(text) > MAX_ATTEMPT:
        raise argparse.ArgumentTypeError(
            f"expected an attempt number from 0 to {MAX_ATTEMPT:,}, got {text[:40]!r}"
        )
    return int(text)


def _seconds(text: str) -> float:
    import math

    with contextlib.suppress(ValueError):
        if 0 < (value := float(text)) < math.inf:  # not nan either
            return value
    raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text[:40]!r}")


def entrypoint() -> NoReturn:
    """The console script (and ``python -m fsm``): run, flush, and leave at once."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's own exits
        code = exc.code if isinstance(exc.code, int) else 2
    except BrokenPipeError as exc:  # ``| head -1``: the reader is gone (not for ``run``,
        # whose output never raises: one escaping it is a defect)
        if sys.argv[1:2] == ["run"] or not _stdout_reader_gone():
            code = _defect(exc)
        else:
            _die_of_sigpipe()
    except BaseException as exc:
        code = _defect(exc)
    outlet.leave(code)
    raise AssertionError("unreachable")  # pragma: no cover - leave() ends the process


def _defect(exc: BaseException) -> int:
    """A defect: still one line, still leave. (An attempt's own defects end inside
    run_attempt, where its secrets are known; none are here.) ``run`` still leaves its
    termination message (fsm.worker.termination)."""
    reason = f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
    _last_say(reason)
    if sys.argv[1:2] == ["run"]:
        from fsm.output.redact import Redactor
        from fsm.worker import termination

        with contextlib.suppress(Exception):
            termination.write(os.environ, Redactor([os.environ.get("HF_TOKEN") or ""]),
                              status=EXIT_INTERNAL, reason=reason)
    return EXIT_INTERNAL


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe or socket whose reader has gone (``| head -1`` done):
    poll reports an error on a write end with no reader left."""
    import select

    try:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _die_of_sigpipe() -> NoReturn:
    """Leave as a Unix tool leaves a pipe whose reader has gone: silently, killed by SIGPIPE
    (the shell sees 141). The commands other than ``run`` write their output with plain
    ``print``, and Python ignores SIGPIPE, so the write raised instead; ``run``'s own output
    goes through outlets that never raise, and it ends with its attempt's status."""
    import signal

    with contextlib.suppress(OSError):  # nothing more may reach the dead pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(128 + signal.SIGPIPE)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_without_repeated_command(argv))
    commands = {"run": _run, "validate": _validate, "demo": _demo, "diagram": _diagram,
                "policy": _policy, "status": _fleet, "explain": _fleet}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        _last_say("interrupted")
        return 130


def _without_repeated_command(argv: Sequence[str] | None) -> list[str]:
    """The image's ENTRYPOINT is ``flash-bootstrap run`` and CONTRACT section 1 launches it as
    ``docker run ... "$IMAGE" flash-bootstrap run``: docker appends the command to the
    entrypoint, so the runner sees ``run flash-bootstrap run``. Both are fixed outside this
    program, so the repeated words are taken as the one ``run`` they mean."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:3] == ["run", PROG, "run"]:
        del args[1:3]
    return args


def _say(line: str) -> None:
    with contextlib.suppress(Exception):  # a closed or broken stderr: the status still counts
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _last_say(line: str) -> None:
    """The process's last line: no log event may follow it."""
    from fsm.output import log

    log.silence()
    _say(line)


def _run(args: argparse.Namespace) -> int:
    if args.store is not None and (problem := _store_url_problem(args.store)):
        _say(problem)
        return 2
    from fsm.attempt.runner import run_attempt
    from fsm.context import Settings
    from fsm.hub import spawn as hub_spawn
    from fsm.output import log

    environ = dict(os.environ)  # as given: the worker's environment is built from it
    outlet.install()  # from here on the runner's own output can neither raise nor block it
    log.configure()
    log.quiet_libraries()  # this process's own: no library bars or text among the events
    hub_spawn.report()
    settings = Settings.resolve(environ, payload=args.payload, store=args.store,
                                code_root=args.code_root, scratch_dir=args.scratch_dir)
    outcome = run_attempt(settings, environ, interrupt=interrupt.PROCESS_FLAG, say=_last_say,
                          hard_exit=outlet.leave)
    hub_spawn.finish()
    _last_say(outcome.reason)
    return outcome.exit_code


def _store_url_problem(url: str) -> str | None:
    if url.startswith(("file:///", "http://", "https://")):
        return None
    if url.startswith("file://"):
        return f"--store {url!r}: a local store is file:///absolute/dir"
    return f"--store {url!r}: expected file:///abs/dir or an http(s) Hub endpoint"


def _fleet(args: argparse.Namespace) -> int:
    """status and explain: what the runners left under one prefix (fsm.ops.fleet)."""
    from fsm.ops import fleet

    problem = fleet.arguments_problem(args.repo, args.prefix, getattr(args, "arm", None))
    url = args.store if args.store is not None else os.environ.get("FLASH_STORE") or None
    if problem is None and url is not None:
        problem = _store_url_problem(url)
        if problem and args.store is None:
            problem = f"FLASH_STORE={url!r}: " + problem.removeprefix(f"--store {url!r}: ")
    if problem:
        from fsm.output.redact import Redactor  # a URL's credentials, or the token, are not echoed

        _say(Redactor([os.environ.get("HF_TOKEN") or ""]).text(problem))
        return 2
    common: dict[str, Any] = {"repo": args.repo, "prefix": args.prefix, "url": url,
                              "environ": os.environ, "timeout_s": args.timeout, "say": _say}
    if args.command == "status":
        return fleet.status(as_json=args.json, recursive=args.recursive, **common)
    return fleet.explain(attempt=args.attempt, arm=args.arm, **common)


def _validate(args: argparse.Namespace) -> int:
    from fsm.errors import PayloadError
    from fsm.payload import parse, read_raw

    try:
        payload = parse(read_raw(Path(args.payload)))
    except PayloadError as exc:
        _say(f"payload unusable: {exc}")
        return 2
    dest = payload.dest
    print(json.dumps({"valid": True, "mode": payload.mode, "marker": dest.path(dest.marker_name),
                      "hf_repo": dest.hf_repo}))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from fsm.ops.demo import run_demo

    return run_demo(args.scenario, keep=Path(args.keep) if args.keep else None)


def _policy(args: argparse.Namespace) -> int:
    from fsm.policy import render_table

    print(render_table())
    return 0


def _diagram(args: argparse.Namespace) -> int:
    from fsm.ops import diagram

    marker = None
    if args.marker:
        try:
            marker = json.loads(Path(args.marker).read_text())
        except (OSError, ValueError) as exc:
            _say(f"--marker {args.marker}: not a readable JSON marker ({exc})")
            return 2
    try:
        data = diagram.render(args.format, marker=marker)
    except diagram.DiagramUnavailable as exc:
        _say(str(exc))
        return 2
    if args.output:
        Path(args.output).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0
