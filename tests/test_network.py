"""The network check before the first step (ddpgpt/network.py), on nodes simulated on this
machine: a network namespace per node, with its own host name (unshare --uts), joined to a
bridge in a namespace of its own by a veth pair, so that the traffic stays on them; tc throttles
one node's link. Needs root, as CI has; which fabric NCCL's variables name does not.
(NCCL's own paths are not run here: no GPUs.)"""
import os
import re
import subprocess
import sys
import uuid

import pytest

from ddpgpt import network
from conftest import ROOT, batches_and_losses, torchrun, traceback_of_ours, train_args

SLOW_RATE = "400mbit"  # a tenth or less of what gloo moves over an unthrottled veth here
CHECK_BUDGET_S = 5  # the check's time, throttled link and all, on this loaded CPU


@pytest.mark.parametrize("variables, named", [
    ({"FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "ens"}, ("EFA", 6)),
    ({"NCCL_NET": "AWS Libfabric"}, ("EFA", 6)),
    ({"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "eth0"}, ("InfiniBand", 6)),
    ({"NCCL_IB_HCA": "mlx5_0", "NCCL_IB_DISABLE": "1"}, ("Ethernet", 0.6)),
    ({"NCCL_NET": "Socket"}, ("Ethernet", 0.6)),
    ({"NCCL_SOCKET_IFNAME": "eth0"}, ("Ethernet", 0.6)),
    ({"GLOO_SOCKET_IFNAME": "eth0"}, None),
])
def test_the_variables_name_the_fabric_whose_least_is_expected(variables, named):
    assert network.fabric(variables) == named


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def nodes(request):
    """Namespaces for request.param nodes, node i at 10.77.0.<i + 1> on interface veth0; all
    of them deleted (their links with them) after the test, however it ended."""
    if os.geteuid() != 0:
        pytest.skip("simulated nodes (network namespaces, tc) need root")
    tag = uuid.uuid4().hex[:8]
    bridge, names = f"ddpgpt-{tag}-br", [f"ddpgpt-{tag}-n{i}" for i in range(request.param)]
    made = []
    request.addfinalizer(lambda: [subprocess.run(["ip", "netns", "del", n]) for n in made])
    for name in (bridge, *names):
        ip("netns", "add", name)
        made.append(name)
        ip("-n", name, "link", "set", "lo", "up")
    ip("-n", bridge, "link", "add", "br0", "type", "bridge")
    ip("-n", bridge, "link", "set", "br0", "up")
    for i, name in enumerate(names):
        ip("-n", bridge, "link", "add", f"v{i}", "type", "veth", "peer", "name", "veth0",
           "netns", name)
        ip("-n", bridge, "link", "set", f"v{i}", "master", "br0", "up")
        ip("-n", name, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "veth0")
        ip("-n", name, "link", "set", "veth0", "up")
    return bridge, names


def throttle(nodes, i, on=True):
    """Node i's link at SLOW_RATE both ways (tc on each end of its veth pair), or back."""
    bridge, names = nodes
    for ns, dev in ((names[i], "veth0"), (bridge, f"v{i}")):
        subprocess.run(["tc", "-n", ns, "qdisc", "add" if on else "del", "dev", dev, "root",
                        *(["tbf", "rate", SLOW_RATE, "burst", "64kb", "latency", "100ms"] if on
                          else [])], check=True)


def on_nodes(nodes, per_node, args, env):
    """train.py with args, one torchrun per node, node i named n<i + 1> and running per_node[i]
    ranks: each node's CompletedProcess."""
    _, names = nodes
    procs = [subprocess.Popen(
        ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname n{i + 1} && '
         f'exec "$@"', "sh", sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(names)}",
         f"--node_rank={i}", f"--nproc_per_node={nproc}", "--master_addr=10.77.0.1",
         "--master_port=29500", os.path.join(ROOT, "train.py"), *args],
        env=dict(env, GLOO_SOCKET_IFNAME="veth0"), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i, (ns, nproc) in enumerate(zip(names, per_node))]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def network_line(stdout):
    """The check's line, and its seconds."""
    found = re.search(r"^network: bus bandwidth .*; (\d+\.\d) s\)$", stdout, re.M)
    assert found, stdout
    return found[0], float(found[1])


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_a_slow_link_between_two_nodes_names_both_and_stops_the_run_only_then(nodes, corpus, env,
                                                                               tmp_path):
    # 2 nodes have one link between them: it is judged against network_min_gbps
    steps = ["--network_check=stop", "--network_min_gbps=0.1", "--max_iters=3",
             "--eval_interval=3"]
    throttle(nodes, 1)
    slow = on_nodes(nodes, [1, 1], train_args(corpus, tmp_path / "slow", *steps), env)
    assert slow[0].returncode != 0 and slow[1].returncode != 0
    assert not traceback_of_ours(slow[0].stderr + slow[1].stderr)
    said = slow[0].stdout + slow[0].stderr
    assert re.search(r"train.py: error \(ranks 0, 1\): network: the bus bandwidth between "
                     r"nodes, [\d.]+ GB/s, is far below 0.1 GB/s, the least that "
                     r"network_min_gbps asks, on every link: between n1 and n2\. .* "
                     r"network_check='stop' ends the run here", said), said
    assert "n1: GLOO_SOCKET_IFNAME=veth0; n2: GLOO_SOCKET_IFNAME=veth0" in said
    assert network_line(slow[0].stdout)[1] <= CHECK_BUDGET_S
    assert not os.path.exists(tmp_path / "slow" / "metrics.jsonl")  # before the first step

    throttle(nodes, 1, on=False)
    fast = on_nodes(nodes, [1, 1], train_args(corpus, tmp_path / "fast", *steps), env)
    assert [p.returncode for p in fast] == [0, 0], fast[0].stderr
    line, seconds = network_line(fast[0].stdout)
    assert "bus bandwidth between 2 nodes" in line and seconds <= CHECK_BUDGET_S
    assert "far below" not in fast[0].stdout + fast[0].stderr
    # the check changes no batch and no loss
    torchrun(2, "train.py", *train_args(corpus, tmp_path / "off", *steps[2:],
                                         "--network_check=off"), env=env)
    assert batches_and_losses(tmp_path / "fast") == batches_and_losses(tmp_path / "off")


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [3], indirect=True)
def test_a_slow_node_among_three_is_named_by_its_host_name(nodes, corpus, env, tmp_path):
    # 4 ranks: 2 on n1, 1 on n2, 1 on n3; n3's link throttled, then not
    throttle(nodes, 2)
    slow = on_nodes(nodes, [2, 1, 1], train_args(corpus, tmp_path / "slow", "--max_iters=0"),
                    env)
    assert [p.returncode for p in slow] == [0, 0, 0], slow[0].stderr
    line, seconds = network_line(slow[0].stdout)
    assert "within a node" in line and "between 3 nodes" in line and seconds <= CHECK_BUDGET_S
    assert re.search(r"^network: n3 is slow against the other nodes: [\d.]+ GB/s at best to and "
                     r"from it, against [\d.]+ GB/s between n\d and n\d\. .* \(n3: "
                     r"GLOO_SOCKET_IFNAME=veth0\)", slow[0].stdout, re.M), slow[0].stdout

    throttle(nodes, 2, on=False)
    fast = on_nodes(nodes, [2, 1, 1], train_args(corpus, tmp_path / "fast", "--max_iters=0"),
                    env)
    assert [p.returncode for p in fast] == [0, 0, 0], fast[0].stderr
    assert network_line(fast[0].stdout)[1] <= CHECK_BUDGET_S
    assert "slow against" not in fast[0].stdout
