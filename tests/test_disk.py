"""A real full disk: a run whose output directory is a small tmpfs (mounted here; CI runs as
root) stops at the save that does not fit with one line that says so, loses nothing, and resumes
exactly once there is room."""

import shutil
import subprocess

import pytest
from conftest import REPO, STEPS, TINY, launch, losses, read_jsonl

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
