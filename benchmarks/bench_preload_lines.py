"""The preload of ``bench_preload.py`` (its defaults: 1 GB in 4 files, 50 MiB/s per
connection, 20 ms per request) on both hub lines, side by side in one run: 0.x with
hf_transfer, 0.x without it, and the newest line (hf_xet).

    python benchmarks/bench_preload_lines.py --py0 VENV0/bin/python --py VENV/bin/python

Each interpreter needs the project installed (``pip install -e .``); VENV0 also needs
``'huggingface_hub<1' hf_transfer``. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(python: str, *flags: str) -> dict[str, object]:
    out = subprocess.run([python, str(HERE / "bench_preload.py"), *flags],
                         capture_output=True, text=True, check=True).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--py0", required=True, help="python of a venv with huggingface_hub 0.x")
    parser.add_argument("--py", required=True, help="python of a venv with the newest hub")
    args = parser.parse_args()
    rows = {
        "0.x + hf_transfer": _run(args.py0),
        "0.x plain": _run(args.py0, "--no-accel"),
        "newest (hf_xet)": _run(args.py),
    }
    print(f"{'line':20} {'hub':>8} {'accel':>12} {'median s':>9}  requests/run")
    for name, r in rows.items():
        print(f"{name:20} {r.get('huggingface_hub')!s:>8} {r.get('accelerator')!s:>12} "
              f"{r.get('median_s')!s:>9}  {r.get('requests_per_run')}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
