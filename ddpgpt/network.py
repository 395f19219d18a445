"""The network check before the first step (train.py's network_check; docs/performance.md): timed
all-reduces within each node and over all ranks, then rounds in which the first ranks of two
nodes exchange, every pair of nodes once, so that one slow node or link is named instead of
averaged into the group's figure. It logs the bus bandwidths and says where the network is slow."""
import logging
import os
import re
import time

import torch
import torch.distributed as dist

from ddpgpt import launch, peers, runtime
from ddpgpt.errors import UserError

log = logging.getLogger(__name__)

MIB = {"cuda": 32, "cpu": 4}  # a transfer's size: large enough that its time is bandwidth
REPS = 3  # timed runs of each transfer after one to warm up; the fastest counts
SLOW = 1 / 3  # a node whose best link is below this share of the best pair's is slow
# the fabric that NCCL's variables name (the first that matches) and its least between-node bus
# bandwidth in GB/s: half the rate of its slowest common link (docs/performance.md's table)
FABRICS = (("EFA", 6, r"FI_PROVIDER=efa|NCCL_NET=.*(ofi|libfabric)"),
           ("Ethernet", 0.6, r"NCCL_NET=socket|NCCL_IB_DISABLE=1"),
           ("InfiniBand", 6, r"NCCL_NET=ib$|NCCL_IB_"), ("Ethernet", 0.6, r"NCCL_SOCKET_IFNAME="))
VARIABLES = ("NCCL_NET", "NCCL_IB_", "FI_PROVIDER", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def fabric(variables):
    """(name, least GB/s) of the fabric that NCCL's variables name, or None."""
    text = "\n".join(f"{k}={v}" for k, v in variables.items())
    return next((f[:2] for f in FABRICS if re.search(f"^({f[2]})", text, re.M | re.I)), None)


def fastest(start, device):
    """The fastest of REPS runs of start() after one to warm up, each begun by all ranks
    together and lasting until the transfers start() returns are done; None for none."""
    times = []
    for _ in range(REPS + 1):
        dist.barrier()
        t = time.perf_counter()
        works = start()
        for work in works:
            work.wait()
        if works and runtime.device_type(device) == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times[1:]) if works else None


def measure(rank, device, members):
    """This rank's seconds for its node's all-reduce, for the all-reduce of all ranks (several
    nodes), and on a node's first rank, for an exchange with each other node's: {node: s}."""
    n, node = len(members), next(i for i, m in enumerate(members) if rank in m)
    buf = torch.zeros(2, MIB[runtime.device_type(device)] << 18, device=device)
    group = dist.new_subgroups_by_enumeration(members)[0] if n > 1 else None
    within = fastest(lambda: [dist.all_reduce(buf[0], group=group, async_op=True)], device)
    between = fastest(lambda: [dist.all_reduce(buf[0], async_op=True)], device) if n > 1 else 0
    pairs = {}
    for r in range(1, 1 << (n - 1).bit_length()):  # node ^ r: every pair once
        peer = members[node ^ r][0] if node ^ r < n and rank == members[node][0] else None
        pairs[node ^ r] = fastest(lambda: [] if peer is None else dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, buf[0], peer), dist.P2POp(dist.irecv, buf[1], peer)]), device)
    if group is not None:
        dist.destroy_process_group(group)
    return within, between, pairs


def check(ranks, device, min_gbps, stop, one_node_too):
    """Time the network and log its bus bandwidths; where it is slow, a paragraph that says
    where as a warning, or with stop as a UserError, on every rank alike. Ranks on one node
    are timed only with one_node_too."""
    began, hosts = time.perf_counter(), [peer.host for peer in peers.GROUP["peers"]]
    nodes = list(dict.fromkeys(hosts))
    if len(nodes) == 1 and not one_node_too:
        return
    members = [[r for r, h in enumerate(hosts) if h == node] for node in nodes]
    every = launch.gather((*measure(ranks.rank, device, members), {
        k: v for k, v in os.environ.items() if k.startswith(VARIABLES)}), ranks.world_size)
    size = MIB[runtime.device_type(device)] << 20

    def gbps(t, k=2):  # an all-reduce's bus bandwidth over k ranks; a pair's, each way
        return size / t * 2 * (k - 1) / k / 1e9
    within = [gbps(max(every[r][0] for r in m), len(m)) for m in members if len(m) > 1]
    between = len(nodes) > 1 and gbps(max(e[1] for e in every), ranks.world_size)
    figures = [f"within a node {min(within):.3g} GB/s" if within else "",
               f"between {len(nodes)} nodes {between:.3g} GB/s" if between else ""]
    log.info(f"network: bus bandwidth {', '.join(filter(None, figures))} (all-reduces of "
             f"{size >> 20} MiB; {time.perf_counter() - began:.1f} s)")
    named = fabric(every[0][3]) if dist.get_backend() == "nccl" else None
    least = (min_gbps, "network_min_gbps asks") if min_gbps else \
        (named[1], f"{named[0]} should give") if named else (0, "")
    pairs = {(a, b): gbps(t) for a, m in enumerate(members) for b, t in every[m[0]][2].items()
             if t}  # None: no node b
    paragraph = where_slow(nodes, [every[m[0]][3] for m in members], pairs, between, *least)
    if paragraph and stop:
        raise UserError(f"{paragraph} network_check='stop' ends the run here: fix the network, "
                        f"or set network_check='on' to train on it anyway.")
    if paragraph:
        log.warning(paragraph)


def where_slow(nodes, variables, pairs, between, least, source):
    """The paragraph that names the nodes whose best link is below SLOW of the best pair's, or
    when none is, every node if the bus bandwidth between them is below the least that source
    asks; else None."""
    best = [max((v for k, v in pairs.items() if i in k), default=0) for i in range(len(nodes))]
    slow = [i for i, b in enumerate(best) if b < SLOW * max(best)]
    if slow:
        top = max(pairs, key=pairs.get)
        why = (f"{', '.join(nodes[i] for i in slow)} {'is' if len(slow) == 1 else 'are'} slow "
               f"against the other nodes: {max(best[i] for i in slow):.3g} GB/s at best to and "
               f"from {'it' if len(slow) == 1 else 'them'}, against {pairs[top]:.3g} GB/s "
               f"between {' and '.join(nodes[i] for i in sorted(top))}")
    elif between and between < least:
        slow = range(len(nodes))
        why = (f"the bus bandwidth between nodes, {between:.3g} GB/s, is far below {least:.3g} "
               f"GB/s, the least that {source}, on every link: between "
               f"{' and '.join(nodes) if len(nodes) == 2 else 'all nodes'}")
    else:
        return None
    there = "; ".join(f"{nodes[i]}: " + (", ".join(
        f"{k}={v}" for k, v in sorted(variables[i].items())) or "none set") for i in slow)
    return (f"network: {why}. Every step waits for the slowest link. Check the link (ibstat, "
            f"ethtool: its speed and errors) and the variables that name the fabric there "
            f"({there}); NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET shows the transport NCCL "
            f"chose: 'Using network Socket' where InfiniBand or EFA should be means NCCL fell "
            f"back to sockets. docs/performance.md has each fabric's figures.")
