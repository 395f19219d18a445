"""Where and how a process computes, for every script: its rank among the launched processes,
its device, its precision (dtype, autocast and gradient scaler) and the device's peak FLOP/s for
MFU. The process group that the ranks form is launch.py's."""
import logging
import os
import time
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch

from ddpgpt.errors import UserError

log = logging.getLogger(__name__)


class Ranks(NamedTuple):
    rank: int
    local_rank: int  # among the processes of this node
    world_size: int
    local_world_size: int  # the processes of this node

    @property
    def master(self):
        return self.rank == 0


def ranks():
    """This process's Ranks: torchrun's variables, else one srun task per process, else one
    process alone."""
    env = os.environ
    if "RANK" in env:
        return Ranks(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                     int(env.get("LOCAL_WORLD_SIZE", 1)))
    if int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise UserError(
                    f"{name} is not set: with one srun task per GPU, train.py needs MASTER_ADDR "
                    f"and MASTER_PORT; launch through launch/srun.sh, which sets them.")
        found = Ranks(int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]),
                      int(env["SLURM_NTASKS"]), slurm_tasks_on_this_node(env))
        # init_process_group's env:// rendezvous reads RANK and WORLD_SIZE: set them as
        # torchrun would (srun sets only the SLURM_* variables)
        env.update(RANK=str(found.rank), LOCAL_RANK=str(found.local_rank),
                   WORLD_SIZE=str(found.world_size), LOCAL_WORLD_SIZE=str(found.local_world_size))
        return found
    return Ranks(0, 0, 1, 1)


def slurm_tasks_on_this_node(env):
    """The srun step's tasks on this node (SLURM_NODEID), from SLURM_STEP_TASKS_PER_NODE:
    '8(x2),4' is 8 on each of the first two nodes, 4 on the third."""
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")) \
            .split(","):
        tasks, _, nodes = part.partition("(x")
        counts += [int(tasks)] * int(nodes.rstrip(")") or 1)
    return counts[int(env.get("SLURM_NODEID", 0))]


# ---- the device ----

def pick_device(device, ranks):
    """'auto' is this rank's GPU when torch sees one, else the CPU (with a note where the
    process looks launched to run on a GPU: gpu_job_signs); 'cuda' is this rank's GPU,
    cuda:<local rank>, since a launcher starts one process per GPU. A device this torch cannot
    serve is a UserError that names the ones it can."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and (signs := gpu_job_signs()):
            log.info(f"note: device='auto' is the CPU: torch {torch.__version__} sees no CUDA "
                     f"device (built for CUDA {torch.version.cuda or 'none: a CPU build'}), "
                     f"though {signs}. Install torch's CUDA build, or check the "
                     f"driver with nvidia-smi; --device=cpu runs on the CPU without this note.")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise UserError(f"device={device!r} is not a device: use auto, cpu, cuda (this rank's "
                        f"GPU) or cuda:N.") from None
    if chosen.type == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(f"device={device!r}, but torch {torch.__version__} has no MPS device "
                            f"here (Apple's GPUs, on macOS). {can_run_on()}")
        if ranks.world_size > 1:
            raise UserError(f"device={device!r} runs one process only (gloo cannot all-reduce "
                            f"MPS tensors): run python train.py, not {ranks.world_size} ranks.")
        return device
    if chosen.type not in ("cpu", "cuda"):
        raise UserError(f"device={device!r}: ddpgpt does not run on {chosen.type} devices. "
                        f"{can_run_on()}")
    if chosen.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"device={device!r}, but torch {torch.__version__} sees no CUDA device "
                        f"(built for CUDA {torch.version.cuda or 'none: a CPU build'}): use "
                        f"--device=cpu, or install torch's CUDA build.")
    if chosen.index is not None and ranks.local_world_size > 1:
        raise UserError(f"device={device!r} puts all {ranks.local_world_size} ranks of this node "
                        f"on one GPU: use --device=cuda, which gives each rank its own, "
                        f"cuda:<local rank>.")
    index = ranks.local_rank if chosen.index is None else chosen.index
    # an srun task of its own (LAUNCHER=srun), not a rank that torchrun started: SLURM may bind
    # it to one GPU (--gpus-per-task=1, --gpu-bind), its cuda:0 whatever its SLURM_LOCALID
    own_task = "SLURM_LOCALID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
    if chosen.index is None and torch.cuda.device_count() == 1 and own_task:
        index = 0  # this task's own GPU: SLURM bound it one, and torch sees that one alone
    if index >= torch.cuda.device_count():
        raise UserError(f"this rank needs GPU cuda:{index}, but torch sees "
                        f"{torch.cuda.device_count()}: start at most that many ranks per node.")
    return f"cuda:{index}"


# what a launcher sets when it gives a process GPUs
GPU_JOB_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
                     "SLURM_STEP_GPUS")
NVIDIA_DRIVER = "/dev/nvidiactl"  # the loaded driver's control device, on Linux


def gpu_job_signs():
    """Why this process looks launched to run on a GPU ('' when it does not). A CPU-only
    machine shows none, whatever torch build it has, so device='auto' goes to the CPU there
    without a word."""
    signs = [f"{name}={os.environ[name]}" for name in GPU_JOB_VARIABLES if os.environ.get(name)]
    if os.path.exists(NVIDIA_DRIVER):
        signs.append(f"this machine has an NVIDIA driver ({NVIDIA_DRIVER})")
    return ", ".join(signs)


def can_run_on():
    """The devices this machine's torch serves, as advice."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append(f"cuda ({torch.cuda.device_count()} GPU(s))")
    if torch.backends.mps.is_available():
        found.append("mps")
    return f"This machine's torch {torch.__version__} can run on: {', '.join(found)}."


def device_type(device):
    return torch.device(device).type


def use_device(device):
    """Make device this process's GPU (where it is one), its float32 matmuls in TF32 where the
    tensor cores have it, as nanoGPT: float32 runs (and autocast's float32 parts) go several
    times faster at a precision loss that training does not notice."""
    if device_type(device) == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


class Stopwatch:
    """The time from its making to its last stop(), in seconds(): the host's clock on a CPU; on
    CUDA the device's, by two events on its stream, since the host only queues the kernels and
    its clock would time the queueing. seconds() is read after the step's synchronisation, when
    both events are done: it waits for nothing."""

    def __init__(self, device):
        self.cuda = device_type(device) == "cuda"
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        self.t_start, self.took = time.perf_counter(), 0.0

    def stop(self):
        if self.cuda:
            self.end.record()
        self.took = time.perf_counter() - self.t_start

    def seconds(self):
        return self.start.elapsed_time(self.end) / 1000 if self.cuda else self.took


def on_device(device):
    """A thread initializer (ThreadPoolExecutor's) that makes device the thread's CUDA device.
    CUDA's current device is per thread and a new thread's is cuda:0: a rank's background
    thread that pins memory (the batch reader) or runs DCP's save, which copies on
    torch.cuda.current_stream(), would open a context of its own on GPU 0, every rank's."""
    def set_device():
        if device_type(device) == "cuda":
            torch.cuda.set_device(device)
    return set_device


def to_device(t, device):
    """The host tensor t on device. To a GPU from pinned memory, asynchronously: a copy from
    pageable memory waits for all the work queued on the GPU first, which keeps the host from
    reading the next batch while the GPU runs the last."""
    return t.pin_memory().to(device, non_blocking=True) if device_type(device) == "cuda" else \
        t.to(device)


# ---- precision ----

class Precision(NamedTuple):
    dtype: str  # float32, bfloat16 or float16
    autocast: Any  # the context the forward passes run in
    scaler: torch.amp.GradScaler  # float16's loss scaling; disabled for the others


def precision(dtype, device):
    """The Precision of a dtype setting on a device: 'auto' is bfloat16 on a GPU that has it
    natively, else float16 (emulated bfloat16, on a V100 or T4, is slow), and float32 on a
    CPU. Every script computes in the precision this returns."""
    kind = device_type(device)
    if dtype == "auto" and kind == "cuda":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    elif dtype == "auto":
        dtype = "float32"
    autocast = nullcontext() if dtype == "float32" else torch.autocast(
        kind, dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    return Precision(dtype, autocast, torch.amp.GradScaler(kind, enabled=dtype == "float16"))


# ---- the device's peak, for MFU ----

# Dense bf16 tensor peak of one GPU, by a part of its name; the first that matches counts, so a
# variant comes before its family. From NVIDIA's datasheets, which print the peak with 2:4
# sparsity: half of it is the dense one.
PEAK_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),  # H100 datasheet
              ("H200 NVL", 835e12), ("H200", 989e12),  # H200 datasheet
              ("B200", 2250e12),  # HGX B200 datasheet: 36 PFLOPS sparse for 8 GPUs
              ("A100", 312e12),  # A100 datasheet, SXM and PCIe alike
              ("L40S", 362e12),  # L40S datasheet
              ("A10G", 70e12)]  # AWS's A10G (not NVIDIA's A10, 125e12)


def peak_flops(device):
    """The device's dense bf16 peak in FLOP/s, for MFU; None when unknown (or a CPU)."""
    return peak_flops_of(torch.cuda.get_device_name(device)) if device_type(device) == "cuda" \
        else None


def peak_flops_of(name):
    return next((flops for part, flops in PEAK_FLOPS if part in name), None)
