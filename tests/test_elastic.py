"""Elastic DiLoCo on real processes: islands as launches of their own around a standalone store
(python -m dragon.island_store); an island that dies leaves the others training on.
"""

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


def start(island, islands, out, text_file, store, env=None, extra=()):
    script, args = recipe_args("zero2", out, text_file, STEPS, [*ELASTIC, *extra])
    args += ["--diloco_islands", str(islands), "--diloco_island_index", str(island)]
    args += ["--diloco_store", store]
    return subprocess.Popen(
        launch_command("torchrun", 1, script, args),
        cwd=REPO,
        env=job_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outer(out, island) -> list[dict]:
    return [m for m in read_jsonl(out / f"island{island}" / "metrics.jsonl") if "outer_step" in m]


def test_an_island_lost_during_the_exchange_is_left_out_of_a_retry(tmp_path, text_file, store):
    """Three islands; island 2 dies in outer step 2 after the quorum formed, during the exchange:
    islands 0 and 1 retry without it, agree (bit-identical weights after every outer step) and
    train to the end."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_EXIT_OUTER_STEP": "2", "DRAGON_FAULT_ISLAND": "2"}
    procs = [start(i, 3, out, text_file, store, env) for i in (0, 1, 2)]
    for proc in procs[:2]:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    procs[2].wait(timeout=60)
    assert procs[2].returncode != 0
    assert "the exchange among islands [0, 1, 2] failed" in stdout + stderr
    for a, b in zip(outer(out, 0), outer(out, 1)):
        for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq", "outer_quorum"):
            assert a[key] == b[key], (a["step"], key)
    assert [m["outer_quorum"] for m in outer(out, 0)] == [3, 2, 2, 2]


@pytest.mark.slow
def test_a_killed_island_leaves_the_other_training_then_rejoins(tmp_path, text_file, store):
    """Island 1 is killed after its step 5 (mid-window): island 0 waits out the quorum timeout at
    step 8 and trains on alone (quorum 1). Island 1 started again with --diloco_join takes
    theta_outer, the outer momentum and the step at island 0's next outer step; from its first
    outer step on both islands hold bit-identical weights and outer state, with quorum 2, to the
    end, and both exit 0."""
    steps = ["--max_steps", "1200", "--eval_steps", "600", "--save_steps", "600"]
    out = tmp_path / "run"
    procs = [start(i, 2, out, text_file, store, extra=steps) for i in (0, 1)]
    metrics = out / "island1" / "metrics.jsonl"
    signal_after(procs[1], metrics, "rank", signal.SIGKILL, ranks=1)
    procs[1].wait(timeout=60)
    joiner = start(1, 2, out, text_file, store, extra=[*steps, "--diloco_join"])
    for proc in (procs[0], joiner):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        if proc is procs[0]:
            assert "island [1] did not arrive; training on with islands [0]" in stdout + stderr
    assert "joined the run at step" in stdout + stderr
    mine, theirs = outer(out, 0), {m["step"]: m for m in outer(out, 1) if m["step"] > 4}
    assert [m["outer_quorum"] for m in mine[:2]] == [2, 1] and len(theirs) >= 2
    assert (out / "final" / "model.safetensors").exists()
    for m in mine:
        if m["step"] in theirs:
            for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
                assert m[key] == theirs[m["step"]][key], (m["step"], key)
            assert m["outer_quorum"] == 2
