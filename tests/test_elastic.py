"""Elastic DiLoCo on real processes: islands as launches of their own around a standalone store
(python -m dragon.island_store); an island that dies leaves the others training on.
"""

import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO, free_port, job_env, launch_command, read_jsonl
from test_checkpoints import recipe_args
from test_faults import signal_after

STEPS = 16
ELASTIC = ["--diloco_inner_steps", "4", "--diloco_elastic", "--diloco_store_external",
           "--diloco_quorum_timeout", "5", "--diloco_checksum", "--save_steps", "4"]


@pytest.fixture
def store():
    """A standalone island store on a free port, stopped after the test."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dragon.island_store", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert "listening" in proc.stdout.readline()
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def start(island, islands, out, text_file, store, env=None, extra=(), kind="zero2"):
    """Island `island` of `islands` as a launch of its own (ZeRO-2 on 1 rank, or a pipeline of
    2 stages on 2 ranks)."""
    script, args = recipe_args(kind, out, text_file, STEPS, [*ELASTIC, *extra])
    args += ["--diloco_islands", str(islands), "--diloco_island_index", str(island)]
    args += ["--diloco_store", store]
    return subprocess.Popen(
        launch_command("torchrun", 2 if kind == "pipeline" else 1, script, args),
        cwd=REPO,
        env=job_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outer(out, island) -> list[dict]:
    return [m for m in read_jsonl(out / f"island{island}" / "metrics.jsonl") if "outer_step" in m]


@pytest.mark.parametrize("mode", ["sync", "delayed"])
def test_an_island_lost_during_the_exchange_is_left_out_of_a_retry(
    tmp_path, text_file, store, mode
):
    """Three islands; island 2 dies in outer step 2 after the quorum formed. Sync: it dies
    before the exchange, so islands 0 and 1 retry outer step 2 without it, and agree
    (bit-identical weights after every outer step). Delayed: it dies with the exchange of outer
    step 2 in flight, so islands 0 and 1 find it failed at outer step 3, redo it among
    themselves, and end the run on identical weights. Both train to the end."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_EXIT_OUTER_STEP": "2", "DRAGON_FAULT_ISLAND": "2"}
    extra = ["--diloco_mode", mode, "--diloco_outer_momentum", "0.3"]
    procs = [start(i, 3, out, text_file, store, env, extra) for i in (0, 1, 2)]
    for proc in procs[:2]:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    procs[2].wait(timeout=60)
    assert procs[2].returncode != 0
    keys = ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq", "outer_quorum")
    if mode == "sync":
        assert "the exchange among islands [0, 1, 2] failed" in stdout + stderr
        assert [m["outer_quorum"] for m in outer(out, 0)] == [3, 2, 2, 2]
    else:
        assert "outer step 3: the average in flight since the last outer step failed; islands " \
            "[0, 1] redo it" in stdout + stderr
        assert [m["outer_quorum"] for m in outer(out, 0)] == [3, 3, 2, 2]
    pairs = zip(outer(out, 0), outer(out, 1))
    for a, b in pairs if mode == "sync" else [(outer(out, 0)[-1], outer(out, 1)[-1])]:
        for key in keys:
            assert a[key] == b[key], (a["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("mode, kind", [("sync", "zero2"), ("delayed", "pipeline")])
def test_a_killed_island_leaves_the_other_training_then_rejoins(
    tmp_path, text_file, store, mode, kind
):
    """ZeRO-2 islands in sync mode, pipeline islands in delayed mode. Island 1 (one of its
    ranks) is killed after its step 5 (mid-window): island 0 waits out the quorum timeout at
    step 8 and trains on alone (quorum 1). Island 1 started again with --diloco_join takes
    theta_outer, the outer optimizer's state and the step at island 0's next outer step and ends
    that step on island 0's weights (bit-identical checksums). Sync: both islands stay
    bit-identical to the end. Delayed: each island's own fresh share makes them differ in
    between, and the last step's average makes them identical again. Quorum 2 from the join on;
    both exit 0."""
    last = 800 if kind == "zero2" else 600  # a pipeline island runs at about half the speed
    steps = ["--max_steps", str(last), "--eval_steps", str(last // 2)]
    steps += ["--save_steps", str(last // 2), "--diloco_mode", mode]
    steps += ["--diloco_outer_momentum", "0.3"]
    out = tmp_path / "run"
    procs = [start(i, 2, out, text_file, store, extra=steps, kind=kind) for i in (0, 1)]
    metrics = out / "island1" / "metrics.jsonl"
    signal_after(procs[1], metrics, "rank", signal.SIGKILL, ranks=2 if kind == "pipeline" else 1)
    procs[1].wait(timeout=60)
    joiner = start(1, 2, out, text_file, store, extra=[*steps, "--diloco_join"], kind=kind)
    for proc in (procs[0], joiner):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        if proc is procs[0]:
            assert "island [1] did not arrive; training on with islands [0]" in stdout + stderr
    assert "joined the run at step" in stdout + stderr
    mine, theirs = outer(out, 0), {m["step"]: m for m in outer(out, 1) if m["step"] > 4}
    assert [m["outer_quorum"] for m in mine[:2]] == [2, 1] and len(theirs) >= 2
    assert (out / "final" / "model.safetensors").exists()
    joined = min(theirs)
    assert max(theirs) == last
    for m in mine:
        if m["step"] in theirs:
            assert m["outer_quorum"] == 2
            if mode == "sync" or m["step"] in (joined, last):
                for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
                    assert m[key] == theirs[m["step"]][key], (m["step"], key)


def test_a_joiner_of_another_model_size_or_h_is_refused(tmp_path, text_file, store):
    """A joiner whose model size or H differs from the live island's exits 1 with one line
    naming both values; the live island trains on, unaware."""
    out = tmp_path / "run"
    live = start(0, 2, out, text_file, store, extra=["--max_steps", "100000"])
    extra = ["--diloco_inner_steps", "2", "--n_embd", "64", "--diloco_join"]
    joiner = start(1, 2, tmp_path / "joiner", text_file, store, extra=extra)
    _, stderr = joiner.communicate(timeout=300)
    assert joiner.returncode == 1
    line = next(x for x in stderr.splitlines() if "--diloco_join" in x)
    assert re.search(r"this island's parameters on this rank \d+ \(theirs \d+\), H 2 \(theirs 4\)",
                     line) and "join with the live islands' model" in line, line
    assert live.poll() is None
    live.send_signal(signal.SIGTERM)
    live.communicate(timeout=120)
