"""The other ranks of the process group: the store each torchrun restart meets them in, who
they are (a Peer each, learnt as the group stands), and what a failed collective says about the
one that was lost (launch.watched says it)."""
import contextlib
import os
import re
import socket
import threading
import uuid
from typing import Any, NamedTuple

import torch.distributed as dist

from ddpgpt.fileio import alive


# ---- a store for each restart ----
#
# torchrun (torch 2.4 and later) hands every restart of the workers the same TCPStore: its agent's
# (TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR/MASTER_PORT point at it), which keeps the keys of
# the attempt before. init_process_group's own keys carry no attempt number, so a restarted rank can
# read a dead rank's address and fail ("Connection refused") or wait for ever (pytorch#135712;
# torch's own prefix, TORCHELASTIC_RESTART_COUNT, differs between nodes: it counts the restarts that
# each node's agent caused). Every restart therefore joins under a prefix of its own, a random one
# that rank 0 draws and the others learn through the store. The others delete the key first:
# whatever they then read was written by this attempt's rank 0, since every worker of the attempt
# before is gone before torchrun starts the next. Rank 0 writes it again and again until the group
# stands, so that a rank that deletes it after rank 0 first wrote it still reads it.

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
        # A TCPStore's get() waits for the key, then reads it: two requests, and another rank's
        # delete_key can fall between them; the read then gives b"" (its answer for a missing
        # key), which would leave this rank alone in a group of its own, waiting in
        # init_process_group until the timeout. It waits for rank 0's next write instead.
        published = b""
        while not published:
            published = store.get(ATTEMPT_KEY)
        attempt = published.decode()
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

# once the group stands (launch.init_distributed): its store, where a rank that lost a peer
# leaves a note of it (lost_first), and every rank's Peer, in rank order
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
        return (found[0], named(found[0])) if len(found) == 1 else \
            (None, f"the rank at {ip}:{port}")
    return None, "another rank"


def same_ip(own, named_ip):
    """Whether a socket whose own end is at `own` is reached at `named_ip` (an IPv4 address
    may be listed in its IPv6 form, ::ffff:10.0.0.7)."""
    return own in (named_ip, "0.0.0.0", "::") or own.endswith(f":{named_ip}") \
        or named_ip.endswith(f":{own}")


def ended_here():
    """The ranks of this host whose process has ended, named: torchrun stops the others with
    SIGTERM when one fails, and before the first step, where no collective has failed yet to
    say whom it lost, this names it. Ranks on other hosts are named there."""
    here = socket.gethostname()
    return [named(r) for r, peer in enumerate(GROUP["peers"])
            if peer.host == here and peer.pid != os.getpid() and not alive(peer.pid)]


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
        with contextlib.suppress(Exception):  # a store gone with its host: this rank's own view
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

    store, found = GROUP["store"], []
    if store is not None:
        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        thread.join(NOTE_WAIT_S)
    return found[0] if found else lost
