"""Read a job failure the way its launcher, runtime and scheduler reported it.

A failed job reaches the job track as an exit code, a scheduler's reason and the tail of
its log.  :func:`read_failure` parses what those three say, by their structure rather
than by keywords:

* the **exit code and signal**: 128+N (a container's status) or -N (Slurm, torchrun) is
  signal N; 137 is SIGKILL (the OOM killer or a scheduler), 143 SIGTERM (preemption), 139
  SIGSEGV, 134 SIGABRT;
* the **scheduler's reason**: Kubernetes termination reasons (``OOMKilled``, ``Evicted``,
  ``DeadlineExceeded``, ...) and disruption reasons, Slurm job states (``NODE_FAIL``,
  ``PREEMPTED``, ``TIMEOUT``, ``OUT_OF_MEMORY``, ...) and ``slurmstepd`` notices;
* **torchrun's ChildFailedError summary**: the root-cause rank, its host, exit code or
  signal, and the message of its error file;
* **NCCL result codes** (``ncclUnhandledCudaError``, ``ncclSystemError``,
  ``ncclInternalError``, ``ncclInvalidUsage``, ``ncclRemoteError``, ...), the CUDA error
  behind an unhandled CUDA error, NCCL's own ``WARN`` lines with their host prefix, and
  the watchdog's collective timeouts;
* **CUDA runtime errors** by the runtime's own message (``cudaGetErrorString``);
* the **Python exception**: the root one, not the launcher's wrapper around it;
* the **driver's own lines**: an ``NVRM: Xid`` report, "uncorrectable ECC error", "GPU
  has fallen off the bus", "GPU is lost".

:func:`classify` turns that reading into a :class:`Triage`: a kind (hardware, network,
user, transient, elsewhere, unknown), a fault class, how strong the evidence is, whether
the failure says anything about the job's nodes, and the rule that decided, by name.
The job track (:mod:`pipeline.correlate.policy`) combines it with the job's history: the same
signature on other nodes points at the job, failures of different jobs beginning on one
node point at the node.  Nothing here does I/O.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass, field
from typing import Any, Literal

from detectors.xid import lookup as xid_lookup
from schemas import FaultClass

from detectors.nvrm import parse_xid

__all__ = ["Reading", "Triage", "classify", "read_failure", "triage", "signature_basis"]

Kind = Literal["hardware", "contained", "suspect", "network", "user", "transient", "elsewhere", "unknown"]

#: the most text read from the end of a log (a longer tail is cut at a line break)
MAX_READ = 64 * 1024

# ----------------------------------------------------------------------------- reading


@dataclass
class Reading:
    """What a failure's exit code, reason and log tail say, field by field."""

    exit_code: int | None = None
    signal: str | None = None
    #: the scheduler's word for why the job ended: a Kubernetes reason, a Slurm state,
    #: or a slurmstepd notice ("PREEMPTED", "OOMKilled", "TIME_LIMIT", ...)
    scheduler_reason: str | None = None
    #: (type, message) of every Python exception line, in order
    exceptions: list[tuple[str, str]] = field(default_factory=list)
    #: the root exception: the last one that is not a launcher's wrapper
    exception: tuple[str, str] | None = None
    #: torchrun's root cause: rank, host, exitcode, signal, message
    torchrun: dict[str, Any] | None = None
    #: CUDA runtime errors named in the text, as ``cudaError*`` names
    cuda_errors: list[str] = field(default_factory=list)
    #: NCCL result codes named in the text
    nccl_errors: list[str] = field(default_factory=list)
    #: NCCL WARN lines: (host, message)
    nccl_warns: list[tuple[str | None, str]] = field(default_factory=list)
    nccl_watchdog: bool = False
    #: Xid codes of NVRM lines in the text
    xids: list[int] = field(default_factory=list)
    #: driver phrases that only failing hardware prints
    hardware: list[str] = field(default_factory=list)
    #: fabric errors: InfiniBand work-completion errors, link down
    network: list[str] = field(default_factory=list)
    #: peers that went away: connection reset/closed/refused, broken pipe, store timeouts
    peer_lost: list[str] = field(default_factory=list)
    #: exit codes a launcher reports for its workers ("failed (exitcode: 2)", "exits with
    #: return code = -9", "Exited with exit code 1", "returned non-zero exit status 1")
    launcher_exit: list[int] = field(default_factory=list)
    #: a command line the program refused (argparse's ``prog: error: ...``)
    argument_error: str | None = None
    #: HTTP status codes of failed requests (a hub, a registry, an object store)
    http_status: list[int] = field(default_factory=list)
    #: the cluster's own notice that the job or its node was preempted
    preempted: str | None = None
    #: a container image that could not be pulled: ("timeout" | "missing", text)
    image_pull: tuple[str, str] | None = None
    #: too little shared memory for the job (a container's /dev/shm)
    shm: str | None = None
    #: NVIDIA's own tools saying a GPU failed (DCGM diagnostics, nvidia-smi's remap state)
    diagnostics: list[str] = field(default_factory=list)
    #: NVML or nvidia-smi unable to reach the GPU or its driver
    gpu_stack: str | None = None
    #: the scheduler could not set the job up on a node (a failed prolog): the node, when named
    prolog: tuple[str, str | None] | None = None
    #: hosts a launcher names as where a worker failed (srun, mpirun), first first
    failed_hosts: list[str] = field(default_factory=list)
    #: the last line that says what went wrong (for the signature)
    last_error: str = ""

    def facts(self) -> dict[str, Any]:
        """The non-empty fields, for a verdict's evidence."""
        out: dict[str, Any] = {}
        for k in ("exit_code", "signal", "scheduler_reason", "torchrun", "cuda_errors", "nccl_errors",
                  "nccl_watchdog", "xids", "hardware", "network", "peer_lost", "launcher_exit", "argument_error",
                  "http_status", "preempted", "image_pull", "shm", "diagnostics", "gpu_stack", "prolog",
                  "failed_hosts"):
            v = getattr(self, k)
            if v not in (None, [], False, ""):
                out[k] = v
        if self.exception:
            out["exception"] = f"{self.exception[0]}: {self.exception[1]}"[:300]
        if self.nccl_warns:
            out["nccl_warn"] = [f"{h or '?'}: {m}"[:200] for h, m in self.nccl_warns[-3:]]
        return out


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: launcher prefixes in front of a worker's line: ``[rank3]:``, ``[default0]:``,
#: ``0: `` (srun -l), ``[1,0]<stderr>:`` (mpirun), ``host: `` (pdsh/deepspeed)
_PREFIX = re.compile(
    r"^(?:\s*(?:\[(?:rank|default)?\d+\]:?|\d{1,5}:(?=\s)|\[\d+,\d+\]<std(?:out|err)>:|[\w.-]+:\s(?=\[rank|\[default)))\s*"
)
_EXC = re.compile(
    r"^(?P<type>(?:[A-Za-z_][\w]*\.)*(?:[A-Z][\w]*(?:Error|Exception|Exit|Interrupt|Failure|Fault|Timeout)"
    r"|KeyboardInterrupt|StopIteration))(?::\s?(?P<msg>.*))?$"
)
#: exceptions that wrap a worker's own: the launcher reporting that a child failed
WRAPPERS = frozenset({
    "ChildFailedError", "ProcessRaisedException", "ProcessExitedException", "CalledProcessError",
    "SystemExit", "BackendCompilerFailed",
})
_SIGNAL_TEXT = re.compile(r"\bSignal (\d+) \((SIG[A-Z0-9]+)\) received by PID\b|\bkilled by signal (\d+)\b|"
                          r"\bexited with signal (SIG[A-Z0-9]+)\b|\bterminated by signal (SIG[A-Z0-9]+)\b|"
                          r"\bgot signal:? ?(\d+)\b", re.IGNORECASE)
#: a shell's or launcher's word for a signal: "Killed", "Segmentation fault (core dumped)", ...
_SHELL_SIGNAL = {"killed": "SIGKILL", "segmentation fault": "SIGSEGV", "bus error": "SIGBUS",
                 "aborted": "SIGABRT", "illegal instruction": "SIGILL", "floating point exception": "SIGFPE",
                 "terminated": "SIGTERM", "hangup": "SIGHUP"}
_SHELL_SIGNAL_RE = re.compile(r"^(?:\S+: line \d+:\s+\d+\s+)?(Killed|Segmentation fault|Bus error|Aborted|"
                              r"Illegal instruction|Floating point exception|Terminated|Hangup)"
                              r"(?: \(core dumped\))?(?:\s|$)")
#: launchers that name the host a worker failed on: srun ("srun: error: HOST: task N: ..."),
#: Open MPI ("process rank N with PID P on node HOST exited on signal S"), pdsh-style prefixes
_HOST_LINES = (
    re.compile(r"srun: error: ([\w.-]+): tasks? [\d,-]+: (.*)$"),
    re.compile(r"process rank \d+ with PID \d+ on node ([\w.-]+) exited on signal (\d+)"),
)

# torchrun's summary: "Root Cause (first observed failure):" then "  host : ..." lines
_TR_ROOT = re.compile(r"Root Cause \(first observed failure\):", re.IGNORECASE)
_TR_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s*(.*)$")
_TR_EXIT = re.compile(r"^(-?\d+)\s*(?:\(pid:\s*(\d+)\))?")

# Kubernetes and Slurm words, as they print them
K8S_REASONS = {
    "oomkilled": "OOMKilled", "evicted": "Evicted", "deadlineexceeded": "DeadlineExceeded",
    "backofflimitexceeded": "BackoffLimitExceeded", "containercannotrun": "ContainerCannotRun",
    "preemptionbyscheduler": "PreemptionByScheduler", "preempting": "PreemptionByScheduler",
    "deletionbytaintmanager": "DeletionByTaintManager", "evictionbyevictionapi": "EvictionByEvictionAPI",
    "terminationbykubelet": "TerminationByKubelet", "deletionbypodgc": "DeletionByPodGC",
    "nodelost": "NodeLost", "nodeaffinity": "NodeAffinity", "unexpectedadmissionerror": "UnexpectedAdmissionError",
    "starterror": "StartError", "createcontainererror": "CreateContainerError",
    "createcontainerconfigerror": "CreateContainerConfigError", "errimagepull": "ErrImagePull",
    "imagepullbackoff": "ImagePullBackOff", "invalidimagename": "InvalidImageName",
}
SLURM_STATES = ("NODE_FAIL", "PREEMPTED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "CANCELLED",
                "FAILED", "REQUEUED")
_SLURM_STATE = re.compile(r"\b(" + "|".join(SLURM_STATES) + r")\b")
_STEPD = re.compile(r"\*\*\* (?:JOB|STEP) [\w.+]+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*")
_STEPD_REASONS = {"TIME LIMIT": "TIME_LIMIT", "PREEMPTION": "PREEMPTED", "NODE FAILURE": "NODE_FAIL",
                  "JOB REQUEUE": "REQUEUED"}
_OOM_KILL = re.compile(r"\boom[-_ ]kill(?:ed)?\b|\bOut of memory: Killed process\b|\btasks? [\d,-]+: Out Of Memory\b|"
                       r"Some of (?:the|your) "
                       r"(?:step|processes).* (?:have been|may have been) OOM Killed", re.IGNORECASE)

# CUDA runtime errors by their cudaGetErrorString text (CUDA Runtime API, "Error Handling")
CUDA_MESSAGES = (
    ("out of memory", "cudaErrorMemoryAllocation"),
    ("an illegal memory access was encountered", "cudaErrorIllegalAddress"),
    ("device-side assert triggered", "cudaErrorAssert"),
    ("misaligned address", "cudaErrorMisalignedAddress"),
    ("an illegal instruction was encountered", "cudaErrorIllegalInstruction"),
    ("invalid device function", "cudaErrorInvalidDeviceFunction"),
    ("no kernel image is available for execution on the device", "cudaErrorNoKernelImageForDevice"),
    ("invalid device ordinal", "cudaErrorInvalidDevice"),
    ("invalid argument", "cudaErrorInvalidValue"),
    ("invalid resource handle", "cudaErrorInvalidResourceHandle"),
    ("too many resources requested for launch", "cudaErrorLaunchOutOfResources"),
    ("operation not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported"),
    ("the provided ptx was compiled with an unsupported toolchain", "cudaErrorUnsupportedPtxVersion"),
    ("unspecified launch failure", "cudaErrorLaunchFailure"),
    ("the launch timed out and was terminated", "cudaErrorLaunchTimeout"),
    ("uncorrectable ecc error encountered", "cudaErrorECCUncorrectable"),
    ("an uncorrectable ecc error was encountered", "cudaErrorECCUncorrectable"),
    ("uncorrectable nvlink error was detected", "cudaErrorNvlinkUncorrectable"),
    ("cuda driver version is insufficient for cuda runtime version", "cudaErrorInsufficientDriver"),
    ("system has unsupported display driver / cuda driver combination", "cudaErrorSystemDriverMismatch"),
    ("forward compatibility was attempted on non supported hw", "cudaErrorCompatNotSupportedOnDevice"),
    ("no cuda-capable device is detected", "cudaErrorNoDevice"),
    ("cuda-capable device(s) is/are busy or unavailable", "cudaErrorDevicesUnavailable"),
    ("all cuda-capable devices are busy or unavailable", "cudaErrorDevicesUnavailable"),
    ("system not yet initialized", "cudaErrorSystemNotReady"),
    ("initialization error", "cudaErrorInitializationError"),
    ("peer access is not supported between these two devices", "cudaErrorPeerAccessUnsupported"),
    ("operation not supported", "cudaErrorNotSupported"),
    ("unknown error", "cudaErrorUnknown"),
)
#: what each CUDA error says: (kind, fault class, strong)
CUDA_KIND: dict[str, tuple[Kind, FaultClass, bool]] = {
    "cudaErrorMemoryAllocation": ("user", FaultClass.user_error, True),
    # an illegal address or instruction is what NVIDIA's Xid 13 and 31 report: "the
    # application's unless it repeats on the same GPU"; only a run elsewhere tells the two
    # apart, and a user's bug that fails the same way there is stopped at its second attempt
    "cudaErrorIllegalAddress": ("suspect", FaultClass.unknown, False),
    "cudaErrorAssert": ("user", FaultClass.user_error, True),
    "cudaErrorMisalignedAddress": ("user", FaultClass.user_error, True),
    "cudaErrorIllegalInstruction": ("suspect", FaultClass.unknown, False),
    "cudaErrorInvalidDeviceFunction": ("user", FaultClass.user_error, True),
    "cudaErrorNoKernelImageForDevice": ("user", FaultClass.user_error, True),
    "cudaErrorInvalidDevice": ("user", FaultClass.user_error, True),
    "cudaErrorInvalidValue": ("user", FaultClass.user_error, False),
    "cudaErrorInvalidResourceHandle": ("user", FaultClass.user_error, False),
    "cudaErrorLaunchOutOfResources": ("user", FaultClass.user_error, True),
    "cudaErrorStreamCaptureUnsupported": ("user", FaultClass.user_error, True),
    "cudaErrorUnsupportedPtxVersion": ("user", FaultClass.user_error, True),
    "cudaErrorInsufficientDriver": ("user", FaultClass.user_error, True),
    "cudaErrorSystemDriverMismatch": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorCompatNotSupportedOnDevice": ("user", FaultClass.user_error, True),
    "cudaErrorPeerAccessUnsupported": ("user", FaultClass.user_error, False),
    "cudaErrorNotSupported": ("user", FaultClass.user_error, False),
    # the GPU or its driver: seen as often from a failing board as from a bad kernel
    "cudaErrorLaunchFailure": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorLaunchTimeout": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorUnknown": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorNoDevice": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorInitializationError": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorSystemNotReady": ("suspect", FaultClass.gpu_hardware, False),
    "cudaErrorDevicesUnavailable": ("transient", FaultClass.transient_software, False),
    # only failing hardware reports these
    "cudaErrorECCUncorrectable": ("hardware", FaultClass.gpu_memory, True),
    "cudaErrorNvlinkUncorrectable": ("hardware", FaultClass.nvlink, True),
}
_CUDA_CONTEXT = re.compile(r"CUDA error:|CUDA failure|Cuda failure|cudaError\w*|CUDA_ERROR_\w+|CUDA driver error|"
                           r"\(error code |"
                           r"cuda runtime error|CUDA out of memory|cudaMalloc|CUDA Exception", re.IGNORECASE)
_CUDA_NAMED = re.compile(r"\b(cudaError[A-Z]\w+)\b")
_CU_DRIVER = {
    "CUDA_ERROR_OUT_OF_MEMORY": "cudaErrorMemoryAllocation", "CUDA_ERROR_ECC_UNCORRECTABLE": "cudaErrorECCUncorrectable",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "cudaErrorIllegalAddress", "CUDA_ERROR_LAUNCH_FAILED": "cudaErrorLaunchFailure",
    "CUDA_ERROR_NO_DEVICE": "cudaErrorNoDevice", "CUDA_ERROR_UNKNOWN": "cudaErrorUnknown",
    "CUDA_ERROR_NVLINK_UNCORRECTABLE": "cudaErrorNvlinkUncorrectable", "CUDA_ERROR_ASSERT": "cudaErrorAssert",
    "CUDA_ERROR_INVALID_DEVICE": "cudaErrorInvalidDevice", "CUDA_ERROR_NOT_INITIALIZED": "cudaErrorInitializationError",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "cudaErrorNoKernelImageForDevice",
}
_CU_DRIVER_RE = re.compile(r"\b(" + "|".join(_CU_DRIVER) + r")\b")
_TORCH_OOM = re.compile(r"\b(?:torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory\b|HIP out of memory\b)")
_LIB_STATUS = re.compile(r"\b(CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|CUSOLVER_STATUS_\w+|CUFFT_\w+)\b")
LIB_STATUS_KIND: dict[str, tuple[Kind, FaultClass, bool]] = {
    # a kernel that failed on the device: a failing GPU as often as a faulty program
    "CUBLAS_STATUS_EXECUTION_FAILED": ("suspect", FaultClass.gpu_hardware, False),
    "CUDNN_STATUS_EXECUTION_FAILED": ("suspect", FaultClass.gpu_hardware, False),
    "CUBLAS_STATUS_INTERNAL_ERROR": ("suspect", FaultClass.gpu_hardware, False),
    "CUDNN_STATUS_INTERNAL_ERROR": ("suspect", FaultClass.gpu_hardware, False),
    "CUBLAS_STATUS_ALLOC_FAILED": ("user", FaultClass.user_error, True),
    "CUBLAS_STATUS_INVALID_VALUE": ("user", FaultClass.user_error, True),
    "CUBLAS_STATUS_NOT_SUPPORTED": ("user", FaultClass.user_error, True),
    "CUDNN_STATUS_NOT_SUPPORTED": ("user", FaultClass.user_error, True),
    "CUDNN_STATUS_BAD_PARAM": ("user", FaultClass.user_error, True),
    "CUDNN_STATUS_ALLOC_FAILED": ("user", FaultClass.user_error, True),
}

# NCCL result codes (nccl.h ncclResult_t) by name and by ncclGetErrorString's text
NCCL_MESSAGES = (
    ("unhandled cuda error", "ncclUnhandledCudaError"),
    ("unhandled system error", "ncclSystemError"),
    ("unhanled system error", "ncclSystemError"),
    ("internal error", "ncclInternalError"),
    ("invalid argument", "ncclInvalidArgument"),
    ("invalid usage", "ncclInvalidUsage"),
    ("remote process exited or there was a network error", "ncclRemoteError"),
)
_NCCL_NAMED = re.compile(r"\b(nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidArgument|InvalidUsage|"
                         r"RemoteError|InProgress))\b")
_NCCL_ERROR_LINE = re.compile(r"NCCL error\b|NCCL failure|ncclCommInitRank|ProcessGroupNCCL|DistBackendError|"
                              r"NCCL communicator|Last NCCL (?:warning|error)|failed: *$", re.IGNORECASE)
#: ``host:pid:tid [rank] NCCL WARN message``
_NCCL_WARN = re.compile(r"^(?:(?P<host>[\w.-]+):\d+:\d+\s+)?\[\d+\]\s+NCCL WARN\s+(?P<msg>.*)$")
_NCCL_CUDA_FAILURE = re.compile(r"Cuda failure(?: \d+)? '([^']+)'", re.IGNORECASE)
_WATCHDOG = re.compile(
    r"Watchdog caught collective operation timeout|watchdog thread terminated with exception|"
    r"Some NCCL operations have failed or timed out|ProcessGroupNCCL's watchdog got stuck|"
    r"NCCL watchdog timeout|collective operation timeout|Timeout\(ms\)=\d+\) ran for \d+ milliseconds",
    re.IGNORECASE)
#: only failing hardware prints these (the driver, NVML, the CUDA runtime)
_HARDWARE = re.compile(
    r"uncorrectable ECC error|GPU has fallen off the bus|fallen off the bus|\bGPU is lost\b|"
    r"uncorrectable NVLink error|NVML_ERROR_GPU_IS_LOST|GPU requires reset|"
    r"Unable to determine the device handle for GPU[^:]*: (?:GPU is lost|Unknown Error)|"
    r"double[- ]bit ECC error|\bDBE\b.*\bECC\b|row remapping failure|RmInitAdapter failed",
    re.IGNORECASE)
#: the fabric: work-completion errors of the verbs API, link state, the NIC driver
_NETWORK = re.compile(
    r"NET/IB\s*:.*(?:Got completion|error|failed)|IBV_WC_\w+|\bibv_\w+ failed|ibv_poll_cq|"
    r"transport retry counter exceeded|\bwr_id\b.*\bstatus\b|\bmlx5_core\b.*(?:link down|Link down|err|fatal)|"
    r"\bLink down\b|local (?:protection|length) error|remote (?:access|operation|invalid request) error|"
    r"NET/IB\s*:\s*No device found|NET/Plugin|PCIe Bus Error|AER:.*error|"
    r"\bstate:?\s+(?:DOWN|Down|INIT|Initializing)\b.*\bphys(?:ical)?_?\s?state:?\s+(?!LinkUp|LINK_UP)\w+|"
    r"Physical state:\s+(?:Polling|Disabled|Sleep|LinkErrorRecovery)|"
    r"device '[^']*': sys files not found \(/sys/class/infiniband|"
    r"NET/OFI\b.*(?:failed|No eligible providers|error)|aws-ofi-nccl initialization failed|"
    r"No route to host|Network is unreachable",
    re.IGNORECASE)
#: the other end went away: a consequence of a failure elsewhere, or of the network
_PEER_LOST = re.compile(
    r"Connection reset by peer|Connection closed by (?:remote )?peer|Connection refused|Broken pipe|"
    r"socket (?:has )?timed out|Socket Timeout|client socket has timed out|timed out after \d+|"
    r"Timed out (?:waiting|initializing)|failed to recv, got 0 bytes|recvBytes|"
    r"remote process exited|store.*(?:timeout|timed out)|RendezvousTimeoutError|RendezvousClosedError|"
    r"RendezvousConnectionError|Rendezvous.*(?:timed out|closed)|DistStoreError|DistNetworkError|"
    r"NCCL communicator was aborted|Process group watchdog thread terminated",
    re.IGNORECASE)
_SHM = re.compile(r"insufficient shared memory|(?:creating|create) shared memory segment|shm_open|"
                  r"/dev/shm\b.*(?:No space left|too small|full)|unable to write to file </torch_\w+>",
                  re.IGNORECASE)
#: launchers reporting a worker's exit: torchrun, the DeepSpeed and accelerate launchers, srun, subprocess
_LAUNCHER_EXIT = re.compile(
    r"failed \(exitcode: (-?\d+)\)|exits with return code = (-?\d+)|Exited with exit code (\d+)|"
    r"returned non-zero exit status (-?\d+)|exit(?:ed)? with (?:error |exit )?code:? (-?\d+)|"
    r"exit status (-?\d+)\b|Training process finished\. Exit code: (-?\d+)", re.IGNORECASE)
_ARGPARSE = re.compile(r"^[\w./-]+: error: (unrecognized arguments|the following arguments are required|argument |"
                       r"invalid choice|ambiguous option|expected one argument)(.*)$")
_HTTP = re.compile(r"\b(?:HTTP Error|HTTPError:?|Status(?: code)?:?|status_code=|Client Error|Server Error)\s*:?\s*"
                   r"(4\d\d|5\d\d)\b|\b(4\d\d|5\d\d) (?:Client|Server) Error\b|\b(429|50[0234]) "
                   r"(?:Too Many Requests|Internal Server Error|Bad Gateway|Service Unavailable|Gateway Time-?out)",
                   re.IGNORECASE)
_PREEMPTED = re.compile(r"\b(?:was|is|been|being|got|job|node|instance|vm) (?:preempted|reclaimed)\b|"
                        r"\bpreemption notice\b|\bDUE TO PREEMPTION\b|\bspot (?:instance )?(?:interruption|termination)\b|"
                        r"\bPreempted\b", re.IGNORECASE)
_IMAGE_PULL = re.compile(r"Failed to pull image|ErrImagePull|ImagePullBackOff|error pulling image|"
                         r"pull access denied|manifest unknown|error pinging docker registry", re.IGNORECASE)
_TIMEOUTISH = re.compile(r"i/o timeout|timed out|TLS handshake timeout|connection reset|temporary failure|"
                         r"EOF\b|503|502|504|429|too many requests", re.IGNORECASE)
#: NVML or nvidia-smi cannot reach the GPU or its driver: the node's GPU stack, not the program
_NVML_BROKEN = re.compile(r"Failed to initialize NVML|NVIDIA-SMI has failed because it couldn't communicate|"
                          r"Driver/library version mismatch|No devices were found|NVML_ERROR_(?!NOT_SUPPORTED)\w+|"
                          r"couldn't communicate with the NVIDIA driver", re.IGNORECASE)
#: Slurm could not set up the job on a node (its prolog failed: Slurm drains that node)
_PROLOG = re.compile(r"Prolog failure on node (\S+)|prolog failed|Job allocation \d+ has been revoked", re.IGNORECASE)
#: nvidia-smi -q: a row remap waits for the next GPU reset (the GPU needs one)
_REMAP_PENDING = re.compile(r"^\s*Pending\s*:\s*Yes\s*$")
#: NVIDIA's tools reporting a failed GPU: DCGM diagnostics and nvidia-smi's row-remapping state
_DIAG = re.compile(r"\|\s*(?:Fail|FAIL)\s*-\s*GPU|\bdcgmi? diag\b.*\bfail|Remapping Failure Occurred\s*:\s*Yes|"
                   r"Uncorrectable Error\s*:\s*[1-9]|DRAM Uncorrectable\s*:\s*[1-9]|SRAM Uncorrectable\s*:\s*[1-9]",
                   re.IGNORECASE)
#: NCCL's warning line in every version: ``host:pid:tid [dev] file.cc:123 NCCL WARN msg``,
#: older ``include/socket.h:344 WARN msg``
_NCCL_WARN_ANY = re.compile(r"^(?:(?P<host>[\w.-]+):\d+:\d+\s+\[\d+\]\s+)?(?:[\w./-]+\.(?:cc|cu|h|cpp):\d+\s+)?"
                            r"(?:NCCL\s+)?WARN\s+(?P<msg>.*)$")
_NCCL_NET_WARN = re.compile(r"socket|NET/|\bIB\b|ibv|verbs|interface|bootstrap|address family|connect|"
                            r"\bRDMA\b|GDR|peermem|plugin|libfabric|EFA|\bmr\b|register", re.IGNORECASE)

#: Python exceptions that say the code, its inputs or its environment are wrong
USER_EXCEPTIONS = frozenset({
    "SyntaxError", "IndentationError", "TabError", "NameError", "UnboundLocalError", "TypeError", "ValueError",
    "AttributeError", "KeyError", "IndexError", "AssertionError", "ImportError", "ModuleNotFoundError",
    "FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "PermissionError", "NotImplementedError",
    "ZeroDivisionError", "RecursionError", "OverflowError", "UnicodeDecodeError", "UnicodeEncodeError",
    "JSONDecodeError", "LookupError", "ArithmeticError", "FloatingPointError", "OutOfMemoryError",
    "ConfigAttributeError", "ConfigKeyError", "MissingMandatoryValue", "ValidationError", "ArgumentError",
    "InstantiationException", "SafetensorError", "HeaderTooLarge", "UnpicklingError", "EOFError",
    "MisconfigurationException", "DeepSpeedConfigError", "HFValidationError", "RepositoryNotFoundError",
    "GatedRepoError", "EntryNotFoundError", "LocalEntryNotFoundError", "RevisionNotFoundError",
    "InductorError", "Unsupported", "TorchRuntimeError", "UserError", "ShapeError", "DataLoaderError",
})
#: exceptions of a failing network, store or service: the next attempt may well pass
TRANSIENT_EXCEPTIONS = frozenset({
    "ConnectionError", "ConnectionResetError", "ConnectionRefusedError", "ConnectionAbortedError",
    "BrokenPipeError", "TimeoutError", "timeout", "gaierror", "ReadTimeout", "ConnectTimeout", "ReadTimeoutError",
    "ConnectTimeoutError", "ProtocolError", "RemoteDisconnected", "IncompleteRead", "ChunkedEncodingError",
    "ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "HfHubHTTPError", "HTTPError",
    "ServiceUnavailable", "TooManyRequests", "ThrottlingException", "SlowDown", "InternalServerError",
    "EndpointConnectionError", "ResponseStreamingError", "TransientError", "StaleFileHandle",
})
#: the distributed runtime reporting a lost peer, store or rendezvous: root cause elsewhere
ELSEWHERE_EXCEPTIONS = frozenset({
    "DistNetworkError", "DistStoreError", "RendezvousTimeoutError", "RendezvousClosedError",
    "RendezvousConnectionError", "RendezvousError", "RendezvousStateError", "DistBackendError",
})


def _lines(text: str) -> list[str]:
    text = _ANSI.sub("", text.replace("\x00", "")).replace("\r\n", "\n").replace("\r", "\n")
    return [_PREFIX.sub("", ln).rstrip() for ln in text.split("\n")]


def _signal_name(num: int) -> str | None:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return None


def _signal_of_exit(code: int | None) -> str | None:
    if code is None:
        return None
    if code < 0:
        return _signal_name(-code)
    if 128 < code < 160:
        return _signal_name(code - 128)
    return None


def _torchrun(lines: list[str]) -> dict[str, Any] | None:
    start = next((i for i, ln in enumerate(lines) if _TR_ROOT.search(ln)), None)
    if start is None:
        return None
    out: dict[str, Any] = {}
    for ln in lines[start + 1:start + 20]:
        m = _TR_FIELD.match(ln)
        if not m:
            if out and ln.strip().startswith("="):
                break
            continue
        key, value = m.group(1), m.group(2).strip()
        if key == "host":
            out["host"] = value
        elif key == "rank":
            r = re.match(r"(\d+)", value)
            if r:
                out["rank"] = int(r.group(1))
        elif key == "exitcode":
            e = _TR_EXIT.match(value)
            if e:
                out["exitcode"] = int(e.group(1))
                sig = _signal_of_exit(out["exitcode"]) if out["exitcode"] < 0 else None
                if sig:
                    out["signal"] = sig
        elif key == "error_file" and value and value != "<N/A>":
            out["error_file"] = value
        elif key == "traceback":
            s = _SIGNAL_TEXT.search(value)
            if s and s.group(2):
                out["signal"] = s.group(2)
    return out or None


def _cuda_errors(line: str) -> list[str]:
    found: list[str] = []
    low = line.lower()
    if _CUDA_CONTEXT.search(line) or "cuda" in low:
        for text, name in CUDA_MESSAGES:
            if text in low:
                found.append(name)
                break  # the first (most specific) message of the table on this line
    found.extend(m for m in _CUDA_NAMED.findall(line) if m in CUDA_KIND)
    found.extend(_CU_DRIVER[m] for m in _CU_DRIVER_RE.findall(line))
    if _TORCH_OOM.search(line):
        found.append("cudaErrorMemoryAllocation")
    return found


def _nccl_errors(line: str, following: str = "") -> list[str]:
    """NCCL result codes on ``line`` (by name, or by ncclGetErrorString's text on a line
    that speaks of NCCL, or on the line after it: NCCL's messages wrap)."""
    found = list(_NCCL_NAMED.findall(line))
    if not found and _NCCL_ERROR_LINE.search(line):
        low = f"{line} {following}".lower()
        for text, name in NCCL_MESSAGES:
            if text in low:
                found.append(name)
                break
    return found


def _uniq(xs: list[Any]) -> list[Any]:
    return list(dict.fromkeys(xs))


def _first_int(m: re.Match[str]) -> int | None:
    return next((int(g) for g in m.groups() if g is not None), None)


def read_failure(exit_code: int | None, reason: str | None, log_tail: str | None) -> Reading:
    """Parse a failure's exit code, scheduler reason and log tail (any of them may be
    missing, garbled or huge)."""
    r = Reading(exit_code=exit_code, signal=_signal_of_exit(exit_code))
    reason = (reason or "")[:MAX_READ]
    tail = log_tail or ""
    if len(tail) > MAX_READ:
        tail = tail[-MAX_READ:]
        tail = tail[tail.find("\n") + 1:] if "\n" in tail else tail
    lines = _lines(reason) + _lines(tail)

    # the scheduler's word
    for word in re.findall(r"[A-Za-z_]+", reason):
        w = K8S_REASONS.get(word.lower())
        if w:
            r.scheduler_reason = w
            break
    if r.scheduler_reason is None:
        m = _SLURM_STATE.search(reason)
        if m and m.group(1) not in ("FAILED", "CANCELLED"):
            r.scheduler_reason = m.group(1)
    errors: list[str] = []
    for i, ln in enumerate(lines):
        s = ln.strip()
        if not s:
            continue
        following = lines[i + 1].strip() if i + 1 < len(lines) else ""
        m = _STEPD.search(s)
        if m and r.scheduler_reason is None:
            r.scheduler_reason = _STEPD_REASONS.get((m.group(1) or "").strip(), "CANCELLED")
        if _OOM_KILL.search(s) and r.scheduler_reason is None:
            r.scheduler_reason = "OOM_KILL"
        if r.signal is None:
            sig = _SIGNAL_TEXT.search(s)
            if sig:
                name = sig.group(2) or sig.group(4) or sig.group(5)
                num = sig.group(1) or sig.group(3) or sig.group(6)
                r.signal = name.upper() if name else _signal_name(int(num))
            else:
                sh = _SHELL_SIGNAL_RE.search(s)
                if sh:
                    r.signal = _SHELL_SIGNAL[sh.group(1).lower()]
        for pat in _HOST_LINES:
            hm = pat.search(s)
            if hm:
                r.failed_hosts.append(hm.group(1))
                tail_ = hm.group(2)
                if r.signal is None and tail_.isdigit():
                    r.signal = _signal_name(int(tail_))
                elif r.signal is None:
                    sh = _SHELL_SIGNAL_RE.search(tail_)
                    if sh:
                        r.signal = _SHELL_SIGNAL[sh.group(1).lower()]
        le = _LAUNCHER_EXIT.search(s)
        if le:
            code = _first_int(le)
            if code is not None:
                r.launcher_exit.append(code)
        ap = _ARGPARSE.match(s)
        if ap and r.argument_error is None:
            r.argument_error = s[:300]
            errors.append(s)
        for h in _HTTP.finditer(s):
            code = _first_int(h)
            if code is not None:
                r.http_status.append(code)
        if r.preempted is None and _PREEMPTED.search(s):
            r.preempted = s[:300]
        if r.image_pull is None and _IMAGE_PULL.search(s):
            r.image_pull = ("timeout" if _TIMEOUTISH.search(s) else "missing", s[:300])
            errors.append(s)
        if r.shm is None and _SHM.search(s):
            r.shm = s[:300]
            errors.append(s)
        if r.gpu_stack is None and _NVML_BROKEN.search(s):
            r.gpu_stack = s[:200]
            errors.append(s)
        pm = _PROLOG.search(s)
        if pm and r.prolog is None:
            r.prolog = (s[:200], pm.group(1))
            errors.append(s)
        if _REMAP_PENDING.match(ln) and any("Remapped Rows" in x for x in lines[max(0, i - 4):i]):
            r.diagnostics.append("row remapping pending: the GPU needs a reset")
        if _DIAG.search(s):
            r.diagnostics.append(s[:200])
            errors.append(s)
        x = parse_xid(s)
        if x is not None:
            r.xids.append(x.code)
            errors.append(s)
        warn = _NCCL_WARN.match(s) or _NCCL_WARN_ANY.match(s)
        if warn:
            r.nccl_warns.append((warn.group("host"), warn.group("msg")))
            cf = _NCCL_CUDA_FAILURE.search(warn.group("msg"))
            if cf:
                r.cuda_errors.extend(_cuda_errors("CUDA error: " + cf.group(1)))
            elif _NCCL_NET_WARN.search(warn.group("msg")):
                r.network.append("NCCL WARN " + warn.group("msg")[:120])
            errors.append(s)
        e = _EXC.match(s)
        if e:
            r.exceptions.append((e.group("type"), (e.group("msg") or "").strip()))
            errors.append(s)
        cuda = _cuda_errors(s)
        if cuda:
            r.cuda_errors.extend(cuda)
            errors.append(s)
        nccl = _nccl_errors(s, following)
        if nccl:
            r.nccl_errors.extend(nccl)
            errors.append(s)
        if _WATCHDOG.search(s):
            r.nccl_watchdog = True
            errors.append(s)
        hw = _HARDWARE.search(s)
        if hw:
            r.hardware.append(hw.group(0))
            errors.append(s)
        net = _NETWORK.search(s)
        if net:
            r.network.append(net.group(0))
            errors.append(s)
        peer = _PEER_LOST.search(s)
        if peer:
            r.peer_lost.append(peer.group(0))
        if e is None and re.search(r"\b(?:error|fatal|failed|failure)\b", s, re.IGNORECASE):
            errors.append(s)
    for k in ("cuda_errors", "nccl_errors", "hardware", "network", "peer_lost", "xids", "http_status",
              "diagnostics"):
        setattr(r, k, _uniq(getattr(r, k)))
    r.torchrun = _torchrun(lines)
    if r.torchrun:
        r.signal = r.signal or r.torchrun.get("signal")
        if r.exit_code is None and r.torchrun.get("exitcode") is not None:
            r.exit_code = r.torchrun["exitcode"]
    if r.exit_code is None and r.launcher_exit:
        r.exit_code = r.launcher_exit[0]
    if r.signal is None and r.exit_code is not None:
        r.signal = _signal_of_exit(r.exit_code)
    own = [x for x in r.exceptions if x[0].rsplit(".", 1)[-1] not in WRAPPERS]
    r.exception = own[-1] if own else None
    r.last_error = errors[-1] if errors else next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return r


# ----------------------------------------------------------------------------- deciding


@dataclass(frozen=True)
class Triage:
    """What a failure says about its cause, and the rule that said it."""

    kind: Kind
    fault_class: FaultClass
    rule: str
    reason: str
    #: strong: the text names its cause; weak: it is consistent with several
    strong: bool
    #: whether the failure is evidence about the nodes it ran on (their repeat-failure
    #: and origin counts); a user's bug or a scheduler's decision is not
    blames_nodes: bool
    #: the node the text names (torchrun's root-cause host, an NCCL WARN's host) when it
    #: is one of the job's nodes
    node: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def evidence(self) -> dict[str, Any]:
        return {"rule": self.rule, "kind": self.kind, "strong": self.strong, "why": self.reason, **self.facts}


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _xid_in_text(codes: list[int]) -> tuple[str, FaultClass, int] | None:
    """The first Xid in the text that says something: ``isolate`` (the node must go) or
    ``restart_app`` (contained to the application), by the catalog's action."""
    for action in ("isolate", "restart_app"):
        for c in codes:
            info = xid_lookup(c)
            if info.action == action:
                return action, FaultClass(info.fault_class), c
    return None


def classify(r: Reading, nodes: list[str] | None = None) -> Triage:
    """The cause a failure's reading points at (the first rule that matches wins).

    Kinds, and what the job track does with them (:mod:`pipeline.correlate.policy`):

    * ``hardware``: only failing hardware prints this (an Xid that takes the node out, an
      uncorrectable ECC or NVLink error, a GPU off the bus or lost, NVIDIA's diagnostics
      failing a GPU): requeue without the node it names, isolate that node;
    * ``contained``: an Xid the driver contained to the application (94): restart;
    * ``suspect``: errors a failing GPU raises as often as a faulty program (an unknown
      CUDA error, an unspecified launch failure, NCCL's unhandled CUDA error): requeue on
      other nodes, which tells the two apart;
    * ``network``: the fabric, the NIC or the node's network setup (NCCL system and
      internal errors, verbs work-completion errors, NCCL's network warnings): requeue;
    * ``user``: the program, its inputs or its environment: retry once, then stop;
    * ``transient``: preemption, eviction, a service that failed a request: retry;
    * ``elsewhere``: a watchdog timeout or a lost peer: the cause is another rank, not
      named: retry once;
    * ``unknown``: nothing names a cause: retry once.
    """
    nodes = nodes or []
    facts = r.facts()

    def t(kind: Kind, fc: FaultClass, rule: str, why: str, strong: bool, blames: bool,
          node: str | None = None) -> Triage:
        return Triage(kind=kind, fault_class=fc, rule=rule, reason=why, strong=strong, blames_nodes=blames,
                      node=node, facts=facts)

    named = _named_node(r, nodes)
    exc_type = _short(r.exception[0]) if r.exception else None

    # 1. the hardware's own words
    xid = _xid_in_text(r.xids)
    if xid is not None and xid[0] == "isolate":
        return t("hardware", xid[1], "xid_in_log", f"the driver reported Xid {xid[2]}", True, True, named)
    hw_cuda = [c for c in r.cuda_errors if CUDA_KIND[c][0] == "hardware"]
    if hw_cuda:
        return t("hardware", CUDA_KIND[hw_cuda[0]][1], "cuda_hardware_error",
                 f"the CUDA runtime reported {hw_cuda[0]}", True, True, named)
    if r.hardware:
        low = r.hardware[0].lower()
        fc = (FaultClass.gpu_memory if "ecc" in low or "remap" in low or "dbe" in low
              else FaultClass.nvlink if "nvlink" in low else FaultClass.gpu_hardware)
        return t("hardware", fc, "hardware_message", f"the driver said: {r.hardware[0]}", True, True, named)
    if r.diagnostics:
        return t("hardware", FaultClass.gpu_memory if "remap" in r.diagnostics[0].lower()
                 or "correctable" in r.diagnostics[0].lower() else FaultClass.gpu_hardware,
                 "nvidia_diagnostics", f"NVIDIA's diagnostics failed a GPU: {r.diagnostics[0]}", True, True, named)
    if r.gpu_stack:
        return t("suspect", FaultClass.gpu_hardware, "gpu_stack_unreachable",
                 f"NVML cannot reach the node's GPUs or driver: {r.gpu_stack[:120]}", False, True, named)
    app_xid = next((c for c in r.xids if xid_lookup(c).action == "app_unless_repeated"), None)
    if xid is None and app_xid is not None:
        return t("suspect", FaultClass.unknown, "xid_application_or_gpu",
                 f"Xid {app_xid} is the application's unless it repeats on the same GPU: run it on other GPUs",
                 False, True, named)
    if xid is not None:
        return t("contained", xid[1], "xid_contained",
                 f"the driver contained Xid {xid[2]} to the application: restart it, the node stays", True, False)

    # 2. the scheduler's decision
    sr = r.scheduler_reason
    if sr in ("OOMKilled", "OUT_OF_MEMORY", "OOM_KILL"):
        return t("user", FaultClass.user_error, "host_out_of_memory",
                 f"the job ran out of host memory ({sr})", True, False)
    if sr in ("Evicted", "PREEMPTED", "PreemptionByScheduler", "EvictionByEvictionAPI", "DeletionByTaintManager",
              "TerminationByKubelet", "DeletionByPodGC", "REQUEUED"):
        return t("transient", FaultClass.transient_software, "scheduler_preempted",
                 f"the scheduler took the job's resources back ({sr})", True, False)
    if sr in ("DeadlineExceeded", "TIMEOUT", "TIME_LIMIT", "DEADLINE"):
        return t("user", FaultClass.user_error, "time_limit",
                 f"the job reached the time limit it was given ({sr}): running it again ends the same way",
                 True, False)
    if sr in ("NODE_FAIL", "BOOT_FAIL", "NodeLost"):
        return t("suspect", FaultClass.unknown, "scheduler_node_failure",
                 f"the scheduler lost a node of the job ({sr})", False, True, named)
    if r.prolog is not None:
        host = r.prolog[1]
        node = next((n for n in nodes if host and n.split(".")[0].lower() == host.split(".")[0].lower()), named)
        return t("suspect", FaultClass.unknown, "scheduler_prolog_failure",
                 f"the scheduler could not set the job up on a node: {r.prolog[0][:120]}", False, True, node)
    if r.preempted:
        return t("transient", FaultClass.transient_software, "preempted",
                 f"the cluster preempted the job or its node: {r.preempted[:120]}", True, False)
    if r.image_pull is not None:
        if r.image_pull[0] == "timeout":
            return t("transient", FaultClass.transient_software, "image_pull_timeout",
                     "the container image could not be pulled in time", False, False)
        return t("user", FaultClass.user_error, "image_missing", "the container image could not be pulled",
                 True, False)
    if sr in ("CreateContainerConfigError", "InvalidImageName", "ErrImagePull", "ImagePullBackOff",
              "ContainerCannotRun", "StartError", "CreateContainerError"):
        return t("user", FaultClass.user_error, "container_config",
                 f"the container could not start ({sr})", False, False)

    # 3. the program's environment and command line
    if r.shm:
        return t("user", FaultClass.user_error, "shared_memory",
                 "too little shared memory for the job (the container's /dev/shm)", True, False)
    if r.argument_error:
        return t("user", FaultClass.user_error, "argument_error",
                 f"the program refused its command line: {r.argument_error[:120]}", True, False)

    # 4. NCCL: its result code, the CUDA error behind it, its own warnings
    user_nccl = [c for c in r.nccl_errors if c in ("ncclInvalidUsage", "ncclInvalidArgument")]
    if user_nccl:
        return t("user", FaultClass.user_error, "nccl_invalid_usage",
                 f"NCCL refused the call ({user_nccl[0]})", True, False)
    if r.network:
        return t("network", FaultClass.node_network, "fabric_error",
                 f"the network reported: {r.network[0]}", False, True, named)

    # 5. the CUDA runtime
    if r.cuda_errors:
        name = _strongest_cuda(r.cuda_errors)
        kind, fc, strong = CUDA_KIND[name]
        if kind == "suspect":
            return t(kind, fc, "cuda_error_ambiguous", f"{name}: raised by failing GPUs and by faulty programs alike",
                     False, True, named)
        return t(kind, fc, "cuda_error", f"the CUDA runtime reported {name}", strong, kind != "user", named)
    status = [s for s in _LIB_STATUS.findall(" ".join(e[1] for e in r.exceptions)) if s in LIB_STATUS_KIND]
    if status:
        kind, fc, strong = LIB_STATUS_KIND[status[0]]
        return t(kind, fc, "cuda_library_status", f"a CUDA library returned {status[0]}", strong, kind != "user",
                 named)
    if "ncclUnhandledCudaError" in r.nccl_errors:
        return t("suspect", FaultClass.gpu_hardware, "nccl_unhandled_cuda_error",
                 "NCCL hit a CUDA error it does not name", False, True, named)
    sys_nccl = [c for c in r.nccl_errors if c in ("ncclSystemError", "ncclInternalError", "ncclRemoteError")]
    if sys_nccl:
        return t("network", FaultClass.node_network, "nccl_system_error",
                 f"NCCL reported {sys_nccl[0]}: a socket, the fabric or a peer failed", False, True, named)

    # 6. the Python exception of the worker that failed first
    if exc_type is not None:
        if exc_type in USER_EXCEPTIONS:
            return t("user", FaultClass.user_error, "python_exception", f"the code raised {exc_type}", True, False)
        if exc_type in TRANSIENT_EXCEPTIONS and not r.nccl_watchdog:
            return t("transient", FaultClass.transient_software, "transient_exception",
                     f"a network call or service failed ({exc_type})", False, True)
    if any(c == 429 or c >= 500 for c in r.http_status):
        code = next(c for c in r.http_status if c == 429 or c >= 500)
        return t("transient", FaultClass.transient_software, "service_unavailable",
                 f"a service answered HTTP {code}", False, False)

    # 7. consequences of a failure elsewhere: a watchdog, a lost peer or store
    if r.nccl_watchdog:
        return t("elsewhere", FaultClass.unknown, "nccl_watchdog_timeout",
                 "a collective timed out: some rank stopped or stalled, the text does not say which or why",
                 False, True, named)
    if r.nccl_errors:
        return t("elsewhere", FaultClass.unknown, "nccl_error",
                 f"NCCL reported {r.nccl_errors[0]} without naming its cause", False, True, named)
    if (exc_type in ELSEWHERE_EXCEPTIONS) or r.peer_lost:
        what = exc_type if exc_type in ELSEWHERE_EXCEPTIONS else r.peer_lost[0]
        return t("elsewhere", FaultClass.unknown, "peer_lost",
                 f"a peer, the store or the rendezvous went away ({what})", False, True, named)
    if exc_type is not None:
        return t("user", FaultClass.user_error, "python_exception_generic",
                 f"the code raised {exc_type} with no sign of the GPU, NCCL or the network", False, False)

    # 8. signals alone
    sig = r.signal
    if sig in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT"):
        return t("transient", FaultClass.transient_software, "stop_signal",
                 f"the job was asked to stop ({sig}): preemption or a scheduler's decision", False, False)
    if sig == "SIGKILL":
        return t("unknown", FaultClass.unknown, "sigkill",
                 "killed (SIGKILL) with no reason given: the OOM killer or a scheduler", False, True, named)
    if sig in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
        return t("unknown", FaultClass.unknown, "crash_signal",
                 f"the process crashed ({sig}) without a message", False, True, named)
    return t("unknown", FaultClass.unknown, "no_evidence", "nothing in the exit code, reason or log names a cause",
             False, True, named)


def _strongest_cuda(names: list[str]) -> str:
    """Of the CUDA errors seen, the one whose verdict is firmest: a user's error named
    outright over an ambiguous one (an OOM often ends in 'unspecified launch failure')."""
    def rank(n: str) -> tuple[int, int]:
        kind, _, strong = CUDA_KIND[n]
        return ({"hardware": 0, "user": 1, "transient": 2, "suspect": 3}[kind] - (1 if strong else 0), 0)
    return min(names, key=rank)


def _named_node(r: Reading, nodes: list[str]) -> str | None:
    """The job's node that the text names as the failure's origin, if any."""
    if not nodes:
        return None
    known = {n.lower(): n for n in nodes}
    short = {n.split(".")[0].lower(): n for n in nodes}

    def match(host: str | None) -> str | None:
        if not host:
            return None
        h = host.lower()
        return known.get(h) or short.get(h.split(".")[0])

    if r.torchrun:
        hit = match(r.torchrun.get("host"))
        if hit:
            return hit
    for host in r.failed_hosts:  # the launcher's first failed worker
        hit = match(host)
        if hit:
            return hit
    for warn_host, _ in reversed(r.nccl_warns):
        hit = match(warn_host)
        if hit:
            return hit
    return None


# ------------------------------------------------------------------------- signatures

_NUM = re.compile(r"0x[0-9a-fA-F]+|\b\d+(?:\.\d+)?\b|\d+")
_IP = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\[[0-9a-fA-F:]+\](?::\d+)?")
_PATHISH = re.compile(r"/tmp/\S+|pid[ =:]\s*\d+", re.IGNORECASE)
_WS = re.compile(r"\s+")


def signature_basis(r: Reading, t: Triage, nodes: list[str]) -> str:
    """What two failures must share to be 'the same failure': the rule, the root
    exception's type and message, or the last error line, with numbers, addresses, pids
    and the job's own node names taken out (they differ from one placement to the next)."""
    if r.exception is not None:
        body = f"{_short(r.exception[0])}: {r.exception[1]}"
    else:
        body = r.last_error
    body = body[:400]
    for n in sorted(nodes, key=len, reverse=True):
        if n:
            body = body.replace(n, "<node>")
            body = body.replace(n.split(".")[0], "<node>")
    body = _IP.sub("#", body)
    body = _PATHISH.sub("#", body)
    body = _NUM.sub("#", body)
    body = _WS.sub(" ", body).strip().lower()
    return f"{t.rule}|{body}"


def triage(exit_code: int | None, reason: str | None, log_tail: str | None,
           nodes: list[str] | None = None) -> tuple[Reading, Triage]:
    """Read and classify one failure."""
    r = read_failure(exit_code, reason, log_tail)
    return r, classify(r, nodes)
