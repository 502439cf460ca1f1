"""The worker console's fault families: what a failed worker's last lines say about whose
fault its death was.

Each row is a :class:`fsm.policy.signatures.Signature` read from the ``console``: a family of
texts defined by meaning (a CUDA error class recognized by its message, its enum names and
its number; NCCL's and the transports' errors in the forms the libraries print; NVML's
errors; the kernel's Xid lines by the class of NVIDIA's Xid catalogue; crashes inside the
driver's libraries), with its class and its sources. ``docs/policy.md`` prints them
(``flash-bootstrap policy``).

How a class is decided when the words alone could be either (an unspecified launch
failure, an application-class Xid, "all CUDA-capable devices are busy"): retriable. A
wrong fatal kills a run a fresh host would have finished; a wrong retriable costs one
more attempt, because the next attempt sees the same fault follow the job to another host
and ends it (``fault-follows-job``, CONTRACT section 9). The job's own rows are the faults
whose words name the program's doing (its memory, its kernel's bounds, its collectives).

The job's rows come first and win: a job fault anywhere in the examined lines makes the
console's verdict fatal, whatever host rows match too (one rank's CUDA OOM makes the others
report NCCL errors). Among host rows the last matching line decides. A weak row decides
only when no stronger one matches: first a retriable weak row, a fault whose words name no
cause (an unspecified launch failure, CUDA's unknown error, an application-class Xid,
NCCL's "unhandled cuda error"), which a line naming the cause beside it overrules;
last a fatal weak row, a consequence (an NCCL watchdog's timeout, NCCL's "unhandled
system error").
Such a row is retried although its words fit a job's bug as well: one attempt cannot tell
them apart, the second can (a job's bug follows it to the next host, ``fault-follows-job``).
"""

from __future__ import annotations

import re

from fsm.policy.signatures import Match, Signature, Table

__all__ = ["CONSOLE", "CONSOLE_WINDOW_LINES", "HOST_XIDS", "RETRIED_APPLICATION_XIDS",
           "console_verdict", "fingerprint"]

#: Only the console's last lines are examined: what scrolled out did not end the worker.
CONSOLE_WINDOW_LINES = 200

CUDA_ERRORS = "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html"
XID_CATALOGUE = "https://docs.nvidia.com/deploy/xid-errors/"
NVML_API = "https://docs.nvidia.com/deploy/nvml-api/group__nvmlReturn.html"
NCCL_ERRORS = ("https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting"
               ".html")


def _gh(*threads: str) -> tuple[str, ...]:
    """Public threads, ``owner/repo#number``, as links."""
    return tuple(f"https://github.com/{thread.replace('#', '/issues/')}" for thread in threads)


def cuda_number(*numbers: int) -> str:
    """A CUDA error by its number, as the libraries print it: "CUDA error 999", "cuda runtime
    error (999)", "Cuda failure 999", "CUDA Error: 999", "CUDA error DRIVER: '999'", glog's
    check "error == cudaSuccess (999 vs. 0)" or "CUDA_SUCCESS == cuInit(0) (0 vs. 999)",
    "cudaRuntimeGetVersion() failed with error #999". More than one number: the error's
    number in older CUDA releases too."""
    number = "(?:" + "|".join(map(str, numbers)) + ")"
    return (r"\bcuda\w*(?:[ _]runtime)?[ _]?(?:error|failure|err)\w*(?: DRIVER| RUNTIME)?\s*"
            rf"(?:code)?\s*[:=#]?\s*[('\"]?{number}[)'\"]?(?![\d.])"
            rf"|\bcudaSuccess \({number} vs\. 0\)|\bCUDA_SUCCESS == [^\n]*\(0 vs\. {number}\)"
            rf"|\bcuda\w+\(\)[^\n]{{0,24}}?\berror #?{number}\b")


def cuda_error(number: int, message: str, *names: str) -> str:
    """A CUDA error by its message (``cudaGetErrorString``), its runtime and driver enum
    names, and its number (:func:`cuda_number`)."""
    return "|".join([message, *(rf"\b{name}\b" for name in names), cuda_number(number)])


def _job(sig_id: str, family: str, pattern: str, meaning: str,
         sources: tuple[str, ...] = (), *, blame: str = "job", weak: bool = False) -> Signature:
    return Signature(sig_id, family, pattern, meaning, blame, False, "console", sources, weak)


def _host(sig_id: str, family: str, blame: str, pattern: str, meaning: str,
          sources: tuple[str, ...] = (), *, weak: bool = False) -> Signature:
    return Signature(sig_id, family, pattern, meaning, blame, True, "console", sources, weak)


#: The Xid catalogue's hardware, firmware, memory and fabric classes: the GPU, its memory,
#: its micro-controllers (GSP), its bus or its links failed. 144-150 are NVLink5's link
#: errors (NVIDIA/nccl#2241); 154 is "GPU recovery action changed" (a reset or a reboot).
HOST_XIDS = (32, 38, 48, 54, 56, 57, 58, 61, 62, 63, 64, 69, 74, 79, 92, 94, 95, 109, 110,
             119, 120, 121, 122, 123, 124, 140, 143, 144, 145, 146, 147, 148, 149, 150, 154)
#: The catalogue's "application" class, whose causes it lists as the hardware, the driver
#: or the program alike: 13 (graphics engine exception), 31 (MMU fault), 43 (GPU stopped
#: processing). A program's own bad kernel prints its CUDA error beside them (a job row,
#: which wins); alone they are retried, and a job that causes them again on the next host
#: is ended by ``fault-follows-job``. 45 (preemptive cleanup) follows a stop and decides
#: nothing.
RETRIED_APPLICATION_XIDS = (13, 31, 43)


def _xid(numbers: tuple[int, ...]) -> str:
    return (r"\bXid\b\s*(?:\([^)\n]*\))?\s*:?\s*(?:"
            + "|".join(str(x) for x in numbers) + r")\b")


#: The console's rows, the job's first (in a line, the first row that matches decides).
CONSOLE_SIGNATURES: tuple[Signature, ...] = (
    # --- the job's own faults -----------------------------------------------------------
    _job("cuda-oom", "job-oom",
         r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"
         r"|\bcudaErrorMemoryAllocation\b|\bCUDA_ERROR_OUT_OF_MEMORY\b",
         "the job asked its GPU for more memory than it has (cudaErrorMemoryAllocation, 2)",
         (CUDA_ERRORS,)),
    _job("device-side-assert", "job-kernel",
         cuda_error(710, r"device-side assert(?:ion)? triggered", "cudaErrorAssert",
                    "CUDA_ERROR_ASSERT"),
         "a CUDA kernel's assertion failed (bad indices or labels; cudaErrorAssert, 710)",
         (CUDA_ERRORS,)),
    _job("illegal-memory-access", "job-kernel",
         cuda_error(700, r"illegal memory access", "cudaErrorIllegalAddress",
                    "CUDA_ERROR_ILLEGAL_ADDRESS"),
         "a CUDA kernel read or wrote outside its memory (cudaErrorIllegalAddress, 700): the "
         "program's bug in nearly every case; a GPU whose memory fails reports ECC as well "
         "(Xid 48, 63, 64, 94, 95), which the GPU watch reads",
         (CUDA_ERRORS, *_gh("pytorch/pytorch#111101"))),
    _job("cuda-kernel-fault", "job-kernel",
         "|".join((
             cuda_error(716, r"\bmisaligned address\b", "cudaErrorMisalignedAddress",
                        "CUDA_ERROR_MISALIGNED_ADDRESS"),
             cuda_error(715, r"an illegal instruction was encountered",
                        "cudaErrorIllegalInstruction", "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
             cuda_error(718, r"invalid program counter", "cudaErrorInvalidPc",
                        "CUDA_ERROR_INVALID_PC"),
             cuda_error(714, r"hardware stack error", "cudaErrorHardwareStackError",
                        "CUDA_ERROR_HARDWARE_STACK_ERROR"),
         )),
         "a CUDA kernel's own exception: a misaligned address (716), an illegal instruction "
         "(715), a bad program counter (718) or its stack overrun (714): the kernel's code, on "
         "any GPU", (CUDA_ERRORS,)),
    _job("cuda-fork", "job-cuda-fork",
         r"Cannot re-initialize CUDA in forked subprocess",
         "the job started CUDA and then forked (a DataLoader or multiprocessing worker with "
         "the 'fork' start method): CUDA cannot run in the child, on any host; the child's "
         "'initialization error' beside it is this, not the driver",
         ("https://github.com/graphnet-team/graphnet/pull/614",)),
    _job("cuda-build-mismatch", "job-build",
         "|".join((
             cuda_error(209, r"no kernel image is available for execution on the device",
                        "cudaErrorNoKernelImageForDevice", "CUDA_ERROR_NO_BINARY_FOR_GPU"),
             cuda_error(200, r"device kernel image is invalid", "cudaErrorInvalidKernelImage",
                        "CUDA_ERROR_INVALID_IMAGE"),
             cuda_error(222, r"PTX was compiled with an unsupported toolchain",
                        "cudaErrorUnsupportedPtxVersion", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
         )),
         "the program's compiled GPU code does not fit the GPU or the driver: built for other "
         "architectures (209), an image the driver cannot load (200), PTX from a toolkit "
         "newer than the driver (222): the job's build, the same on every host of the run's "
         "GPU type",
         (CUDA_ERRORS, *_gh("HRNet/HigherHRNet-Human-Pose-Estimation#95",
                            "verl-project/verl#5876"))),
    _job("cuda-launch-config", "job-kernel",
         "|".join((
             cuda_error(101, r"invalid device ordinal", "cudaErrorInvalidDevice",
                        "CUDA_ERROR_INVALID_DEVICE"),
             cuda_error(9, r"invalid configuration argument", "cudaErrorInvalidConfiguration"),
             cuda_error(701, r"too many resources requested for launch",
                        "cudaErrorLaunchOutOfResources", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
         )),
         "the program asked for what no GPU gives it: a GPU index it was not given (101), a "
         "block or grid shape out of range (9), more registers or shared memory than a block "
         "may use (701)", (CUDA_ERRORS, *_gh("yandex-research/tab-ddpm#20", "sxyu/svox2#6"))),
    _job("cuda-library-status", "job-cuda-library",
         r"\b(?:CUDNN|CUBLAS|CUSOLVER|CUSPARSE|CUFFT)_STATUS_(?!SUCCESS\b)[A-Z_]+\b",
         "cuDNN or cuBLAS refused or failed the program's call (its shapes, its workspace, its "
         "memory, its build): in every thread of the corpus that settled one, 12 of 12, the "
         "job's; a consequence that decides only when no row names a cause (a GPU fault "
         "beside it is retried)",
         (CUDA_ERRORS, *_gh("pytorch/pytorch#3038", "ShaoqingRen/faster_rcnn#24")),
         weak=True),
    _job("nccl-collective-mismatch", "job-collective",
         r"Mismatched collective detected|collective mismatch error"
         r"|Message truncated : receiv(?:ed|ing) \d+ bytes instead of \d+"
         r"|\bncclInvalidUsage\b|\bncclInvalidArgument\b"
         r"|NCCL error[^\n]*\binvalid (?:usage|argument)\b",
         "NCCL: the ranks disagree on a collective, its sizes or their configuration (invalid "
         "usage or argument)",
         (NCCL_ERRORS, *_gh("NVIDIA/nccl#969", "NVIDIA/nccl#1176", "NVIDIA/nccl#296"))),
    _job("shm-exhausted", "shm",
         r"insufficient shared memory \(shm\)|out of shared memory\. Please try to raise your "
         r"shared memory limit|Error while creating shared memory segment|failed to extend "
         r"/dev/shm|/dev/shm[^\n]*No space left on device|posix_fallocate failed[^\n]*No space "
         r"left on device|unable to write to file </torch_",
         "shared memory (/dev/shm) ran out: the container's size for it, the same on every "
         "host the run is sent to, or the job's own use (DataLoader workers, NCCL segments)",
         _gh("codalab/codalab-worksheets#1961", "NVIDIA/nccl#342"), blame="shm"),
    _job("disk-full", "disk-full",
         r"No space left on device|\[Errno 28\]|\bENOSPC\b|Disk quota exceeded|\bEDQUOT\b"
         r"|PytorchStreamWriter failed writing file",
         "a filesystem ran out of space or quota; the job's fault unless the host's scratch or "
         "cache filesystem was already short before setup (see the host evidence below)",
         _gh("huggingface/diffusers#4957", "databrickslabs/dolly#139"), blame="disk"),
    _job("nccl-timeout", "nccl-timeout",
         r"Watchdog caught collective operation timeout|Some NCCL operations have failed or "
         r"timed out|ProcessGroupNCCL[^\n]*\bTimeout at NCCL work\b",
         "an NCCL collective timed out (the watchdog): mostly a rank that stopped calling it "
         "(unequal batches, a rank-0-only step, a dataset scan), a consequence that decides "
         "only when no host row matches", _gh("pytorch/pytorch#141069"), blame="nccl-timeout",
         weak=True),
    _job("nccl-system-error", "nccl-system",
         r"unhandled system error|ncclSystemError",
         "NCCL: a system call failed under it (a socket, shared memory, a registration): in "
         "every thread of the corpus that settled it, 7 of 7, the job's own NCCL environment "
         "(the interface it names, the container's IPC and /dev/shm, its SR-IOV backend), so "
         "it fails the run; a failing NIC or fabric prints its own line beside it (NET/IB, "
         "NET/OFI, verbs), which is a host row and decides",
         (NCCL_ERRORS, *_gh("NVIDIA/nccl#697", "pytorch/examples#611")), weak=True),
    # --- the GPU ------------------------------------------------------------------------
    _host("gpu-ecc-uncorrectable", "gpu-ecc", "gpu",
          cuda_error(214, r"uncorrectable ECC error(?!s?\s*[:=]\s*0\b)",
                     "cudaErrorECCUncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE"),
          "the GPU's memory has an uncorrectable ECC error (cudaErrorECCUncorrectable, 214)",
          (CUDA_ERRORS, *_gh("vllm-project/vllm#5222", "NVIDIA/semantic-segmentation#33"))),
    _host("gpu-fallen-off-bus", "gpu-lost", "gpu", r"fallen off the bus",
          "the GPU stopped answering on PCIe", (XID_CATALOGUE,)),
    _host("gpu-lost", "gpu-lost", "gpu",
          r"GPU is lost|\bNVMLError_GpuIsLost\b|\bNVML_ERROR_GPU_IS_LOST\b"
          r"|\bNVML_ERROR_RESET_REQUIRED\b|\bNVMLError_ResetRequired\b",
          "the driver lost the GPU, or it needs a reset (NVML_ERROR_GPU_IS_LOST, "
          "NVML_ERROR_RESET_REQUIRED)", (NVML_API, *_gh("JosephKJ/OWOD#81"))),
    _host("nvml-device-handle", "gpu-lost", "gpu",
          r"Unable to determine the device handle for GPU(?![^\n]*GPU is lost)",
          "NVML (nvidia-smi) can no longer reach a GPU: gone from the bus or wedged in the "
          "driver", _gh("stanford-cs336/assignment4-data#1")),
    _host("cuda-contained", "gpu-contained", "gpu",
          r"Invalid access of peer GPU memory over nvlink or a hardware error"
          r"|\bcudaErrorContained\b|\bCUDA_ERROR_CONTAINED\b",
          "CUDA's contained hardware error (cudaErrorContained): an HBM or NVLink fault the "
          "GPU contained, the context is lost",
          (CUDA_ERRORS, *_gh("wtdcode/vllm-backport#62", "daydreamlive/scope#749"))),
    _host("cuda-devices-unavailable", "gpu-unavailable", "gpu",
          "|".join((
              cuda_error(46, r"CUDA-capable device\(?s?\)?\s*(?:is|are|is/are)?\s*busy or "
                         r"unavailable", "cudaErrorDevicesUnavailable",
                         "CUDA_ERROR_DEVICE_UNAVAILABLE"),
              cuda_error(216, r"exclusive-thread device (?:that is )?already in use",
                         "cudaErrorDeviceAlreadyInUse", "CUDA_ERROR_CONTEXT_ALREADY_IN_USE"),
          )),
          "CUDA finds every GPU busy or unavailable (cudaErrorDevicesUnavailable, 46), or a GPU "
          "in exclusive-thread mode already held (cudaErrorDeviceAlreadyInUse, 216): another "
          "process holds a GPU, the host's compute mode is exclusive, or the GPU is in a bad "
          "state; the runner saw no other process on the GPUs before the worker started",
          (CUDA_ERRORS, *_gh("tensorflow/tensorflow#526"))),
    _host("cuda-launch-failure", "gpu-launch-failure", "gpu",
          cuda_error(719, r"unspecified launch failure", "cudaErrorLaunchFailure",
                     "CUDA_ERROR_LAUNCH_FAILED", "CURAND_STATUS_LAUNCH_FAILURE"),
          "a kernel died of an exception CUDA does not name (cudaErrorLaunchFailure, 719): "
          "unlike a kernel's own faults (the job's rows) it names no cause, and it follows a "
          "GPU or driver fault (Xid 13, 43, 79; a resume from suspend) as often as a bug",
          (CUDA_ERRORS, *_gh("opendatalab/MinerU#381", "ultralytics/ultralytics#7716")),
          weak=True),
    _host("cuda-launch-timeout", "gpu-watchdog", "gpu",
          cuda_error(702, r"the launch timed out and was terminated", "cudaErrorLaunchTimeout",
                     "CUDA_ERROR_LAUNCH_TIMEOUT"),
          "a kernel ran past the GPU's watchdog and was ended (cudaErrorLaunchTimeout, 702): "
          "the watchdog runs only on a GPU that also drives a display, the host's "
          "configuration; a training host's GPUs have none",
          (CUDA_ERRORS, *_gh("ComputationalRadiationPhysics/picongpu#2704",
                             "numba/numba#9381"))),
    _host("cuda-invalid-ptx", "gpu-jit", "gpu",
          cuda_error(218, r"a PTX JIT compilation failed", "cudaErrorInvalidPtx",
                     "CUDA_ERROR_INVALID_PTX"),
          "the driver could not compile the program's PTX for this GPU (cudaErrorInvalidPtx, "
          "218): a faulty GPU or a driver in a bad state in every thread of the corpus that "
          "settled it (a restart, another node); PTX newer than the driver says so in its own "
          "words (222, the job's), and a job's PTX that fails again on the next host is ended "
          "by fault-follows-job",
          (CUDA_ERRORS, *_gh("openmm/openmm#3474", "seekrcentral/seekr2#8")), weak=True),
    _host("nvrm-xid", "xid", "gpu", _xid(HOST_XIDS),
          "the kernel driver reported a hardware, memory, firmware or fabric Xid ("
          + ", ".join(map(str, HOST_XIDS)) + ")", (XID_CATALOGUE,)),
    _host("nvrm-xid-application", "xid", "gpu", _xid(RETRIED_APPLICATION_XIDS),
          "the kernel driver reported an application-class Xid (13, 31, 43), whose causes the "
          "catalogue lists as the hardware, the driver or the program alike",
          (XID_CATALOGUE, *_gh("pytorch/pytorch#51382")), weak=True),
    _host("driver-library-crash", "driver-crash", "driver",
          r"\bsegfault at [0-9a-f]+ ip [0-9a-f]+ sp [0-9a-f]+ error \d+ in "
          r"lib(?:cuda|nvidia-[\w-]+|nvcuvid|nvoptix)\.so"
          r"|(?:SIGSEGV|Segmentation fault|signal 11\b|SIGBUS)[^\n]*\blib(?:cuda|nvidia-[\w-]+)"
          r"\.so",
          "a process crashed inside the NVIDIA driver's own libraries (libcuda, libnvidia-*): "
          "the driver's user-space half, the same program runs on a healthy host",
          _gh("BVLC/caffe#183", "nagadomi/waifu2x#139")),
    # --- the driver and its services ----------------------------------------------------
    _host("cuda-no-gpus", "no-gpu", "driver",
          r"No CUDA GPUs are available|Found no NVIDIA driver on your system",
          "CUDA sees no GPU in a container started with GPUs", _gh("pytorch/pytorch#87890")),
    _host("cuda-no-device", "no-gpu", "driver",
          cuda_error(100, r"no CUDA-capable device is detected", "cudaErrorNoDevice",
                     "CUDA_ERROR_NO_DEVICE"),
          "CUDA sees no GPU in a container started with GPUs (cudaErrorNoDevice, 100)",
          (CUDA_ERRORS,)),
    _host("nvml-no-devices", "no-gpu", "driver", r"^\s*No devices were found\s*$",
          "nvidia-smi lists no GPU (NVML sees none) in a container started with GPUs",
          _gh("pytorch/pytorch#190132")),
    _host("cuda-driver-too-old", "driver-too-old", "driver",
          cuda_error(35, r"CUDA driver version is insufficient for CUDA runtime version"
                     r"|The NVIDIA driver on your system is too old"
                     r"|nvidia-container-cli: requirement error: unsatisfied condition: cuda>=",
                     "cudaErrorInsufficientDriver", "CUDA_ERROR_INSUFFICIENT_DRIVER"),
          "the host's driver is older than the image's CUDA (cudaErrorInsufficientDriver, 35; "
          "hosts of a fleet differ in driver; a fresh host may have a newer one)",
          (CUDA_ERRORS, *_gh("vllm-project/vllm#1772"))),
    _host("cuda-forward-compat", "driver-too-old", "driver",
          cuda_error(804, r"forward compatibility was attempted on non supported HW",
                     "cudaErrorCompatNotSupportedOnDevice",
                     "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"),
          "CUDA's forward-compatibility libraries on a GPU or driver that does not support "
          "them (804): the host's driver is too old for the image's CUDA",
          (CUDA_ERRORS, *_gh("PKU-YuanGroup/Video-LLaVA#22"))),
    _host("cuda-unknown-init", "cuda-unknown", "driver",
          r"CUDA unknown error - this may be due to an incorrectly set up\b"
          r"|failed call to cuInit: CUDA_ERROR_UNKNOWN",
          "CUDA could not start (error 999, CUDA_ERROR_UNKNOWN): the driver's state is broken "
          "(nvidia_uvm lost, after a suspend or a driver fault); a reset or reboot cures it",
          _gh("pytorch/pytorch#88639", "gbionics/jaxsim#50")),
    _host("cuda-unknown", "cuda-unknown", "driver",
          r"\bcuda\w*(?:[ _]runtime)?[ _]?(?:error|failure|err)\b[^\n]{0,32}?\bunknown error\b"
          r"|\bcudaErrorUnknown\b|(?<!cuInit: )\bCUDA_ERROR_UNKNOWN\b|" + cuda_number(999, 30),
          "a CUDA call failed with CUDA's unknown error (cudaErrorUnknown, 999; 30 before CUDA "
          "10.1): the driver or the GPU, never the program's own mistake, which CUDA names",
          (CUDA_ERRORS, *_gh("pytorch/pytorch#197073")), weak=True),
    _host("cuda-init-failed", "cuda-init", "driver",
          # These calls' reports name the error: the errors other rows name (no device, a
          # driver too old, the fabric, a mismatch, unknown) are theirs
          r"(?:Unexpected error from cudaGetDeviceCount\(\)"
          r"|\bcudaGetDeviceCount\b[^\n]{0,8}?\b(?:returned|failed)\b"
          r"|\bcuInit\b[^\n]{0,40}?\b(?:failed|results? in)\b|\bfailed call to cuInit\b)"
          r"(?![^\n]*(?:\bError (?:100|35|802|803|804|999)\b|CUDA_ERROR_(?:NO_DEVICE|UNKNOWN"
          r"|INSUFFICIENT_DRIVER|SYSTEM_DRIVER_MISMATCH|COMPAT_NOT_SUPPORTED|SYSTEM_NOT_READY)))"
          r"|\bcuda driver (?:library )?init(?:ialization)? fail"
          r"|\bCUDA_ERROR_NOT_INITIALIZED\b|\bcudaErrorInitializationError\b"
          r"|\bcuda\w*(?:[ _]runtime)?[ _]?(?:error|failure)\b[^\n]{0,8}?\binitialization error\b",
          "CUDA could not start on the host's GPUs: the driver's first calls failed (cuInit, "
          "the first device count; cudaErrorInitializationError, 3, or the driver's own "
          "number, such as 500 or 30): the kernel module and its libraries out of step, "
          "nvidia_uvm missing or broken, the driver's memory manager (HMM) failing; a reboot "
          "or a fresh host cures it. A job that forked after starting CUDA says so (a job row, "
          "which wins); one whose own settings or libraries stop CUDA on every host fails the "
          "same way on the next and is ended by fault-follows-job",
          (CUDA_ERRORS, *_gh("canonical/lxd#5618", "ollama/ollama#11593",
                             "NVIDIA/open-gpu-kernel-modules#797"))),
    _host("nvml-init-failed", "nvml", "driver", r"Failed to initialize NVML",
          "NVML cannot talk to the driver",
          _gh("NVIDIA/nvidia-docker#1730", "NVIDIA/nvidia-container-toolkit#1397")),
    _host("nvml-error", "nvml", "driver",
          r"(?<!initialize )(?<!detection error: )"
          r"\bNVML(?:Error)?\b[^\n]{0,24}?\bUnknown Error\b"
          r"|\bNVMLError_(?:Unknown|DriverNotLoaded|LibRmVersionMismatch|InsufficientPower"
          r"|IrqIssue|CorruptedInforom|OperatingSystem)\b"
          r"|\bNVML_ERROR_(?:UNKNOWN|DRIVER_NOT_LOADED|LIB_RM_VERSION_MISMATCH|INSUFFICIENT_POWER"
          r"|IRQ_ISSUE|CORRUPTED_INFOROM|OPERATING_SYSTEM)\b|\binfoROM is corrupted\b",
          "NVML answered with an error of its own that names the host (unknown, driver not "
          "loaded, library and kernel module of different versions, a GPU's power cables, an "
          "interrupt fault, a corrupted infoROM, the GPU's device blocked by the host's "
          "cgroups): the host's driver or GPU, as pynvml and nvidia-smi report it",
          (NVML_API, *_gh("pytorch/pytorch#88363"))),
    _host("container-gpu-setup", "container-runtime", "driver",
          r"nvidia-container-cli: (?!requirement error)[^\n]*?\berror\b"
          r"(?![^\n]*\bdriver/library version mismatch\b)"
          r"|\bdriver rpc error\b|/dev/nvidia[\w-]*\"?: no such (?:file|device)"
          r"|/run/nvidia-persistenced/socket\b[^\n]*\bno such file",
          "the NVIDIA container runtime could not give the container its GPUs: the driver "
          "not loaded or too slow to answer without persistence mode, its device nodes or "
          "libraries missing (nvidia-uvm, libnvidia-ml), NVML broken, its own package "
          "regressed: the host's driver setup. A mount refused because a file exists was "
          "the image's in one thread and the node image's toolkit in another: retried, and "
          "an image that carries the driver's files fails again on the next host "
          "(fault-follows-job). A requirement the driver does not meet is "
          "cuda-driver-too-old's, a driver and library of different versions "
          "driver-library-mismatch's",
          _gh("pytorch/pytorch#88363", "NVIDIA/nvidia-docker#288",
              "NVIDIA/nvidia-container-toolkit#202")),
    _host("driver-library-mismatch", "driver", "driver",
          r"Driver/library version mismatch"
          r"|system has unsupported display driver / cuda driver combination"
          r"|\bcudaErrorSystemDriverMismatch\b|\bCUDA_ERROR_SYSTEM_DRIVER_MISMATCH\b",
          "the loaded kernel driver and the user-space library differ (driver upgraded "
          "without a reboot; cudaErrorSystemDriverMismatch, 803)",
          (CUDA_ERRORS, *_gh("illinois-scicomp/machine-shop-maintenance#60"))),
    _host("smi-no-driver", "driver", "driver",
          r"NVIDIA-SMI has failed because it couldn'?t communicate with the NVIDIA driver"
          r"|NVIDIA-SMI couldn'?t find libnvidia-ml\.so",
          "nvidia-smi finds no working NVIDIA driver (the kernel module not loaded, or lost "
          "with a kernel update; its NVML library missing)",
          _gh("lyulyul/shine-cluster#50", "NVIDIA/nvidia-docker#1163")),
    _host("driver-module-missing", "driver", "driver",
          r"\bmodprobe: (?:FATAL|ERROR):[^\n]*\bnvidia\w*"
          r"|\bCould not load UVM kernel module\b|\bcould not insert '?nvidia\w*"
          r"|\bNVIDIA kernel module\b[^\n]*\bnot (?:loaded|found)\b",
          "the NVIDIA kernel module (nvidia, nvidia_uvm) is not loaded and cannot be: not "
          "built for the running kernel after an update, or its install failed",
          _gh("GoogleCloudPlatform/compute-gpu-installation#10", "NVIDIA/nvidia-docker#481")),
    _host("nvrm-init-adapter", "gpu-init", "gpu",
          r"\bRmInitAdapter failed\b|\brm_init_adapter failed\b"
          r"|\bCannot initialize GSP firmware RM\b|\bcannot initialize GSP-RM\b",
          "the kernel driver could not bring a GPU up (RmInitAdapter): its firmware (GSP) "
          "failed to start, the board failed, or the driver does not support it",
          _gh("NVIDIA/open-gpu-kernel-modules#116",
              "illinois-scicomp/machine-shop-maintenance#76")),
    _host("nvrm-no-gpu", "driver", "driver",
          r"NVRM: No NVIDIA graphics adapter probed|NVRM: The NVIDIA probe routine was not "
          r"called",
          "the kernel driver found no NVIDIA GPU to drive", _gh("mattshma/bigdata#133")),
    # --- the links: NVLink, the NVSwitch fabric, InfiniBand and the node's network -------
    _host("nvlink-uncorrectable", "nvlink", "interconnect",
          cuda_error(220, r"uncorrectable NVLink error", "cudaErrorNvlinkUncorrectable",
                     "CUDA_ERROR_NVLINK_UNCORRECTABLE")
          + r"|\bNVLink\b[^\n]*\b(?:uncorrectable|link down|training failed)\b"
          r"|P2P is disabled between NVLINK connected GPUs",
          "an NVLink between GPUs failed (cudaErrorNvlinkUncorrectable, 220), or NVML finds "
          "GPUs joined by NVLink unable to reach each other's memory (NCCL: 'probably due to a "
          "hardware issue')", (CUDA_ERRORS, *_gh("NVIDIA/nccl#2329"))),
    _host("cuda-system-not-ready", "fabric", "interconnect",
          r"(?:\b802\b|\bCUDA\b|\berror\b)[^\n]*?system not yet initialized"
          r"|\bcudaErrorSystemNotReady\b|\bCUDA_ERROR_SYSTEM_NOT_READY\b",
          "CUDA error 802: the NVSwitch fabric is not initialized (the host's fabric manager "
          "is not running)", (CUDA_ERRORS, *_gh("pytorch/pytorch#35710"))),
    _host("nvls-fabric", "fabric", "interconnect",
          r"Failed to bind NVLink SHARP \(NVLS\) Multicast memory"
          r"|error in the Fabric Manager or NVSwitches",
          "NCCL: NVLink SHARP multicast failed: the Fabric Manager or the NVSwitches are in a "
          "bad state", _gh("NVIDIA/DCGM#304")),
    _host("nccl-nvls-invalid-argument", "fabric", "interconnect",
          r"transport/nvls\.cc:\d+ NCCL WARN Cuda failure (?:\d+ )?'invalid argument'",
          "NCCL: NVLink SHARP setup refused by the fabric (the fabric manager restarted while "
          "GPUs held resources): the node needs a GPU reset or reboot",
          _gh("NVIDIA/nccl#976", "NVIDIA/nccl#1488")),
    _host("nccl-graph-mismatch", "fabric", "interconnect",
          r"NCCL WARN XML Import Channel : dev \d+ not found",
          "NCCL: the topology or graph file the node image sets (NCCL_GRAPH_FILE) names GPUs "
          "or NICs the host does not have", _gh("NVIDIA/nccl#1240")),
    _host("nccl-cuda-error", "gpu-nccl-cuda", "gpu",
          r"\bunhandled cuda error\b|\bncclUnhandledCudaError\b",
          "NCCL: a CUDA call under it failed, the GPU or its driver faulted (a job's own bad "
          "kernel shows its own row, which wins)",
          (NCCL_ERRORS, *_gh("vllm-project/vllm#7896")), weak=True),
    _host("ib-completion-error", "interconnect", "interconnect",
          r"\bNET/IB\w*\s*:?\s*Got completion\b"
          r"|\bIBV_WC_\w+_ERR\b"
          r"|\b(?:work )?completion (?:with|has) (?:an? )?(?:error|status)\b"
          r"|\bwc(?:\.|_| )status\b[^\n]*\b(?:err|error|fail)"
          r"|\bGot completion from peer\b|\bcqe (?:with|has) (?:an? )?error\b"
          r"|\berror polling [HL]P CQ with status\b",
          "InfiniBand or RoCE: a work request completed with an error status (12: retries "
          "exceeded, the peer's NIC unreachable), as NCCL, an IB net plugin, Open MPI or verbs "
          "print it",
          _gh("NVIDIA/nccl#1405", "NVIDIA/nccl#1664")),
    _host("ib-retry-exceeded", "interconnect", "interconnect",
          r"\bIBV_WC_RETRY_EXC_ERR\b|\btransport retry count(?:er)? exceeded\b"
          r"|\bInfiniBand retry count between two MPI processes has been\b"
          r"|\bUCX\s+(?:ERROR|FATAL)\b[^\n]*(?:Endpoint timeout|Remote (?:access|operation) "
          r"error|local protection error|port (?:error|down)|link down)",
          "libibverbs, UCX or Open MPI: the InfiniBand or RoCE transport's retries ran out or "
          "its link failed: the link or the fabric dropped the traffic",
          _gh("openucx/ucx#6000")),
    _host("nccl-network", "interconnect", "interconnect",
          r"NET/(?:IB|Socket|OFI)\b(?![^\n]*\bGot completion\b)"
          r"[^\n]*?\b(?:error|errors|fail|failed|failure|closed"
          r"|timeout|timed out|unable to)\b|ncclRemoteError|\bibv_\w+ failed"
          r"|remote process exited or there was a network error",
          "NCCL: the network or InfiniBand transport failed, or a peer became unreachable "
          "(ncclRemoteError)", (NCCL_ERRORS, *_gh("NVIDIA/nccl#902", "NVIDIA/nccl#2076"))),
)
#: The last row, a tier of its own: an error in the GPU stack's words (CUDA, its libraries,
#: NCCL, NVML, the kernel driver, the InfiniBand verbs) that no row above names. It decides
#: only when nothing else in the window does, and it is retried: a fresh host tells a
#: host's fault from a job's, which fails the same way there (``fault-follows-job``).
GPU_STACK_ERROR = _host(
    "gpu-stack-error", "gpu-stack", "driver",
    r"\bCUDA(?: driver| runtime)? error\b|\bcuda runtime error\b|\bCUDA_ERROR_[A-Z_]+\b"
    r"|\bcudaError[A-Z]\w*\b|\bCUDARuntimeError\b|\bcuDNN error\b|\bNCCL error\b"
    r"|\bnccl\w*Error\b|\bNCCL WARN\b[^\n]*\b(?:fail\w*|error)\b"
    r"|\bNVML\w*\b[^\n]*\berror\b|\bNVRM: [^\n]*\b(?:fail\w*|error)\b"
    r"|\bibv_\w+\b[^\n]*\bfail|\bmlx5\w*\b[^\n]*\berr",
    "an error in the GPU stack's own words (CUDA, cuDNN, NCCL, NVML, the kernel driver, the "
    "InfiniBand verbs) that no row names: retried once, since one attempt cannot tell the "
    "host's fault from the job's, and a job's follows it to the next host "
    "(fault-follows-job)", (CUDA_ERRORS, NCCL_ERRORS), weak=True)
#: NCCL's informational lines (``NCCL_DEBUG=INFO``) report, they never fail: a healthy
#: start prints "NET/Plugin: Failed to find ncclNetPlugin_v8 symbol" and the like.
CONSOLE = Table((*CONSOLE_SIGNATURES, GPU_STACK_ERROR), ignore_case=True, skip=r"\bNCCL INFO\b")


def console_verdict(tail: str) -> Match | None:
    """What the console's last ``CONSOLE_WINDOW_LINES`` lines say: a job fault if any line
    shows one (fatal rows win), else the last line naming a host fault, else the last line
    of a fault whose words name no cause (a weak retriable row), else the first line of a
    consequence (a weak fatal row, such as an NCCL timeout), else the last GPU-stack error
    no row names (``GPU_STACK_ERROR``), else None."""
    job: Match | None = None
    host: Match | None = None
    unnamed: Match | None = None
    consequence: Match | None = None
    stack: Match | None = None
    for match in CONSOLE.lines(tail, last=CONSOLE_WINDOW_LINES):
        sig = match.signature
        if sig is GPU_STACK_ERROR:
            stack = match
        elif sig.weak and sig.retriable:
            unnamed = match
        elif sig.weak:
            consequence = consequence or match
        elif sig.retriable:
            host = match
        elif job is None:
            job = match
    return job or host or unnamed or consequence or stack


# --- what makes two occurrences the same fault ------------------------------------------

_PREFIXES = (
    re.compile(r"^\[?rank\s*\d+\]?\s*:\s*", re.IGNORECASE),  # torchrun's [rank3]:
    re.compile(r"^\S+:\d+:\d+\s+\[\d+\]\s*"),  # NCCL's host:pid:tid [dev]
    re.compile(r"^\[\s*\d+\.\d+\]\s*"),  # the kernel's [ 8123.441907]
)
_VARYING = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"  # UUIDs
    r"|\b0x[0-9a-f]+\b"  # addresses
    r"|\b[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]\b"  # PCI addresses
    r"|\b\d+(?:\.\d+)*\b",  # numbers: GPU indices, ranks, pids, IPs, sizes, times
    re.IGNORECASE,
)


def fingerprint(match: Match) -> str:
    """What identifies an occurrence of a console fault across hosts: its family and its
    deciding line with what differs from host to host (ranks, GPU indices, PCI and memory
    addresses, UUIDs, pids, addresses, figures) taken out."""
    line = match.line
    for prefix in _PREFIXES:
        line = prefix.sub("", line)
    line = _VARYING.sub("#", line.lower())
    line = re.sub(r"\s+", " ", line).strip()
    return f"{match.signature.family}: {line}"
