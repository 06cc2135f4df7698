"""Elastic DiLoCo on real processes: islands as launches of their own around a standalone store
(python -m dragon.diloco.island_store); an island that dies leaves the others training on.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, free_port, job_env, launch_command, read_jsonl
from test_checkpoints import logged_steps, recipe_args
from test_faults import ranks_of, signal_after

from test_diloco import nesterov, toy

from dragon.checkpoint.catalog import is_complete
from dragon.diloco.quorum import START_TIMEOUT, step_key

STEPS = 16
ELASTIC = ["--diloco_inner_steps", "4", "--diloco_elastic", "--diloco_store_external",
           "--diloco_quorum_timeout", "5", "--diloco_checksum", "--save_steps", "4"]


@contextlib.contextmanager
def island_store():
    """A standalone island store on a free port (HOST:PORT), stopped on exit. Its file runs as a
    script (-P: its directory is not put on sys.path), which spares the seconds of `import
    dragon`; test_multinode starts it as the docs do, with -m."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-P", str(REPO / "dragon/diloco/island_store.py"), "--host",
         "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert "listening" in proc.stdout.readline()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture
def store():
    with island_store() as address:
        yield address


def start(island, islands, out, text_file, store, env=None, extra=(), kind="zero2", ranks=None):
    """Island `island` of `islands` as a launch of its own (ZeRO-2 on 1 rank, or a pipeline of
    2 stages on 2 ranks; `ranks`: so many instead)."""
    script, args = recipe_args(kind, out, text_file, STEPS, [*ELASTIC, *extra])
    args += ["--diloco_islands", str(islands), "--diloco_island_index", str(island)]
    args += ["--diloco_store", store]
    return subprocess.Popen(
        launch_command("torchrun", ranks or (2 if kind == "pipeline" else 1), script, args),
        cwd=REPO,
        env=job_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outer(out, island) -> list[dict]:
    return [m for m in read_jsonl(out / f"island{island}" / "metrics.jsonl") if "outer_step" in m]


def toy_island(tmp_path, store, island: int, part: str) -> subprocess.Popen:
    """Island `island` of tests/scripts/diloco_islands.py's `part`, started."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests/scripts/diloco_islands.py"), str(island), store,
         str(tmp_path / f"island{island}.json"), part],
        cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def toy_islands(tmp_path, store, part: str, killed: tuple = ()) -> tuple[list, list[str]]:
    """tests/scripts/diloco_islands.py's `part` as islands 0 and 1: each one's record (None for
    the islands `killed` by SIGKILL), and what each wrote to stderr."""
    procs = [toy_island(tmp_path, store, i, part) for i in (0, 1)]
    stderr = [proc.communicate(timeout=300)[1] for proc in procs]
    for i, (proc, err) in enumerate(zip(procs, stderr)):
        assert proc.returncode == (-signal.SIGKILL if i in killed else 0), err[-3000:]
    return [None if i in killed else json.loads((tmp_path / f"island{i}.json").read_text())
            for i in (0, 1)], stderr


def window_delta(theta: torch.Tensor, island: int) -> torch.Tensor:
    """theta_outer - theta after a toy island's window of inner steps from theta."""
    centre = torch.cat([t.flatten() for t in toy.centre(island)])
    w = theta.clone()
    for _ in range(toy.INNER_STEPS):
        w = w - toy.INNER_LR * (w - centre)
    return theta - w


def equal_the_simulation(zero: list, one: list, ones_steps: tuple, outer_gradient) -> None:
    """Toy islands 0 (every outer step of 4) and 1 (`ones_steps`) equal the hand simulation,
    theta_outer stepped by Nesterov 0.3 with outer_gradient(k, theta) at outer step k, after
    each outer step they took, and end identical (==)."""
    theta, buf, thetas = torch.cat([t.flatten() for t in toy.initial_weights()]), None, []
    for k in (1, 2, 3, 4):
        theta, buf = nesterov(theta, buf, outer_gradient(k, theta), mu=0.3)
        thetas.append(theta)
    for island, record, outer_steps in ((0, zero, (1, 2, 3, 4)), (1, one, ones_steps)):
        for r, k in zip(record, outer_steps):
            for key in ("weights", "outer"):
                got = torch.tensor(sum(r[key], []))
                assert torch.allclose(got, thetas[k - 1], rtol=1e-5, atol=1e-6), (
                    island, k, key, (got - thetas[k - 1]).abs().max())
    assert zero[-1]["weights"] == one[-1]["weights"] and zero[-1]["outer"] == one[-1]["outer"]


def test_a_survivor_trains_on_as_a_one_island_diloco_would(tmp_path, store):
    """Toy weights (tests/scripts/diloco_islands.py), two elastic islands, sync then delayed
    mode; island 1 leaves after outer step 1. Island 0's outer steps 2-4 (quorum 1) give bit for
    bit the weights and theta_outer of a one-island DiLoCo started from island 0's state after
    outer step 1 (theta_outer, outer momentum, and in delayed mode the two-island average in
    flight) on the same inner steps. Island 1, joining after the run ended, is told so in one
    line."""
    (zero, one), stderr = toy_islands(tmp_path, store, "elastic")
    assert "island [1] did not arrive; training on with islands [0]" in stderr[0]
    assert one["join"].startswith("error: --diloco_join: the live islands ended the run at step "
                                  "12; no outer step is left to join"), one["join"]
    for mode, record in zero.items():
        assert [r["metrics"]["outer_quorum"] for r in record] == [2, 1, 1, 1]
        for k, r in enumerate(record[1:], 2):
            for key in ("weights", "outer"):
                got, want = (torch.tensor(sum(x[key], [])) for x in (r, r["alone"]))
                assert torch.equal(got, want), (mode, k, key, (got - want).abs().max())
            norm = r["alone"]["metrics"]["outer_grad_norm"]
            assert r["metrics"]["outer_grad_norm"] == norm, (mode, k)


def test_a_late_island_lands_in_the_next_outer_step_weighted_by_staleness(tmp_path, store):
    """Toy weights, elastic islands in sync mode, quorum timeout 1 s: island 1 reaches outer
    step 2 three seconds late. Island 0 takes it alone (quorum 1) and does not wait; island 1
    lands its window-2 pseudo-gradient in outer step 3, weighted 1/2 against island 0's fresh
    one, and takes theta_outer. Both islands' weights and theta_outer equal the hand
    simulation after every outer step they took (the late delta counted once), and end
    identical (==)."""
    (zero, one), stderr = toy_islands(tmp_path, store, "late")
    assert "outer step 2 went on without this island (islands [0])" in stderr[1]
    assert "outer step 3: island 1 lands 1 outer step(s) late, weighted 0.5," in stderr[0]
    assert [r["metrics"]["outer_quorum"] for r in zero] == [2, 1, 2, 2]
    assert [r["step"] for r in one] == [3, 9, 12]  # it did not train window 3
    assert one[1]["metrics"]["landed_late_by"] == 1 and zero[2]["metrics"]["outer_late"] == 1

    kept = None

    def outer_gradient(k, theta):
        nonlocal kept
        if k == 3:  # island 0 fresh, island 1's window 2 at weight 1/2
            return (window_delta(theta, 0) + 0.5 * kept) / 1.5
        if k == 2:  # island 0 alone; island 1 keeps its pseudo-gradient
            kept = window_delta(theta, 1)
            return window_delta(theta, 0)
        return (window_delta(theta, 0) + window_delta(theta, 1)) / 2

    equal_the_simulation(zero, one, (1, 3, 4), outer_gradient)


def test_a_late_island_is_not_let_into_the_last_outer_step(tmp_path, store):
    """Toy weights, as above, but island 1 is late for outer step 3 and announces itself for
    step 4, the run's last, before it forms: the last step lets no island in late (it would not
    know it is the last), so island 0 ends alone, and island 1 stops with one line saying that
    its window did not land."""
    (zero, one), stderr = toy_islands(tmp_path, store, "late_final")
    assert [r["metrics"]["outer_quorum"] for r in zero] == [2, 2, 1, 1]
    assert "late, weighted" not in stderr[0] and "outer_late" not in zero[-1]["metrics"]
    assert [r["step"] for r in one] == [3, 6, 9]
    assert one[-1]["stopped"] == ("error: island 1 missed outer step 3 and could not land late: "
                                  "the live islands ended the run at step 12; no outer step is "
                                  "left to join (to train on, resume every island with a larger "
                                  "--max_steps)"), one[-1]


def test_an_island_that_dies_deciding_a_quorum_is_decided_without(tmp_path, store):
    """Toy weights, elastic islands in sync mode: island 0, first at outer step 2, is SIGKILLed
    while it decides who takes the step. Island 1 sees no decision within the quorum timeout
    and the slack, decides the step without island 0 (its rank 0, elected once through the
    store), and trains on alone to the end, as a one-island DiLoCo from outer step 2."""
    (_, one), stderr = toy_islands(tmp_path, store, "decider_dies", killed=(0,))
    assert "outer step 2: island 0 was to decide who takes it and did not; island 1 decides " \
        "without [0]" in stderr[1]
    assert [r["metrics"]["outer_quorum"] for r in one] == [2, 1, 1, 1]
    assert [r["step"] for r in one] == [3, 6, 9, 12]


def test_a_member_whose_exchange_failed_alone_joins_the_next_outer_step(tmp_path, store):
    """Toy weights, elastic islands in sync mode: island 1's exchange of outer step 2 completes
    on island 0 (with island 1's share) but fails on island 1 alone. Island 1's retry finds the
    step done and joins outer step 3 as a joiner (a zero share, island 0's theta_outer), not
    as a quorum of its own. Both equal the hand simulation, where island 1's window 2 counts
    once, and end identical (==)."""
    (zero, one), stderr = toy_islands(tmp_path, store, "failed_alone")
    assert "outer step 2: islands [0] completed it with this island's share" in stderr[1]
    assert [r["metrics"]["outer_quorum"] for r in zero] == [2, 2, 2, 2]
    assert [r["step"] for r in one] == [3, 9, 12]

    def outer_gradient(k, theta):  # outer step 3: island 0 alone (the joiner sends zeros)
        both = (window_delta(theta, 0) + window_delta(theta, 1)) / 2
        return window_delta(theta, 0) if k == 3 else both

    equal_the_simulation(zero, one, (1, 3, 4), outer_gradient)


def test_a_joiner_whose_round_failed_on_it_alone_joins_a_later_one(tmp_path, store):
    """Toy weights, elastic islands in sync mode: island 1 joins island 0 (alone from its first
    outer step) at outer step 2; the join round completes on island 0 but fails on island 1
    alone, as when the round's last message is lost to it. Island 1's retry gets no quorum
    within the quorum timeout and the slack, and it joins outer step 3 instead of waiting for
    one that is over. Both equal the hand simulation, where the joiner sends zeros, and end
    identical (==)."""
    (zero, one), stderr = toy_islands(tmp_path, store, "join_fails")
    assert "outer step 2 went on without this island; it joins a later one" in stderr[1]
    assert [r["metrics"]["outer_quorum"] for r in zero] == [1, 2, 2, 2]
    assert zero[0]["started_in"] < START_TIMEOUT / 2  # the joiner said so: not waited for
    assert [r["step"] for r in one] == [9, 12]

    def outer_gradient(k, theta):  # island 0 alone until outer step 4
        both = (window_delta(theta, 0) + window_delta(theta, 1)) / 2
        return window_delta(theta, 0) if k < 4 else both

    equal_the_simulation(zero, one, (3, 4), outer_gradient)


def test_an_island_that_starts_later_than_the_quorum_timeout_is_waited_for(tmp_path, store):
    """Toy weights, elastic islands in sync mode, quorum timeout 1 s: island 1 starts 4 s after
    island 0. The first outer step waits for the islands that start together up to
    START_TIMEOUT, so island 0 waits for it there, both take every outer step (quorum 2), and
    both equal the hand simulation of two islands."""
    (zero, one), _ = toy_islands(tmp_path, store, "late_start")
    assert 3 < zero[0]["started_in"] < START_TIMEOUT, zero[0]["started_in"]
    assert [r["metrics"]["outer_quorum"] for r in zero] == [2, 2, 2, 2]
    assert [r["metrics"]["outer_quorum"] for r in one] == [2, 2, 2, 2]
    equal_the_simulation(zero, one, (1, 2, 3, 4), lambda k, theta: (
        window_delta(theta, 0) + window_delta(theta, 1)) / 2)


def test_a_restarted_island_never_joins_the_attempt_its_dead_launch_arrived_at(tmp_path, store):
    """Toy weights, elastic islands in sync mode: island 1 arrives at outer step 2, is let in,
    and is SIGKILLed before the step's group forms; island 0's group waits for it. Started again
    with --diloco_join meanwhile, island 1 finds the live islands at outer step 2, which its dead
    launch arrived at: it joins outer step 3 instead (joining step 2 would give island 0's
    waiting group a member that takes the step as a joiner while island 0 takes it as a member).
    Island 0 takes step 2 alone once its group fails; both equal the hand simulation and end
    identical (==)."""
    zero = toy_island(tmp_path, store, 0, "restarted")
    dead = toy_island(tmp_path, store, 1, "restarted")
    assert dead.wait(timeout=300) == -signal.SIGKILL, dead.communicate()[1][-3000:]
    again = toy_island(tmp_path, store, 1, "rejoin")
    for proc in (zero, again):
        stderr = proc.communicate(timeout=300)[1]
        assert proc.returncode == 0, stderr[-3000:]
    assert "outer step 2: an earlier launch of this island arrived at it and died" in stderr
    zero, one = (json.loads((tmp_path / f"island{i}.json").read_text()) for i in (0, 1))
    assert [r["metrics"]["outer_quorum"] for r in zero] == [2, 1, 2, 2]
    assert [r["step"] for r in one] == [9, 12]

    def outer_gradient(k, theta):  # outer steps 2 and 3: island 0 alone (the joiner sends 0)
        both = (window_delta(theta, 0) + window_delta(theta, 1)) / 2
        return window_delta(theta, 0) if k in (2, 3) else both

    equal_the_simulation(zero, one, (3, 4), outer_gradient)


def test_a_late_island_of_the_recipe_lands_late_and_the_islands_end_identical(
    tmp_path, text_file, store
):
    """Two elastic ZeRO-2 islands (quorum timeout 5 s): island 1 reaches outer step 2 (step 8)
    eight seconds late, island 0 outer step 3 six seconds late. Island 0 takes outer step 2
    alone; island 1 lands in outer step 3 (step 12) without training steps 9-12, logs each step
    it trained once, saves at step 12 with island 0, and both end on identical weights and
    theta_outer (checksums ==) after outer steps 3 and 4."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_LATE": "1:2:8,0:3:6"}
    procs = [start(i, 2, out, text_file, store, env) for i in (0, 1)]
    ends = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, stderr) in zip(procs, ends):
        assert proc.returncode == 0, stderr[-3000:]
    assert "outer step 2 went on without this island (islands [0])" in ends[1][1]
    zero, one = outer(out, 0), outer(out, 1)
    assert [m["outer_quorum"] for m in zero] == [2, 1, 2, 2]
    assert [m["step"] for m in one] == [4, 12, 16]
    assert one[1]["landed_late_by"] == 1 and zero[2]["outer_late"] == 1
    rows = read_jsonl(out / "island1" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [*range(1, 9), *range(13, 17)]
    assert is_complete(out / "island1" / "checkpoints" / "step12")
    keys = ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq")
    for a, b in zip(zero[2:], one[1:]):
        for key in keys:
            assert a[key] == b[key], (a["step"], key)


# mode -> (the outer step island 2 dies in, flags, ranks per island). Delayed fragments: F = 2
# of H 4, each landing a step after its sync; outer step 3 is fragment 0's sync at step 4 (1:
# fragment 1's at step 2, 2: its landing at step 3). Neurons: delayed islands of K=2 shares (the
# delayed run, each rank redoing its share).
LOST = {"sync": ("2", ["--diloco_mode", "sync"], 1),
        "fragments": ("3", ["--diloco_mode", "delayed", "--diloco_fragments", "2"], 1),
        "neurons": ("2", ["--diloco_mode", "delayed", "--neuron_parallel", "2"], 2)}


@pytest.mark.parametrize("mode", ["sync", "fragments",
                                  pytest.param("neurons", marks=pytest.mark.slow)])
def test_an_island_lost_during_the_exchange_is_left_out_of_a_retry(
    tmp_path, text_file, store, mode
):
    """Three islands; island 2 dies in outer step 2 after the quorum formed. Sync: it dies
    before the exchange, so islands 0 and 1 retry outer step 2 without it, and agree
    (bit-identical weights after every outer step). Delayed: it dies with the exchange of outer
    step 2 in flight, so islands 0 and 1 find it failed at outer step 3, redo it among
    themselves, and end the run on identical weights (run as islands of 2 neuron shares, each
    rank redoing its share). Delayed fragments: the same with fragment 0's exchange, found failed
    at its landing a step later. Both train to the end."""
    out = tmp_path / "run"
    dies_at, flags, ranks = LOST[mode]
    env = {"DRAGON_FAULT_EXIT_OUTER_STEP": dies_at, "DRAGON_FAULT_ISLAND": "2"}
    extra = [*flags, "--diloco_outer_momentum", "0.3"]
    procs = [start(i, 3, out, text_file, store, env, extra, ranks=ranks) for i in (0, 1, 2)]
    for proc in procs[:2]:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    procs[2].wait(timeout=60)
    assert procs[2].returncode != 0
    keys = ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq", "outer_quorum")
    if mode == "sync":
        assert "the exchange among islands [0, 1, 2] failed" in stdout + stderr
        assert [m["outer_quorum"] for m in outer(out, 0)] == [3, 2, 2, 2]
    elif mode == "fragments":
        assert "outer step 4: the exchange of fragment(s) [0] in flight failed; islands [0, 1] " \
            "redo it among themselves" in stdout + stderr
        assert [m["outer_quorum"] for m in outer(out, 0)][:5] == [3, 3, 3, 2, 2]
    else:  # delayed, or delayed islands of neuron shares
        assert "outer step 3: the average in flight since the last outer step failed; islands " \
            "[0, 1] redo it" in stdout + stderr
        assert [m["outer_quorum"] for m in outer(out, 0)] == [3, 3, 2, 2]
    pairs = zip(outer(out, 0), outer(out, 1))
    for a, b in pairs if mode == "sync" else [(outer(out, 0)[-1], outer(out, 1)[-1])]:
        for key in keys:
            assert a[key] == b[key], (a["step"], key)


def test_an_island_lost_before_its_group_forms_is_waited_for_no_longer_than_a_decision(
        tmp_path, text_file, store):
    """Island 1 of 2 dies in outer step 2 (step 8) after the quorum's decision and before it
    forms its group, so it never connects: island 0's group gives up waiting for it within the
    quorum timeout (5 s) and DECISION_SLACK, not within --dist_timeout (300 s), and the retry
    trains on alone to the end."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_EXIT_BEFORE_GROUP": "2", "DRAGON_FAULT_ISLAND": "1"}
    procs = [start(i, 2, out, text_file, store, env, ["--dist_timeout", "300"])
             for i in (0, 1)]
    stdout, stderr = procs[0].communicate(timeout=240)  # before the bound: 300 s and more
    procs[1].wait(timeout=60)
    assert procs[0].returncode == 0 and procs[1].returncode != 0, stderr[-3000:]
    assert ("outer step 2: the exchange among the quorum's islands failed (wait timeout after "
            "15000ms") in stderr, stderr[-3000:]
    assert [m["outer_quorum"] for m in outer(out, 0)] == [2, 1, 1, 1]
    rows = {m["step"]: m["time"] for m in read_jsonl(out / "island0" / "metrics.jsonl")
            if "loss" in m}
    waited = rows[8] - rows[7]  # step 8's row is written after its outer step
    print(f"island 0 waited {waited:.1f} s for the island that never connected")
    assert waited < 5 + 10 + 20, waited


def test_fewer_islands_than_the_minimum_end_the_run(tmp_path, text_file, store):
    """--diloco_min_islands 2 of 2: island 1 dies in outer step 2 (step 8) after the quorum
    formed; island 0's retry finds itself alone and ends the run with one line naming the flag
    and exit code 1, its step-4 checkpoint complete and `latest`."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_EXIT_OUTER_STEP": "2", "DRAGON_FAULT_ISLAND": "1"}
    procs = [start(i, 2, out, text_file, store, env, ["--diloco_min_islands", "2"])
             for i in (0, 1)]
    _, stderr = procs[0].communicate(timeout=600)
    procs[1].wait(timeout=60)
    assert procs[0].returncode == 1 and procs[1].returncode != 0, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: outer step 2: 1 island(s) [0] reached it, fewer than "
                      "--diloco_min_islands 2"], stderr[-3000:]
    checkpoints = out / "island0" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step4"
    assert is_complete(checkpoints / "step4")
    # step 8's row is never written: its outer step ended the run
    assert max(logged_steps(out / "island0" / "metrics.jsonl")) == 7


# In sync mode on ZeRO-2 islands, the churn soak (tests/test_churn.py) kills and restarts islands
# this way several times, and resumes every island from a save after the joins.
@pytest.mark.slow
def test_a_killed_pipeline_island_leaves_the_other_training_then_rejoins(tmp_path, text_file,
                                                                        store):
    """Pipeline islands in delayed mode. Island 1 (one of its ranks) is killed after its step 5
    (mid-window): island 0 waits out the quorum timeout at step 8 and trains on alone (quorum
    1). Island 1 started again with --diloco_join (and --resume_from_checkpoint auto, which finds
    no checkpoint of its own: a fresh joiner) takes theta_outer, the outer optimizer's state and
    the step at island 0's next outer step and ends that step on island 0's weights
    (bit-identical checksums). Each island's own fresh share makes them differ in between, and
    the last step's average makes them identical again. Quorum 2 from the join on; both exit
    0."""
    last = 64  # the joiner joins at step 12 (start_joiner_after_step_8)
    steps = ["--max_steps", str(last), "--eval_steps", str(last // 2)]
    steps += ["--save_steps", str(last // 16 * 4), "--diloco_mode", "delayed"]
    steps += ["--diloco_outer_momentum", "0.3", "--lr_scheduler_type", "constant_with_warmup"]
    out = tmp_path / "run"
    procs = [start(i, 2, out, text_file, store, extra=steps, kind="pipeline") for i in (0, 1)]
    metrics = out / "island1" / "metrics.jsonl"
    signal_after(procs[1], metrics, "rank", signal.SIGKILL, ranks=2)
    procs[1].wait(timeout=60)
    joiner = start_joiner_after_step_8(procs[0], out, store, lambda: start(
        1, 2, out, text_file, store, kind="pipeline",
        extra=[*steps, "--diloco_join", "--resume_from_checkpoint", "auto"]))
    mine, theirs = both_end_after_the_rejoin(procs[0], joiner, out)
    assert len(theirs) >= 2
    assert (out / "final" / "model.safetensors").exists()
    joined = min(theirs)
    assert max(theirs) == last
    for m in mine:
        if m["step"] in theirs:
            assert m["outer_quorum"] == 2
            if m["step"] in (joined, last):
                for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
                    assert m[key] == theirs[m["step"]][key], (m["step"], key)


def both_end_after_the_rejoin(survivor, joiner, out) -> tuple[list[dict], dict[int, dict]]:
    """Wait for the island that trained on alone and the one that rejoined: both end well, the
    survivor said it trained on, the joiner that it joined, and island 0's first two outer steps
    had 2 then 1 islands. (Island 0's outer records, island 1's after step 4 by step.)"""
    for proc in (survivor, joiner):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        if proc is survivor:
            assert "island [1] did not arrive; training on with islands [0]" in stdout + stderr
    assert "joined the run at step" in stdout + stderr
    mine, theirs = outer(out, 0), {m["step"]: m for m in outer(out, 1) if m["step"] > 4}
    assert [m["outer_quorum"] for m in mine[:2]] == [2, 1]
    return mine, theirs


def start_joiner_after_step_8(live, out, store, start_joiner, wait_for_keys=None):
    """The joiner, started once `live` (island 0) has ended step 8 alone: a joiner that started
    up within the quorum timeout would be a member of step 8, as if island 1 had never left.
    Island 0's ranks stay stopped until the joiner has announced itself for one of its next two
    outer steps, so it joins a few steps on on any machine (island 0 alone outruns a start-up).
    `wait_for_keys(store, keys, joiner)` waits until one of the keys is in the store (default:
    a client of the store in this process)."""
    metrics = out / "island0" / "metrics.jsonl"
    while 8 not in logged_steps(metrics, having="outer_step"):
        assert live.poll() is None, live.stderr.read()[-3000:]
        time.sleep(0.05)
    ranks = ranks_of(live.pid)
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        # The joiner announces for the outer step after the last one island 0 published, which
        # is the last one it logged, or the one after when it stopped in between.
        last = last_outer_step(metrics)
        keys = [f"{step_key(last + k)}/joining/1" for k in (1, 2)]
        joiner = start_joiner()
        (wait_for_keys or wait_in_store)(store, keys, joiner)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    return joiner


def last_outer_step(path) -> int:
    """The last outer step logged in a metrics file being written (a torn last line ignored)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return max(row["outer_step"] for row in rows if "outer_step" in row)


def wait_in_store(store, keys, joiner):
    """Until one of `keys` is in the store at HOST:PORT, while `joiner` runs."""
    host, port = store.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    while not any(client.check([key]) for key in keys):
        assert joiner.poll() is None, joiner.stderr.read()[-3000:]
        time.sleep(0.05)


def joined_after_a_failed_round(live, joiner, out, island: int, last: int) -> str:
    """Island 0 (`live`) and the joiner, island `island`, both end well after a round that
    failed and was retried, and the joiner took its outer steps to `last` with island 0, the
    two of them, on the same weights and theta_outer (==). Returns what they printed."""
    said = ""
    for proc in (live, joiner):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        said += stdout + stderr
    assert "retrying without the lost island" in said
    assert "joined the run at step" in said
    mine = {m["step"]: m for m in outer(out, 0)}
    theirs = outer(out, island)
    assert len(theirs) >= 2 and theirs[-1]["step"] == last
    for m in theirs:
        assert m["outer_quorum"] == mine[m["step"]]["outer_quorum"] == 2
        for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
            assert m[key] == mine[m["step"]][key], (m["step"], key)
    return said


@pytest.mark.slow
def test_an_island_killed_while_another_joins_leaves_the_joiner_with_the_survivors(
    tmp_path, text_file, store
):
    """Islands 0 and 1 of 3 train (sync, H 4, quorum timeout 5 s, 0.2 s a step); island 2 joins
    them and is held at its first exchange (a test-only hook) while island 1 is SIGKILLed. The
    round fails on every member, and islands 0 and 2 retry it without island 1: the joiner
    takes the live state there and trains on. Both exit 0, with identical weights and
    theta_outer after every outer step from the join on (quorum 2)."""
    out, release = tmp_path / "run", tmp_path / "release"
    steps = ["--max_steps", "40", "--eval_steps", "40", "--save_steps", "40"]
    slow = {"DRAGON_FAULT_STEP_SECONDS": "0.2"}
    live = [start(i, 3, out, text_file, store, env=slow, extra=steps) for i in (0, 1)]
    joiner = start(2, 3, out, text_file, store, env={"DRAGON_FAULT_HOLD_JOIN": str(release)},
                   extra=[*steps, "--diloco_join"])
    while not (tmp_path / "release.held").exists():
        for proc in (*live, joiner):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    for pid in ranks_of(live[1].pid):
        os.kill(pid, signal.SIGKILL)
    live[1].wait(timeout=60)
    release.touch()
    joined_after_a_failed_round(live[0], joiner, out, 2, 40)


def test_a_joiner_of_another_model_size_or_h_is_refused(tmp_path, text_file, store):
    """A joiner whose model size or H differs from the live island's exits 1 with one line
    naming both values; the live island trains on, unaware."""
    out = tmp_path / "run"
    live = start(0, 2, out, text_file, store,
                 extra=["--max_steps", "100000", "--max_data_epochs", "1e9"])
    extra = ["--diloco_inner_steps", "2", "--n_embd", "64", "--diloco_join"]
    joiner = start(1, 2, tmp_path / "joiner", text_file, store, extra=extra)
    _, stderr = joiner.communicate(timeout=300)
    assert joiner.returncode == 1
    line = next(x for x in stderr.splitlines() if "--diloco_join" in x)
    assert re.search(r"this island's parameters on this rank \d+ \(theirs \d+\), H 2 \(theirs 4\)",
                     line) and "join with the live islands' model" in line, line
    assert live.poll() is None
    live.send_signal(signal.SIGTERM)  # to its launcher, which passes it on: a preemption
    _, stderr = live.communicate(timeout=120)
    # the rank saves; torchrun stops its workers on a signal of its own, then re-raises it: 1
    assert live.returncode == 1 and "preempted (SIGTERM to this rank): saved step" in stderr, \
        stderr[-3000:]
