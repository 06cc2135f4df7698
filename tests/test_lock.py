"""One run per output directory at a time (dragon.run.lock), with real 2-rank jobs."""

import json
import socket
import subprocess

from conftest import REPO, STEPS, TINY, job_env, launch_command, read_jsonl


def job(out, text_file) -> subprocess.Popen:
    args = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY]
    return subprocess.Popen(launch_command("torchrun", 2, "recipes/pretrain.py", args), cwd=REPO,
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_runs_started_together_in_one_directory(tmp_path, text_file):
    """A scheduler that launches a job twice: one run is refused in one line naming the other
    (host and pid); the other trains every step once and keeps its checkpoints; the lock is gone
    when it ends."""
    out = tmp_path / "run"
    first, second = job(out, text_file), job(out, text_file)
    results = [(p.wait(timeout=600), p.stdout.read() + p.stderr.read()) for p in (first, second)]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] != 0, [log[-2000:] for _, log in results]
    refused = next(log for code, log in results if code != 0)
    errors = [line for line in refused.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another run is using it (pid " in errors[0], refused[-2000:]
    assert f"on {socket.gethostname()}" in errors[0]
    steps = [m["step"] for m in read_jsonl(out / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{STEPS}"
    assert not (out / "dragon.lock").exists()


def test_a_stale_lock_is_taken_over(tmp_path, text_file):
    """The lock of a run whose process is gone (same host, dead pid) is taken over, saying so."""
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock = {"host": socket.gethostname(), "pid": gone.pid, "started": 0}
    (out / "dragon.lock").write_text(json.dumps(lock))
    proc = job(out, text_file)
    code, log = proc.wait(timeout=600), proc.stdout.read() + proc.stderr.read()
    assert code == 0, log[-2000:]
    assert f"taking over the lock of pid {gone.pid}" in log and "its process is gone" in log
    assert not (out / "dragon.lock").exists()
