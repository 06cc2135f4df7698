"""A flipped byte keeps a file's size, so only its CRC-32 finds it: a resume recomputes the
checksums of the checkpoint it takes, falls back past a damaged one in one warning that names the
file, refuses a damaged tag named outright, and agrees with recipes/verify_checkpoints.py on the
checkpoint it takes."""

import shutil

import pytest
from conftest import REPO, TINY, launch, losses, read_jsonl, run_recipe_in_process
from test_disk import verify

SAVES = 3  # step4, step8, step12: the newest is damaged, the one before it is taken
STEPS = 4 * SAVES


def args(out, text_file, extra=()) -> list[str]:
    return ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--per_device_train_batch_size", "4", *TINY,
            "--max_steps", str(STEPS), "--save_total_limit", str(SAVES), *extra]


@pytest.fixture(scope="module")
def three_saves(tmp_path_factory, text_file):
    """An uninterrupted 2-rank ZeRO-2 run that keeps its three checkpoints, and its metrics."""
    out = tmp_path_factory.mktemp("three") / "run"
    proc = launch("torchrun", 2, "recipes/pretrain.py", args(out, text_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step12", "step4", "step8"], names
    return out, read_jsonl(out / "metrics.jsonl")


def flipped_copy(three_saves, tmp_path, file: str):
    """A copy of the run whose newest checkpoint's `file` has one byte flipped, same size."""
    out = tmp_path / "run"
    shutil.copytree(three_saves[0], out)
    victim = out / "checkpoints" / f"step{STEPS}" / file
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("file", ["mp_rank_00_model_states.pt",
                                  "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_flipped_byte_falls_back_and_continues_the_previous_checkpoint(three_saves, tmp_path,
                                                                          text_file, file):
    out = flipped_copy(three_saves, tmp_path, file)
    checked = verify(out)  # the offline verifier names the same checkpoint the resume takes
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"step{STEPS}: damaged: {file} fails its CRC-32 check" in checked.stdout
    assert f"a resume takes {out / 'checkpoints' / 'step8'}" in checked.stdout
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  args(out, text_file, ["--resume_from_checkpoint", "latest"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    warned = f"step{STEPS} is damaged ({file} fails its CRC-32 check)"
    assert warned in log, log[-3000:]
    assert "falling back to the newest whole checkpoint step8" in log
    resumed = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 8][-(STEPS - 8):]
    assert [m["step"] for m in resumed] == list(range(9, STEPS + 1))
    assert losses(resumed) == losses(three_saves[1])[8:]


@pytest.mark.slow
def test_a_flipped_byte_in_a_named_tag_is_refused_in_one_line(three_saves, tmp_path, text_file):
    file = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    out = flipped_copy(three_saves, tmp_path, file)
    proc = launch("torchrun", 2, "recipes/pretrain.py",
                  args(out, text_file, ["--resume_from_checkpoint", f"step{STEPS}"]))
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"step{STEPS} is damaged ({file} fails its CRC-32 check)" in errors[0], errors
    assert not any(m["step"] > STEPS for m in read_jsonl(out / "metrics.jsonl"))


@pytest.mark.slow
def test_a_run_whose_every_checkpoint_is_damaged_is_refused_naming_each(three_saves, tmp_path,
                                                                       text_file, monkeypatch):
    """A byte flipped in each of the three checkpoints: the refusal names every one and says
    that none is whole, not that nothing was saved."""
    file = "mp_rank_00_model_states.pt"
    out = flipped_copy(three_saves, tmp_path, file)
    for step in (4, 8):
        victim = out / "checkpoints" / f"step{step}" / file
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py",
                                 args(out, text_file, ["--resume_from_checkpoint", "auto"]))
    assert f"none of the 3 checkpoints in {out / 'checkpoints'} is whole: " in line, line
    for step in (12, 8, 4):
        assert f"step{step} is damaged ({file} fails its CRC-32 check)" in line, line
    assert "no complete checkpoint" not in line
