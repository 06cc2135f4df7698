"""Two nodes, as a cluster runs them: each node a network namespace (tests/netns.py) with its own
address, joined by a veth link; one rank per node, one launch per node, gloo bound to the node's
interface. 2 nodes x 1 rank must train as 1 node x 2 ranks (conftest's shared runs).

The namespaces share this machine's filesystem, so both nodes see one output directory, as on a
cluster with a shared filesystem. Making namespaces needs root (CI runs as root): without it
these tests fail, they do not skip.
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (DILOCO_DELAYED, DILOCO_ZERO3, LOSS_ATOL, PIPE_X2, REPO, STEPS, TINY,
                      job_env, losses, read_jsonl)
from netns import Cluster, alive, namespaces, remove_leftovers, wait_all
from test_checkpoints import SLOWED, logged_steps

from dragon.checkpoint.catalog import MARKER, is_complete
from test_diloco import assert_islands_identical, island_metrics, islands_run
from test_elastic import ELASTIC, both_end_after_the_rejoin, start_joiner_after_step_8
from test_faults import ranks_of

# The tiny model's fp32 weights (BDH: 40,960 parameters): a data-parallel step has each rank
# send at least half of them (its reduce-scatter share); an outer step all of them.
WEIGHT_BYTES = 40_960 * 4
WEIGHT_KEYS = ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq")
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
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_on_two_nodes_equals_one_node(cluster, runs, text_file, tmp_path, rendezvous):
    """torchrun's static multi-node rendezvous (`--nnodes 2 --node_rank i --master_addr <node 0>
    --master_port P` on each node) and its c10d rendezvous (`--rdzv_backend c10d
    --rdzv_endpoint <node 0>:P`, ranks in the order the nodes arrive). torchrun hosts the c10d
    store where the endpoint names this machine, which it judges by hostname, and tells the
    ranks to meet at the first node's hostname: where that resolves elsewhere (here, and on a
    second NIC) each node needs `--local_addr <its address>` and node 0 `--rdzv_conf
    is_host=1`."""
    _, ref, _ = runs("zero2")
    out, port = tmp_path / "run", next(_ports)
    args = recipe_args(out, text_file, "zero2.json")
    if rendezvous == "static":
        how = [["--node_rank", node, "--master_addr", cluster.address(0), "--master_port", port]
               for node in (0, 1)]
    else:
        how = [["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{cluster.address(0)}:{port}",
                "--rdzv_id", "dragon", "--rdzv_conf", f"is_host={int(node == 0)}",
                "--local_addr", cluster.address(node)]
               for node in (0, 1)]
    commands = [["torchrun", "--nnodes", 2, "--nproc_per_node", 1, *how[node],
                 REPO / "recipes/pretrain.py", *args] for node in (0, 1)]
    sent = run_on_nodes(cluster, commands, tmp_path / "logs")
    assert_same_training(read_jsonl(out / "metrics.jsonl"), ref)
    assert min(sent) > STEPS * WEIGHT_BYTES / 2, sent


@pytest.mark.slow
def test_pipeline_one_stage_per_node_equals_one_node(cluster, runs, text_file, tmp_path):
    """The pipeline recipe, 2 stages, one per node (deepspeed launcher, --no_ssh): the
    activations and their gradients cross the link, and it trains as the 2-stage pipeline on
    one node does."""
    _, ref, _ = runs("pipe_x2", **PIPE_X2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    out, port = tmp_path / "run", next(_ports)
    args = recipe_args(out, text_file, PIPE_X2["config"], PIPE_X2["extra"])
    commands = [["deepspeed", "--hostfile", hostfile, "--no_ssh", "--node_rank", node,
                 "--master_addr", cluster.address(0), "--master_port", port,
                 REPO / PIPE_X2["script"], *args] for node in (0, 1)]
    sent = run_on_nodes(cluster, commands, tmp_path / "logs")
    assert_same_training(read_jsonl(out / "metrics.jsonl"), ref)
    print("bytes sent per node:", sent)
    # each node sends every micro-batch's activations (4 x 64 x 32 fp32) or their gradients
    assert min(sent) > STEPS * 2 * 4 * 64 * 32 * 4, sent
    assert (out / "final" / "model.safetensors").exists()


# The shared one-launch DiLoCo runs a launch per node repeats: 2 islands of one rank each, sync
# (ZeRO-3, H 4) and delayed (ZeRO-0 with dropout, H 2); each a (config, arguments, outer steps).
ONE_LAUNCH = {
    "sync": ("diloco_zero3", DILOCO_ZERO3["config"], DILOCO_ZERO3["extra"], (4, 8)),
    "delayed": ("diloco_delayed", DILOCO_DELAYED["config"], DILOCO_DELAYED["extra"], (2, 4, 6, 8)),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "delayed"])
def test_diloco_islands_one_per_node_equal_one_launch(cluster, runs, text_file, tmp_path, mode):
    """Two DiLoCo islands, a launch per node: each island is a one-node torchrun world of its
    own, and they meet at the store that island 0's rank hosts on node 0's address
    (--diloco_store). Every island trains as the same islands do in one launch on one host
    (sync: bit-identical weights after each outer step; delayed: each island's own fresh share
    in between, identical after the last)."""
    name, config, extra, outer_steps = ONE_LAUNCH[mode]
    ref = islands_run(runs, name, config=config, extra=extra)
    out, store = tmp_path / "run", f"{cluster.address(0)}:{next(_ports)}"
    args = recipe_args(out, text_file, config, extra)
    commands = [["torchrun", "--nproc_per_node", 1, "--master_port", next(_ports),
                 REPO / "recipes/pretrain.py", *args, "--diloco_island_index", node,
                 "--diloco_store", store] for node in (0, 1)]
    sent = run_on_nodes(cluster, commands, tmp_path / "logs")
    assert min(sent) > len(outer_steps) * WEIGHT_BYTES / 2, sent  # the pseudo-gradients
    if mode == "sync":
        assert_islands_identical(out, steps=outer_steps)
    else:
        rows = [[m for m in island_metrics(out, i) if "outer_step" in m] for i in (0, 1)]
        assert rows[0][0]["outer_sum"] != rows[1][0]["outer_sum"]  # each island's own share
        assert [rows[0][-1][k] for k in WEIGHT_KEYS] == [rows[1][-1][k] for k in WEIGHT_KEYS]
    for island in (0, 1):
        metrics, want = island_metrics(out, island), island_metrics(ref, island)
        assert losses(metrics) == pytest.approx(losses(want), abs=LOSS_ATOL)
        got = [m["weights_sum"] for m in metrics if "outer_step" in m]
        assert got == pytest.approx([m["weights_sum"] for m in want if "outer_step" in m],
                                    rel=1e-5)
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_lost_node_ends_the_other_in_bounded_time_and_the_same_command_resumes(
        cluster, runs, text_file, tmp_path):
    """Node 1 lost after step 5 (every process in it SIGKILLed, while node 0's rank is held
    stopped so it cannot have finished): node 0's job ends within seconds, not at a timeout, and
    its one error line names node 1's address. The same command on both nodes
    (--resume_from_checkpoint auto) resumes from step 4: step 5 again bit for bit, and every
    step as 1 node x 2 ranks trains it."""
    _, ref, _ = runs("zero2")
    out, port = tmp_path / "run", next(_ports)
    args = recipe_args(out, text_file, "zero2.json", ["--resume_from_checkpoint", "auto"])

    def launch(node):
        cmd = ["torchrun", "--nnodes", 2, "--nproc_per_node", 1, "--node_rank", node,
               "--master_addr", cluster.address(0), "--master_port", port,
               REPO / "recipes/pretrain.py", *args]
        return cluster.popen(node, cmd, cwd=REPO, env=cluster.env(node, job_env()),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [launch(node) for node in (0, 1)]
    while 5 not in logged_steps(out / "metrics.jsonl"):
        assert procs[0].poll() is None, procs[0].stderr.read()[-3000:]
        time.sleep(0.005)
    held = ranks_of(procs[0].pid)
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    cluster.lose(1)
    lost = time.time()
    for pid in held:
        os.kill(pid, signal.SIGCONT)
    _, stderr = procs[0].communicate(timeout=120)
    ended = time.time() - lost
    print(f"node 0 ended {ended:.1f} s after node 1 was lost")
    assert procs[0].returncode != 0 and ended < 60
    told = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(told) == 1, stderr[-3000:]
    assert f"the rank(s) at {cluster.address(1)} are gone" in told[0], told[0]
    first = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}

    port = next(_ports)
    procs = [launch(node) for node in (0, 1)]
    codes = wait_all(procs, JOB_TIMEOUT)
    assert codes == [0, 0], [p.stderr.read()[-3000:] for p in procs]
    rows = read_jsonl(out / "metrics.jsonl")
    # the resume moved the rows past step 4 to metrics.replaced.jsonl: these are the resumed run's
    again = [m for m in rows if m.get("step", 0) >= 5 and "loss" in m]
    assert again[0]["step"] == 5 and again[0]["loss"] == first[5]  # from step 4's checkpoint
    assert [m["step"] for m in again] == [5, 6, 7, 8]
    whole = [first[step] for step in range(1, 5)] + [m["loss"] for m in again]
    assert whole == pytest.approx(losses(ref), abs=LOSS_ATOL)


def on_own_disk(disk: Path, out: Path, cmd: list) -> list:
    """`cmd` with `out` replaced by `disk` for it and its children only: a node's local disk,
    mounted at the path every node names (`ip netns exec` gives each command a mount namespace
    of its own, so the mount ends with it)."""
    return ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", disk, out, *cmd]


@pytest.mark.slow
def test_node_local_checkpoints_resume_where_every_node_holds_them_and_from_the_copy(
        cluster, runs, text_file, tmp_path):
    """--checkpoint_storage local: each node writes its own rank's files to --output_dir on its
    own disk, and --checkpoint_copy_to copies each checkpoint to a store. Both nodes SIGKILLed
    after step 5. (1) The same command resumes on the same disks from the newest checkpoint
    that both hold whole: node 1's newest is unmarked first, so both take the one before; every
    step as 1 node x 2 ranks trains it, the resumed step == the killed run's. (2) Fresh disks
    resume from the store's copy as it was at the kill, named by URL (each node fetches it):
    the resumed step == (1)'s."""
    _, ref, _ = runs("zero2")
    out, store, snapshot = tmp_path / "run", tmp_path / "store", tmp_path / "store_at_kill"
    out.mkdir()
    local = ["--checkpoint_storage", "local", "--save_steps", "2", "--save_total_limit", "3"]
    args = recipe_args(out, text_file, "zero2.json", local)

    def launch(disks, *extra, env=None):
        port = next(_ports)
        for disk in disks:
            disk.mkdir(exist_ok=True)
        procs = [cluster.popen(node, on_own_disk(disk, out, [
            "torchrun", "--nnodes", 2, "--nproc_per_node", 1, "--node_rank", node,
            "--master_addr", cluster.address(0), "--master_port", port,
            REPO / "recipes/pretrain.py", *args, *extra]), cwd=REPO,
            env=cluster.env(node, job_env(**(env or {}))), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for node, disk in enumerate(disks)]
        return procs

    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    again = ["--checkpoint_copy_to", store, "--resume_from_checkpoint", "auto"]
    procs = launch(disks, *again, env=SLOWED)
    copied = store / "checkpoints" / "step4" / MARKER
    while not (5 in logged_steps(disks[0] / "metrics.jsonl") and copied.exists()):
        assert all(p.poll() is None for p in procs), [p.stderr.read()[-3000:] for p in procs]
        time.sleep(0.005)
    for node in (0, 1):
        cluster.lose(node)
    wait_all(procs, JOB_TIMEOUT)
    first = {m["step"]: m["loss"] for m in read_jsonl(disks[0] / "metrics.jsonl") if "loss" in m}
    assert max(first) < 8, "killed too late"
    shutil.copytree(store, snapshot)
    for node, disk in enumerate(disks):  # each disk holds its own rank's files, and says so
        tag_dir = disk / "checkpoints" / "step4"
        assert json.loads((tag_dir / MARKER).read_text())["node"]["ranks"] == [node]
        shards = sorted(p.name for p in tag_dir.glob("*optim_states.pt"))
        assert len(shards) == 1 and f"rank_{node}_" in shards[0], shards
        assert (tag_dir / f"rng_state_{node}.pt").exists()
        assert not (tag_dir / f"rng_state_{1 - node}.pt").exists()
    whole = json.loads(copied.read_text())["files"]
    assert {"rng_state_0.pt", "rng_state_1.pt"} <= set(whole), sorted(whole)

    newest = [(disk / "checkpoints" / "latest").read_text() for disk in disks]
    (disks[1] / "checkpoints" / newest[1] / MARKER).unlink()  # node 1 killed before its marker
    older = f"step{int(newest[1].removeprefix('step')) - 2}"
    procs = launch(disks, *again)
    assert wait_all(procs, JOB_TIMEOUT) == [0, 0], [p.stderr.read()[-3000:] for p in procs]
    told = procs[0].stderr.read()
    assert f"{newest[0]} on this node, {older} whole on every node: resuming {older}" in told
    rows = read_jsonl(disks[0] / "metrics.jsonl")
    assert_resumed(rows, first, int(older.removeprefix("step")) + 1, ref)
    second = {m["step"]: m["loss"] for m in rows if "loss" in m}

    fresh = [tmp_path / "fresh0", tmp_path / "fresh1"]
    at = (snapshot / "checkpoints" / "latest").read_text()
    procs = launch(fresh, "--resume_from_checkpoint", f"file://{snapshot}")  # as a URL: fetched
    assert wait_all(procs, JOB_TIMEOUT) == [0, 0], [p.stderr.read()[-3000:] for p in procs]
    for disk in fresh:  # each disk fetched the store's latest checkpoint for itself
        assert is_complete(str(disk / "resumed_from" / "checkpoints" / at))
    assert_resumed(read_jsonl(fresh[0] / "metrics.jsonl"), second,
                   int(at.removeprefix("step")) + 1, ref)


def assert_resumed(rows: list[dict], before: dict, resumed: int, ref: list[dict]) -> None:
    """A run resumed before step `resumed` trains it as the run `before` did (bit for bit: the
    same ranks, data position, RNG and optimizer state) and then every step as `ref` does."""
    steps = [m for m in rows if "loss" in m and m["step"] >= resumed]
    assert [m["step"] for m in steps] == list(range(resumed, STEPS + 1))
    assert steps[0]["loss"] == before[resumed]
    whole = [before[s] for s in range(1, resumed)] + [m["loss"] for m in steps]
    assert whole == pytest.approx(losses(ref), abs=LOSS_ATOL)


# Run inside a node: python -c WAIT_FOR_KEYS HOST:PORT KEY... returns once one key is in the store.
WAIT_FOR_KEYS = """import sys, time
from datetime import timedelta
import torch.distributed as dist
host, port = sys.argv[1].rsplit(":", 1)
store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
while not any(store.check([key]) for key in sys.argv[2:]):
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_elastic_islands_train_on_when_a_node_is_lost_and_it_rejoins(cluster, text_file,
                                                                    tmp_path):
    """Elastic DiLoCo, an island per node, the store on node 0 (its own process). Node 1 lost
    after its step 5: island 0 waits out the quorum timeout at step 8 and trains on alone. Node
    1 restarted with --diloco_join --resume_from_checkpoint auto takes the live island's weights
    at an outer step, and both end on bit-identical weights (sync)."""
    last, port = 64, next(_ports)
    store = f"{cluster.address(0)}:{port}"
    server = cluster.popen(0, [sys.executable, "-m", "dragon.diloco.island_store", "--host",
                               cluster.address(0), "--port", port], cwd=REPO,
                           env=cluster.env(0, job_env()), stdout=subprocess.PIPE, text=True)
    assert "listening" in server.stdout.readline()
    out = tmp_path / "run"
    steps = ["--max_steps", str(last), "--eval_steps", str(last // 2), "--save_steps", "16",
             "--lr_scheduler_type", "constant_with_warmup", "--diloco_outer_momentum", "0.3"]
    args = recipe_args(out, text_file, "zero2.json",
                       [*ELASTIC, *steps, "--diloco_islands", "2", "--diloco_store", store])

    def island(node, *extra):
        cmd = ["torchrun", "--nproc_per_node", 1, "--master_port", next(_ports),
               REPO / "recipes/pretrain.py", *args, "--diloco_island_index", node, *extra]
        return cluster.popen(node, cmd, cwd=REPO, env=cluster.env(node, job_env()),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [island(node) for node in (0, 1)]
    while 5 not in logged_steps(out / "island1" / "metrics.jsonl"):
        assert procs[1].poll() is None, procs[1].stderr.read()[-3000:]
        time.sleep(0.005)
    cluster.lose(1)
    assert alive(server.pid)  # the store lives on node 0
    def wait_in_node_0(store, keys, joiner):  # the store is reachable from the nodes only
        watcher = cluster.popen(0, [sys.executable, "-c", WAIT_FOR_KEYS, store, *keys], cwd=REPO,
                                env=cluster.env(0, job_env()))
        while watcher.poll() is None:
            assert joiner.poll() is None, joiner.stderr.read()[-3000:]
            time.sleep(0.05)
        assert watcher.returncode == 0

    joiner = start_joiner_after_step_8(procs[0], out, store, lambda: island(
        1, "--diloco_join", "--resume_from_checkpoint", "auto"), wait_in_node_0)
    mine, theirs = both_end_after_the_rejoin(procs[0], joiner, out)
    assert max(theirs) == last
    for m in mine:
        if m["step"] in theirs:
            assert m["outer_quorum"] == 2
            for key in WEIGHT_KEYS:
                assert m[key] == theirs[m["step"]][key], (m["step"], key)


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
    # the process inside node 1 is gone too (or a zombie): a SIGKILL lands within moments
    deadline = time.monotonic() + 10
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(int(pid))
