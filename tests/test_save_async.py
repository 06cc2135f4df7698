"""--save_async: saves written in the background by real 2-rank jobs. The step returns once the
save's states are copied into the rank's shared buffer for its writer process; a checkpoint is
marked (and `latest` moves) only once every rank's files are written. A fault hook (tests/faults:
DRAGON_FAULT_HOLD_SAVE_STEP) holds one save's writes, so that a write is in flight for as long as
a test needs. The full disk: tests/test_disk.py; the writer process alone:
tests/test_save_writer.py."""

import json
import os
import signal
import time

import pytest
import torch
from conftest import PIPE_X2, STEPS, losses, read_jsonl
from test_checkpoints import kill_tree, logged_steps, start
from test_faults import latest, ranks_of

from dragon.checkpoint.catalog import MARKER, is_complete
from dragon.checkpoint.verify import crc32_of

ASYNC = ["--save_async", "--dropout", "0.0", "--save_steps", "2"]


def marked_files(tag_dir) -> dict:
    return json.loads((tag_dir / MARKER).read_text())["files"]


def assert_same_checkpoint(ours, theirs) -> None:
    """The same files, each byte for byte on disk and as its marker records it (size, CRC-32), but
    the RNG files' Python and numpy generators: the recipes leave those unseeded, so they differ
    between any two runs."""
    mine, reference = marked_files(ours), marked_files(theirs)
    assert sorted(mine) == sorted(reference)
    assert sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file()) == sorted(
        [*mine, MARKER])
    for name in mine:
        assert mine[name] == [(ours / name).stat().st_size, crc32_of(str(ours / name))], name
        if name.startswith("rng_state_"):
            a, b = (torch.load(d / name, weights_only=False) for d in (ours, theirs))
            assert torch.equal(a["torch"], b["torch"]), name
        else:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def ranks(launcher_pid: int) -> list[int]:
    """The ranks below a launcher, not their writer processes (which run the same command)."""
    found = ranks_of(launcher_pid)
    return [pid for pid in found if parent(pid) not in found]


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_for_step(proc, metrics, step: int, timeout: float = 300) -> None:
    """Until `step`'s training row is logged (the job still running); a step that waits for the
    held write never gets there."""
    deadline = time.time() + timeout
    while max(logged_steps(metrics, "loss"), default=0) < step:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"step {step} never logged: the step waited for the write"
        time.sleep(0.01)


@pytest.mark.parametrize("name,kwargs", [
    ("zero2", {}),
    pytest.param("pipe_x2", PIPE_X2, marks=pytest.mark.slow),  # a 2-stage pipeline
])
def test_async_saves_are_the_synchronous_saves(runs, name, kwargs):
    """Losses, evaluations and both checkpoints of the shared synchronous run, byte for byte."""
    sync_out, sync_metrics, _ = runs(name, **kwargs)
    out, metrics, _ = runs(f"{name}_async", **{
        **kwargs, "extra": [*kwargs.get("extra", ()), "--save_async"]})
    assert losses(metrics) == losses(sync_metrics)
    assert losses(metrics, "eval_loss") == losses(sync_metrics, "eval_loss")
    assert latest(out) == f"step{STEPS}"
    for tag in ("step4", f"step{STEPS}"):
        assert_same_checkpoint(out / "checkpoints" / tag, sync_out / "checkpoints" / tag)


@pytest.mark.slow
def test_sigkill_during_a_background_write_resumes_the_previous_checkpoint(runs, tmp_path,
                                                                           text_file):
    """The step-4 save's writes are held; training goes on past it (the step did not wait for
    the files); a SIGKILL then leaves step2 as the resume point, and the resume's losses and last
    checkpoint equal the uninterrupted run's, bit for bit."""
    reference_out, reference, _ = runs("zero2")
    out = tmp_path / "run"
    proc = start("zero2", out, text_file, STEPS, ASYNC, env={"DRAGON_FAULT_HOLD_SAVE_STEP": "4"})
    wait_for_step(proc, out / "metrics.jsonl", 5)  # the step-4 write is still held
    kill_tree(proc.pid)
    proc.wait()
    checkpoints = out / "checkpoints"
    assert latest(out) == "step2" and is_complete(checkpoints / "step2")
    assert not is_complete(checkpoints / "step4")
    proc = start("zero2", out, text_file, STEPS, [*ASYNC, "--resume_from_checkpoint", "latest"])
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"resumed from {checkpoints / 'step2'} at step 2" in stdout + stderr
    resumed = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 2 and "loss" in m]
    assert [m["step"] for m in resumed] == list(range(3, STEPS + 1))
    assert losses(resumed) == losses(reference)[2:]
    assert_same_checkpoint(checkpoints / f"step{STEPS}", reference_out / "checkpoints" /
                           f"step{STEPS}")


@pytest.mark.slow
def test_a_preemption_during_a_background_write_saves_and_exits_0(tmp_path, text_file):
    """SIGTERM to a rank while the step-4 save's writes are held: once they go on, step 4
    completes, the preemption's save waits for it and for its own files, and the job exits 0."""
    out, release = tmp_path / "run", tmp_path / "release"
    proc = start("zero2", out, text_file, STEPS, ASYNC,
                 env={"DRAGON_FAULT_HOLD_SAVE_STEP": "4", "DRAGON_FAULT_RELEASE": str(release)})
    wait_for_step(proc, out / "metrics.jsonl", 5)
    os.kill(ranks(proc.pid)[-1], signal.SIGTERM)
    release.touch()
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    saved = int(latest(out)[4:])
    assert 5 <= saved < STEPS, saved
    assert f"saved step {saved}; continue with --resume_from_checkpoint latest" in stdout + stderr
    assert is_complete(out / "checkpoints" / "step4")
    assert is_complete(out / "checkpoints" / f"step{saved}")
    assert max(logged_steps(out / "metrics.jsonl")) == saved

