"""Two nodes, as a cluster runs them: each node a network namespace (tests/netns.py) with its own
address, joined by a veth link; one rank per node, one launch per node, gloo bound to the node's
interface. 2 nodes x 1 rank must train as 1 node x 2 ranks (conftest's shared runs).

The namespaces share this machine's filesystem, so both nodes see one output directory, as on a
cluster with a shared filesystem. Making namespaces needs root (CI runs as root): without it
these tests fail, they do not skip.
"""

import itertools
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DILOCO_ZERO3, LOSS_ATOL, REPO, STEPS, TINY, job_env, losses, read_jsonl
from netns import Cluster, alive, namespaces, remove_leftovers, wait_all
from test_diloco import assert_islands_identical, island_metrics

# The tiny model's fp32 weights (BDH: 40,960 parameters): a data-parallel step has each rank
# send at least half of them (its reduce-scatter share); an outer step all of them.
WEIGHT_BYTES = 40_960 * 4
JOB_TIMEOUT = 240  # s; a 2-node job of the tiny model takes ~15 s on 2 cores
_ports = itertools.count(29400)  # fresh namespaces: any port is free in them


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2) as nodes:
        yield nodes
    assert not [ns for ns in namespaces() if ns in nodes.names]


def recipe_args(out: Path, text_file: Path, config: str, extra=()) -> list[str]:
    """The shared runs' arguments (conftest.Runs), for a launch of our own."""
    return ["--deepspeed", str(REPO / "ds_configs" / config), "--output_dir", str(out),
            "--train_file", str(text_file), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY, *extra]


def run_on_nodes(cluster: Cluster, commands: list[list], logs: Path) -> list[int]:
    """Start commands[i] on node i, wait for all; assert every one exits 0. Returns the bytes
    each node sent over its link meanwhile."""
    logs.mkdir(parents=True, exist_ok=True)
    sent = [cluster.tx_bytes(node) for node in range(len(commands))]
    procs = []
    for node, cmd in enumerate(commands):
        with open(logs / f"node{node}.log", "w") as log:
            procs.append(cluster.popen(node, cmd, cwd=REPO, env=cluster.env(node, job_env()),
                                       stdout=log, stderr=subprocess.STDOUT))
    codes = wait_all(procs, JOB_TIMEOUT)
    for node, code in enumerate(codes):
        tail = (logs / f"node{node}.log").read_text()[-3000:]
        assert code == 0, f"node {node} exited {code}:\n{tail}"
    return [cluster.tx_bytes(node) - sent[node] for node in range(len(commands))]


def assert_same_training(metrics: list[dict], ref: list[dict]) -> None:
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, STEPS + 1))
    assert losses(metrics, "tokens") == losses(ref, "tokens")  # the same global batch
    assert losses(metrics) == pytest.approx(losses(ref), abs=LOSS_ATOL)
    assert losses(metrics, "eval_loss") == pytest.approx(losses(ref, "eval_loss"), abs=LOSS_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_launcher_on_two_nodes_equals_one_node(cluster, runs, text_file, tmp_path,
                                                         stage):
    """`deepspeed --hostfile H --no_ssh --node_rank i --master_addr <node 0>` on each node, as a
    scheduler without ssh launches it. With --no_ssh the launcher never resolves the hostfile's
    names: it only counts their slots and takes the i-th entry as this node, so `node0`/`node1`
    need no DNS; the ranks meet at --master_addr."""
    _, ref, _ = runs(f"zero{stage}", config=f"zero{stage}.json")  # torchrun, 1 node x 2 ranks
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    out, port = tmp_path / "run", next(_ports)
    args = recipe_args(out, text_file, f"zero{stage}.json")
    commands = [["deepspeed", "--hostfile", hostfile, "--no_ssh", "--node_rank", node,
                 "--master_addr", cluster.address(0), "--master_port", port,
                 REPO / "recipes/pretrain.py", *args] for node in (0, 1)]
    sent = run_on_nodes(cluster, commands, tmp_path / "logs")
    assert_same_training(read_jsonl(out / "metrics.jsonl"), ref)
    print("bytes sent per node:", sent)
    assert min(sent) > STEPS * WEIGHT_BYTES / 2, sent  # the gradients went over the link
    assert (out / "final" / "model.safetensors").exists()
    # both ranks wrote their shard of the optimizer state into the shared directory
    shards = sorted(p.name for p in (out / "checkpoints" / "step8").glob("*optim_states.pt"))
    assert len(shards) == 2, shards


@pytest.mark.slow
def test_torchrun_on_two_nodes_equals_one_node(cluster, runs, text_file, tmp_path):
    """torchrun's static multi-node rendezvous: `--nnodes 2 --node_rank i --master_addr
    <node 0> --master_port P` on each node."""
    _, ref, _ = runs("zero2")
    out, port = tmp_path / "run", next(_ports)
    args = recipe_args(out, text_file, "zero2.json")
    commands = [["torchrun", "--nnodes", 2, "--nproc_per_node", 1, "--node_rank", node,
                 "--master_addr", cluster.address(0), "--master_port", port,
                 REPO / "recipes/pretrain.py", *args] for node in (0, 1)]
    sent = run_on_nodes(cluster, commands, tmp_path / "logs")
    assert_same_training(read_jsonl(out / "metrics.jsonl"), ref)
    assert min(sent) > STEPS * WEIGHT_BYTES / 2, sent


@pytest.mark.slow
def test_diloco_islands_one_per_node_equal_one_launch(cluster, runs, text_file, tmp_path):
    """Two DiLoCo islands (one ZeRO-3 rank each, H 4, sync), a launch per node: each island is
    a one-node torchrun world of its own, and they meet at the store that island 0's rank
    hosts on node 0's address (--diloco_store). Every island trains as the same islands do in
    one launch on one host, and both islands hold bit-identical weights after each outer
    step."""
    ref = runs("diloco_zero3", **DILOCO_ZERO3)[0]
    out, store = tmp_path / "run", f"{cluster.address(0)}:{next(_ports)}"
    args = recipe_args(out, text_file, "zero3.json", DILOCO_ZERO3["extra"])
    commands = [["torchrun", "--nproc_per_node", 1, "--master_port", next(_ports),
                 REPO / "recipes/pretrain.py", *args, "--diloco_island_index", node,
                 "--diloco_store", store] for node in (0, 1)]
    sent = run_on_nodes(cluster, commands, tmp_path / "logs")
    assert min(sent) > 2 * WEIGHT_BYTES, sent  # two outer steps' pseudo-gradients
    assert_islands_identical(out, steps=(4, 8))
    for island in (0, 1):
        metrics, want = island_metrics(out, island), island_metrics(ref, island)
        assert losses(metrics) == pytest.approx(losses(want), abs=LOSS_ATOL)
        got = [m["weights_sum"] for m in metrics if "outer_step" in m]
        assert got == pytest.approx([m["weights_sum"] for m in want if "outer_step" in m],
                                    rel=1e-5)
    assert (out / "final" / "model.safetensors").exists()


# -- the harness itself: the link is the only way between nodes, and nothing is left behind --

def test_nodes_reach_each_other_only_through_their_link():
    """Node 1 reaches node 0's address and its bytes count on its own interface; the host
    has no address or interface of theirs. A 4-node cluster goes through a bridge."""
    serve = ("import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); "
             "s.listen(); c, _ = s.accept(); print(len(c.recv(100)))")
    with Cluster(4) as nodes:
        for node in (1, 3):
            server = nodes.popen(0, [sys.executable, "-c", serve, 5000 + node],
                                 stdout=subprocess.PIPE, text=True)
            send = (f"import socket, time\nfor _ in range(50):\n  try: s = socket."
                    f"create_connection(('{nodes.address(0)}', {5000 + node})); break\n"
                    f"  except OSError: time.sleep(0.1)\ns.sendall(b'x' * 100)")
            before = nodes.tx_bytes(node)
            assert nodes.run(node, [sys.executable, "-c", send]).returncode == 0
            assert server.communicate(timeout=30)[0].strip() == "100"
            assert nodes.tx_bytes(node) - before >= 100
        # the host holds none of it (a connect from the host is no test: this sandbox's
        # network answers any address)
        host = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert nodes.subnet + "." not in host and not any(i in host for i in nodes.ifnames)
        names = [*nodes.names, nodes.switch]
        assert set(names) <= set(namespaces())
    assert not set(names) & set(namespaces())


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_owner_leaves_no_namespaces(tmp_path, how):
    """A test process killed with its cluster up: SIGTERM removes the namespaces (and the
    processes inside) at once; after SIGKILL the next cluster to start removes them."""
    code = ("import sys, subprocess, time; sys.path.insert(0, sys.argv[1]); import netns\n"
            "c = netns.Cluster(2).__enter__(); p = c.popen(1, ['sleep', '600'])\n"
            "print(p.pid, *c.names, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(REPO / "tests")],
                             stdout=subprocess.PIPE, text=True)
    pid, *names = owner.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(namespaces())
    owner.send_signal(getattr(signal, how))
    owner.wait(timeout=30)
    if how == "SIGKILL":
        assert set(names) <= set(namespaces())  # nobody was left to clean up
        assert set(names) <= set(remove_leftovers())
    assert not set(names) & set(namespaces())
    assert not alive(int(pid))  # the process inside node 1 is gone too (or a zombie)
