"""Islands of unequal speed (--diloco_island_steps, dragon.diloco.pace) in real recipe jobs: a
slower island trains fewer steps of each window and rests through the others, the outer average
weights the islands by the tokens they trained, and they stay identical and resume exactly."""

import contextlib
import subprocess

import pytest
from conftest import REPO, free_port, job_env, launch_command, losses, read_jsonl
from test_checkpoints import SLOWED, finish, kill_when, logged_steps, recipe_args
from test_elastic import island_store
from test_diloco import DILOCO, assert_islands_identical, island_metrics, islands_run


def outer_steps(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "outer_step" in m]


def test_a_fixed_plan_weights_islands_by_tokens(runs):
    """2 islands (ZeRO-0, H 2, sync), island 1 training 1 step of every 2 (--diloco_island_steps
    2,1): island 1 trains and logs a loss at steps 2, 4, 6, 8 only, every outer step weights the
    islands 2/3 and 1/3 as their logged tokens say, both hold bit-identical weights after every
    outer step, and the run's tokens count both islands' trained steps exactly (its resume: the
    next test)."""
    extra = [*DILOCO, "--diloco_island_steps", "2,1"]
    full_out = islands_run(runs, "unequal_islands", config="zero0.json", extra=extra)
    assert_islands_identical(full_out)
    full = [island_metrics(full_out, i) for i in (0, 1)]
    assert [m["step"] for m in full[1] if "loss" in m] == [2, 4, 6, 8]
    assert [m["step"] for m in full[0] if "loss" in m] == list(range(1, 9))
    outer = [outer_steps(metrics) for metrics in full]
    for a, b in zip(*outer):
        assert (a["island_steps"], b["island_steps"]) == (2, 1)
        assert a["island_tokens"] == 2 * b["island_tokens"] > 0
        assert a["outer_weight"] == pytest.approx(2 / 3) and b["outer_weight"] == (
            pytest.approx(1 / 3))
        assert (a["island_plan"], b["island_plan"]) == (2, 1)
    assert losses(full[1])[-1] < losses(full[1])[0]
    per_step = outer[0][0]["island_tokens"] // 2  # the run's tokens: both islands' trained steps
    for metrics in full:
        counted = {m["step"]: m["tokens"] for m in metrics if "tokens" in m}
        assert counted == {s: per_step * (s + s // 2) for s in range(1, 9)}, counted


@pytest.mark.slow
def test_a_killed_pair_with_a_plan_resumes_exactly_with_the_same_command(runs, tmp_path):
    """The run of the test above as one command with --resume_from_checkpoint auto, SIGKILLed
    between its step-4 and step-8 saves, then started again with the same command: each
    island's losses and outer checksums are those of the uninterrupted run, bit for bit."""
    extra = [*DILOCO, "--diloco_island_steps", "2,1"]
    full_out = islands_run(runs, "unequal_islands", config="zero0.json", extra=extra)
    out = tmp_path / "killed"
    args = runs.arguments(out, config="zero0.json",
                          extra=[*extra, "--resume_from_checkpoint", "auto"])

    def start(**env):
        return subprocess.Popen(launch_command("torchrun", 2, "recipes/pretrain.py", args),
                                cwd=REPO, env=job_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    proc = start(**SLOWED)
    kill_when(proc, lambda: max(logged_steps(out / "island0" / "metrics.jsonl"), default=0) >= 5)
    assert max(logged_steps(out / "island0" / "metrics.jsonl")) < 8, "killed too late"
    finish(start())
    for i in (0, 1):
        full, resumed = island_metrics(full_out, i), island_metrics(out, i)
        assert losses(resumed) == losses(full)
        assert [m.get("outer_sum") for m in resumed] == [m.get("outer_sum") for m in full]


def test_fragments_with_a_plan_stay_identical(runs):
    """Streaming DiLoCo (F 2 of H 4, sync) with island 1 training 2 of every 4 steps: each
    fragment's sync weights the islands by the tokens they trained since the last sync, and
    both islands hold a bit-identical theta_outer after every one (the weights of the fragments
    not synced yet differ by design), and identical weights at the end."""
    extra = ["--diloco_islands", "2", "--diloco_inner_steps", "4", "--diloco_fragments", "2",
             "--diloco_checksum", "--diloco_island_steps", "4,2"]
    out = islands_run(runs, "unequal_fragments", config="zero0.json", extra=extra)
    assert_islands_identical(out, keys=("outer_sum", "outer_sumsq"))
    outer = [outer_steps(island_metrics(out, i)) for i in (0, 1)]
    assert outer[0][-1]["weights_sum"] == outer[1][-1]["weights_sum"]
    assert [m["island_steps"] for m in outer[0]] == [2, 2, 2, 2]
    assert [m["island_steps"] for m in outer[1]] == [1, 1, 1, 1]
    assert all(m["outer_weight"] == pytest.approx(2 / 3) for m in outer[0])


def start_island(island: int, out, text_file, store: str, plan: str, env=None, extra=()):
    """Island `island` of 2 as a launch of its own (ZeRO-2, 1 rank), H 4, 16 steps."""
    script, args = recipe_args("zero2", out, text_file, 16, [
        "--diloco_islands", "2", "--diloco_inner_steps", "4", "--diloco_checksum",
        "--diloco_island_index", str(island), "--diloco_store", store,
        "--diloco_island_steps", plan, "--save_steps", "8", *extra])
    return subprocess.Popen(launch_command("torchrun", 1, script, args), cwd=REPO,
                            env=job_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_auto_a_slow_island_trains_fewer_steps_and_the_islands_stay_identical(tmp_path,
                                                                              text_file, elastic):
    """Two launches, island 1 slowed to at least 0.4 s a training forward (a test-only hook),
    --diloco_island_steps auto, a fixed group or elastic islands (sync): both train every step
    of the first window; from then on they agree on a plan in which island 1 trains fewer steps
    than island 0, which trains all 4; every outer step weights them by their logged tokens,
    and their weights are bit-identical after every outer step."""
    with contextlib.ExitStack() as stack:
        store, extra = f"127.0.0.1:{free_port()}", []
        if elastic:
            store = stack.enter_context(island_store())
            extra = ["--diloco_elastic", "--diloco_store_external", "--diloco_quorum_timeout",
                     "30"]
        procs = [start_island(i, tmp_path, text_file, store, "auto",
                              {"DRAGON_FAULT_STEP_SECONDS": "0.4"} if i == 1 else None, extra)
                 for i in (0, 1)]
        for proc in procs:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
    outer = [outer_steps(read_jsonl(tmp_path / f"island{i}" / "metrics.jsonl")) for i in (0, 1)]
    assert [m["step"] for m in outer[0]] == [4, 8, 12, 16] == [m["step"] for m in outer[1]]
    assert [m["island_steps"] for m in outer[0]] == [4, 4, 4, 4]
    assert outer[1][0]["island_steps"] == 4
    assert all(m["island_steps"] < 4 for m in outer[1][1:]), [m["island_steps"] for m in outer[1]]
    for a, b in zip(*outer):
        assert a["island_plan"] == 4 and b["island_plan"] < 4
        total = a["island_tokens"] + b["island_tokens"]
        assert a["outer_weight"] == pytest.approx(a["island_tokens"] / total)
        assert b["outer_weight"] == pytest.approx(b["island_tokens"] / total)
        for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
            assert a[key] == b[key], (a["step"], key)
    trained = [m["step"] for m in read_jsonl(tmp_path / "island1" / "metrics.jsonl")
               if "loss" in m]
    assert len(trained) == sum(m["island_steps"] for m in outer[1])
