"""One run per output directory at a time (dragon.run.lock), with real 2-rank jobs."""

import json
import os
import socket
import subprocess
import time

import pytest

from conftest import REPO, STEPS, TINY, bad_input_base, free_port, job_env, launch_command, \
    read_jsonl, run_recipe_in_process


def job(out, text_file, **env) -> subprocess.Popen:
    args = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY]
    return subprocess.Popen(launch_command("torchrun", 2, "recipes/pretrain.py", args), cwd=REPO,
                            env=job_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_runs_started_together_in_one_directory(tmp_path, text_file):
    """A scheduler that launches a job twice: one run is refused in one line naming the other
    (host and pid); the other trains every step once and keeps its checkpoints; the lock is gone
    when it ends. Both wait at the lock until both are there (a busy machine starts one late),
    and the one that trains holds its step-4 save until the other has ended."""
    out, at_lock, release = tmp_path / "run", tmp_path / "at_lock", tmp_path / "release"
    hold = dict(DRAGON_FAULT_HOLD_LOCK=str(at_lock), DRAGON_FAULT_HOLD_SAVE_STEP="4",
                DRAGON_FAULT_RELEASE=str(release))
    jobs = [job(out, text_file, **hold), job(out, text_file, **hold)]
    deadline = time.monotonic() + 300  # two runs past the lock would both hold for ever

    def wait_for(condition) -> None:  # or for a job's end
        while not condition() and all(p.poll() is None for p in jobs) \
                and time.monotonic() < deadline:
            time.sleep(0.05)

    wait_for(lambda: len(list(tmp_path.glob("at_lock.*"))) == 2)
    at_lock.touch()  # both race for the lock now
    wait_for(lambda: False)  # until one of them ends: the refused one
    release.touch()
    results = [(p.wait(timeout=600), p.stdout.read() + p.stderr.read()) for p in jobs]
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


def test_nodes_that_do_not_share_the_output_dir_are_refused(tmp_path, text_file):
    """Two torchrun "nodes" (--nnodes 2, one rank each); node 1 runs in a mount namespace of its
    own where the output directory's parent is another, empty directory, as a node-local disk
    would be. Both nodes stop before the model is built, with one line naming the rank that cannot
    see what rank 0 writes."""
    shared, local = tmp_path / "shared", tmp_path / "node1_disk"
    shared.mkdir()
    local.mkdir()
    out = shared / "run"
    args = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY]
    port = str(free_port())

    def node(i):
        torchrun = ["torchrun", "--nnodes", "2", "--node_rank", str(i), "--nproc_per_node", "1",
                    "--master_addr", "127.0.0.1", "--master_port", port,
                    "recipes/pretrain.py", *args]
        if i == 1:  # `unshare -m` makes the mount private to this node's processes
            script = f'mount --bind "{local}" "{shared}" && exec "$@"'
            torchrun = ["unshare", "-m", "sh", "-c", script, "node1", *torchrun]
        return subprocess.Popen(torchrun, cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    nodes = [node(0), node(1)]
    logs = [p.communicate(timeout=300) for p in nodes]
    assert all(p.returncode != 0 for p in nodes), [err[-2000:] for _, err in logs]
    errors = [line for line in logs[0][0].splitlines() + logs[0][1].splitlines()
              if line.startswith("error:")]
    assert len(errors) == 1, logs[0][1][-3000:]
    assert errors[0].startswith(f"error: --output_dir {out}: rank 1 on ")
    assert "does not see the files rank 0 writes there" in errors[0]
    assert not (local / "run" / "metrics.jsonl").exists()
    assert not (out / "metrics.jsonl").exists()


def test_another_hosts_lock_is_broken_only_by_break_lock(monkeypatch, tmp_path, text_file, caplog):
    """A lock held on another host (whose process this host cannot see) refuses the run in one
    line naming --break_lock; with it the run takes the lock over, saying so."""
    from dragon.run.lock import take_run_lock

    out = tmp_path / "run"
    out.mkdir()
    theirs = {"host": "elsewhere", "pid": 1, "started": 0}
    (out / "dragon.lock").write_text(json.dumps(theirs))
    message = run_recipe_in_process(monkeypatch, "recipes/pretrain.py",
                                    bad_input_base("zero2.json", out, text_file))
    assert "another run is using it (pid 1 on elsewhere" in message
    assert message.endswith("or pass --break_lock if that run is gone"), message
    assert json.loads((out / "dragon.lock").read_text()) == theirs
    with caplog.at_level("WARNING", logger="dragon"):
        take_run_lock(str(out), break_lock=True)
    assert "taking over the lock of pid 1 on elsewhere" in caplog.text and "--break_lock" in \
        caplog.text
    assert json.loads((out / "dragon.lock").read_text())["pid"] == os.getpid()


LOCAL = ["--checkpoint_storage", "local"]
KEEP_SHARED = "; keep the checkpoints on storage every node shares (--checkpoint_storage shared)"
DILOCO = ["--diloco_islands", "2", "--diloco_inner_steps", "2"]


@pytest.mark.parametrize("recipe, config, extra, env, refused", [
    ("recipes/pretrain_pipeline.py", "pipeline_zero0.json", [*LOCAL, "--pipeline_stages", "2"],
     {"WORLD_SIZE": "2"}, "--checkpoint_storage local: the pipeline recipe's export reads every "
     "stage's files from one directory" + KEEP_SHARED),
    ("recipes/pretrain.py", "zero2.json", [*LOCAL, *DILOCO], {"WORLD_SIZE": "2"},
     "--checkpoint_storage local: each DiLoCo island already keeps its own directory "
     "(island<i>/): run one island per node with --diloco_island_index" + KEEP_SHARED),
    ("recipes/pretrain_accelerate.py", "zero2.json", LOCAL, {},
     "recipes/pretrain_accelerate.py: not with --checkpoint_storage local (save_state writes "
     "every node's files into one directory); recipes/pretrain.py takes it"),
    ("recipes/pretrain.py", "zero2.json", ["--checkpoint_storage", "nfs"], {},
     "--checkpoint_storage='nfs': valid are shared, local"),
    ("recipes/pretrain.py", "zero2.json", ["--checkpoint_copy_to", "nope://bucket/run"], {},
     "--checkpoint_copy_to nope://bucket/run: fsspec cannot open it (Protocol not known: nope)"),
], ids=["pipeline", "diloco", "accelerate", "unknown", "bad-store"])
def test_storage_a_recipe_cannot_keep_is_refused(monkeypatch, tmp_path, text_file, recipe,
                                                 config, extra, env, refused):
    """--checkpoint_storage local and --checkpoint_copy_to are refused in one line before any
    work where a recipe keeps files that one directory must hold, or the store cannot open."""
    line = run_recipe_in_process(monkeypatch, recipe, [
        *bad_input_base(config, tmp_path / "run", text_file), *extra], env)
    assert line == f"error: {refused}"
    assert not (tmp_path / "run" / "checkpoints").exists()
