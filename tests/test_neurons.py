"""Neuron parallelism (dragon.parallel.neurons): K = 2 and 4 real processes that split BDH's
neurons give the unsplit model's logits and gradients in every attention form, carry its state
and generate its greedy text; the ZeRO recipe with --neuron_parallel trains as the unsplit
model does, resumes exactly and exports the whole model."""

import subprocess
import sys

import pytest
import torch
from conftest import LOSS_ATOL, REPO, TINY, free_port, job_env, losses, read_jsonl, run_tool
from safetensors.torch import load_file
from test_recipe import final_logits

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from neuron_split import CASES, run_cases, whole_model  # noqa: E402


def split_among(k: int, tmp_path) -> dict:
    port, out = free_port(), tmp_path / f"k{k}.pt"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests/scripts/neuron_split.py"),
                               str(r), str(k), str(port), str(out)], cwd=REPO, env=job_env(),
                              stderr=subprocess.PIPE, text=True) for r in range(k)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def unsplit():
    return run_cases(whole_model(), lambda grads: grads)


@pytest.mark.parametrize("k", [2, 4])
def test_split_neurons_equal_the_whole_model(k, unsplit, tmp_path):
    """Logits and every gradient within 1e-5 (fp32; the sums over neurons are added in another
    order) for the quadratic, chunked and recurrent forms at T = 16 (two chunks of 8) and 13;
    a stream continued through the sharded state cache gives the one-call logits; greedy
    generation gives the same ids."""
    split = split_among(k, tmp_path)
    for case in CASES:
        ours, whole = split[case], unsplit[case]
        assert (ours["logits"] - whole["logits"]).abs().max() < 1e-5, case
        assert abs(ours["loss"] - whole["loss"]) < 1e-5, case
        assert ours["grads"].keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():
            scale = grad.abs().max()
            assert (ours["grads"][name] - grad).abs().max() <= 1e-5 * max(1.0, scale), (case, name)
    assert (split["carried"] - unsplit["carried"]).abs().max() < 1e-5
    assert torch.equal(split["generated"], unsplit["generated"])


# ---- the ZeRO recipe with --neuron_parallel ----------------------------------------------------

SPLIT = ["--neuron_parallel", "2"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_ranks_that_split_the_neurons_equal_one_rank(stage, runs):
    """2 ranks, each with half of every head's neurons and the whole batch of 8, train as 1 rank
    on the batch of 8 (ZeRO-0, 1 and 2): losses, evaluations, gradient norms (each shard counted
    once, by DeepSpeed or by dragon under ZeRO-0) and BDH's sparsity; the final export holds the
    whole model."""
    one_out, one, _ = runs("one_rank", launcher="python", nproc=1, micro=8)
    out, split, _ = runs(f"neurons_zero{stage}", config=f"zero{stage}.json", micro=8, extra=SPLIT)
    assert losses(split) == pytest.approx(losses(one), abs=LOSS_ATOL)
    assert losses(split, "eval_loss") == pytest.approx(losses(one, "eval_loss"), abs=LOSS_ATOL)
    assert losses(split, "grad_norm") == pytest.approx(losses(one, "grad_norm"), rel=1e-4)
    key = "sparsity/layer1/xy"
    assert losses(split, key) == pytest.approx(losses(one, key), abs=1e-5)
    torch.testing.assert_close(final_logits(out), final_logits(one_out),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_two_neuron_shares_by_two_data_ranks_equal_two_data_ranks(runs):
    """4 ranks: 2 shares of the neurons x 2 data-parallel ranks (DeepSpeed averages gradients
    over the ranks that hold the same share) train as 2 data-parallel ranks of the whole model."""
    _, dp, _ = runs("zero2")
    _, split, _ = runs("neurons_x_dp", nproc=4, extra=SPLIT)
    assert losses(split) == pytest.approx(losses(dp), abs=LOSS_ATOL)
    assert losses(split, "eval_loss") == pytest.approx(losses(dp, "eval_loss"), abs=LOSS_ATOL)
    assert losses(split, "grad_norm") == pytest.approx(losses(dp, "grad_norm"), rel=1e-4)


@pytest.mark.slow
def test_a_killed_split_run_resumes_exactly_and_exports_the_whole_model(tmp_path, text_file):
    """SIGKILLed between checkpoints and resumed from latest (dropout on, each rank its own masks
    for its neurons): the uninterrupted losses bit for bit. recipes/export.py of the last
    checkpoint (each share's ZeRO files merged, then the neurons joined) equals the engine's
    final/ export exactly; a launch without the split resumes it, joined."""
    from test_checkpoints import SLOWED, finish, kill_when, logged_steps, start

    steps, extra = 12, ["--save_steps", "4"]
    full = tmp_path / "full"
    finish(start("neurons", full, text_file, steps, extra))
    expected = losses(read_jsonl(full / "metrics.jsonl"))
    out = tmp_path / "killed"
    proc = start("neurons", out, text_file, steps, extra, env=SLOWED)
    kill_when(proc, lambda: max(logged_steps(out / "metrics.jsonl"), default=0) >= 6)
    assert max(logged_steps(out / "metrics.jsonl")) < 8, "killed too late"
    finish(start("neurons", out, text_file, steps, [*extra, "--resume_from_checkpoint", "latest"]))
    resumed = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 4][-(steps - 4):]
    assert [m["step"] for m in resumed] == list(range(5, steps + 1))
    assert [m["loss"] for m in resumed] == expected[4:]

    job = run_tool("recipes/export.py", "--checkpoint", full / "checkpoints" / "step12",
                   "--output", tmp_path / "hf")
    assert job.returncode == 0, job.stderr[-3000:]
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    final = load_file(full / "final" / "model.safetensors")
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in ours)
    assert ours["layer.encoder"].shape == (2, 32, 128)  # every neuron

    job = subprocess.run(
        [sys.executable, "recipes/pretrain.py", "--deepspeed", str(REPO / "ds_configs/zero2.json"),
         "--output_dir", str(out), "--train_file", str(text_file), *TINY, "--max_steps", "16",
         "--resume_from_checkpoint", "latest"],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]  # one process takes the joined shares
    assert "resume: converting the checkpoint from ZeRO-2 on 1 data-parallel rank(s) x 2 neuron " \
        "shares to ZeRO-2 on 1 data-parallel rank(s)" in job.stderr


@pytest.mark.slow
def test_the_accelerate_recipe_splits_the_neurons_as_the_zero_recipe(runs):
    """`accelerate launch` with --neuron_parallel 2 (ZeRO-2, 2 ranks): DeepSpeed gets the neuron
    groups through accelerator.prepare, so the run trains as the ZeRO recipe's split run: losses,
    evaluations and gradient norms within 2e-5 (1e-4 relative for the norms), the same export."""
    zero, ours, _ = runs("neurons_zero2", config="zero2.json", micro=8, extra=SPLIT)
    out, theirs, _ = runs("accelerate_neurons", launcher="accelerate", config="zero2.yaml",
                          script="recipes/pretrain_accelerate.py", micro=8, extra=SPLIT)
    assert losses(theirs) == pytest.approx(losses(ours), abs=LOSS_ATOL)
    assert losses(theirs, "eval_loss") == pytest.approx(losses(ours, "eval_loss"), abs=LOSS_ATOL)
    assert losses(theirs, "grad_norm") == pytest.approx(losses(ours, "grad_norm"), rel=1e-4)
    assert len(losses(theirs)) == 8
    torch.testing.assert_close(final_logits(out), final_logits(zero), atol=1e-4, rtol=1e-4)
