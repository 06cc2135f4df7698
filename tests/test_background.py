"""The outer exchange on its own thread (dragon.wire.exchange_thread) and --diloco_fragment_delay
auto (dragon.diloco.landing): every codec, whole or in fragments, trains bit for bit as the
exchange issued from the training thread does, and islands end identical; `auto` on a link
between two namespace nodes lands later on a slower link, says once when the link is slower than
the window, and resumes bit for bit after a SIGKILL with fragments in flight."""

import json
import shutil
import subprocess
import sys
import time

import pytest
from conftest import REPO, free_port, job_env, losses
from netns import Cluster, wait_all
from test_checkpoints import logged_steps
from test_diloco import island_metrics, islands_run
from test_fragments import DELAYED_INT4
from test_multinode import JOB_TIMEOUT, WEIGHT_KEYS, recipe_args

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import background_islands as toy  # noqa: E402


@pytest.fixture(scope="module")
def toy_islands(tmp_path_factory) -> list[dict]:
    """tests/scripts/background_islands.py as two real islands (one launch each)."""
    out, store = tmp_path_factory.mktemp("background"), f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests/scripts/background_islands.py"),
                               str(i), store, str(out / f"island{i}.json")], cwd=REPO,
                              env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out / f"island{i}.json").read_text()) for i in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("codec", list(toy.CODECS))
@pytest.mark.parametrize("fragments", [1, toy.F])
def test_every_codec_on_the_exchange_thread_equals_the_training_thread(toy_islands, codec,
                                                                       fragments):
    """Delayed mode, a fixed delay of 1 with 4 fragments: the weights and theta_outer after
    every inner step are the same bits with the exchange on its own thread as with its
    collectives issued from the training thread (as before the thread), on both islands, and
    both islands end on the same weights and theta_outer."""
    name = f"{codec}-f{fragments}"
    for island in toy_islands:
        inline, thread = island[f"{name}-inline"], island[f"{name}-thread"]
        assert [m["step"] for m in thread] == list(range(1, toy.STEPS + 1))
        for a, b in zip(inline, thread):
            assert a["weights"] == b["weights"] and a["outer"] == b["outer"], (name, a["step"])
        assert [m["metrics"].get("outer_landed") for m in inline] == [
            m["metrics"].get("outer_landed") for m in thread]
        assert inline[0]["weights"] != inline[-1]["weights"]  # it trained
    ends = [island[f"{name}-thread"][-1] for island in toy_islands]
    assert ends[0]["weights"] == ends[1]["weights"] and ends[0]["outer"] == ends[1]["outer"]


@pytest.mark.slow
def test_auto_landings_agree_across_islands(toy_islands):
    """`auto` (4 int4 fragments): both islands land every fragment at the same step, within H
    steps of its sync, log it as outer_landed_after, and end identical."""
    rows = [[(m["step"], m["metrics"].get("outer_landed"), m["metrics"].get("outer_landed_after"))
             for m in island["auto"]] for island in toy_islands]
    assert rows[0] == rows[1]
    after = [a for _, landed, a in rows[0] if a is not None]
    assert len(after) >= toy.F and all(1 <= a <= toy.H for a in after), rows[0]
    ends = [island["auto"][-1] for island in toy_islands]
    assert ends[0]["weights"] == ends[1]["weights"] and ends[0]["outer"] == ends[1]["outer"]


@pytest.mark.slow
def test_int4_fragments_on_the_exchange_thread_train_as_on_the_training_thread(runs):
    """Real ZeRO-2 islands (2 x 2 ranks), 4 int4 fragments, delay 1: every loss and every
    checksum of the weights and theta_outer the same bits with and without the thread."""
    thread = islands_run(runs, "fragments_zero2_int4", nproc=4, micro=2, extra=DELAYED_INT4)
    inline = islands_run(runs, "fragments_zero2_int4_inline", nproc=4, micro=2,
                         extra=[*DELAYED_INT4, "--diloco_exchange_thread", "false"])
    for island in (0, 1):
        a, b = island_metrics(thread, island), island_metrics(inline, island)
        assert losses(a) == losses(b)
        for key in ("weights_sum", "outer_sum", "outer_landed"):
            assert [m.get(key) for m in a] == [m.get(key) for m in b], key


# 2 islands, one per node, 4 fp32 fragments (H 4) in delayed mode with `auto`, 12 steps, a save
# at step 8; a fragment's exchange (41 KB) is about 0.3 s at 1 Mbit/s, the window of 4 tiny
# inner steps about a tenth of that: far slower than the window
AUTO = ["--diloco_islands", "2", "--diloco_inner_steps", "4", "--diloco_fragments", "4",
        "--diloco_mode", "delayed", "--diloco_checksum", "--diloco_outer_lr", "1",
        "--diloco_outer_momentum", "0.3", "--max_steps", "12", "--save_steps", "8",
        "--eval_steps", "8"]
SLOW = "1mbit"
SHORTFALL = "DiLoCo: the link is slower than the window: "


def start(cluster: Cluster, out, text_file, logs, extra=()) -> list:
    """Island i on node i (a torchrun launch each, the store on node 0); logs to logs/node<i>."""
    logs.mkdir(parents=True, exist_ok=True)
    store, args = f"{cluster.address(0)}:{free_port()}", recipe_args(out, text_file, "zero0.json",
                                                                    [*AUTO, *extra])
    procs = []
    for node in (0, 1):
        cmd = ["torchrun", "--nproc_per_node", 1, "--master_port", free_port(),
               REPO / "recipes/pretrain.py", *args, "--diloco_island_index", node,
               "--diloco_store", store]
        with open(logs / f"node{node}.log", "w") as log:
            procs.append(cluster.popen(node, cmd, cwd=REPO, env=cluster.env(node, job_env()),
                                       stdout=log, stderr=subprocess.STDOUT))
    return procs


def landings(out) -> list[tuple]:
    """(step, outer_landed, outer_landed_after) of island 0's steps where a fragment landed;
    the same on island 1."""
    rows = [[(m["step"], m["outer_landed"], m.get("outer_landed_after"))
             for m in island_metrics(out, i) if "outer_landed" in m] for i in (0, 1)]
    assert rows[0] == rows[1]
    return rows[0]


def ended_identical(out) -> None:
    last = [[m for m in island_metrics(out, i) if "outer_step" in m][-1] for i in (0, 1)]
    assert [last[0][k] for k in WEIGHT_KEYS] == [last[1][k] for k in WEIGHT_KEYS]


@pytest.mark.slow
def test_auto_landings_follow_the_link_and_a_killed_run_resumes_bit_for_bit(text_file, tmp_path):
    """Two namespace nodes, `auto`: unshaped, fragments land two steps after they sync; at 1
    Mbit/s, a link far slower than the window, at the bound (H steps after), and each island
    says once in one line what the window needs, and trains on. Islands end identical. Then the
    slow run's step-8 checkpoint (every fragment in flight) resumed, SIGKILLed after step 9
    (fragment 1 in flight) and resumed again: steps 9-12 repeat the slow run bit for bit."""
    with Cluster(2) as cluster:
        fast = tmp_path / "fast"
        assert wait_all(start(cluster, fast, text_file, tmp_path / "fast-logs"), JOB_TIMEOUT) == [
            0, 0]
        for node in (0, 1):
            cluster.shape(node, SLOW)
        slow = tmp_path / "slow"
        codes = wait_all(start(cluster, slow, text_file, tmp_path / "slow-logs"), JOB_TIMEOUT)
        assert codes == [0, 0], (tmp_path / "slow-logs" / "node1.log").read_text()[-3000:]
        again = tmp_path / "again"
        for i in (0, 1):
            checkpoints = again / f"island{i}" / "checkpoints"
            shutil.copytree(slow / f"island{i}" / "checkpoints" / "step8", checkpoints / "step8")
            (checkpoints / "latest").write_text("step8")
        resume = ["--resume_from_checkpoint", "latest"]
        procs = start(cluster, again, text_file, tmp_path / "killed-logs", resume)
        while 9 not in logged_steps(again / "island0" / "metrics.jsonl", "loss"):
            assert all(p.poll() is None for p in procs), "the resumed run ended before step 9"
            time.sleep(0.005)
        for node in (0, 1):
            cluster.lose(node)
        wait_all(procs, 60)
        assert 12 not in logged_steps(again / "island0" / "metrics.jsonl", "loss")
        codes = wait_all(start(cluster, again, text_file, tmp_path / "again-logs", resume),
                         JOB_TIMEOUT)
        assert codes == [0, 0], (tmp_path / "again-logs" / "node1.log").read_text()[-3000:]

    quick, late = landings(fast), landings(slow)
    print("unshaped:", quick, f"\n{SLOW}:", late)
    # before the save: the first exchange has the link to itself, the others queue behind it
    slow_after, quick_after = ([after for step, _, after in rows if step <= 8]
                               for rows in (late, quick))
    assert len(slow_after) == 4 and max(slow_after) == 4 and sum(slow_after) > sum(quick_after)
    assert [step for step, _, _ in late][-2:] == [10, 12]  # the save decided 10; the last
    for run, logs, said in ((fast, "fast-logs", 0), (slow, "slow-logs", 1)):
        ended_identical(run)
        lines = [line for node in (0, 1) for line in (tmp_path / logs / f"node{node}.log")
                 .read_text().splitlines() if SHORTFALL in line]
        assert said <= len(lines) <= 2 * said, lines  # once, on each island that waited
        for line in lines:
            assert "MB per window at the " in line and "Mbit/s measured" in line
            assert "Would fit: --diloco_inner_steps " in line, line
    assert losses(island_metrics(slow, 0))[-1] < losses(island_metrics(slow, 0))[0]
    for i in (0, 1):
        want = [m for m in island_metrics(slow, i) if m["step"] > 8]
        got = island_metrics(again, i)
        assert [m["step"] for m in got if "loss" in m] == [9, 10, 11, 12]
        for key in ("loss", "weights_sum", "outer_sum", "outer_landed", "outer_landed_after"):
            assert [m.get(key) for m in got] == [m.get(key) for m in want], key
    ended_identical(again)
