"""The console verdict of a failed worker (issue 13), as properties of the pure functions:
``policy.console_verdict`` reads the last ``CONSOLE_WINDOW_LINES`` lines of a redacted
console tail, ``policy.judge_worker`` turns a worker's facts into a rule.

Tails are generated from real-world lines, one or more per console signature, and noise
that shows none: training logs, healthy NCCL and NVRM lines that look close, tqdm
progress bars redrawn with carriage returns, and arbitrary text.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from fsm import policy, rules
from fsm.policy import CONSOLE_SIGNATURES, CONSOLE_WINDOW_LINES, WorkerFacts, families

WINDOW = CONSOLE_WINDOW_LINES
BY_ID = {sig.id: sig for sig in CONSOLE_SIGNATURES}
BLAMES = {"gpu", "driver", "interconnect", "job", "shm", "disk", "nccl-timeout"}
HOST_FAMILIES = {"gpu", "driver", "interconnect"}

#: Real-world lines, by the signature each must be classified to when it is alone: what
#: torch, CUDA, NVML, NCCL and the kernel's NVRM driver print.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "cuda-oom": (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 3.75 MiB is free. Including non-PyTorch memory, "
        "this process has 79.14 GiB memory in use.",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; "
        "39.39 GiB total capacity; 35.12 GiB already allocated; 1.02 GiB free)",
        "RuntimeError: CUDA error: out of memory",
    ),
    "device-side-assert": (
        "RuntimeError: CUDA error: device-side assert triggered",
        "[rank3]: RuntimeError: CUDA error: device-side assert triggered",
    ),
    "illegal-memory-access": (
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "terminate called after throwing an instance of 'c10::Error'  what():  CUDA error: an "
        "illegal memory access was encountered",
    ),
    "gpu-ecc-uncorrectable": (
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    ),
    "gpu-fallen-off-bus": (
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "[ 8123.441907] NVRM: GPU at PCI:0000:bd:00: GPU-6d2b0c1e has fallen off the bus.",
    ),
    "gpu-lost": (
        "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the "
        "system to recover this GPU",
    ),
    # The lines below, down to the end of the table, are from tests/data/console_corpus.jsonl
    # (public issue threads, each named by its corpus id).
    "nvml-device-handle": (
        "Unable to determine the device handle for GPU0000:62:00.0: Unknown Error",  # cs336-1
    ),
    "cuda-contained": (
        "torch.AcceleratorError: CUDA error: Invalid access of peer GPU memory over nvlink or "
        "a hardware error",  # scope-749
        "(Worker_TP2 pid=1304) Search for `cudaErrorContained' in https://docs.nvidia.com/cuda/"
        "cuda-runtime-api/group__CUDART__TYPES.html for more information.",  # vllm-backport-62
    ),
    "nvrm-xid": (
        "[ 5432.101234] NVRM: Xid (PCI:0000:18:00): 48, pid=2871, name=python3, An uncorrectable "
        "double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 0.",
        "NVRM: Xid (PCI:0000:b7:00): 94, pid=22131, name=python, Ch 00000008",
        "NVRM: Xid (PCI:0000:ca:00): 119, pid=1582, name=nv-hostengine, Timeout after 6s of "
        "waiting for RPC response from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL).",
        "NVRM: Xid (PCI:0000:3b:00): 74, pid=1221, name=python, NVLink: fatal error detected "
        "on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        "NVRM: Xid (PCI:0000:3b:00): 63, pid=0, name=<unknown>, Row Remapper: New row marked "
        "for remapping, reset gpu to activate.",
        "192.168.11.119: kern: warning: [2026-04-22T21:26:20.695845708Z]: NVRM: Xid "
        "(PCI:0000:48:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset "
        "Required)",  # vllm-40652
    ),
    "cuda-no-gpus": ("RuntimeError: No CUDA GPUs are available",),
    "cuda-no-device": (
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda "
        "functions before calling NumCudaDevices() that might have already set an error? "
        "Error 100: no CUDA-capable device is detected",
        "E external/xla/xla/stream_executor/cuda/cuda_driver.cc:282] failed call to cuInit: "
        "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected",
    ),
    "cuda-driver-too-old": (
        "RuntimeError: CUDA driver version is insufficient for CUDA runtime version",
        # vllm-project/vllm#1772; nanodet (RangiLyu/nanodet#216)
        "RuntimeError: The NVIDIA driver on your system is too old",
        "RuntimeError: The NVIDIA driver on your system is too old (found version 10010). "
        "Please update you",
        # pytorch/pytorch#82472
        "nvidia-container-cli: requirement error: unsatisfied condition: cuda>=11.7, please "
        "update your driver to a newer version, or use an earlier cuda container: unknown.",
        "CUDA error 35 [/src/cuda.cu, 42]: CUDA driver version is insufficient for CUDA "
        "runtime version",
    ),
    "nvml-init-failed": (
        "Failed to initialize NVML: Unknown Error",
        "pynvml.NVMLError_Uninitialized... Failed to initialize NVML: GPU access blocked by "
        "the operating system",
    ),
    "driver-library-mismatch": (
        "nvidia-container-cli: initialization error: nvml error: driver/library version "
        "mismatch: unknown",
        "NVML: Driver/library version mismatch",
    ),
    "smi-no-driver": (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make "
        "sure that the latest NVIDIA driver is installed and running.",  # gcp-18
    ),
    "nvrm-no-gpu": (
        "[188497.595099] NVRM: No NVIDIA graphics adapter probed!",  # bigdata-133
        "[188549.976351] NVRM: The NVIDIA probe routine was not called for 3 device(s).",
    ),
    "cuda-forward-compat": (
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda "
        "functions before calling NumCudaDevices() that might have already set an error? Error "
        "804: forward compatibility was attempted on non supported HW",  # videollava-22
    ),
    "cuda-system-not-ready": (
        "RuntimeError: cuda runtime error (802) : system not yet initialized at /opt/conda/"
        "conda-bld/pytorch_1579022034529/work/aten/src/THC/THCGeneral.cpp:50",  # pytorch-35710
        "Failed to allocate device vector A (error code system not yet initialized)! [Vector "
        "addition of 5000 elements]",  # gpu-operator-1043
    ),
    "nvls-fabric": (
        "[2026-06-23 15:45:07] gpu-stress-dgc86-xfpt6:420:437 [5] transport/nvls.cc:379 "
        "(nvlsAllocateMem) NCCL WARN Failed to bind NVLink SHARP (NVLS) Multicast memory of "
        "size 2097152 : CUDA error 401 'the operation cannot be performed in the present "
        "state'.",  # dcgm-304
        "This is usually caused by a system or configuration error in the Fabric Manager or "
        "NVSwitches. ",  # pytorch-177472
    ),
    "nccl-collective-mismatch": (
        # NVIDIA/nccl#1176
        "1: compute-st-p4de24xlarge-2:4827:6900 [4] bootstrap.cc:77 NCCL WARN Message "
        "truncated : received 256 bytes instead of 4",
        # NVIDIA/nccl#296
        "init.cc:1247 NCCL WARN Mismatched collective detected, please check your collective "
        "calls at and around rank 39.",
    ),
    "cuda-build-mismatch": (
        # HRNet/HigherHRNet-Human-Pose-Estimation#95
        "RuntimeError: CUDA error: no kernel image is available for execution on the device",
        # verl-project/verl#5876
        "torch.AcceleratorError: CUDA error: device kernel image is invalid",
        # cupy/cupy#6875
        "cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorUnsupportedPtxVersion: the "
        "provided PTX was compiled with an unsupported toolchain.",
    ),
    "cuda-launch-config": (
        # yandex-research/tab-ddpm#20
        "RuntimeError: CUDA error: invalid device ordinal",
        # open-mmlab/mmdetection3d#306
        "RuntimeError: CUDA error: invalid configuration argument",
        # sxyu/svox2#6
        "RuntimeError: CUDA error: too many resources requested for launch",
    ),
    "cuda-library-status": (
        # ShaoqingRen/faster_rcnn#24
        "Check failed: status == CUBLAS_STATUS_SUCCESS (13 vs. 0)  CUBLAS_STATUS_EXECUTION_FAILED",
        # pytorch/pytorch#3038
        "RuntimeError: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",
    ),
    "container-gpu-setup": (
        # pytorch/pytorch#88363
        "nvidia-container-cli: detection error: nvml error: unknown error: unknown.",
        # NVIDIA/nvidia-container-toolkit#202
        "nvidia-container-cli: initialization error: driver rpc error: timed out: unknown.",
        "lstat /dev/nvidia-uvm-tools: no such file or directory",  # NVIDIA/nvidia-docker#288
        "open /run/nvidia-persistenced/socket: no such file or directory",  # crumbvms-395
    ),
    "cuda-init-failed": (
        "cudaGetDeviceCount returned 30",  # canonical/lxd#5618
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda "
        "functions before calling NumCudaDevices() that might have already set an error? "
        "Error 500: named symbol not found",  # stable-diffusion-webui-docker-694
        "cu->cuInit(0) failed -> CUDA_ERROR_NOT_INITIALIZED: initialization",  # ogkm-797
        "[0]:ERROR: CUDA error: initialization error, line 299, file cuda_memtest.cpp",
    ),
    "cuda-invalid-ptx": (
        # openmm/openmm#3474 (GPU0 of that node faulty)
        "CUDA platform error: Error loading CUDA module: CUDA_ERROR_INVALID_PTX (218)",
    ),
    "cuda-launch-timeout": (
        "CUDA error: the launch timed out and was terminated",  # numba/numba#9381
        "SystemError: CUDA_ERROR_LAUNCH_TIMEOUT",  # pyrit-124
    ),
    "driver-module-missing": (
        # GoogleCloudPlatform/compute-gpu-installation#10
        "modprobe: FATAL: Module nvidia not found in directory /lib/modules/5.13.0-1025-gcp",
        "Error: Could not load UVM kernel module. Is nvidia-modprobe installed?",  # nv-docker-481
    ),
    "nvrm-init-adapter": (
        # illinois-scicomp/machine-shop-maintenance#76
        "NVRM: GPU 0000:81:00.0: RmInitAdapter failed! (0x25:0x40:1470)",
        "[    3.596583] NVRM RmInitAdapter: Cannot initialize GSP firmware RM",  # ogkm-116
    ),
    "cuda-fork": (
        # graphnet-team/graphnet#614
        "RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
        "multiprocessing, you must use the 'spawn' start method",
    ),
    "nvml-no-devices": (
        # pytorch/pytorch#190132
        "No devices were found",
    ),
    "nccl-nvls-invalid-argument": (
        # NVIDIA/nccl#1488, #976
        "node23:12098:12141 [2] transport/nvls.cc:244 NCCL WARN Cuda failure 1 'invalid "
        "argument'",
        "transport/nvls.cc:165 NCCL WARN Cuda failure 'invalid argument'",
    ),
    "nccl-graph-mismatch": (
        # NVIDIA/nccl#1240
        "Spotllm:73025:73112 [0] graph/search.cc:719 NCCL WARN XML Import Channel : dev 1 "
        "not found.",
    ),
    "shm-exhausted": (
        # parallelwavegan#314 and pytorch's DataLoader; NVIDIA/nccl#342
        "ERROR: Unexpected bus error encountered in worker. This might be caused by "
        "insufficient shared memory (shm).",
        "include/shm.h:48 NCCL WARN Error while creating shared memory segment "
        "nccl-shm-recv-250a7cc850ba9298-0-1-3 (size 9637888)",
        "RuntimeError: DataLoader worker (pid 572) is killed by signal: Bus error. It is "
        "possible that dataloader's workers are out of shared memory. Please try to raise "
        "your shared memory limit.",
    ),
    "disk-full": (
        # huggingface/diffusers#4957; databrickslabs/dolly#139 (PytorchStreamWriter)
        "OSError: [Errno 28] No space left on device",
        "RuntimeError: [enforce fail at inline_container.cc:471] . PytorchStreamWriter "
        "failed writing file data/228: file write failed",
    ),
    "nccl-timeout": (
        # pytorch/pytorch#141069; Lightning-AI/litdata#340
        "[rank2]:[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=19, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=1800000) ran for 1800093 milliseconds before timing out.",
        "[rank3]:[E ProcessGroupNCCL.cpp:577] [Rank 3] Some NCCL operations have failed or "
        "timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations "
        "might run on corrupted/incomplete data.",
    ),
    "nccl-cuda-error": (
        # vllm-project/vllm#7896 (a bad node, removed)
        "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for "
        "details) [repeated 6x across cluster]",
    ),
    "cuda-unknown-init": (
        # pytorch/pytorch#88639; a JAX run's cuInit after a suspend
        "UserWarning: CUDA initialization: CUDA unknown error - this may be due to an "
        "incorrectly set up environment, e.g. changing env variable CUDA_VISIBLE_DEVICES "
        "after program start. Setting the available devices to be zero.",
        "E0513 cuda_driver.cc:268] failed call to cuInit: CUDA_ERROR_UNKNOWN: unknown error",
    ),
    "nccl-system-error": (
        "torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed "
        "or device error.",
    ),
    "nccl-network": (
        "gpu-node-1:2345:2399 [2] include/socket.h:409 NCCL WARN NET/Socket : Connection "
        "closed by remote peer 10.0.0.5<52418>",
        "ncclRemoteError: A call failed possibly due to a network error or a remote process "
        "exiting prematurely.",
    ),
    "ib-completion-error": (
        "kp-ddp-worker-0:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from "
        "peer 10.216.210.236<54862> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid "
        "fd00:1148:9000:5000:4:200:3:ff22 remoteGidsfd00:1148:9000:5000:4:200:3:ff1f",  # nccl-1405
        "NET/IBP:Got completion from peer 7.6.13.83<36315> with status=12 opcode=32698 "
        "len=32696 vendor err 129 (Send)",  # nccl-1664
        "NCCL WARN NET/IB Got completion error 12",  # nccl-1170
        "[[1176,1],0][btl_openib_component.c:2905:handle_wc] from tango092.vpac.org to: "
        "tango090 error polling LP CQ with status RETRY",  # Open MPI's users' list
        "gpu-node-3:1234:5678 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion "
        "from peer 10.0.0.4<45678> with error 12, opcode 0, len 0, vendor err 129 (Recv)",
    ),
    # Written from the documents the rows cite (CUDA's error strings and enum names, the
    # Xid catalogue, NVML's return codes), not from corpus texts.
    "cuda-kernel-fault": (
        "RuntimeError: CUDA error: misaligned address",
        "RuntimeError: CUDA error: an illegal instruction was encountered",
        "CUDA error 718 at kernel.cu:88",
    ),
    "cuda-devices-unavailable": (
        "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable",
        "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable",
        "Check failed: CUDA_SUCCESS == dynload::cuCtxSetCurrent(context) (0 vs. 216)",  # tf-526
        "CUDA_ERROR_CONTEXT_ALREADY_IN_USE: exclusive-thread device already in use by a "
        "different thread",
    ),
    "cuda-launch-failure": (
        "RuntimeError: CUDA error: unspecified launch failure",
        "cuda runtime error (719) : unspecified launch failure at THCCachingHostAllocator.cpp:278",
    ),
    "nvrm-xid-application": (
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics SM Warp Exception on "
        "(GPC 0, TPC 0, SM 0): Out Of Range Address",
        "NVRM: Xid (PCI:0000:3b:00): 31, pid=1234, name=python, Ch 0000000a, intr 10000000. MMU "
        "Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_4c000000.",
        "NVRM: Xid (PCI:0000:3b:00): 43, pid=1234, name=python, Ch 00000008",
    ),
    "driver-library-crash": (
        "[ 9123.5531] python[4711]: segfault at 18 ip 00007f3a1c2b4e10 sp 00007ffd4c1a2b80 "
        "error 4 in libcuda.so.535.129.03[7f3a1c000000+2a00000]",
        "Caught signal 11 (Segmentation fault: address not mapped) in libcuda.so.1",
    ),
    "cuda-unknown": (
        "RuntimeError: CUDA error: unknown error",
        "NCCL WARN Cuda failure 'unknown error'",
        "CUDA_ERROR_UNKNOWN while launching kernel",
    ),
    "nvml-error": (
        "pynvml.NVMLError_Unknown: Unknown Error",
        "pynvml.nvml.NVMLError_DriverNotLoaded: Driver Not Loaded",
        # NVML's return codes that name the host (NVML_API's nvmlReturn_t)
        "pynvml.NVMLError_CorruptedInforom: Corrupted infoROM",
        "pynvml.NVMLError_InsufficientPower: Insufficient External Power",
        "WARNING: infoROM is corrupted at gpu 0000:0B:00.0",  # the GPU operator's guide
    ),
    "nvlink-uncorrectable": (
        "RuntimeError: CUDA error: uncorrectable NVLink error was detected during the execution",
        "P2P is disabled between NVLINK connected GPUs 1 and 0. This should not be the case "
        "given their connectivity, and is probably due to a hardware issue.",  # nccl-2329
    ),
    "ib-retry-exceeded": (
        "[compute001:31180:0:31180] ib_mlx5_log.c:143  Transport retry count exceeded on "
        "mlx5_0:1/RoCE (synd 0x15 vend 0x81 hw_synd 0/0)",  # ucx-6000
        # Open MPI's openib transport, as its users' list quotes it (wrapped, and not)
        "The InfiniBand retry count between two MPI processes has been",
        "The InfiniBand retry count between two MPI processes has been exceeded.",
    ),
}

#: Lines that look close to a signature and are none: healthy NCCL transport lines, a
#: preemptive-cleanup Xid (45), ECC counters, memory reports, training logs.
NEAR_MISSES = (
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.3<0>",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.3<0>",
    "NCCL version 2.19.3+cuda12.3",
    "NVRM: Xid (PCI:0000:3b:00): 45, pid=1234, name=python, Ch 00000008",
    "ECC errors: volatile corrected 0, uncorrected 0",
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-6d2b0c1e-0000-0000-0000-000000000001)",
    "torch.cuda.max_memory_allocated: 71.3 GiB of 79.1 GiB",
    "step 120/1000 | loss 2.3141 | lr 3.0e-04 | 41,200 tok/s",
    "[rank0]: saving checkpoint to /runcode/ckpt/step_120",
    "Traceback (most recent call last):",
    '  File "/runcode/code/flash/engine/worker/__main__.py", line 88, in <module>',
    "wandb: Run history: train/loss ▇▆▅▄▃▂▁",
)

#: What NCCL prints at every healthy start with ``NCCL_DEBUG=INFO`` (recipes set it): the
#: net plugin lookup "fails" for each plugin version it tries (2.19 and later), or finds no
#: plugin (``dlerror=``, 2.18 and earlier), and NCCL goes on with its own transport.
HEALTHY_NCCL_INIT = (
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin: Failed to find ncclNetPlugin_v8 symbol.",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin: Failed to find ncclCollNetPlugin_v8 "
    "symbol.",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/Plugin : dlerror=libnccl-net.so: cannot open "
    "shared object file: No such file or directory No plugin found (libnccl-net.so), using "
    "internal implementation",
    "gpu-node-3:1234:1234 [0] NCCL INFO NET/IB : No device found.",
    "gpu-node-3:1234:1290 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using "
    "internal network plugin.",
)

#: What one line may hold: no line break of any kind (so one piece is one line whatever
#: the splitter), no surrogates.
LINE_CHARS = st.characters(exclude_categories=["Cs", "Cc", "Zl", "Zp"])


def _verdict_id(text: str) -> str | None:
    found = policy.console_verdict(text)
    return None if found is None else found.signature.id


#: A noise line: not blank, and no signature shows in it.
NOISE = st.one_of(
    st.sampled_from(NEAR_MISSES),
    st.text(LINE_CHARS, min_size=1, max_size=80),
).filter(lambda s: bool(s.strip()) and policy.console_verdict(s) is None)

HOST_LINES = [(sid, line) for sid, lines in EXAMPLES.items() if BY_ID[sid].retriable
              for line in lines]
#: The job's rows that win over host rows (a weak row, a consequence, does not).
JOB_LINES = [(sid, line) for sid, lines in EXAMPLES.items()
             if not BY_ID[sid].retriable and not BY_ID[sid].weak for line in lines]
#: The consequences: weak rows that are the job's (a fault's words that name no cause are
#: weak and retriable, and rank below the host rows that name one).
WEAK_LINES = [(sid, line) for sid, lines in EXAMPLES.items()
              if BY_ID[sid].weak and not BY_ID[sid].retriable for line in lines]
HOST = st.sampled_from(HOST_LINES)
JOB = st.sampled_from(JOB_LINES)
#: One line break each, however the console wrote it.
BREAK = st.sampled_from(["\n", "\r", "\r\n"])


@st.composite
def progress_bar(draw: st.DrawFn) -> str:
    """A tqdm bar redrawn in place: several ``\\r``-separated lines on one terminal line."""
    total = draw(st.integers(10, 5000))
    steps = sorted(draw(st.lists(st.integers(0, total), min_size=1, max_size=5)))
    frames = []
    for done in steps:
        pct = 100 * done // total
        bar = "█" * (pct // 10) + " " * (10 - pct // 10)
        frames.append(f"{pct:3d}%|{bar}| {done}/{total} [00:{pct % 60:02d}<01:16,  7.21it/s]")
    return "\r".join(frames)


def _lines_of(piece: str) -> int:
    """How many console lines ``piece`` is (no trailing break): one per \\r or \\n, plus 1."""
    return len(re.split(r"\r\n|\r|\n", piece))


#: What draws a value: a composite's ``draw`` or ``st.data()``'s.
Draw = Callable[[st.SearchStrategy[Any]], Any]


def _join(draw: Draw, pieces: list[str], *, trailing: bool | None = None) -> str:
    out = ""
    for i, piece in enumerate(pieces):
        out += piece
        if i < len(pieces) - 1:
            out += draw(BREAK)
    if trailing is None:
        trailing = draw(st.booleans())
    return out + (draw(BREAK) if trailing else "")


@st.composite
def host_tails(draw: st.DrawFn) -> tuple[str, list[tuple[str, str]]]:
    """A tail of host lines, noise and progress bars, every line within the window; and the
    host lines, in order."""
    host = draw(st.lists(HOST, min_size=1, max_size=6))
    pieces: list[tuple[str, str | None]] = [(line, sid) for sid, line in host]
    pieces += [(n, None) for n in draw(st.lists(NOISE, max_size=15))]
    pieces += [(bar, None) for bar in draw(st.lists(progress_bar(), max_size=4))]
    ordered = draw(st.permutations(pieces))
    text = _join(draw, [p for p, _ in ordered])
    assert sum(_lines_of(p) for p, _ in ordered) < WINDOW, "the test keeps all in the window"
    return text, [(sid, p) for p, sid in ordered if sid is not None]


@st.composite
def any_tails(draw: st.DrawFn) -> str:
    """Any mix of host lines, job lines and noise (the window may be exceeded)."""
    pieces = draw(st.lists(st.one_of(HOST.map(lambda x: x[1]), JOB.map(lambda x: x[1]), NOISE,
                                     progress_bar()), max_size=12))
    filler = draw(st.integers(0, WINDOW + 5))
    at = draw(st.integers(0, len(pieces)))
    pieces[at:at] = ["step"] * filler
    return _join(draw, pieces)


FACTS = st.builds(
    WorkerFacts,
    heartbeat_retriable=st.booleans(),
    upload_lost=st.booleans(),
    oom_killed=st.booleans(),
    console=any_tails(),
    stalled=st.booleans(),
    gpus_changed=st.booleans(),
    env_hides_gpus=st.booleans(),
    gpus_fine=st.booleans(),
    disk_short_at_start=st.booleans(),
)


# --- the examples themselves ----------------------------------------------------------


def test_the_signature_table_is_well_formed() -> None:
    ids = [sig.id for sig in CONSOLE_SIGNATURES]
    assert len(ids) == len(set(ids)), "signature ids are unique"
    assert {sig.blame for sig in CONSOLE_SIGNATURES} == BLAMES
    for sig in CONSOLE_SIGNATURES:
        assert sig.retriable is (sig.blame in HOST_FAMILIES), sig.id
        assert sig.family and sig.witness == "console" and sig.sources, sig.id
        assert sig.meaning.strip(), sig.id
        re.compile(sig.pattern)
    assert WINDOW >= 1


def test_every_signature_has_real_world_examples_and_no_example_is_stale() -> None:
    assert set(EXAMPLES) == set(BY_ID)


def test_each_example_alone_is_classified_to_its_own_signature_and_no_other_matches() -> None:
    for sid, lines in EXAMPLES.items():
        for line in lines:
            found = policy.console_verdict(line)
            assert found is not None, f"{sid}: {line!r} matched nothing"
            assert found.signature == BY_ID[sid], f"{line!r} classified {found.signature.id}"
            assert found.line == line.strip()
            others = [
                sig.id for sig in CONSOLE_SIGNATURES
                if sig.id != sid and re.search(sig.pattern, line, re.IGNORECASE)
            ]
            assert others == [], f"{line!r} also matches {others}"


def test_the_near_misses_match_nothing() -> None:
    for line in NEAR_MISSES:
        assert policy.console_verdict(line) is None, line


def test_a_healthy_nccl_start_logged_at_info_level_shows_no_fault() -> None:
    """A job that fails of its own bug right after NCCL's start must not look like a bad
    interconnect: these lines are printed by every healthy run with NCCL_DEBUG=INFO."""
    wrong = {line: _verdict_id(line) for line in HEALTHY_NCCL_INIT if _verdict_id(line)}
    assert wrong == {}


def test_every_documented_xid_is_a_host_fault_by_its_class() -> None:
    for xid in policy.HOST_XIDS:
        line = f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=1234, name=python, Ch 00000001"
        assert _verdict_id(line) == "nvrm-xid", xid
    for xid in families.RETRIED_APPLICATION_XIDS:
        line = f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=1234, name=python, Ch 00000001"
        assert _verdict_id(line) == "nvrm-xid-application", xid
    for xid in (45, 8, 480, 790):
        line = f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=1234, name=python, Ch 00000001"
        assert _verdict_id(line) is None, xid


def test_a_long_line_is_shown_stripped_and_capped_around_its_match() -> None:
    line = "   " + "x" * 500 + " RuntimeError: CUDA error: uncorrectable ECC error " + "y" * 500
    found = policy.console_verdict(line + "\n")
    assert found is not None and found.signature.id == "gpu-ecc-uncorrectable"
    assert 0 < len(found.line) <= 300
    assert found.line in line.strip()
    assert "uncorrectable ECC error" in found.line


def test_the_policy_table_lists_every_signature_with_its_class() -> None:
    table = policy.render_table()
    printed = subprocess.run(
        [sys.executable, "-m", "fsm", "policy"], capture_output=True, check=True, timeout=60
    ).stdout.decode()
    assert printed.strip() == table.strip()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| `")}
    for sig in CONSOLE_SIGNATURES:
        row = rows[f"`{sig.id}`"]
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)]
        assert sig.family in cells, row
        assert cells[-3] == ("retriable" if sig.retriable else "fatal"), row
        assert all(source in cells[-2] for source in sig.sources), row
    for rule in (rules.WORKER_HOST_FAULT, rules.WORKER_OOM_KILLED, rules.HOST_GPU_MISSING):
        assert f"`{rule.id}`" in rows, rule.id
        assert rows[f"`{rule.id}`"].rstrip(" |").endswith(rule.verdict)


# --- (a) determinism ------------------------------------------------------------------


@given(any_tails(), any_tails())
def test_the_console_verdict_is_deterministic(tail: str, other: str) -> None:
    first = policy.console_verdict(tail)
    policy.console_verdict(other)  # nothing carries over from one call to the next
    assert policy.console_verdict(tail) == first
    assert policy.console_verdict(str(tail)) == first


@given(FACTS, FACTS)
def test_judge_worker_is_a_pure_function_of_the_facts(
    facts: WorkerFacts, other: WorkerFacts
) -> None:
    first = policy.judge_worker(facts)
    policy.judge_worker(other)
    assert policy.judge_worker(WorkerFacts(*facts)) == first
    assert policy.judge_worker(facts) == first


def _the_hosts_by_hand(console: policy.ConsoleMatch, facts: WorkerFacts) -> bool:
    """HOST_EVIDENCE's console rows, written out again."""
    sig = console.signature
    if sig.id in ("cuda-no-gpus", "cuda-no-device", "cuda-unknown-init", "nvml-no-devices"):
        return not (facts.env_hides_gpus or facts.gpus_fine)
    if sig.id == "disk-full":
        return facts.disk_short_at_start
    return sig.retriable


@given(FACTS)
def test_judge_worker_follows_the_order_of_the_evidence(facts: WorkerFacts) -> None:
    """Heartbeat, then lost upload, then OOM kill, then the GPUs' change since the start,
    then the console's verdict with the host's evidence beside it (``HOST_EVIDENCE``); for a
    stalled worker (whose heartbeat and local metrics describe an attempt that never
    finished): OOM kill, then the GPUs, then the console, then the stall, fatal when it
    stalled before."""
    rule, match = policy.judge_worker(facts)
    console = policy.console_verdict(facts.console)
    hosts = console is not None and _the_hosts_by_hand(console, facts)
    if facts.stalled:
        if facts.oom_killed:
            expected = rules.WORKER_OOM_KILLED
        elif facts.gpus_changed:
            expected = rules.WORKER_HOST_FAULT
        elif console is not None:
            expected = rules.WORKER_HOST_FAULT if hosts else rules.WORKER_FAILED
        else:
            expected = rules.WORKER_STALLED
        assert rule is expected
        assert match == (console if not (facts.oom_killed or facts.gpus_changed) else None)
        return
    if facts.heartbeat_retriable:
        expected = rules.WORKER_HEARTBEAT_RETRIABLE
    elif facts.upload_lost:
        expected = rules.WORKER_UPLOAD_LOST
    elif facts.oom_killed:
        expected = rules.WORKER_OOM_KILLED
    elif facts.gpus_changed or hosts:
        expected = rules.WORKER_HOST_FAULT
    else:
        expected = rules.WORKER_FAILED
    assert rule is expected
    if facts.gpus_changed and expected is rules.WORKER_HOST_FAULT:
        assert match is None
        return
    if rule in (rules.WORKER_HOST_FAULT, rules.WORKER_FAILED):
        assert match == console
    assert rule.retriable is (rule in (rules.WORKER_HEARTBEAT_RETRIABLE,
                                       rules.WORKER_UPLOAD_LOST, rules.WORKER_HOST_FAULT))


@given(st.data())
def test_a_weak_row_decides_only_without_a_host_row(data: st.DataObject) -> None:
    """An NCCL watchdog's timeout beside an InfiniBand error is the link's fault; alone it
    is the job's (HOST_EVIDENCE)."""
    tail, _ = data.draw(host_tails())
    weak = data.draw(st.sampled_from(WEAK_LINES))[1]
    lines = re.split(r"\r\n|\r|\n", tail)
    lines.insert(data.draw(st.integers(0, len(lines))), weak)
    found = policy.console_verdict("\n".join(lines))
    assert found is not None and found.signature.retriable
    alone = policy.console_verdict(weak)
    assert alone is not None and alone.signature.weak and not alone.signature.retriable


# --- (b) the worker's own verdict wins -------------------------------------------------


@given(any_tails(), st.booleans(), st.booleans())
def test_a_retriable_heartbeat_always_wins(tail: str, upload_lost: bool, oom: bool) -> None:
    rule, _ = policy.judge_worker(WorkerFacts(True, upload_lost, oom, tail))
    assert rule is rules.WORKER_HEARTBEAT_RETRIABLE
    assert rule.retriable


# --- (c) a job fault in the window is never retried by the console ----------------------


@given(st.data())
def test_a_job_line_in_the_window_makes_the_console_fatal(data: st.DataObject) -> None:
    """One rank's CUDA OOM makes the others print NCCL errors: whatever host lines come
    with it, before or after, the job's own fault decides."""
    tail, _ = data.draw(host_tails())
    job = data.draw(st.lists(JOB, min_size=1, max_size=3))
    lines = re.split(r"\r\n|\r|\n", tail)
    for _, line in job:
        lines.insert(data.draw(st.integers(0, len(lines))), line)
    console = "\n".join(lines)
    found = policy.console_verdict(console)
    assert found is not None
    assert found.signature.blame not in HOST_FAMILIES and not found.signature.retriable
    assert found.line in {line.strip() for _, line in job}
    oom = data.draw(st.booleans())
    rule, match = policy.judge_worker(WorkerFacts(False, False, oom, console))
    assert not rule.retriable
    assert rule is (rules.WORKER_OOM_KILLED if oom else rules.WORKER_FAILED)
    if not oom:
        assert match == found


@given(JOB, HOST, st.booleans())
def test_a_job_and_a_host_fault_on_one_line_is_the_jobs(
    job: tuple[str, str], host: tuple[str, str], job_first: bool
) -> None:
    line = f"{job[1]} ; {host[1]}" if job_first else f"{host[1]} ; {job[1]}"
    found = policy.console_verdict(line)
    assert found is not None and found.signature.id == job[0]


# --- (d) what scrolled out of the window does not count ---------------------------------


@given(st.lists(st.one_of(HOST, JOB), min_size=1, max_size=4), st.integers(0, 30),
       st.data())
def test_a_signature_followed_by_a_windowful_of_noise_does_not_count(
    faults: list[tuple[str, str]], extra: int, data: st.DataObject
) -> None:
    noise = data.draw(st.lists(NOISE, min_size=1, max_size=5))
    after = [noise[i % len(noise)] for i in range(WINDOW + extra)]
    tail = _join(data.draw, [line for _, line in faults] + after)
    assert policy.console_verdict(tail) is None
    rule, match = policy.judge_worker(WorkerFacts(console=tail))
    assert (rule, match) == (rules.WORKER_FAILED, None)


@given(JOB, HOST, st.data())
def test_a_job_fault_that_scrolled_out_does_not_outrank_a_host_fault_in_the_window(
    job: tuple[str, str], host: tuple[str, str], data: st.DataObject
) -> None:
    noise = data.draw(st.lists(NOISE, min_size=WINDOW - 1, max_size=WINDOW - 1))
    tail = _join(data.draw, [job[1], host[1], *noise])
    found = policy.console_verdict(tail)
    assert found is not None and found.signature.id == host[0]
    assert policy.judge_worker(WorkerFacts(console=tail)) == (rules.WORKER_HOST_FAULT, found)


@given(st.one_of(HOST, JOB), st.data())
def test_a_signature_on_the_windows_first_line_still_counts(
    fault: tuple[str, str], data: st.DataObject
) -> None:
    """Exactly ``CONSOLE_WINDOW_LINES`` lines, the console's final newline included."""
    noise = data.draw(st.lists(NOISE, min_size=WINDOW - 1, max_size=WINDOW - 1))
    tail = "\n".join(["early noise"] * data.draw(st.integers(0, 3)) + [fault[1], *noise])
    tail += data.draw(st.sampled_from(["", "\n"]))
    found = policy.console_verdict(tail)
    assert found is not None and found.signature.id == fault[0]


# --- (e) host lines alone: the last one decides ---------------------------------------


@given(host_tails())
def test_with_only_host_faults_the_last_line_naming_one_decides(
    drawn: tuple[str, list[tuple[str, str]]],
) -> None:
    """The last line that names a host fault; only when none does, the last of those whose
    words name no cause (weak retriable rows: a line naming the cause overrules them)."""
    tail, host = drawn
    named = [(sid, line) for sid, line in host if not BY_ID[sid].weak]
    last_id, last_line = (named or host)[-1]
    found = policy.console_verdict(tail)
    assert found is not None
    assert found.signature.id == last_id
    assert found.line == last_line.strip()
    rule, match = policy.judge_worker(WorkerFacts(console=tail))
    assert rule is rules.WORKER_HOST_FAULT and rule.retriable
    assert match == found


@given(HOST, st.lists(progress_bar(), min_size=1, max_size=6), st.data())
def test_a_host_fault_followed_by_a_redrawn_progress_bar_still_decides(
    host: tuple[str, str], bars: list[str], data: st.DataObject
) -> None:
    """tqdm redraws with ``\\r``: the frames are lines, but a few of them do not scroll a
    host fault out of the window."""
    tail = host[1] + "\r" + "\r".join(bars) + data.draw(st.sampled_from(["", "\n", "\r"]))
    found = policy.console_verdict(tail)
    assert found is not None and found.signature.id == host[0]
    assert found.line == host[1].strip()


@given(HOST, progress_bar())
def test_carriage_returns_split_lines(host: tuple[str, str], bar: str) -> None:
    """A progress bar redrawn past the window in one terminal line scrolls a fault out."""
    frames = "\r".join([bar] * WINDOW)
    assert policy.console_verdict(host[1] + "\r" + frames) is None
    assert policy.console_verdict(host[1] + "\n" + frames) is None


# --- (c) the GPU stack's error that no row names ---------------------------------------

#: Errors in the GPU stack's words that no row names, from tuning threads (the job's, as
#: it happened: the first attempt cannot tell, the second does).
UNNAMED_STACK_LINES = (
    # NVIDIA/nccl#1726
    "ncclCommInitRank failed with error: NCCL error: internal error",
    # daa233/generative-inpainting-pytorch#9
    "RuntimeError: cuda runtime error (11) : invalid argument at "
    "/pytorch/aten/src/THC/THCGeneral.cpp:383",
)


@given(st.sampled_from(UNNAMED_STACK_LINES), st.lists(st.sampled_from(
    [line for _, line in HOST_LINES + JOB_LINES + WEAK_LINES]), max_size=3))
def test_an_unnamed_gpu_stack_error_decides_only_when_no_row_matches(
    line: str, others: list[str]
) -> None:
    """Alone, the GPU stack's error in words no row names is retried (``gpu-stack-error``);
    any row's line in the window decides instead, whatever the order."""
    alone = policy.console_verdict(line)
    assert alone is not None and alone.signature is families.GPU_STACK_ERROR
    assert alone.signature.retriable and alone.signature not in CONSOLE_SIGNATURES
    if others:
        found = policy.console_verdict("\n".join([*others, line]))
        assert found is not None and found.signature is not families.GPU_STACK_ERROR
        assert found == policy.console_verdict("\n".join(others))


def test_noise_and_warnings_in_gpu_words_are_not_errors() -> None:
    for line in (*HEALTHY_NCCL_INIT, *NEAR_MISSES,
                 "UserWarning: Attempting to run cuBLAS, but there was no current CUDA context!",
                 "NCCL WARN NET/Plugin: Could not find: libnccl-net.so. Using internal "
                 "network plugin."):
        found = policy.console_verdict(line)
        assert found is None or found.signature is not families.GPU_STACK_ERROR, line
