"""Fault injection on real 2-rank jobs: NaN steps, a save that fails on one rank, preemption, a
dead rank and a dead DiLoCo island. Each ends in bounded time with a clear message and an intact
last checkpoint, and a resume from it gives the uninterrupted run's losses (bit-equal).

Faults come from signals to real processes and from the test-only hooks of tests/faults
(DRAGON_FAULT_NAN_STEPS, DRAGON_FAULT_SAVE_STEP, DRAGON_FAULT_RANK).
"""

import os
import re
import signal
import subprocess
import time

import pytest
import torch
from conftest import REPO, free_port, job_env, launch_command, read_jsonl
from test_checkpoints import (
    RESUMABLE,
    STEPS,
    descendants,
    logged_steps,
    recipe_args,
    start,
    tags,
    uninterrupted,
)

from dragon.checkpoint.read_model import model_from_checkpoint
from dragon.checkpoint.catalog import is_complete

# Every job here ends well inside this (measured: a few seconds after the fault).
EXIT_BOUND_S = 60
DILOCO = ["--diloco_islands", "2", "--diloco_inner_steps", "4"]
_diloco: list = []


def run(kind, out, text_file, extra=(), env=None, launcher="torchrun", fault_step=None):
    """Run a job to its end: (exit code, seconds, stdout + stderr). The seconds run from the
    metrics line of `fault_step` (logged just before the fault acts) to the end; without it, the
    whole job."""
    began = time.time()
    proc = start(kind, out, text_file, STEPS, [*RESUMABLE, *extra], env, launcher)
    stdout, stderr = proc.communicate(timeout=600)
    if fault_step is not None:
        began = {m["step"]: m["time"] for m in read_jsonl(out / "metrics.jsonl")}[fault_step]
    return proc.returncode, time.time() - began, stdout + stderr


def resume_matches(kind, out, text_file, reference, after: int) -> None:
    """Resume from `latest` (at step `after`) with no fault: the uninterrupted run's losses."""
    code, _, log = run(kind, out, text_file, ["--resume_from_checkpoint", "latest"])
    assert code == 0, log[-3000:]
    resumed = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > after]
    resumed = resumed[-(STEPS - after) :]
    assert [m["step"] for m in resumed] == list(range(after + 1, STEPS + 1))
    assert [m["loss"] for m in resumed] == reference[after:]


def report(fault, recipe, seconds, exit_code, kept, resumed) -> None:
    """One row of the reliability table (benchmarks/README.md), shown with `pytest -s`."""
    print(f"\n| {fault} | {recipe} | {seconds:.1f} s | {exit_code} | {kept} | {resumed} |")


def latest(out) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize("kind", ["zero2", "pipeline"])
def test_nan_stop_keeps_the_last_checkpoint(kind, tmp_path, text_file):
    """--nan_policy stop: a NaN loss at step 6 on rank 0 stops every rank with the step and the
    value; step 4 stays the checkpoint to resume from, complete (the resumes after the other
    faults show that such a checkpoint gives the uninterrupted losses)."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_NAN_STEPS": "6"}
    code, seconds, log = run(kind, out, text_file, ["--nan_policy", "stop"], env, fault_step=6)
    assert code == 1 and seconds < EXIT_BOUND_S, log[-3000:]
    assert "error: step 6: the loss is nan on some rank, 1 bad step(s) in a row" in log
    assert max(logged_steps(out / "metrics.jsonl")) == 6
    assert latest(out) == "step4" and tags(out) == ["step4"]
    assert is_complete(out / "checkpoints" / "step4")
    report("NaN loss, --nan_policy stop", kind, seconds, code, "step4 (complete)", "-")


def test_nan_steps_are_skipped_until_too_many_in_a_row(tmp_path, text_file):
    """ZeRO-0 fp32 (where DeepSpeed steps the torch optimizer itself): the update of a NaN step is
    not applied (the weights saved after it equal those before, the LR holds); a finite step
    resets the count; the third bad step in a row stops the run (after its save: the weights are
    finite)."""
    out = tmp_path / "run"
    zero0 = ["--deepspeed", str(REPO / "ds_configs/zero0.json")]
    extra = [*zero0, "--save_steps", "1", "--save_total_limit", "10", "--max_bad_steps", "3"]
    env = {"DRAGON_FAULT_NAN_STEPS": "2,4,5,6"}
    code, seconds, log = run("zero2", out, text_file, extra, env, fault_step=6)
    assert code == 1 and seconds < EXIT_BOUND_S, log[-3000:]
    assert "step 2: the loss is nan on some rank; the update was skipped (1 of at most 3" in log
    assert "error: step 6: the loss is nan on some rank, 3 bad step(s) in a row" in log
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl")}
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    assert metrics[2]["lr"] == metrics[1]["lr"] and metrics[3]["lr"] > metrics[2]["lr"]
    saved = {s: model_from_checkpoint(out / "checkpoints" / f"step{s}") for s in (1, 2, 6)}
    weights = {s: model.state_dict() for s, model in saved.items()}
    for name, value in weights[1].items():
        assert torch.equal(value, weights[2][name]), name  # step 2's update was skipped
        assert torch.isfinite(weights[6][name]).all()  # steps 4-6 skipped: still finite
    assert latest(out) == "step6"
    report("NaN at steps 2, 4-6, skip", "zero0", seconds, code, "step6 (finite)", "-")


@pytest.mark.parametrize("kind", ["zero2", "pipeline"])
def test_a_failed_save_on_one_rank(kind, tmp_path, tmp_path_factory, text_file):
    """Rank 1 cannot write the step-8 save (ENOSPC). zero2 (--save_failure stop): every rank stops
    with the failing rank named, `latest` still names step 4, the half-written step 8 is gone, and
    the run resumes exactly. pipeline (--save_failure continue): it trains on and the next save
    succeeds."""
    out = tmp_path / "run"
    env = {"DRAGON_FAULT_SAVE_STEP": "8", "DRAGON_FAULT_RANK": "1"}
    if kind == "zero2":
        reference = uninterrupted(kind, tmp_path_factory, text_file)
        code, seconds, log = run(kind, out, text_file, env=env, fault_step=8)
        assert code == 1 and seconds < EXIT_BOUND_S, log[-3000:]
        assert "error: step 8: saving step8 in" in log
        assert "failed on rank 1 ([Errno 28] No space left on device" in log
        assert latest(out) == "step4" and tags(out) == ["step4"]
        resume_matches(kind, out, text_file, reference, after=4)
        report("rank 1's save fails, stop", kind, seconds, code, "step4", "equal from step 5")
    else:
        code, seconds, log = run(kind, out, text_file, ["--save_failure", "continue"], env)
        assert code == 0, log[-3000:]
        assert "failed on rank 1" in log and "training on, the next save retries" in log
        assert latest(out) == f"step{STEPS}" and "step8" not in tags(out)
        assert (out / "final" / "model.safetensors").exists()
        report("rank 1's save fails, continue", kind, seconds, code, f"step{STEPS}", "-")


def signal_after(proc, metrics, target, sig, at_step=5, ranks=2) -> float:
    """After `at_step` is logged, send `sig` to the launcher or to its last rank (found before,
    so the signal lands at once); returns when it was sent."""
    pid = proc.pid if target == "launcher" else None
    while pid is None or max(logged_steps(metrics), default=0) < at_step:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        if pid is None and len(found := ranks_of(proc.pid)) == ranks:
            pid = found[-1]
        time.sleep(0.005)
    os.kill(pid, sig)
    return time.time()


def signal_when(proc, metrics, target, sig, at_step=5):
    """signal_after, then the seconds until the job ended."""
    sent = signal_after(proc, metrics, target, sig, at_step)
    proc.wait(timeout=600)
    return time.time() - sent


def ranks_of(launcher_pid: int) -> list[int]:
    """The recipe processes below a launcher, by pid."""

    def is_recipe(pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                args = f.read().split("\0")
        except OSError:
            return False
        # `python [-u] recipes/x.py ...`, not a launcher whose arguments name the recipe
        scripts = [i for i, a in enumerate(args) if "/recipes/" in a and a.endswith(".py")]
        return bool(scripts) and all(a in (args[0], "-u") for a in args[: scripts[0]])

    return sorted(p for p in descendants(launcher_pid)[1:] if is_recipe(p))


@pytest.mark.parametrize(
    "kind,target,sig",
    [
        ("zero2", "rank", signal.SIGTERM),
        pytest.param("pipeline", "launcher", signal.SIGINT, marks=pytest.mark.slow),
    ],
)
def test_preemption_saves_and_resumes_exactly(
    kind, target, sig, tmp_path, tmp_path_factory, text_file
):
    """SIGTERM to one rank (as slurm sends it) or SIGINT to the launcher (which forwards it):
    every rank agrees after the step, saves it, says so and exits 0; the resume equals the
    uninterrupted run. A launcher that was itself signalled exits 1, as torchrun does."""
    reference = uninterrupted(kind, tmp_path_factory, text_file)
    out = tmp_path / "run"
    proc = start(kind, out, text_file, STEPS, RESUMABLE)
    seconds = signal_when(proc, out / "metrics.jsonl", target, sig)
    log = proc.stdout.read() + proc.stderr.read()
    assert seconds < EXIT_BOUND_S
    # torchrun stops its workers on a signal of its own, then re-raises it as an exception: 1
    assert proc.returncode == (1 if target == "launcher" else 0), log[-3000:]
    saved = int(latest(out)[4:])
    assert 5 <= saved < STEPS and is_complete(out / "checkpoints" / latest(out))
    assert f"preempted ({sig.name} to " in log and f"saved step {saved}" in log
    assert max(logged_steps(out / "metrics.jsonl")) == saved
    resume_matches(kind, out, text_file, reference, after=saved)
    fault = f"{sig.name} to {'the launcher' if target == 'launcher' else 'rank 1'}"
    report(fault, kind, seconds, proc.returncode, f"step{saved}", f"equal from step {saved + 1}")


@pytest.mark.slow
@pytest.mark.parametrize("kind,launcher", [("zero2", "deepspeed"), ("pipeline", "torchrun")])
def test_a_dead_rank_ends_the_job(kind, launcher, tmp_path, text_file):
    """SIGKILL of rank 1 after step 5: the launcher ends the job non-zero within seconds (no
    survivor waits in a collective for the timeout), and step 4 stays complete (a resume from
    such a checkpoint gives the uninterrupted losses: test_checkpoints' SIGKILL test)."""
    out = tmp_path / "run"
    proc = start(kind, out, text_file, STEPS, RESUMABLE, launcher=launcher)
    seconds = signal_when(proc, out / "metrics.jsonl", "rank", signal.SIGKILL)
    log = proc.stdout.read() + proc.stderr.read()
    assert proc.returncode != 0 and seconds < EXIT_BOUND_S, log[-3000:]
    # deepspeed's launcher polls its ranks once a second and names the first failed one it meets:
    # the killed rank (-9) or a survivor whose collective broke (1); torchrun lists every failure
    reported = r"exits with return code = (-9|1)\b" if launcher == "deepspeed" else "exitcode  : -9"
    assert re.search(reported, log), log[-3000:]
    saved = latest(out)  # step 4, unless the job outran the kill
    assert int(saved[4:]) % 4 == 0 and int(saved[4:]) < STEPS
    assert is_complete(out / "checkpoints" / saved)
    fault = f"SIGKILL of rank 1 ({launcher})"
    report(fault, kind, seconds, proc.returncode, f"{saved} (complete)", "-")


def island_losses(out, island) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(out / f"island{island}" / "metrics.jsonl")
            if "loss" in m}


def island_latest(out, island) -> str:
    return (out / f"island{island}" / "checkpoints" / "latest").read_text().strip()


def diloco_reference(tmp_path_factory, text_file) -> list[dict[int, float]]:
    if not _diloco:
        out = tmp_path_factory.mktemp("uninterrupted_diloco")
        code, _, log = run("zero2", out, text_file, DILOCO)
        assert code == 0, log[-3000:]
        _diloco.extend(island_losses(out, i) for i in (0, 1))
    return _diloco


def start_island(island, out, text_file, store, extra=()):
    """Island `island` of two as a launch of its own (one rank), meeting the other at `store`."""
    script, args = recipe_args("zero2", out, text_file, STEPS, [*RESUMABLE, *DILOCO])
    args += ["--diloco_island_index", str(island), "--diloco_store", store, *extra]
    return subprocess.Popen(
        launch_command("torchrun", 1, script, args),
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_preempting_one_island_saves_every_island_at_the_outer_step(
    tmp_path, tmp_path_factory, text_file
):
    """DiLoCo, 2 islands of 1 rank, H=4: SIGTERM to island 1 after step 5; both islands save at
    the next outer step (8) and exit 0, and resume to the uninterrupted run's losses."""
    reference = diloco_reference(tmp_path_factory, text_file)
    out = tmp_path / "run"
    proc = start("zero2", out, text_file, STEPS, [*RESUMABLE, *DILOCO])
    seconds = signal_when(proc, out / "island1" / "metrics.jsonl", "rank", signal.SIGTERM)
    log = proc.stdout.read() + proc.stderr.read()
    assert proc.returncode == 0 and seconds < EXIT_BOUND_S, log[-3000:]
    assert [island_latest(out, i) for i in (0, 1)] == ["step8", "step8"]
    assert "preempted (SIGTERM to " in log and "saved step 8" in log
    code, _, log = run("zero2", out, text_file, [*DILOCO, "--resume_from_checkpoint", "latest"])
    assert code == 0, log[-3000:]
    for i in (0, 1):
        resumed = island_losses(out, i)
        steps = range(9, STEPS + 1)
        assert [resumed[s] for s in steps] == [reference[i][s] for s in steps]
    report("SIGTERM to island 1", "DiLoCo zero2", seconds, 0, "step8, both", "equal from step 9")


@pytest.mark.slow
def test_a_dead_island_stops_the_other_at_the_outer_step(tmp_path, tmp_path_factory, text_file):
    """Islands as separate launches (where no launcher ends the survivor): SIGKILL of island 1's
    rank after its step 5; island 0 stops at the next outer step (8) within seconds, naming
    island 1, and both resume from their last common checkpoint to the uninterrupted losses."""
    reference = diloco_reference(tmp_path_factory, text_file)
    out, store = tmp_path / "run", f"127.0.0.1:{free_port()}"
    procs = [start_island(i, out, text_file, store) for i in (0, 1)]
    metrics = out / "island1" / "metrics.jsonl"
    sent = signal_after(procs[1], metrics, "rank", signal.SIGKILL, ranks=1)
    procs[0].wait(timeout=600)
    seconds = time.time() - sent
    procs[1].wait(timeout=600)
    code, log = procs[0].returncode, procs[0].stdout.read() + procs[0].stderr.read()
    assert code != 0 and seconds < EXIT_BOUND_S, log[-3000:]
    assert "island 1 did not reach this outer step (" in log
    saved = island_latest(out, 0)  # step 4, unless island 1 outran the kill
    assert island_latest(out, 1) == saved and int(saved[4:]) < STEPS
    store = f"127.0.0.1:{free_port()}"
    resume = ["--resume_from_checkpoint", "latest"]
    procs = [start_island(i, out, text_file, store, resume) for i in (0, 1)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    after = int(saved[4:])
    for i in (0, 1):
        resumed = island_losses(out, i)
        steps = range(after + 1, STEPS + 1)
        assert [resumed[s] for s in steps] == [reference[i][s] for s in steps]
    fault, resumed = "SIGKILL of island 1 (own launch)", f"equal from step {after + 1}"
    report(fault, "DiLoCo zero2", seconds, code, f"{saved}, both", resumed)
