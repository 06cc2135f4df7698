"""launch/slurm.sh under a real Slurm (a one-node cluster of Debian's daemons, tests/slurm_cluster):
a named config trains and samples on 2 tasks, a preempted job saves, requeues itself and resumes
with the losses of the job that was not stopped, and the pipeline recipe goes through the same
script."""

import json
import time

import pytest

from conftest import REPO, losses, read_jsonl, with_local_data
from slurm_cluster import Cluster, why_not

SMALL = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--mlp_internal_dim_multiplier",
         "8", "--block_size", "64", "--logging_steps", "1", "--max_eval_samples", "16",
         "--disable_tqdm"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = why_not()
    if reason:
        pytest.fail(f"the Slurm tests cannot run here: {reason}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def sbatch(slurm, log, *argv) -> str:
    """Submit launch/slurm.sh with `argv` on 2 tasks from the repository's root; the job id."""
    done = slurm.run("sbatch", "--parsable", "--chdir", str(REPO), "--ntasks", "2", "--output",
                     str(log), "launch/slurm.sh", *map(str, argv))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def quickstart(out, text_file, steps, *extra) -> list[str]:
    return ["recipes/pretrain.py", "recipes/configs/quickstart_cpu.yaml", "--train_file",
            text_file, "--max_steps", str(steps), "--eval_steps", str(steps), "--save_steps",
            str(steps), *SMALL, "--output_dir", out, *extra]


def test_sbatch_trains_a_named_config_and_samples(slurm, tmp_path, text_file):
    log = tmp_path / "job.out"
    job = sbatch(slurm, log, *quickstart(tmp_path / "run", text_file, 4,
                                          "--sample_max_new_tokens", "20"))
    fields = slurm.wait(job)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-3000:]
    assert f"slurm.sh: job {job}, start 1: 2 rank(s) on 1 node(s)" in text
    assert "--- sample from" in text
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


STEPS = 16


@pytest.fixture(scope="module")
def never_stopped(slurm, tmp_path_factory, text_file) -> list[float]:
    """The losses of the job the preempted ones are compared with."""
    root = tmp_path_factory.mktemp("never_stopped")
    job = sbatch(slurm, root / "job.out", *quickstart(root / "run", text_file, STEPS))
    assert slurm.wait(job)["JobState"] == "COMPLETED", (root / "job.out").read_text()[-3000:]
    return losses(read_jsonl(root / "run" / "metrics.jsonl"))


@pytest.mark.parametrize("signalled", ["script", "ranks"])
def test_a_preempted_job_saves_requeues_and_resumes_exactly(slurm, tmp_path, text_file,
                                                            never_stopped, signalled):
    """SIGTERM after step 5, to the batch script (as --signal=B:TERM@120 sends it before the time
    limit; it passes it on to every rank and requeues the job) or to the ranks alone
    (`scancel --signal=TERM`: the job saves and ends with 0, and is requeued by hand): the
    second start resumes with --resume_from_checkpoint auto, and its losses are those of the same
    job never stopped, each step logged once. (Slurm holds a requeued job for a while; the test
    lets it start 3 s on.)"""
    steps = STEPS
    out, log = tmp_path / "preempted", tmp_path / "preempted.out"
    job = sbatch(slurm, log, *quickstart(out, text_file, steps))
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and any(m["step"] >= 5 for m in read_jsonl(metrics))):
        assert time.monotonic() < deadline and slurm.state(job).get("JobState") != "FAILED"
        time.sleep(0.2)
    signalled_at = time.monotonic()
    whom = ["--batch"] if signalled == "script" else []
    assert slurm.run("scancel", *whom, "--signal=TERM", job).returncode == 0
    if signalled == "ranks":
        fields = slurm.wait(job)
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0"
        assert slurm.run("scontrol", "requeue", job).returncode == 0
    while slurm.state(job).get("JobState") not in ("PENDING", "COMPLETED", "FAILED"):
        time.sleep(0.2)
    requeued = time.monotonic()
    # slurmd refuses a job credential made in the second it revoked the job's last one (the job's
    # end): the requeued start waits 3 s rather than Slurm's own hold
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now+3")
    saved = max(m["step"] for m in read_jsonl(metrics))
    while not any(m["step"] > saved for m in read_jsonl(metrics)):
        assert slurm.state(job).get("JobState") in ("PENDING", "RUNNING"), \
            log.read_text()[-3000:] + slurm.log_tail()
        time.sleep(0.2)
    resumed = time.monotonic()
    fields = slurm.wait(job)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-3000:]
    assert f"saved step {saved}" in text
    assert ("requeueing job" in text) == (signalled == "script")
    assert f"resumed from {out / 'checkpoints' / f'step{saved}'} at step {saved}" in text
    rows = read_jsonl(metrics)
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    assert losses(rows) == never_stopped
    print(json.dumps({f"slurm requeue, signal to the {signalled}": {
        "signal_to_exit_s": round(requeued - signalled_at, 1),
        "requeue_to_first_resumed_step_s": round(resumed - requeued, 1)}}))


def test_the_pipeline_recipe_goes_through_the_same_script(slurm, tmp_path, text_file):
    """The 1B pipeline config (its hub data a local file), shrunk to 2 stages on 2 tasks."""
    config = with_local_data(["recipes/configs/bdh_1b_4x8gpu_pipeline.yaml"], text_file,
                             tmp_path)[0]
    log = tmp_path / "job.out"
    job = sbatch(slurm, log, "recipes/pretrain_pipeline.py", config, *SMALL, "--max_steps", "4",
                 "--eval_steps", "4", "--save_steps", "4", "--neuron_parallel", "1",
                 "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                 "--bf16", "false", "--sample_max_new_tokens", "0", "--output_dir",
                 tmp_path / "run")
    fields = slurm.wait(job)
    assert fields["JobState"] == "COMPLETED", log.read_text()[-3000:]
    assert len(losses(read_jsonl(tmp_path / "run" / "metrics.jsonl"))) == 4
