"""The process around the library: the session that train.py and eval.py run in, which owns what
a launched process lives through and the library does not know of: the process group (peers.py),
the ranks' agreement on start-up errors (start), stop signals (signals.py), the hang watchdog
(watchdog.py), rank 0's lock on each folder the run writes (lock.py), and a lost peer said as
one paragraph (watched). A loop of your own uses the library without any of this
(docs/training.md has the layers); the error line itself is errors.py's."""
import contextlib
import os
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ddpgpt import lock, logs, peers, runtime, signals, watchdog
from ddpgpt.errors import UserError, exit_now, line, say


class Session(NamedTuple):
    script: str
    ranks: runtime.Ranks
    device: str
    stops: list  # the stop signals received so far (train.py's loop agrees on them)


class StartUpFailed(Exception):
    """A rank met a UserError at start-up, which rank 0 has said: every rank stops."""


@contextlib.contextmanager
def session(script, device, backend="", timeout_s=600, *, locks=(), watch=None, stops=False,
            standing=lambda: ("", ""), log_stream=None):
    """The Session of a script's process, made in the order below: stops records stop signals
    and watches the launcher; watch is the hang watchdog's (out_dir, hang_timeout_s,
    startup_timeout_s); on rank 0 each of `locks`, (folder, what to do when it cannot be written),
    is locked until the end. A rank that loses another says so with standing(): (where the run is,
    how to go on). At the end every rank leaves together (finish): status 1 if start-up failed."""
    received = signals.catch_stop_signals(script) if stops else []
    ranks = runtime.ranks()
    if stops:
        signals.stop_when_the_launcher_dies(script)  # once ranks() has set RANK under srun
    if watch:
        watchdog.start(watch[0], ranks.rank, ranks.world_size, *watch[1:])
    logs.setup(ranks.master, stream=log_stream)
    device = runtime.pick_device(device, ranks)
    init_distributed(device, ranks.world_size, backend, timeout_s)
    status, s = 1, Session(script, ranks, device, received)
    with watched(ranks, standing), contextlib.ExitStack() as held:

        def take_locks():  # on rank 0; agreed on as any start-up error
            for folder, fix in locks if ranks.master else ():
                held.enter_context(lock.locked(folder, script, fix))

        with contextlib.suppress(StartUpFailed):
            start(s, take_locks)
            yield s
            status = 0
    finish(ranks.world_size, status)  # the locks released; exits after a failed start-up


def start(s, start_up):
    """start_up()'s result once every rank has run it; where a rank met a UserError, every
    rank stops together (StartUpFailed), rank 0 having said each distinct problem once, and no
    rank is left waiting in a later collective. start_up runs no collective after a rank could
    meet its UserError, so that every rank gets to agree."""
    try:
        found, error = start_up(), None
    except UserError as e:
        found, error = None, str(e)
    problems = {}
    for r, e in enumerate(gather(error, s.ranks.world_size)):
        if e is not None:
            problems.setdefault(e, []).append(r)
    if problems:
        for message, where in problems.items() if s.ranks.master else ():
            say(line(s.script, message, where if s.ranks.world_size > 1 else ()))
        raise StartUpFailed
    return found


# ---- the process group ----

def init_distributed(device, world_size, backend="", timeout_s=600):
    """Use the device (runtime.use_device), and with several ranks join the process group
    ('' picks nccl on CUDA, gloo on a CPU) in a store of this restart's own, and learn every
    rank's address for peers.lost_peer()."""
    runtime.use_device(device)
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
        with peers.this_restarts_store(rank, world_size, timeout) as store:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout,
                                    device_id=torch.device(device) if backend == "nccl" else None)
        peers.GROUP.update(store=store, peers=gather(peers.this_peer(), world_size))


def check_backend(backend, device):
    """The backend for this device ('' picks it); one that this torch cannot serve is a
    UserError that names those it can."""
    kind = runtime.device_type(device)
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    built = [name for name in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{name}_available")()]
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


def finish(world_size, status=0):
    """The end of a process: one alone exits with status when it is not 0. A rank of several that
    every rank reached together (the run succeeded, or all agreed to stop) leaves the process group
    and exits with status at once: the group's last owner is then the model (DDP's reducer, FSDP),
    whose teardown as the script returns joins gloo's threads while holding the GIL, and a gloo
    thread that is still dropping a collective's tensor waits for that GIL: the rank hangs for ever
    (1 in 6 runs on 4 ranks here). Everything a script writes is closed or flushed by then. (A rank
    that fails alone never comes here: errors.run ends it at once too.)"""
    if world_size > 1:
        dist.destroy_process_group()
        exit_now(status)  # os._exit: it does not return
    if status:
        raise SystemExit(status)


def gather(value, world_size):
    """Every rank's value (any picklable object), in rank order, on every rank."""
    if world_size == 1:
        return [value]
    every = [None] * world_size
    dist.all_gather_object(every, value)
    return every


# ---- a lost peer ----

@contextlib.contextmanager
def watched(ranks, standing):
    """A collective that fails because another rank is gone becomes a UserError: which rank was lost
    first (peers.lost_first), in which of our functions, and standing(): (where the run is, e.g. 'at
    iter 57', and how to go on). The lowest rank that survives says all of it; the others say in one
    line that they lost it too, so that a log of many ranks holds one paragraph."""
    try:
        yield
    except RuntimeError as e:
        lost = peers.lost_peer(e, ranks.rank, ranks.world_size)
        if lost is None:
            raise
        first = peers.lost_first(lost.rank, ranks.rank)
        who = lost.who if first == lost.rank else peers.named(first)
        at, advice = standing()
        where = " ".join(filter(None, (watchdog.where_raised(e.__traceback__, ranks.world_size),
                                       at)))
        if not (ranks.rank == 0 or (ranks.rank == 1 and first == 0)):
            raise UserError(f"lost {who} too, in {where} ({lost.said}); the lowest rank that "
                            f"survives says what to do.") from None
        if first != lost.rank:
            who += f", which rank {lost.rank} had lost before it left,"
        how = ("has gone: it failed, was killed (kill -9, the out-of-memory killer), crashed "
               "or lost its node; its own log and the launcher's report say which"
               if lost.gone else
               "did not answer within dist_timeout_s: it is stuck or stopped, or its node went "
               "away without closing its connections")
        raise UserError(f"lost {who} in {where}: that rank {how}. The backend said: "
                        f"{lost.said}. {advice}") from None
