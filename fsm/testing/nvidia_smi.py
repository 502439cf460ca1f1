"""A fake ``nvidia-smi`` that answers nvidia-smi's selective queries from a declared host
state, printing what the real tool prints: for the runner's tests, and for worker authors who
want to see how their job meets a sick, busy or vanishing GPU without owning one.

    from fsm.testing.nvidia_smi import FakeApp, FakeGpu, FakeHost, FakeNvidiaSmi

    host = FakeHost.h100s(8)
    host.gpus[3].ecc_uncorrected = 2                 # a sick GPU
    host.apps.append(FakeApp(host.gpus[0].uuid, pid=4242, used_memory_mib=30000))
    with FakeNvidiaSmi(tmp_path / "smi", host) as fake:
        env = fake.env()                             # PATH with the fake first
        ...                                          # run the runner with env
        host.gpus[5].unreachable = "Unknown Error"   # mid-run: NVML loses GPU 5
        fake.set(host)                               # the next call answers from this
        assert any("--query-compute-apps" in a[0] for a in fake.calls())

The executable is a two-line shell script that imports this file with the interpreter that
created it (``python -I -S``: the standard library only, no site packages): each call reads
the state file afresh, so a test changes the host between two calls with :meth:`set`.
:func:`render` is the same answer as a pure function, for tests that need no process.

It answers ``--query-gpu``, ``--query-remapped-rows``, ``--query-compute-apps`` (each with
``--format=csv[,noheader][,nounits]``, optionally ``-i``) and ``-L``; anything else is refused.
A hang (``FakeHost.hang``) sleeps until killed: :meth:`FakeNvidiaSmi.stop` (or leaving the
``with`` block) kills whatever the fake left hanging. A delay (``FakeHost.delay``, per
switch) answers correctly but slowly, as the real tool does on large hosts [14].

Where each format detail comes from; the code cites these by number. Details no source
showed are marked *assumed*.

[1] ``nvidia-smi -h`` of driver 590.48.01 on an H100: "SELECTIVE QUERY OPTIONS ... [one of]
    --query-gpu ... --query-compute-apps ... --query-remapped-rows ... [mandatory]
    --format= ... csv - comma separated values (MANDATORY), noheader - skip the first line
    with column headers, nounits - don't print units for numerical values". Captured in
    utkuozdemir/nvidia_gpu_exporter, internal/captures/
    linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt (a file of real outputs).
[2] The same capture, ``--query-gpu=... --format=csv``: a header of the canonical field
    names joined by ", ", units in brackets (``memory.total [MiB]``), values joined by ", "
    with units (``81559 MiB``, ``0 MiB``); ``[N/A]`` for what the GPU does not support
    (``retired_pages.*`` on an H100), bare ``N/A`` (``fabric.health.*``), an empty field
    (``platform.chassis_serial_number``), ``[Requested functionality has been
    deprecated]``; ``pci.bus_id`` as ``00000000:00:09.0``; ``index`` 0-based. Its ``-L``:
    ``GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)``.
[3] The same capture, ``--query-compute-apps=...,gpu_uuid,pid,process_name,used_gpu_memory
    --format=csv``: header ``... gpu_uuid, pid, process_name, used_gpu_memory [MiB]``, rows
    ``..., 11327, /root/tools/memhog, 2566 MiB``; with no process, the header and no row.
[4] ``--help-query-gpu`` (the same capture; and driver 535.129.03's, quoted in
    XueSongTap/XueSongTap.github.io, _posts/2024-01-04-nvidia-smi-more.md): the fields and
    their aliases (``"uuid" or "gpu_uuid"``, ``"name" or "gpu_name"``, ``"pci.bus_id" or
    "gpu_bus_id"``, ``"retired_pages.single_bit_ecc.count" or "retired_pages.sbe"``, ...),
    ``ecc.errors.uncorrected.volatile.total`` ("volatile error counters track the number of
    errors detected since the last driver load"), ``retired_pages.pending``, the timestamp
    format "YYYY/MM/DD HH:MM:SS.msec". On 535 ``remapped_rows.*`` are *not* ``--query-gpu``
    fields (on 590 they are): the fake refuses them there, as 535 does.
[5] ``--help-query-compute-apps`` (the same capture, and NVIDIA A40 output in the public
    code index): ``gpu_name``, ``gpu_bus_id``, ``gpu_serial``, ``gpu_uuid``, ``pid``,
    ``"process_name" or "name"``, ``"used_gpu_memory" or "used_memory"``.
[6] A header names the canonical field whatever alias was asked:
    ``--query-gpu=gpu_name,gpu_bus_id,vbios_version --format=csv`` prints ``name,
    pci.bus_id, vbios_version`` (stas00/ml-engineering, compute/accelerator/nvidia/debug.md).
[7] ``--query-remapped-rows`` fields ``gpu_bus_id``, ``gpu_uuid``,
    ``remapped_rows.correctable``, ``remapped_rows.uncorrectable``, ``remapped_rows.pending``,
    ``remapped_rows.failure`` (the ``remapped_rows`` section of [4] on 590; scripts in the
    public index). The flags print ``No``/``Yes`` in [2]; Azure/azhpc-diagnostics,
    Linux/test/compatibility.bats asserts real ``--query-remapped-rows=remapped_rows.failure,
    gpu_bus_id --format=csv,noheader`` rows match ``^[01], [0-9a-fA-F]{8}:`` and that GPUs
    without remapping print ``[N/A]``: both spellings exist (``FakeHost.remap_flags``).
[8] A GPU NVML cannot reach: ``Unable to determine the device handle for GPU
    0000:0B:00.0: Unknown Error`` (xxd3vin/workspace#19; NVIDIA/open-gpu-kernel-modules#387,
    driver 520), ``... for GPU0000:65:00.0: Unknown Error`` (NVIDIA/nvidia-container-toolkit
    #69, driver 525.85.12; meta-llama/llama-models#200, driver 560), ``... for GPU1:
    0000:34:00.0: Unknown Error`` (driver 610.57.04, a session log in the public index): the
    bus id with a 4-digit domain. The command then exits non-zero (TRAPS.md); the status for
    this case is not documented: the RETURN VALUE list (the man page, quoted in
    NVIDIA/cloud-native-docs, gpu-operator/troubleshooting.rst) has "15 - The GPU has fallen
    off the bus or has otherwise become inaccessible" and "255 - Other error or internal
    driver error occurred"; the fake exits 255 for NVML's "Unknown Error" (*assumed*).
    Whether the other GPUs are still listed varies: wookayin/gpustat#125 and
    meta-llama/llama-models#200 report the whole command failing, TRAPS.md and the 610 log
    show the rest listed (``FakeHost.lost_stops_listing``).
[9] nvidia-smi prints its errors on stdout: ``Field "cuda_version" is not a valid field to
    query.`` came through ``2>/dev/null`` in a session log of the public index;
    anderskm/gputil#63: "nvidia-smi returned the error message directly to the stdout".
    Exit status 2 for a refused field or argument (RETURN VALUE: "2 - A supplied argument
    or flag is invalid"; *assumed* for these messages). ``Invalid combination of input
    arguments. Please run 'nvidia-smi -h' for help.`` is its answer to an option it does not
    take (an Open MPI users' list post, ``nvidia-smi topo -m`` on an old driver).
[10] Whole-tool failures: ``Failed to initialize NVML: Driver/library version mismatch``
    then ``NVML library version: 535.161``, exit 18 (anderskm/gputil#55); ``NVIDIA-SMI has
    failed because it couldn't communicate with the NVIDIA driver. ...``, exit 9 ("9 -
    NVIDIA driver is not loaded"); ``No devices were found``, exit 6 ("6 - A query to find
    an object was unsuccessful"; the pairing *assumed*).
[11] A warning beside complete output: ``WARNING: infoROM is corrupted at gpu
    0000:0B:00.0`` after the whole table, exit 14 (NVIDIA/cloud-native-docs,
    gpu-operator/troubleshooting.rst, "infoROM is corrupted (nvidia-smi return code 14)");
    the fake prints warnings on stderr, with ``FakeHost.warning_status`` (0 by default, as
    this project's tests have it).
[12] Inside a container the listed pids are the host's: "the nvidia-driver itself does not
    support pid-namespaces ... you will always get the host pids" (NVIDIA/nvidia-docker
    #1483).
[13] A field whose query failed prints the NVML error in brackets, e.g. ``[Unknown Error]``
    beside ``[Not Supported]`` and ``[N/A]`` (enkore/i3pystatus#850); ``power.management``
    is documented as "Either "Supported" or "[Not Supported]"" ([4]).
[14] Slow but correct answers: about 30 s per call on large multi-GPU VMs without the
    persistence daemon, about 2 s with it (Azure/aks-gpu#105); the same reported on GCP
    (GoogleCloudPlatform/ai-infra-cluster-provisioning#227). ``FakeHost.delay``.
[15] A GPU that fell off the bus, in NVML's other words: ``Unable to determine the device
    handle for GPU 0000:02:00.0: GPU is lost. Reboot the system to recover this GPU``
    (JosephKJ/OWOD#81; with two spaces before "Reboot" in marian-nmt/marian#251 and
    AlexeyAB/darknet#86): :data:`GPU_IS_LOST` as ``FakeGpu.unreachable``. A domain of three
    digits, ``for GPU 000:BA:80.0: Unknown Error``, in NVIDIA/dcgm-exporter#604.
[16] A whole-tool failure inside a running container while the training on its GPUs goes
    on: ``Failed to initialize NVML: Unknown Error`` after the host's ``systemctl
    daemon-reload`` (NVIDIA/nvidia-docker#1671; #1678: "we can see the training process
    information through host nvidia-smi command output"; NVIDIA/nvidia-container-toolkit
    #1744): :data:`NVML_UNKNOWN` as ``FakeHost.failure``. Its exit status is not quoted in
    those threads; the fake uses 255 ("Other error", [8]; *assumed*).

This module imports nothing but the standard library and nothing of ``fsm``: it runs as a
script of its own. The runtime never imports it (the container image does not carry it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DRIVER_UNREACHABLE", "GPU_IS_LOST", "INVALID_ARGUMENTS", "NVML_MISMATCH", "NVML_UNKNOWN",
    "FakeApp", "FakeGpu",
    "FakeHost", "FakeNvidiaSmi", "Rendered", "render",
]

MODULE = os.path.abspath(__file__)
#: Bus ids of an HGX H100 board, by index; further GPUs get made-up ones.
_HGX_BUSES = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
#: [9]
INVALID_ARGUMENTS = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
#: [10]
DRIVER_UNREACHABLE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running."
)
NVML_MISMATCH = "Failed to initialize NVML: Driver/library version mismatch"
#: [16]
NVML_UNKNOWN = "Failed to initialize NVML: Unknown Error"
#: [15]: NVML's reason for a GPU that fell off the bus
GPU_IS_LOST = "GPU is lost. Reboot the system to recover this GPU"
SWITCHES = ("--query-gpu", "--query-remapped-rows", "--query-compute-apps")


@dataclass
class FakeGpu:
    """One GPU. A value of None prints ``[N/A]`` [2] (or what ``spellings`` says for that
    field: ``[Not Supported]``, ``N/A``, ``""``, ``[Unknown Error]`` [13])."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    #: ``00000000:18:00.0``; None: an HGX H100's bus id for its index
    bus_id: str | None = None
    memory_total_mib: int | None = 81559  # [2]
    #: memory in use besides the listed processes' (``memory.used`` adds theirs)
    memory_used_mib: int | None = 0
    ecc_uncorrected: int | None = 0
    ecc_uncorrected_aggregate: int | None = 0
    #: ``[N/A]`` on Ampere and Hopper, which remap rows instead [2]
    retired_pages_pending: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    remapped_correctable: int | None = 0
    remapped_uncorrectable: int | None = 0
    remap_pending: bool | None = False
    remap_failure: bool | None = False
    #: NVML's error for this GPU's handle (``"Unknown Error"``, ``"GPU is lost"``): the GPU
    #: is named in ``Unable to determine the device handle ...`` instead of listed [8]
    unreachable: str | None = None
    #: the exit status when this GPU is unreachable (*assumed*, [8])
    unreachable_status: int = 255
    #: field name -> the text printed instead of its value
    spellings: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeApp:
    """One process with a compute context on a GPU (``--query-compute-apps``)."""

    gpu_uuid: str
    pid: int | None
    process_name: str | None = "python3"
    used_memory_mib: int | None = 1024


@dataclass
class FakeHost:
    """The host the fake describes."""

    gpus: list[FakeGpu] = field(default_factory=list)
    apps: list[FakeApp] = field(default_factory=list)
    driver: str = "550.54.15"
    #: switches (``--query-gpu``, ...) that never answer; ``"*"`` for every call
    hang: list[str] = field(default_factory=list)
    #: switch (or ``"*"``) -> seconds a call takes before it answers [14]
    delay: dict[str, float] = field(default_factory=dict)
    #: a whole-tool failure: this message (on stdout [9]) and ``failure_status`` [10]
    failure: str | None = None
    failure_status: int = 9
    #: fields this driver does not know: asking for one is refused [4], [9]
    refuse: list[str] = field(default_factory=list)
    #: lines printed on stderr beside the answer, and the status then [11]
    warnings: list[str] = field(default_factory=list)
    warning_status: int = 0
    #: how ``remapped_rows.pending``/``failure`` print: ``Yes``/``No`` or ``1``/``0`` [7]
    remap_flags: Literal["yes_no", "digits"] = "yes_no"
    #: how a lost GPU is named [8]: ``GPU0000:3B:00.0`` ("bus"), ``GPU 0000:3B:00.0``
    #: ("spaced"), ``GPU3: 0000:3B:00.0`` ("indexed")
    lost_style: Literal["bus", "spaced", "indexed"] = "bus"
    #: a lost GPU ends the listing (only its message is printed) [8]
    lost_stops_listing: bool = False
    #: the lost-GPU message goes to stderr instead of stdout [9]
    lost_to_stderr: bool = False

    @classmethod
    def h100s(cls, count: int = 8, **kwargs: Any) -> FakeHost:
        """``count`` healthy, idle H100s, each with its own UUID and bus id (kept when a
        GPU is removed from the list, as a real GPU keeps its slot)."""
        gpus = [FakeGpu(uuid=f"GPU-6d2b0c1e-0000-4000-8000-{i:012x}", bus_id=_default_bus(i))
                for i in range(count)]
        return cls(gpus=gpus, **kwargs)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FakeHost:
        raw = json.loads(text)
        raw["gpus"] = [FakeGpu(**gpu) for gpu in raw.get("gpus", [])]
        raw["apps"] = [FakeApp(**app) for app in raw.get("apps", [])]
        return cls(**raw)


@dataclass(frozen=True)
class Rendered:
    """What the fake prints for one call, and how it exits (``hang``: it never does)."""

    stdout: str
    stderr: str
    status: int
    hang: bool = False
    #: seconds before the answer is printed [14]
    delay: float = 0.0


# --- the answer, as a pure function --------------------------------------------------------


def _default_bus(index: int) -> str:
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else f"{(0xE0 + index) % 256:02X}"
    return f"00000000:{bus}:00.0"


def bus_id(host: FakeHost, index: int) -> str:
    """``pci.bus_id`` of GPU ``index`` [2]."""
    return host.gpus[index].bus_id or _default_bus(index)


def lost_message(host: FakeHost, index: int) -> str:
    """The message for a GPU NVML cannot reach, in ``host.lost_style`` [8]."""
    gpu = host.gpus[index]
    full = bus_id(host, index)
    short = full[4:] if len(full.split(":")[0]) == 8 else full  # the 4-digit domain form
    where = {"bus": f"GPU{short}", "spaced": f"GPU {short}",
             "indexed": f"GPU{index}: {short}"}[host.lost_style]
    return f"Unable to determine the device handle for {where}: {gpu.unreachable}"


_Getter = Callable[[FakeHost, int], object]


def _g(attr: str) -> _Getter:
    return lambda host, i: getattr(host.gpus[i], attr)


def _timestamp(host: FakeHost, i: int) -> str:
    now = time.time()
    return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


def memory_used(host: FakeHost, i: int) -> int | None:
    """``memory.used`` ("Total memory allocated by active contexts" [4]): the GPU's own
    ``memory_used_mib`` plus what its listed processes use."""
    gpu = host.gpus[i]
    if gpu.memory_used_mib is None:
        return None
    return gpu.memory_used_mib + sum(
        app.used_memory_mib or 0 for app in host.apps if app.gpu_uuid == gpu.uuid)


def _free(host: FakeHost, i: int) -> int | None:
    total, used = host.gpus[i].memory_total_mib, memory_used(host, i)
    return None if total is None or used is None else max(0, total - used)


#: ``--query-gpu`` fields: canonical name -> (aliases, unit, value) [4]
GPU_FIELDS: dict[str, tuple[tuple[str, ...], str, _Getter]] = {
    "timestamp": ((), "", _timestamp),
    "driver_version": ((), "", lambda host, i: host.driver),
    "count": ((), "", lambda host, i: len(host.gpus)),
    "name": (("gpu_name",), "", _g("name")),
    "uuid": (("gpu_uuid",), "", _g("uuid")),
    "pci.bus_id": (("gpu_bus_id",), "", bus_id),
    "index": ((), "", lambda host, i: i),
    "memory.total": ((), "MiB", _g("memory_total_mib")),
    "memory.used": ((), "MiB", memory_used),
    "memory.free": ((), "MiB", _free),
    "ecc.errors.uncorrected.volatile.total": ((), "", _g("ecc_uncorrected")),
    "ecc.errors.uncorrected.aggregate.total": ((), "", _g("ecc_uncorrected_aggregate")),
    "retired_pages.single_bit_ecc.count": (("retired_pages.sbe",), "", _g("retired_pages_sbe")),
    "retired_pages.double_bit.count": (("retired_pages.dbe",), "", _g("retired_pages_dbe")),
    "retired_pages.pending": ((), "", _g("retired_pages_pending")),
}
#: ``--query-remapped-rows`` fields [7]
REMAP_FIELDS: dict[str, tuple[tuple[str, ...], str, _Getter]] = {
    "timestamp": ((), "", _timestamp),
    "gpu_name": ((), "", _g("name")),
    "gpu_bus_id": ((), "", bus_id),
    "gpu_uuid": ((), "", _g("uuid")),
    "remapped_rows.correctable": ((), "", _g("remapped_correctable")),
    "remapped_rows.uncorrectable": ((), "", _g("remapped_uncorrectable")),
    "remapped_rows.pending": ((), "", _g("remap_pending")),
    "remapped_rows.failure": ((), "", _g("remap_failure")),
}
#: ``--query-compute-apps`` fields [5]; the value reads the app, not the GPU
APP_FIELDS: dict[str, tuple[tuple[str, ...], str, Callable[[FakeHost, int, FakeApp], object]]] = {
    "timestamp": ((), "", lambda host, i, app: _timestamp(host, i)),
    "gpu_name": ((), "", lambda host, i, app: host.gpus[i].name),
    "gpu_bus_id": ((), "", lambda host, i, app: bus_id(host, i)),
    "gpu_serial": ((), "", lambda host, i, app: f"{1650000000000 + i}"),
    "gpu_uuid": ((), "", lambda host, i, app: app.gpu_uuid),
    "pid": ((), "", lambda host, i, app: app.pid),
    "process_name": (("name",), "", lambda host, i, app: app.process_name),
    "used_gpu_memory": (("used_memory",), "MiB", lambda host, i, app: app.used_memory_mib),
}


def _canonical(table: Mapping[str, tuple[tuple[str, ...], str, Any]], asked: str) -> str | None:
    for name, (aliases, _, _) in table.items():
        if asked == name or asked in aliases:
            return name
    return None


def _cell(value: object, unit: str, units: bool, spelling: str | None, flags: str) -> str:
    if spelling is not None:
        return spelling
    if value is None:
        return "[N/A]"  # [2]
    if isinstance(value, bool):
        if flags == "digits":
            return "1" if value else "0"  # [7]
        return "Yes" if value else "No"  # [2], [7]
    if unit and units:
        return f"{value} {unit}"  # [2]
    return str(value)


def render(host: FakeHost, argv: Sequence[str]) -> Rendered:
    """What nvidia-smi with arguments ``argv`` prints on ``host``."""
    args = list(argv)
    options: dict[str, str] = {}
    listing = False
    while args:
        arg = args.pop(0)
        name, eq, value = arg.partition("=")
        if arg in ("-L", "--list-gpus"):
            listing = True
        elif name in (*SWITCHES, "--format", "-i", "--id"):
            if not eq:
                if not args:
                    return Rendered(INVALID_ARGUMENTS + "\n", "", 2)
                value = args.pop(0)
            if name in options or (name in SWITCHES and set(options) & set(SWITCHES)):
                return Rendered(INVALID_ARGUMENTS + "\n", "", 2)  # [1]: "[one of]"
            options["-i" if name == "--id" else name] = value
        else:
            return Rendered(INVALID_ARGUMENTS + "\n", "", 2)  # [9]
    switch = next((s for s in SWITCHES if s in options), None)
    answer = _render(host, options, listing, switch)
    delay = host.delay.get(switch or "-L", host.delay.get("*", 0.0))
    return replace(answer, delay=delay) if delay and not answer.hang else answer


def _render(host: FakeHost, options: Mapping[str, str], listing: bool,
            switch: str | None) -> Rendered:
    if listing == (switch is not None):
        if not listing:
            return Rendered("", "fake nvidia-smi (fsm.testing.nvidia_smi) answers only "
                            "selective queries and -L\n", 2)
        return Rendered(INVALID_ARGUMENTS + "\n", "", 2)
    if switch is not None and "--format" not in options:
        return Rendered(INVALID_ARGUMENTS + "\n", "", 2)  # [1] "[mandatory]"; wording *assumed*
    if host.failure is not None:
        return Rendered(host.failure + "\n", "", host.failure_status)  # [10]
    if "*" in host.hang or (switch is not None and switch in host.hang):
        return Rendered("", "", 0, hang=True)
    chosen = _chosen(host, options.get("-i"))
    if chosen is None:
        return Rendered("No devices were found\n", "", 6)
    if listing:
        return _answer(host, chosen, None, lambda i: [
            f"GPU {i}: {host.gpus[i].name} (UUID: {host.gpus[i].uuid})"])  # [2]
    assert switch is not None
    formats = options["--format"].split(",")
    if "csv" not in formats or set(formats) - {"csv", "noheader", "nounits"}:
        return Rendered(INVALID_ARGUMENTS + "\n", "", 2)  # [1]
    units = "nounits" not in formats
    asked = [field_ for field_ in options[switch].split(",") if field_]
    tables: dict[str, Mapping[str, tuple[tuple[str, ...], str, Any]]] = {
        "--query-gpu": GPU_FIELDS, "--query-remapped-rows": REMAP_FIELDS,
        "--query-compute-apps": APP_FIELDS}
    table = tables[switch]
    names: list[str] = []
    for field_ in asked:
        canonical = _canonical(table, field_)
        if canonical is None or field_ in host.refuse or canonical in host.refuse:
            return Rendered(f'Field "{field_}" is not a valid field to query.\n', "", 2)  # [9]
        names.append(canonical)
    if not names:
        return Rendered(INVALID_ARGUMENTS + "\n", "", 2)
    header = None if "noheader" in formats else ", ".join(
        f"{name} [{table[name][1]}]" if table[name][1] else name for name in names)  # [2], [6]

    def rows(i: int) -> list[str]:
        gpu = host.gpus[i]
        if switch == "--query-compute-apps":
            return [", ".join(_cell(APP_FIELDS[name][2](host, i, app), APP_FIELDS[name][1],
                                    units, None, host.remap_flags) for name in names)
                    for app in host.apps if app.gpu_uuid == gpu.uuid]  # [3]
        return [", ".join(_cell(table[name][2](host, i), table[name][1], units,
                                gpu.spellings.get(name), host.remap_flags) for name in names)]

    return _answer(host, chosen, header, rows)


def _chosen(host: FakeHost, ids: str | None) -> list[int] | None:
    if not host.gpus:
        return None  # [10]
    if ids is None:
        return list(range(len(host.gpus)))
    chosen = []
    for token in ids.split(","):
        for i, gpu in enumerate(host.gpus):
            if token.strip() in (str(i), gpu.uuid, bus_id(host, i)):
                chosen.append(i)
    return chosen or None


def _answer(host: FakeHost, chosen: Sequence[int], header: str | None,
            rows: Callable[[int], list[str]]) -> Rendered:
    out = [header] if header is not None else []
    err: list[str] = []
    status = 0
    for i in chosen:
        gpu = host.gpus[i]
        if gpu.unreachable is not None:
            status = status or gpu.unreachable_status
            message = lost_message(host, i)
            if host.lost_stops_listing:
                return Rendered("" if host.lost_to_stderr else message + "\n",
                                message + "\n" if host.lost_to_stderr else "", status)
            (err if host.lost_to_stderr else out).append(message)  # [8]
            continue
        out += rows(i)
    if host.warnings:
        err += host.warnings  # [11]
        status = status or host.warning_status
    text = "".join(line + "\n" for line in out)
    return Rendered(text, "".join(line + "\n" for line in err), status)


# --- the executable ------------------------------------------------------------------------


class FakeNvidiaSmi:
    """An executable ``nvidia-smi`` under ``directory/bin`` answering from ``host``; each
    call is logged (``calls()``). A context manager: leaving it kills hung fakes."""

    def __init__(self, directory: Path, host: FakeHost | None = None, *,
                 python: str = sys.executable,
                 precompute: Sequence[Sequence[str]] = ()) -> None:
        """``precompute``: argument lists answered by the shell script itself from files
        written at each :meth:`set` (``cat``, no Python: a fake about as cheap as the real
        binary, for benchmarks); such calls are not logged, and a host that hangs is
        always answered by Python."""
        self.directory = Path(directory)
        self.bindir = self.directory / "bin"
        self.bindir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.directory / "nvidia-smi-state.json"
        self.calls_path = self.directory / "nvidia-smi-calls.jsonl"
        self._precompute = [list(argv) for argv in precompute]
        self.set(host if host is not None else FakeHost.h100s(8))
        self.path = self.bindir / "nvidia-smi"
        # The module is imported, not run as a script: its compiled form is cached, so a
        # call costs an interpreter start and the module's imports, not a compile.
        launch = (f"import sys; sys.path.insert(0, {os.path.dirname(MODULE)!r}); "
                  "import nvidia_smi; sys.exit(nvidia_smi.main(sys.argv[1:]))")
        cached = "".join(
            f'if [ "$*" = {shlex.quote(" ".join(argv))} ] && [ -f {shlex.quote(str(ans))}.out ]'
            f"; then if [ -f {shlex.quote(str(ans))}.delay ]; then "
            f'sleep "$(cat {shlex.quote(str(ans))}.delay)"; fi; '
            f"cat {shlex.quote(str(ans))}.out; exit 0; fi\n"
            for argv, ans in zip(self._precompute, self._answer_paths(), strict=True))
        self.path.write_text(
            "#!/bin/sh\n" + cached
            + f"exec {shlex.quote(python)} -I -S -c {shlex.quote(launch)} "
            f"--fake-state {shlex.quote(str(self.state_path))} \"$@\"\n"
        )
        self.path.chmod(0o755)

    def _answer_paths(self) -> list[Path]:
        return [self.directory / f"precomputed-{i}" for i in range(len(self._precompute))]

    def __enter__(self) -> FakeNvidiaSmi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``{"PATH": ...}`` with the fake first, before ``base``'s PATH (else this
        process's)."""
        rest = (base if base is not None else os.environ).get("PATH", os.defpath)
        return {"PATH": f"{self.bindir}{os.pathsep}{rest}"}

    def set(self, host: FakeHost) -> None:
        """Answer from ``host`` from the next call on (atomically: a call in flight reads
        the old state or the new one, never half of either)."""
        for argv, ans in zip(self._precompute, self._answer_paths(), strict=True):
            out = ans.with_suffix(".out")
            answer = render(host, argv)
            if answer.hang or answer.status != 0 or answer.stderr:
                out.unlink(missing_ok=True)  # answered by Python, as it must be
                continue
            delay = ans.with_suffix(".delay")
            if answer.delay:
                delay.write_text(f"{answer.delay:g}")  # before the answer it delays
            else:
                delay.unlink(missing_ok=True)
            part = ans.with_suffix(".part")
            part.write_text(answer.stdout)
            os.replace(part, out)
        part = self.state_path.with_suffix(".part")
        part.write_text(host.to_json())
        os.replace(part, self.state_path)

    def host(self) -> FakeHost:
        return FakeHost.from_json(self.state_path.read_text())

    def calls(self) -> list[list[str]]:
        """The argument lists of every call so far, in order."""
        return [entry["argv"] for entry in self._log()]

    def stop(self) -> None:
        """Kill every call of this fake that is still hanging."""
        for entry in self._log():
            if entry.get("hang"):
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes()
                    if str(self.state_path).encode() in cmdline:
                        os.kill(entry["pid"], signal.SIGKILL)

    def _log(self) -> list[dict[str, Any]]:
        try:
            lines = self.calls_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]


def main(argv: Sequence[str]) -> int:
    """``nvidia-smi.py --fake-state STATE [nvidia-smi arguments]``."""
    if len(argv) < 2 or argv[0] != "--fake-state":
        print("usage: nvidia_smi.py --fake-state STATE [nvidia-smi arguments]", file=sys.stderr)
        return 2
    state = Path(argv[1])
    host = FakeHost.from_json(state.read_text())
    answer = render(host, argv[2:])
    entry = {"argv": list(argv[2:]), "pid": os.getpid(), "hang": answer.hang}
    calls = state.with_name("nvidia-smi-calls.jsonl")
    fd = os.open(calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())  # one write: lines never interleave
    finally:
        os.close(fd)
    if answer.hang:
        while True:  # a GPU stuck in the driver: until killed
            time.sleep(3600)
    if answer.delay:
        time.sleep(answer.delay)  # a slow, healthy answer [14]
    sys.stdout.write(answer.stdout)
    sys.stderr.write(answer.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    return answer.status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
