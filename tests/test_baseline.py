"""A transformer baseline through the ZeRO recipe (--model_type gpt2|llama): transformers' own
model trains, resumes exactly and exports like BDH does."""

import json
import shutil

import pytest
import torch
from conftest import (
    LOSS_ATOL,
    TINY,
    bad_input_base,
    losses,
    read_jsonl,
    run_recipe_in_process,
    run_tool,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

BDH_TINY_PARAMETERS = 3 * 2 * 32 * 128 + 2 * 256 * 32  # conftest.TINY's BDH: N = 128


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_a_baseline_of_the_bdh_s_size_trains_resumes_and_exports(model_type, runs, tmp_path):
    """2 ranks, ZeRO-2, dropout on, the width matched to the BDH's parameter count: the loss
    falls; resumed at step 4, steps 5-8 repeat bit for bit (RNG, data position, Adam and the LR
    schedule came back); the final export is transformers' own model with recipes/export.py's
    weights of the last checkpoint, exactly."""
    extra = ["--model_type", model_type, "--match_params", "--dropout", "0.1"]
    out, metrics, proc = runs(f"baseline_{model_type}", extra=extra)
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["model_type"] == model_type
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / BDH_TINY_PARAMETERS - 1) < 0.15, count
    assert f"a {model_type} baseline: {count:,} parameters" in proc.stderr + proc.stdout
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    assert all("eval_bpb" in m for m in metrics if "eval_loss" in m)

    resumed_out = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step4", resumed_out / "checkpoints" / "step4")
    (resumed_out / "checkpoints" / "latest").write_text("step4")
    _, resumed, _ = runs(f"baseline_{model_type}_resumed", out=resumed_out,
                         extra=[*extra, "--resume_from_checkpoint", "latest"])
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == losses(metrics)[4:]
    # HF's Trainer's weight decay: norms' scales and biases in a group of their own at 0
    assert saved_decays(out / "checkpoints" / "step8") == [("", True, 0.1), ("", False, 0.0)]

    job = run_tool("recipes/export.py", "--checkpoint", out / "checkpoints" / "step8",
                   "--output", tmp_path / "hf")
    assert job.returncode == 0, job.stderr[-3000:]
    ours, final = (load_file(d / "model.safetensors") for d in (tmp_path / "hf", out / "final"))
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in ours)


def saved_decays(tag_dir) -> list[tuple]:
    """Each parameter group's pattern, whether it decays, and its weight decay, as a ZeRO-2
    checkpoint's rank-0 optimizer file holds them."""
    state = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    groups = state["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    return [(g["lr_group"], g["decays"], g["weight_decay"]) for g in groups]


def test_a_resume_with_another_weight_decay_leaves_norms_and_biases_undecayed(runs, tmp_path):
    """GPT-2 resumed at step 4 with --weight_decay 0.3: the decaying group takes it, the group
    of norms and biases stays at 0 (the optimizer's saved state held 0.1 and 0)."""
    extra = ["--model_type", "gpt2", "--match_params", "--dropout", "0.1"]
    out, _, _ = runs("baseline_gpt2", extra=extra)
    runs("baseline_gpt2_decay", out=tmp_path / "decay", extra=[
        *extra, "--resume_from_checkpoint", str(out / "checkpoints" / "step4"),
        "--weight_decay", "0.3"])
    assert saved_decays(tmp_path / "decay" / "checkpoints" / "step8") == [
        ("", True, 0.3), ("", False, 0.0)]


def test_a_baseline_checkpoint_of_one_group_is_refused(monkeypatch, runs, tmp_path, text_file):
    """A baseline saved by a dragon whose optimizer had one group (before 0.3.0.dev0) does not
    load into the two this one builds: one line, before any process group starts; so is one
    whose run.json names no version (written before it did). A baseline's two groups do not go
    onto ZeRO-0 from another layout (dragon's conversion holds one group): one line too."""
    out, _, _ = runs("baseline_gpt2", extra=["--model_type", "gpt2", "--match_params",
                                               "--dropout", "0.1"])

    def refusal(config: str, run_dir) -> str:
        return run_recipe_in_process(monkeypatch, "recipes/pretrain.py", [
            *bad_input_base(config, run_dir, text_file), *TINY, "--model_type", "gpt2",
            "--match_params", "--resume_from_checkpoint", "latest"])

    old = tmp_path / "old"
    shutil.copytree(out / "checkpoints", old / "checkpoints")
    run_file = old / "checkpoints" / "run.json"
    run = json.loads(run_file.read_text())
    run_file.write_text(json.dumps(dict(run, dragon_version="0.2.0")))
    line = refusal("zero2.json", old)
    assert f"--model_type gpt2: {old / 'checkpoints' / 'step8'} was saved by dragon 0.2.0, " \
        "whose parameter groups differ from this one's" in line, line
    run_file.write_text(json.dumps({k: v for k, v in run.items() if k != "dragon_version"}))
    line = refusal("zero2.json", old)
    assert "was saved by dragon 0, whose parameter groups differ" in line, line
    line = refusal("zero0.json", out)
    assert "--model_type gpt2 (its norms and biases: a group without decay) from a checkpoint " \
        "of another layout, with ZeRO-0 (now)" in line, line


@pytest.mark.slow
def test_a_baseline_trains_under_diloco(runs, tmp_path):
    """The transformer baselines under DiLoCo, as BDH: one island whose outer step is the
    identity (lr 1, no momentum) trains as plain GPT-2 does (within 2e-5); 2 Llama islands
    with 2 bf16 fragments in delayed mode (a parameter BDH has not is cut into equal runs of its
    values) and the embedding at half the rate (--lr_scales, with the norms undecayed: 4 groups)
    learn, end on identical weights, and resume on ZeRO-3 islands with the losses of the run not
    stopped (within 2e-5: bf16 rounds each value alone, whatever the partition) and each group's
    rate."""
    gpt2 = ["--model_type", "gpt2", "--match_params", "--dropout", "0.1"]
    _, plain, _ = runs("baseline_gpt2", extra=gpt2)
    _, outer, _ = runs("baseline_gpt2_one_island", extra=[
        *gpt2, "--diloco_inner_steps", "2", "--diloco_outer_lr", "1", "--diloco_outer_momentum",
        "0"])
    assert losses(outer) == pytest.approx(losses(plain), abs=LOSS_ATOL)
    assert [m["outer_step"] for m in outer if "outer_step" in m] == [1, 2, 3, 4]

    llama = ["--model_type", "llama", "--match_params", "--diloco_islands", "2",
             "--diloco_inner_steps", "4", "--diloco_fragments", "2", "--diloco_mode", "delayed",
             "--diloco_compress", "bf16", "--diloco_checksum", "--diloco_outer_momentum", "0.3",
             "--lr_scales", "embed=0.5"]
    out, _, _ = runs("baseline_llama_islands", nproc=2, extra=llama)
    metrics = [read_jsonl(out / f"island{i}" / "metrics.jsonl") for i in (0, 1)]
    assert losses(metrics[0])[-1] < losses(metrics[0])[0] - 0.3
    last = [[m for m in island if "outer_step" in m][-1] for island in metrics]
    for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
        assert last[0][key] == last[1][key], key
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.model_type == "llama"

    # resumed at step 4 (a fragment in flight) on ZeRO-3 islands: the DiLoCo state moves to the
    # new partition (a baseline's parameters have no neurons to join)
    resumed_out = tmp_path / "llama_islands_zero3"
    for island in (0, 1):
        saved = out / f"island{island}" / "checkpoints"
        shutil.copytree(saved / "step4", resumed_out / f"island{island}" / "checkpoints" / "step4")
        for file in saved.glob("*.json"):
            shutil.copy(file, resumed_out / f"island{island}" / "checkpoints")
    _, _, proc = runs("baseline_llama_islands_zero3", nproc=2, config="zero3.json",
                      out=resumed_out, extra=[*llama, "--resume_from_checkpoint", "step4"])
    again = [read_jsonl(resumed_out / f"island{i}" / "metrics.jsonl") for i in (0, 1)]
    for island in (0, 1):
        assert [m["step"] for m in again[island] if "loss" in m] == [5, 6, 7, 8]
        assert losses(again[island]) == pytest.approx(losses(metrics[island])[4:], abs=LOSS_ATOL)
        for m in [*metrics[island], *again[island]]:  # its 4 groups: 2 scales, decayed or not
            assert "loss" not in m or m["lr/embed"] == pytest.approx(0.5 * m["lr"], rel=1e-12)
