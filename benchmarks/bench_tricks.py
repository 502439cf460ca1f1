"""What each start-up trick that reaches into another library's import is worth (issue 38,
item 4): the process with the trick against the same process without it, timed whole
from outside by the workplace's ``farm-bench`` (A/B in turn, medians and the pairwise
ratio), on the huggingface_hub line installed here.

    python benchmarks/bench_tricks.py [--runs 15]

Each pair is one process that does what the runner or the agent does at start, with every
trick (A) and with one taken away (B):

* ``agent``: the agent's load of the library (``fsm.hub.library.load_library``), against
  the same load with ``idna``/``truststore``/``yaml`` not deferred, with ``anyio``,
  ``brotli``, ``chardet``... not blocked, and with tqdm's own lock (which imports
  ``multiprocessing`` and opens a semaphore) made at the first progress bar;
* ``runner``: the runner's import of structlog (``fsm.launch``), against the same import
  with ``asyncio`` not deferred, and with ``rich`` not blocked.

A trick stays only where it saves at least 10 ms on the image's line (docs/startup.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

AGENT = ("from fsm.hub import library; {change}library.load_library(); "
         "from tqdm import tqdm; tqdm.get_lock()")
RUNNER = ("from fsm import deferred; {change}"
          "deferred.defer(deferred.UNUSED_BEFORE_THE_WORKER); "
          "deferred.import_without('structlog', deferred.OPTIONAL_FOR_STRUCTLOG); "
          "import structlog; structlog.get_logger('x')")

PAIRS: dict[str, tuple[str, str]] = {
    "agent: idna, truststore, yaml deferred": (
        AGENT, "library.UNUSED_BY_THE_CALLS = (); "),
    "agent: anyio, brotli, chardet... blocked": (
        AGENT, "library.OPTIONAL_FOR_THE_CALLS = (); "),
    "agent: tqdm's lock a thread lock": (
        AGENT, "library._thread_lock_for_bars = lambda: None; "),
    "runner: asyncio deferred": (
        RUNNER, "deferred.UNUSED_BEFORE_THE_WORKER = (); "),
    "runner: rich blocked for structlog": (
        RUNNER, "deferred.OPTIONAL_FOR_STRUCTLOG = (); "),
}



def _bench(with_trick: str, without: str, runs: int) -> str:
    proc = subprocess.run(
        ["farm-bench", "-n", str(runs), "--warmup", "2", "--timeout", "600",
         "--vs", f"{sys.executable} -c \"{without}\"",
         "--", sys.executable, "-c", with_trick],
        capture_output=True, text=True, check=False)
    return proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    for name, (template, change) in PAIRS.items():
        print(f"== {name}: A with the trick, B without it")
        print(_bench(template.format(change=""), template.format(change=change), args.runs))


if __name__ == "__main__":
    main()
