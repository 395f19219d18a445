"""Where and how a process computes, for every script: its rank among the launched processes,
its device, its precision (dtype, autocast and gradient scaler), the process group (a store of
its own for each torchrun restart, and what a collective's failure says about a lost peer),
the device's peak FLOP/s for MFU, and the ranks' agreement at start-up.
"""
import contextlib
import os
import re
import socket
import sys
import threading
import uuid
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ddpgpt import watchdog
from ddpgpt.errors import PeerLost, UserError


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
                      int(env["SLURM_NTASKS"]), int(env.get("LOCAL_WORLD_SIZE", 1)))
        # init_process_group's env:// rendezvous reads RANK and WORLD_SIZE: set them as
        # torchrun would (srun sets only the SLURM_* variables)
        env.update(RANK=str(found.rank), LOCAL_RANK=str(found.local_rank),
                   WORLD_SIZE=str(found.world_size))
        return found
    return Ranks(0, 0, 1, 1)


def logger(ranks, stream=None):
    """print on rank 0, nothing elsewhere: one copy of each line in a shared log."""
    if not ranks.master:
        return lambda *args, **kw: None
    return print if stream is None else (lambda *args, **kw: print(*args, file=stream, **kw))


# ---- the device ----

def pick_device(device, ranks):
    """'auto' is this rank's GPU when torch sees one, else the CPU; 'cuda' is this rank's GPU,
    cuda:<local rank>, since a launcher starts one process per GPU. cuda:N with several ranks on
    this node would put them all on one GPU. A device this torch cannot serve is a UserError
    that names the ones it can."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise UserError(f"device={device!r} is not a device: use auto, cpu, cuda (this rank's "
                        f"GPU) or cuda:N.") from None
    if chosen.type == "mps":
        return apple_gpu(device, ranks)
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
    if index >= torch.cuda.device_count():
        raise UserError(f"this rank needs GPU cuda:{index}, but torch sees "
                        f"{torch.cuda.device_count()}: start at most that many ranks per node.")
    return f"cuda:{index}"


def apple_gpu(device, ranks):
    """mps, where this torch has it, for one process: gloo, the one backend that could join
    several, all-reduces CPU and CUDA tensors only."""
    if not torch.backends.mps.is_available():
        raise UserError(f"device={device!r}, but torch {torch.__version__} has no MPS device "
                        f"here (Apple's GPUs, on macOS). {can_run_on()}")
    if ranks.world_size > 1:
        raise UserError(f"device={device!r} runs one process only (gloo cannot all-reduce MPS "
                        f"tensors): run python train.py, not {ranks.world_size} ranks.")
    return device


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
        dtype = "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) \
            else "float16"
    elif dtype == "auto":
        dtype = "float32"
    autocast = nullcontext() if dtype == "float32" else torch.autocast(
        kind, dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    return Precision(dtype, autocast, torch.amp.GradScaler(kind, enabled=dtype == "float16"))


# ---- the process group ----

def init_distributed(device, world_size, backend="", timeout_s=600):
    """Set this process's GPU and its float32 matmul precision, and with several ranks join the
    process group ('' picks nccl on CUDA, gloo on a CPU) in a store of this restart's own, and
    learn every rank's address for lost_peer()."""
    if device_type(device) == "cuda":
        torch.cuda.set_device(device)
        # float32 matmuls in TF32 where the tensor cores have it, as nanoGPT: float32 runs
        # (and autocast's float32 parts) go several times faster at a precision loss that
        # training does not notice
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1:
        backend = check_backend(backend, device)
        # torch.distributed.nn.functional's collectives default to group=group.WORLD, taken
        # when it is first imported (by torch._dynamo, which any optimizer's constructor
        # imports): after init_process_group, that keeps the group alive past
        # destroy_process_group, its gloo threads too, and one that drops a collective's
        # tensor during the interpreter's exit aborts the process ("terminate called without
        # an active exception"). Imported before, the default is None.
        import torch.distributed.nn.functional  # noqa: F401
        timeout, rank = timedelta(seconds=timeout_s), int(os.environ["RANK"])
        with this_restarts_store(rank, world_size, timeout) as store:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout,
                                    device_id=torch.device(device) if backend == "nccl" else None)
        GROUP.update(store=store, peers=gather(this_peer(), world_size))


def check_backend(backend, device):
    """The backend for this device ('' picks it); one that this torch cannot serve is a
    UserError that names those it can."""
    kind = device_type(device)
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    built = [name for name, there in (("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if there]
    if backend not in built:
        raise UserError(f"backend={backend!r}, but torch {torch.__version__} was built without "
                        f"it{' (a CPU build)' if not torch.version.cuda else ''}: it has "
                        f"{', '.join(built) or 'no backend'}; use --backend=gloo, or leave "
                        f"backend unset to pick one, or install a torch build with {backend}.")
    if backend == "nccl" and kind != "cuda":
        raise UserError(f"backend='nccl' all-reduces CUDA tensors only, and device={device!r}: "
                        f"use --backend=gloo (or leave backend unset) for a {kind} device, or "
                        f"--device=cuda.")
    return backend


def finish(world_size):
    """Leave the process group on the way out of a run that succeeded, or whose ranks all
    agreed to stop (agree). (A rank that fails alone exits without it: since PyTorch 2.6 destroying a group waits for collectives that the other
    ranks may never join; errors.run says so.)"""
    if world_size > 1:
        dist.destroy_process_group()


def agree(error, ranks, script):
    """Share each rank's start-up error (or None) so that all ranks stop together and rank 0
    reports every distinct problem once; no rank is left waiting in a later collective.
    True when no rank had one."""
    found = [error]
    if ranks.world_size > 1:
        found = [None] * ranks.world_size
        dist.all_gather_object(found, error)
    problems = {}
    for r, e in enumerate(found):
        if e is not None:
            problems.setdefault(e, []).append(r)
    if problems and ranks.master:
        for message, where in problems.items():
            named = "" if ranks.world_size == 1 else \
                f" (rank{'s' if len(where) > 1 else ''} {', '.join(map(str, where))})"
            print(f"{script}: error{named}: {message}", file=sys.stderr)
    return not problems


def gather(value, world_size):
    """Every rank's value (any picklable object), in rank order, on every rank."""
    if world_size == 1:
        return [value]
    every = [None] * world_size
    dist.all_gather_object(every, value)
    return every


# ---- a store for each restart ----
#
# torchrun (torch 2.4 and later) hands every restart of the workers the same TCPStore: its
# agent's (TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR/MASTER_PORT point at it), which keeps
# the keys of the attempt before. init_process_group's own keys carry no attempt number, so a
# restarted rank can read a dead rank's address and fail ("Connection refused") or wait for
# ever (pytorch#135712; torch's own prefix, TORCHELASTIC_RESTART_COUNT, differs between nodes:
# it counts the restarts that each node's agent caused). Every restart therefore joins under a
# prefix of its own, a random one that rank 0 draws and the others learn through the store.
# The others delete the key first: whatever they then read was written by this attempt's
# rank 0, since every worker of the attempt before is gone before torchrun starts the next.
# Rank 0 writes it again and again until the group stands, so that a rank that deletes it
# after rank 0 first wrote it still reads it.

ATTEMPT_KEY = "ddpgpt/attempt"
ATTEMPT_REPUBLISH_S = 0.05


@contextlib.contextmanager
def this_restarts_store(rank, world_size, timeout):
    """The store the process group of this restart is made in: the agent's under this
    attempt's prefix; or, where rank 0 makes a new store for each attempt itself (outside
    torchrun, and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), that one, as env:// makes it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        yield dist.PrefixStore("default_pg", store)  # init_process_group's own prefix
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=False, timeout=timeout)
    joined = threading.Event()
    if rank == 0:
        attempt = uuid.uuid4().hex
        # a connection of its own: a TCPStore client does one request at a time, and the
        # group's set-up waits in the other one
        threading.Thread(target=publish, args=(store.clone(), attempt, joined), daemon=True,
                         name="restart-store").start()
    else:
        store.delete_key(ATTEMPT_KEY)
        attempt = store.get(ATTEMPT_KEY).decode()
    try:
        yield dist.PrefixStore(f"ddpgpt/{attempt}", store)
    finally:
        joined.set()


def publish(store, attempt, joined):
    while not joined.is_set():
        store.set(ATTEMPT_KEY, attempt)
        joined.wait(ATTEMPT_REPUBLISH_S)


# ---- a lost peer ----
#
# A rank that dies (kill -9, the out-of-memory killer, a segfault) closes its connections, and
# the others' next collective fails with the backend's own words; lost_peer() knows them.
# gloo (pair.cc) names the peer's address, which GROUP's peers map to a rank. NCCL's come from
# ProcessGroupNCCL and NCCLUtils: with TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's default, its
# watchdog thread ends the process itself on such an error or a timeout, printing
# "Process group watchdog thread terminated with exception: ..." (and the flight recorder's
# dump, launch/README.md); where one reaches Python instead, it reads as below.

GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
        "Connection refused",  # gloo, in a collective or joining the group
        "remote process exited or there was a network error", "ncclRemoteError",
        "NCCL communicator was aborted",  # NCCL
        "failed to recv, got 0 bytes")  # the store, when the rank that held it is gone
SILENT = ("Timed out waiting", "timed out connecting",  # gloo
          "Watchdog caught collective operation timeout")  # NCCL

# once the group stands (init_distributed): its store, where a rank that lost a peer leaves a
# note of it (lost_first), and every rank's Peer, in rank order
GROUP = {"store": None, "peers": []}


class Peer(NamedTuple):
    host: str
    pid: int
    addresses: list  # [(ip, port)]: its TCP sockets' own ends, gloo's among them


def this_peer():
    """This rank as a Peer: a gloo error names the peer's end of the connection that broke,
    its listening socket or the one it connected from, so both kinds are listed."""
    import psutil  # here only: the one use of it in the package

    try:
        sockets = psutil.Process().net_connections("tcp")
    except psutil.Error:  # where listing them is not allowed: the ranks go unnamed
        sockets = []
    return Peer(socket.gethostname(), os.getpid(), [tuple(c.laddr) for c in sockets if c.laddr])


class Lost(NamedTuple):
    """What a failed collective says about the rank it lost."""
    rank: Any  # its number, or None where the message does not say
    who: str  # 'rank 2 (pid 123 on n1)', 'the rank at 10.0.0.7:41234', 'another rank'
    gone: bool  # its connections closed; False: it did not answer in time
    said: str  # the backend's words, without its source file and its boilerplate


def lost_peer(error, rank, world_size):
    """A Lost, or None for any other error."""
    text = str(error)
    if world_size == 1 or not any(words in text for words in GONE + SILENT):
        return None
    said = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text).strip()
    said = re.split(r"\. This is typically|\n", said)[0].strip()
    lost, who = which_rank(text, rank, world_size)
    return Lost(lost, who, any(words in text for words in GONE), said)


def which_rank(text, rank, world_size):
    """(the lost rank or None, how to name it) as this rank can tell: the other one of two,
    else the rank listening at the address that the message names."""
    if world_size == 2:
        return 1 - rank, named(1 - rank)
    for ip, port in re.findall(r"\[([0-9A-Fa-f.:]+)\]:(\d+)", text):
        # gloo (torch 2.13) prints the port in network byte order
        ports = (int(port), int.from_bytes(int(port).to_bytes(2, "big"), "little"))
        found = [r for r, peer in enumerate(GROUP["peers"]) if r != rank and any(
            p in ports and same_ip(a, ip) for a, p in peer.addresses)]
        if len(found) == 1:
            return found[0], named(found[0])
        return None, f"the rank at {ip}:{port}"
    return None, "another rank"


def same_ip(own, named_ip):
    """Whether a socket whose own end is at `own` is reached at `named_ip` (an IPv4 address
    may be listed in its IPv6 form, ::ffff:10.0.0.7)."""
    return own in (named_ip, "0.0.0.0", "::") or own.endswith(f":{named_ip}") \
        or named_ip.endswith(f":{own}")


def named(rank):
    peers = GROUP["peers"]
    return f"rank {rank}" if rank >= len(peers) else \
        f"rank {rank} (pid {peers[rank].pid} on {peers[rank].host})"


NOTE = "ddpgpt_lost/{}"
NOTE_WAIT_S = 2  # for the store: one whose host is gone would make a survivor wait for ever


def lost_first(lost, rank):
    """The rank lost first as far as the notes in the store tell, after leaving this rank's
    note of it. A survivor leaves its note before it exits, and its exit breaks the
    connections of the ranks that wait for it: those follow the notes back to the rank that
    went first. `lost` where there are none, or the store does not answer in time."""
    def follow():
        first, seen = lost, {rank}
        while first is not None:
            key = NOTE.format(first)
            note = store.get(key).decode() if store.check([key]) else ""
            if not note or int(note) in seen:
                break
            seen.add(first)
            first = int(note)
        store.set(NOTE.format(rank), "" if first is None else str(first))
        found.append(first)

    def in_thread():
        try:
            follow()
        except Exception:  # a store gone with its host: this rank's own view stands
            pass

    store, found = GROUP["store"], []
    if store is not None:
        thread = threading.Thread(target=in_thread, daemon=True)
        thread.start()
        thread.join(NOTE_WAIT_S)
    return found[0] if found else lost


@contextlib.contextmanager
def peers_watched(ranks, standing):
    """A collective that fails because another rank is gone becomes a PeerLost: which rank
    was lost first (lost_first), in which of our functions, and standing(): (where the run
    is, e.g. 'at iter 57', and how to go on). The lowest rank that survives says all of it;
    the others say in one line that they lost it too, so that a log of many ranks holds one
    paragraph."""
    try:
        yield
    except RuntimeError as e:
        lost = lost_peer(e, ranks.rank, ranks.world_size)
        if lost is None:
            raise
        first = lost_first(lost.rank, ranks.rank)
        who = lost.who if first == lost.rank else named(first)
        at, advice = standing()
        where = " ".join(filter(None, (watchdog.where_raised(e.__traceback__, ranks.world_size),
                                       at)))
        if not (ranks.rank == 0 or (ranks.rank == 1 and first == 0)):
            raise PeerLost(f"lost {who} too, in {where} ({lost.said}); the lowest rank that "
                           f"survives says what to do.") from None
        if first != lost.rank:
            who += f", which rank {lost.rank} had lost before it left,"
        how = ("has gone: it failed, was killed (kill -9, the out-of-memory killer), crashed "
               "or lost its node; its own log and the launcher's report say which"
               if lost.gone else
               "did not answer within dist_timeout_s: it is stuck or stopped, or its node went "
               "away without closing its connections")
        raise PeerLost(f"lost {who} in {where}: that rank {how}. The backend said: "
                       f"{lost.said}. {advice}") from None


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
    if device_type(device) != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name):
    return next((flops for part, flops in PEAK_FLOPS if part in name), None)
