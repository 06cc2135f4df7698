"""Checkpoints through the recipes: retention on real saves, SIGKILL + exact resume, a crash mid-
save.
"""

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import CARRY, REPO, TINY, job_env, launch_command, losses, read_jsonl

from dragon.checkpoint.catalog import is_complete

RECIPES = {
    "zero2": ("recipes/pretrain.py", ["--deepspeed", str(REPO / "ds_configs/zero2.json")]),
    "pipeline": (
        "recipes/pretrain_pipeline.py",
        [
            "--deepspeed",
            str(REPO / "ds_configs/pipeline_zero0.json"),
            "--pipeline_stages",
            "2",
            "--gradient_accumulation_steps",
            "2",
        ],
    ),
    # the neurons of every head split over the 2 ranks (tests/test_neurons.py)
    "neurons": ("recipes/pretrain.py", ["--deepspeed", str(REPO / "ds_configs/zero2.json"),
                                        "--neuron_parallel", "2"]),
    # under `accelerate launch` with launch/accelerate/zero2.yaml (ds_configs/zero2.json), its
    # metrics also in accelerate's TensorBoard tracker
    "accelerate": ("recipes/pretrain_accelerate.py", ["--report_to", "tensorboard"]),
}


def recipe_args(kind, out, text_file, steps, extra=()):
    script, base = RECIPES[kind]
    return script, [
        *base,
        "--output_dir",
        out,
        "--train_file",
        text_file,
        "--max_steps",
        steps,
        "--per_device_train_batch_size",
        "4",
        *TINY,
        "--dropout",
        "0.1",
        *extra,
    ]


def start(kind, out, text_file, steps, extra=(), env=None, launcher="torchrun"):
    """A 2-rank job in the background; `env` adds variables (the fault hooks)."""
    script, args = recipe_args(kind, out, text_file, steps, extra)
    if kind == "accelerate":
        launcher, args = "accelerate", ["zero2.yaml", *args]
    return subprocess.Popen(
        launch_command(launcher, 2, script, args),
        cwd=REPO,
        env=job_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc, timeout=600):
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-4000:]
    return stdout, stderr


def tags(out):
    return sorted(
        (p.name for p in (out / "checkpoints").iterdir() if p.is_dir()), key=lambda n: int(n[4:])
    )


def logged_steps(path, having: str = "step") -> set[int]:
    """Steps of the rows that hold `having` in a metrics file that is being written (a torn last
    line is ignored)."""
    steps = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if having in row:
                steps.add(row["step"])
    return steps


def kill_when(proc, condition, then=None, until=None, timeout=300):
    """Wait for condition(); optionally do then() and wait for until(); SIGKILL the whole job."""
    deadline = time.time() + timeout
    for check in (condition, until):
        while check is not None and not check():
            assert proc.poll() is None, (
                f"job ended before the kill point:\n{proc.stderr.read()[-3000:]}"
            )
            assert time.time() < deadline, "kill point never reached"
            time.sleep(0.005)
        if check is condition and then is not None:
            then()
    time.sleep(0.5 if until else 0)  # let the other rank reach DeepSpeed's barrier too
    kill_tree(proc.pid)
    proc.wait()


def descendants(pid: int) -> list[int]:
    """pid and every process below it (torchrun starts ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(stat))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process below it at once."""
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("kind", ["zero2", "pipeline"])
def test_retention_keeps_last_k_and_the_best(kind, tmp_path, text_file):
    """8 saves, K=2, best = highest loss (one of the first steps): it, step7 and step8 stay."""
    out = tmp_path / kind
    finish(
        start(
            kind,
            out,
            text_file,
            8,
            [
                "--save_steps",
                "1",
                "--save_total_limit",
                "2",
                "--metric_for_best_model",
                "loss",
                "--greater_is_better",
            ],
        )
    )
    logged = read_jsonl(out / "metrics.jsonl")
    best = max(logged, key=lambda m: m["loss"])["step"]  # early in training, far outside the window
    assert best <= 3
    assert tags(out) == [f"step{best}", "step7", "step8"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step8"
    assert all(is_complete(out / "checkpoints" / t) for t in tags(out))
    # latest loads: continue 2 more steps from it
    finish(
        start(kind, out, text_file, 10, ["--save_steps", "1", "--resume_from_checkpoint", "latest"])
    )
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")][-2:] == [9, 10]
    # resumed with the default policy (best eval_loss, at step 8 or 10): the old best is gone
    assert tags(out)[-2:] == ["step9", "step10"] and "step1" not in tags(out)


# The runs that kills, faults and preemptions resume to: 12 steps, a save every 4, carried states.
STEPS = 12
RESUMABLE = ["--save_steps", "4", *CARRY]
SLOWED = {"DRAGON_FAULT_STEP_SECONDS": "0.1"}  # a job to be killed between two steps
_uninterrupted: dict = {}


def uninterrupted(kind, tmp_path_factory, text_file) -> list[float]:
    """The per-step losses of the uninterrupted run of `kind`, made once."""
    return losses(uninterrupted_run(kind, tmp_path_factory, text_file)[1])


def uninterrupted_run(kind, tmp_path_factory, text_file):
    """(output dir, metrics) of the uninterrupted run of `kind`, made once."""
    if kind not in _uninterrupted:
        out = tmp_path_factory.mktemp(f"uninterrupted_{kind}")
        finish(start(kind, out, text_file, STEPS, RESUMABLE))
        _uninterrupted[kind] = out, read_jsonl(out / "metrics.jsonl")
    return _uninterrupted[kind]


def tag_dir(kind, out, step: int):
    """Where a recipe's checkpoint of `step` keeps its files (accelerate: in its model's tag)."""
    if kind == "accelerate":
        return out / "checkpoints" / f"checkpoint_{step}" / "pytorch_model"
    return out / "checkpoints" / f"step{step}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero2", "pipeline", "accelerate"])
def test_sigkill_then_resume_matches_uninterrupted(kind, tmp_path, tmp_path_factory, text_file):
    """Killed between checkpoints, resumed from latest: the same per-step losses (bit-equal):
    model, optimizer, LR schedule, data position and RNG came back, and with --carry_state the
    rows' states too (zero states would differ); the accelerate recipe through
    accelerator.save_state and load_state. metrics.jsonl then holds the uninterrupted run's rows,
    each step once; the rows the resume replaced are in metrics.replaced.jsonl, TensorBoard
    (DeepSpeed's monitor) holds each step's loss once, and wandb (offline; DeepSpeed's monitor or
    accelerate's tracker) logs the resume into the first start's run."""
    steps, extra = STEPS, RESUMABLE
    expected_out, expected_rows = uninterrupted_run(kind, tmp_path_factory, text_file)
    board = {"zero2": ["--report_to", "tensorboard,wandb"], "accelerate": ["--report_to", "wandb"],
             "pipeline": ["--report_to", "tensorboard"]}[kind]
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}

    out = tmp_path / "killed"
    metrics = out / "metrics.jsonl"
    # Between the step-4 save and the step-8 save; its steps slowed so that a busy machine's
    # late look at the metrics still kills it before step 8.
    proc = start(kind, out, text_file, steps, [*extra, *board], env={**offline, **SLOWED})
    kill_when(proc, lambda: max(logged_steps(metrics), default=0) >= 6)
    done = max(logged_steps(metrics))
    assert done < 8, "killed too late"
    assert (tag_dir(kind, out, 4) / "carried_state_0.pt").exists()
    finish(start(kind, out, text_file, steps,
                 [*extra, *board, "--resume_from_checkpoint", "latest"], env=offline))
    records = read_jsonl(metrics)
    # Same ranks, same data position, RNG and optimizer state: identical, not merely close.
    assert [(m["step"], sorted(m)) for m in records] == [
        (m["step"], sorted(m)) for m in expected_rows]
    assert losses(records) == losses(expected_rows)
    replaced = read_jsonl(out / "metrics.replaced.jsonl")
    assert sorted({m["step"] for m in replaced}) == list(range(5, done + 1)), replaced
    assert all("replaced_at" in m for m in replaced)
    if "tensorboard" in board[1]:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "monitor" / "bdh"))
        events.Reload()
        assert [e.step for e in events.Scalars("dragon/loss")] == list(range(1, steps + 1))
    if "wandb" in board[1]:  # offline-run-<time>-<id>: two starts, one run
        starts = sorted((out / "monitor" / "wandb").glob("offline-run-*"))
        assert len(starts) == 2 and len({p.name.rsplit("-", 1)[1] for p in starts}) == 1, starts


@pytest.mark.slow
def test_auto_is_one_command_line_for_a_first_start_and_a_restart(tmp_path, tmp_path_factory,
                                                                   text_file):
    """--resume_from_checkpoint auto: in an empty directory it says it starts fresh and trains;
    the same command after a SIGKILL resumes from the last complete checkpoint, and the losses
    are the uninterrupted run's (bit-equal)."""
    expected = uninterrupted("zero2", tmp_path_factory, text_file)
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    command = [*RESUMABLE, "--resume_from_checkpoint", "auto"]
    proc = start("zero2", out, text_file, STEPS, command)
    kill_when(proc, lambda: max(logged_steps(metrics), default=0) >= 6)
    assert "--resume_from_checkpoint auto: no complete checkpoint under" in proc.stdout.read() + (
        proc.stderr.read())
    assert max(logged_steps(metrics)) < STEPS, "killed too late"
    first = [m["loss"] for m in read_jsonl(metrics)]
    assert first == expected[: len(first)]
    stdout, stderr = finish(start("zero2", out, text_file, STEPS, command))
    assert f"resumed from {out / 'checkpoints' / 'step4'} at step 4" in stdout + stderr
    resumed = [m for m in read_jsonl(metrics) if m["step"] > 4][-(STEPS - 4):]
    assert [m["step"] for m in resumed] == list(range(5, STEPS + 1))
    assert [m["loss"] for m in resumed] == expected[4:]


def test_crash_during_a_save_leaves_previous_checkpoint(tmp_path, text_file):
    """Killed while DeepSpeed writes the step-8 checkpoint: step 4 stays the one to resume from,
    and the half-written step 8 is removed by the next successful prune."""
    out = tmp_path / "run"
    metrics, tag8 = out / "metrics.jsonl", out / "checkpoints" / "step8"
    proc = start("zero2", out, text_file, 12, ["--save_steps", "4"])
    kill_when(
        proc,
        lambda: 5 in logged_steps(metrics),
        then=lambda: (
            # A FIFO with no reader blocks DeepSpeed's write of this file: the job is caught mid-
            # save.
            tag8.mkdir(parents=True),
            os.mkfifo(tag8 / "mp_rank_00_model_states.pt"),
        ),
        until=lambda: all((tag8 / f"rng_state_{r}.pt").exists() for r in (0, 1)),
    )
    # What a real crash leaves: a file cut off mid-write and no completion marker.
    (tag8 / "mp_rank_00_model_states.pt").unlink()
    (tag8 / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut off")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step4"
    assert not is_complete(tag8) and is_complete(out / "checkpoints" / "step4")

    # Resume saving every 3 steps: the save at step 6 prunes the half-written step 8.
    finish(
        start(
            "zero2", out, text_file, 12, ["--save_steps", "3", "--resume_from_checkpoint", "latest"]
        )
    )
    assert [m["step"] for m in read_jsonl(metrics)][-8:] == list(range(5, 13))
    assert tags(out) == ["step9", "step12"]
