"""Real storage faults. A full disk: a run whose output directory is a small tmpfs (mounted here;
CI runs as root) stops at the save that does not fit with one line that says so, loses nothing,
and resumes exactly once there is room. Damaged files: a complete checkpoint whose files were cut
later is never loaded; a resume falls back to the newest whole one, and the offline verifier finds
it."""

import re
import shutil
import subprocess
import time

import pytest
from conftest import (REPO, STEPS, TINY, job_env, launch, launch_command, losses, read_jsonl,
                      run_tool)

from dragon.checkpoint.catalog import MARKER

DISK = "1200k"  # a checkpoint of the tiny model is ~700 KB: step 4 fits, step 8 does not


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here (the test needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def recipe_args(out, text_file, extra=()) -> list[str]:
    return ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY, *extra]


def test_a_full_disk_stops_in_one_line_and_resumes_exactly(small_disk, runs, tmp_path,
                                                           text_file):
    out = small_disk / "run"
    proc = launch("torchrun", 2, "recipes/pretrain.py", recipe_args(out, text_file))
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: step {STEPS}: saving step{STEPS} in "), errors
    assert "No space left on device" in errors[0] and "bytes free" in errors[0], errors
    assert errors[0].endswith(f"last complete checkpoint: {out / 'checkpoints' / 'step4'}")
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step4"
    assert not (checkpoints / f"step{STEPS}").exists()  # the partial save is gone
    bigger = tmp_path / "bigger"  # room again: the run's directory on a disk with space
    shutil.copytree(out, bigger)
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  recipe_args(bigger, text_file, ["--resume_from_checkpoint", "latest"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, reference, _ = runs("zero2")
    resumed = [m for m in read_jsonl(bigger / "metrics.jsonl") if m["step"] > 4][-(STEPS - 4):]
    assert losses(resumed) == losses(reference)[4:]


def test_a_disk_full_during_a_background_write_stops_in_one_line(small_disk, text_file):
    """--save_async: the step-8 save's files do not fit; the writer process's failure reaches every
    rank at the next step's poll (or the last step's wait), which stops them in one line; `latest`
    keeps naming step4 and the partial step8 is gone."""
    out = small_disk / "run"
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  recipe_args(out, text_file, ["--save_async", "--max_steps", "10"]))
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert re.match(r"error: step (9|10): saving step8 in ", errors[0]), errors
    assert "No space left on device" in errors[0] and "bytes free" in errors[0], errors
    assert errors[0].endswith(f"last complete checkpoint: {out / 'checkpoints' / 'step4'}")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step4"
    assert not (out / "checkpoints" / "step8").exists()


def damaged_copy(runs, tmp_path, file: str):
    """A copy of the shared 2-rank ZeRO-2 run (step4 and step8, both complete) whose step8 `file`
    is cut to half its length, as a partial copy or a bad disk leaves it."""
    out = tmp_path / "run"
    shutil.copytree(runs("zero2")[0], out)
    victim = out / "checkpoints" / f"step{STEPS}" / file
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return out


def verify(run_dir, *extra) -> subprocess.CompletedProcess:
    return run_tool("recipes/verify_checkpoints.py", "--run", run_dir, *extra)


def test_a_truncated_model_states_file_falls_back_and_resumes_exactly(runs, tmp_path, text_file):
    """`latest` names step8, whose model-states file lost its second half: the resume says so in
    one line, takes step4, and from there the losses equal the uninterrupted run's."""
    out = damaged_copy(runs, tmp_path, "mp_rank_00_model_states.pt")
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  recipe_args(out, text_file, ["--resume_from_checkpoint", "latest"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "step8 is damaged (mp_rank_00_model_states.pt holds " in log, log[-3000:]
    assert "falling back to the newest whole checkpoint step4" in log
    _, reference, _ = runs("zero2")
    resumed = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 4][-(STEPS - 4):]
    assert [m["step"] for m in resumed] == list(range(5, STEPS + 1))
    assert losses(resumed) == losses(reference)[4:]


def test_a_truncated_optimizer_shard_is_refused_by_name_and_found_offline(runs, tmp_path,
                                                                          text_file):
    """Rank 1's optimizer shard of step8 is cut: naming step8 is refused in one line before any
    work; the offline verifier finds it (exit 1) and says a resume takes step4."""
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    out = damaged_copy(runs, tmp_path, shard)
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  recipe_args(out, text_file, ["--resume_from_checkpoint", f"step{STEPS}"]))
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"step{STEPS} is damaged ({shard} holds " in errors[0], errors
    assert not any(m["step"] > STEPS for m in read_jsonl(out / "metrics.jsonl"))
    checked = verify(out)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert lines[0] == f"{out / 'checkpoints' / 'step4'}: whole"
    assert lines[1].startswith(f"{out / 'checkpoints' / f'step{STEPS}'}: damaged: {shard} holds ")
    assert lines[2] == f"a resume takes {out / 'checkpoints' / 'step4'}"


def test_the_verifier_checks_every_byte(runs, tmp_path):
    """A flipped byte keeps the size: only the CRC-32 finds it (sizes alone say whole)."""
    out = tmp_path / "run"
    shutil.copytree(runs("zero2")[0], out)
    assert verify(out).returncode == 0  # every checksum a rank or the marker's writer recorded
    victim = out / "checkpoints" / "step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert verify(out, "--no_checksums").returncode == 0
    checked = verify(out)
    assert checked.returncode == 1
    assert f"step4: damaged: {victim.name} fails its CRC-32 check" in checked.stdout


def fill(mount) -> None:
    """Take every free byte of the disk at `mount`."""
    with open(mount / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(2**16))
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("when", ["metrics", "export"])
def test_a_disk_that_fills_mid_run_stops_in_one_line(when, small_disk, text_file):
    """Another process takes the disk's last byte once the run has written its run files (before
    its first metrics line) or once its last checkpoint is complete: the first metrics append, or
    the final export, fails on rank 0, and every rank stops with one line naming the path, the
    cause and the bytes free; the checkpoint saved before stays the one a resume takes."""
    out = small_disk / "run"
    extra = ["--save_steps", str(STEPS)] if when == "export" else []
    proc = subprocess.Popen(launch_command("torchrun", 2, "recipes/pretrain.py",
                                           recipe_args(out, text_file, extra)),
                            cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ready = out / "checkpoints" / (f"step{STEPS}/{MARKER}" if when == "export" else "run.json")
    while proc.poll() is None and not ready.exists():
        time.sleep(0.005)
    fill(small_disk)
    stdout, stderr = proc.communicate(timeout=600)
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, stderr[-3000:]
    if when == "metrics":
        assert errors[0].startswith("error: step 1: saving step 1's metrics failed on rank 0")
        assert f"writing {out / 'metrics.jsonl'}" in errors[0], errors
        assert errors[0].endswith("last complete checkpoint: none"), errors
    else:
        assert f"saving the export to {out / 'final'} failed on rank 0" in errors[0], errors
        assert f"the trained weights are in {out / 'checkpoints' / f'step{STEPS}'}" in errors[0]
    assert "No space left on device" in errors[0] and "bytes free" in errors[0], errors
