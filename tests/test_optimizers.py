"""The optimizer: parameter groups (--lr_scales, a learning rate per name pattern) and DeepSpeed's
Muon (--optimizer muon), in the optimizer and in metrics.jsonl, through a resume."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
from conftest import LOSS_ATOL, PIPE_X2, TINY, bad_input_base, losses, run_recipe_in_process
from transformers import GPT2Config, GPT2LMHeadModel, Trainer

from dragon import BDHConfig, BDHForCausalLM
from dragon.checkpoint import universal
from dragon.run.optim import decays, lr_group_of, parameter_groups

SCALES = ["--lr_scales", "embed=0.5,lm_head=0.25"]
MUON = ["--optimizer", "muon"]
# DeepSpeed's Muon iterates Newton-Schulz in half precision (deepspeed's ns_compute_dtype), where a
# last-bit difference in a gradient summed in another order can round another way: layouts that
# sum in another order agree to 10 times the fp32 bound (conftest.LOSS_ATOL), those that sum in
# the same order bit for bit.
MUON_ATOL = 2e-4


def args_of(**kwargs):
    return SimpleNamespace(**{"lr_scales": None, "learning_rate": 1e-3, "weight_decay": 0.1,
                              **kwargs})


def test_groups_scale_rates_by_pattern():
    """BDH: one group a pattern, each at its scale of the peak, the rest at the optimizer's own
    rate and first; without --lr_scales, one group of every parameter."""
    bdh = BDHForCausalLM(BDHConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=256))
    groups = parameter_groups(bdh, {}, args_of(lr_scales="embed=0.5,lm_head=0.25"))
    named = {id(p): n for n, p in bdh.named_parameters()}
    by_pattern = {g["lr_group"]: ([named[id(p)] for p in g["params"]], g.get("lr"))
                  for g in groups}
    assert by_pattern == {"": (["layer.encoder", "layer.encoder_v", "layer.decoder"], None),
                          "embed": (["embed.weight"], 0.5e-3), "lm_head": (["lm_head"], 0.25e-3)}
    assert groups[0]["lr_group"] == ""  # metrics.jsonl's `lr`
    assert all(g["decays"] and "weight_decay" not in g for g in groups)  # no norm, no bias


def test_norms_and_biases_do_not_decay_as_in_hf_s_trainer():
    """GPT-2: the parameters HF's Trainer decays (its own get_decay_parameter_names) in the
    first group, at the optimizer's decay; its norms' scales and its biases in a second at weight
    decay 0; under Muon that group's name says so, as its halves keep only the name."""
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256))
    groups = parameter_groups(gpt2, {"optimizer": {"params": {"lr": 2e-3}}}, args_of())
    named = {id(p): n for n, p in gpt2.named_parameters()}
    hf = set(Trainer.get_decay_parameter_names(None, gpt2)) - {"lm_head.weight"}  # tied: wte
    assert [g["decays"] for g in groups] == [True, False]
    assert {named[id(p)] for p in groups[0]["params"]} == hf
    assert {named[id(p)] for p in groups[1]["params"]} == set(named.values()) - hf
    assert "weight_decay" not in groups[0] and groups[1]["weight_decay"] == 0.0
    assert not any("lr" in g for g in groups)
    muon = parameter_groups(gpt2, {"optimizer": {"type": "muon"}}, args_of())
    assert "name" not in muon[0] and muon[1]["name"] == "no_decay:lr_group="
    assert not decays({"name": "no_decay:lr_group=-adam-params"})
    assert decays({"name": "group0-adam-params"})


def test_muon_groups_set_no_rate_and_name_their_pattern():
    """Under DeepSpeed's Muon a group's "lr" would set both of its halves, so the groups set
    none (the LRSchedule does, per half) and carry their pattern in the one key Muon keeps, the
    name; lr_group_of reads it back from a half's name, also where the pattern holds a dash."""
    bdh = BDHForCausalLM(BDHConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=256))
    cfg = {"optimizer": {"type": "muon", "params": {"lr": 3e-3}}}
    groups = parameter_groups(bdh, cfg, args_of(lr_scales="embed=0.5,decoder=0.25"))
    assert [g["name"] for g in groups] == ["lr_group=", "lr_group=decoder", "lr_group=embed"]
    assert not any("lr" in g for g in groups)
    assert lr_group_of({"name": "lr_group=decoder-muon-params", "use_muon": True}) == "decoder"
    assert lr_group_of({"name": "lr_group=a-b-adam-params"}) == "a-b"
    assert lr_group_of({"name": "muon-params"}) == ""


def resumed_at_step_4(runs, name: str, out, tmp_path, extra: list[str], said: list = None,
                      **run) -> list[dict]:
    """The run in `out` restarted from its step-4 checkpoint (and its run.json) alone in a new
    directory: its metrics (`said`: gets the lines it printed; `run`: the run's other
    conftest.Runs arguments)."""
    resumed_out = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step4", resumed_out / "checkpoints" / "step4")
    (resumed_out / "checkpoints" / "latest").write_text("step4")
    shutil.copy(out / "checkpoints" / "run.json", resumed_out / "checkpoints")  # its flags
    _, metrics, proc = runs(name, out=resumed_out,
                            extra=[*extra, "--resume_from_checkpoint", "latest"], **run)
    if said is not None:
        said += (proc.stdout + proc.stderr).splitlines()
    return metrics


def test_lr_scales_are_logged_at_every_step_and_resume_exactly(runs, tmp_path):
    """ZeRO-2 on 2 ranks with --lr_scales embed=0.5,lm_head=0.25: every logged step has lr/embed
    and lr/lm_head at those scales of `lr`; resumed at step 4, steps 5-8 repeat bit for bit; a
    resume with other scales of the same patterns applies them, one with other patterns is
    refused in one line (test_a_resume_with_other_patterns_is_refused)."""
    out, full, _ = runs("lr_scales", extra=SCALES)
    logged = [m for m in full if "lr" in m]
    assert len(logged) == 8
    for m in logged:
        assert m["lr/embed"] == pytest.approx(0.5 * m["lr"], rel=1e-12)
        assert m["lr/lm_head"] == pytest.approx(0.25 * m["lr"], rel=1e-12)
    resumed = resumed_at_step_4(runs, "lr_scales_resumed", out, tmp_path, SCALES)
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == losses(full)[4:]
    assert [m["lr/embed"] for m in resumed] == [m["lr/embed"] for m in full[4:]]


def test_lr_scales_resume_on_zero3_from_another_layout_with_the_same_losses(runs, tmp_path):
    """The ZeRO-2 run with --lr_scales resumed at step 4 on ZeRO-3 (DeepSpeed's universal
    checkpoint): steps 5-8 are the uninterrupted run's within 2e-5, the bound of a resume on
    another layout (docs/checkpoints.md), with each group at its rate. DeepSpeed's ZeRO-3 load
    alone gives every group the first one's settings and one shared step count
    (dragon.parallel.deepspeed_fixes.groups_kept_through_a_load)."""
    out, full, _ = runs("lr_scales", extra=SCALES)
    resumed = resumed_at_step_4(runs, "lr_scales_zero3", out, tmp_path, SCALES,
                                config="zero3.json")
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == pytest.approx(losses(full)[4:], abs=LOSS_ATOL)
    assert [m["lr/lm_head"] for m in resumed] == [m["lr/lm_head"] for m in full[4:]]


def test_lr_scales_onto_zero0_from_another_layout_is_refused(monkeypatch, runs, text_file):
    """dragon's ZeRO-0 conversion holds one parameter group: one line, before any process group
    starts."""
    out, _, _ = runs("lr_scales", extra=SCALES)
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", [
        *bad_input_base("zero0.json", out, text_file), *TINY, *SCALES,
        "--resume_from_checkpoint", "latest"])
    assert "--lr_scales embed=0.5,lm_head=0.25 from a checkpoint of another layout, with ZeRO-0 " \
        "(now): a resume of several parameter groups onto another layout goes between " \
        "ZeRO-1/2/3 layouts" in line, line


def test_a_resume_with_other_patterns_is_refused(monkeypatch, runs, tmp_path, text_file):
    """The checkpoint's optimizer state holds the groups of its patterns: one line, before any
    process group starts."""
    out, _, _ = runs("lr_scales", extra=SCALES)
    base = bad_input_base("zero2.json", out, text_file)
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", [
        *base, *TINY, "--lr_scales", "embed=0.5", "--resume_from_checkpoint", "latest"])
    assert "--lr_scales embed=0.5: " in line and "whose optimizer state holds other " \
        "parameter groups; resume with the same patterns" in line, line


@pytest.mark.parametrize("given,expected", [
    ("embed=0", "--lr_scales 'embed=0': expected PATTERN=SCALE pairs with scales > 0"),
    ("embed", "--lr_scales 'embed': expected PATTERN=SCALE pairs"),
    ("wte=0.5", "--lr_scales: 'wte' is found in no parameter's name; the model's are lm_head, "
                "embed.weight"),
])
def test_bad_lr_scales_stop_before_start(monkeypatch, tmp_path, text_file, given, expected):
    base = bad_input_base("zero2.json", tmp_path, text_file)
    assert expected in run_recipe_in_process(monkeypatch, "recipes/pretrain.py",
                                             [*base, "--lr_scales", given])


def refusal_with_json(monkeypatch, tmp_path, text_file, section: dict, argv: list[str]) -> str:
    """The one line a ZeRO-2 run refuses with: a DeepSpeed JSON of its own with `section`
    added, and `argv`."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto",
                                  "zero_optimization": {"stage": 2}, **section}))
    base = bad_input_base("zero2.json", tmp_path / "out", text_file)
    base[base.index("--deepspeed") + 1] = str(config)
    return run_recipe_in_process(monkeypatch, "recipes/pretrain.py", [*base, *argv])


def test_lr_scales_with_the_json_s_own_scheduler_is_refused(monkeypatch, tmp_path, text_file):
    line = refusal_with_json(monkeypatch, tmp_path, text_file, {"scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": 2}}}, ["--lr_scales", "embed=0.5"])
    assert "--lr_scales embed=0.5: the DeepSpeed JSON's own \"scheduler\" sets one rate" in line



def test_muon_trains_zero2_on_2_ranks_and_resumes_exactly(runs, tmp_path):
    """--optimizer muon, ZeRO-2 on 2 ranks: DeepSpeed's Muon steps BDH's encoders and decoder at
    the Muon rate (lr/muon: 0.02 of the schedule's peak of 1), AdamW the embedding and the head
    at --learning_rate (lr); the losses are finite and fall; resumed at step 4 with another
    --max_grad_norm, which no clip under ZeRO applies (it says so), steps 5-8 repeat bit for
    bit."""
    out, full, _ = runs("muon", extra=MUON)
    logged = [m for m in full if "lr" in m]
    assert len(logged) == 8
    for m in logged:
        assert m["lr/muon"] == pytest.approx(0.02 / 3e-3 * m["lr"], rel=1e-9)
    assert all(math.isfinite(x) for x in losses(full))
    assert losses(full)[-1] < losses(full)[0] - 0.2
    said = []
    resumed = resumed_at_step_4(runs, "muon_resumed", out, tmp_path,
                                [*MUON, "--max_grad_norm", "0.5"], said)
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert [line for line in said if line.startswith("resume: --max_grad_norm")] == [
        "resume: --max_grad_norm 0.5 (the checkpoint's run: 1.0): no clip applies: under ZeRO "
        "dragon turns DeepSpeed's off, as it would clip Muon's update rather than the gradient"]
    assert sum("the clip at" in line for line in said) == 1  # said once, not per rank
    assert losses(resumed) == losses(full)[4:]


def test_muon_with_lr_scales_scales_each_half_and_resumes_exactly(runs, tmp_path):
    """--optimizer muon --lr_scales embed=0.5,decoder=0.25, ZeRO-2 on 2 ranks: the embedding
    (AdamW) at 0.5 of lr, the decoder (Muon) at 0.25 of lr/muon, the encoders at lr/muon; the
    losses fall; resumed at step 4, steps 5-8 repeat bit for bit with the same rates."""
    extra = ["--optimizer", "muon", "--lr_scales", "embed=0.5,decoder=0.25"]
    out, full, _ = runs("muon_scales", extra=extra)
    logged = [m for m in full if "lr" in m]
    assert len(logged) == 8
    for m in logged:
        assert m["lr/muon"] == pytest.approx(0.02 / 3e-3 * m["lr"], rel=1e-9)
        assert m["lr/embed"] == pytest.approx(0.5 * m["lr"], rel=1e-12)
        assert m["lr/muon/decoder"] == pytest.approx(0.25 * m["lr/muon"], rel=1e-12)
    assert losses(full)[-1] < losses(full)[0] - 0.2
    resumed = resumed_at_step_4(runs, "muon_scales_resumed", out, tmp_path, extra)
    assert losses(resumed) == losses(full)[4:]
    assert [m["lr/muon/decoder"] for m in resumed] == [m["lr/muon/decoder"] for m in full[4:]]


def test_muon_trains_under_zero3(runs):
    """ZeRO-3 (DeepSpeed's Muon takes it without reduce-scatter, which dragon turns off): the
    losses are finite and fall, lr/muon at its rate."""
    _, metrics, _ = runs("muon_zero3", config="zero3.json", extra=MUON)
    assert all(math.isfinite(x) for x in losses(metrics))
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.1
    assert all(m["lr/muon"] == pytest.approx(0.02 / 3e-3 * m["lr"], rel=1e-9)
               for m in metrics if "lr" in m)


def zero0_muon_unclipped(runs) -> list[float]:
    """The losses of Muon without ZeRO on 2 ranks, with no gradient clipping."""
    return losses(runs("muon_zero0_unclipped", config="zero0.json",
                       extra=[*MUON, "--max_grad_norm", "0"])[1])


def test_muon_under_zero_steps_as_without_zero_with_no_clipping(runs):
    """DeepSpeed's ZeRO clips Muon's orthogonalised update instead of the gradient
    (tests/test_deepspeed_fixes.py), so under ZeRO-1/2/3 dragon turns the clip off and says so
    in one line: ZeRO-2 then steps as ZeRO-0 without a clip, bit for bit (the same sums), and
    ZeRO-3 within the half-precision bound (its own partitioned sums)."""
    _, zero2, proc = runs("muon", extra=MUON)
    assert "--optimizer muon under ZeRO-2: DeepSpeed would clip Muon's orthogonalised update " \
        "rather than the gradient, so the clip at 1 (--max_grad_norm, or the JSON's " \
        "gradient_clipping) is turned off" in proc.stderr
    reference = zero0_muon_unclipped(runs)
    assert losses(zero2) == reference
    zero3 = losses(runs("muon_zero3", config="zero3.json", extra=MUON)[1])
    assert zero3 == pytest.approx(reference, abs=MUON_ATOL)


def test_muon_in_the_pipeline_steps_as_the_plain_model_and_resumes_exactly(runs, tmp_path):
    """A 2-stage ZeRO-0 pipeline under Muon (no clip, as the reference) against the plain model
    on 2 ranks: the same losses within the half-precision bound (the tied block's gradient is
    summed across stages); resumed at step 4, steps 5-8 repeat bit for bit."""
    pipe = dict(PIPE_X2, extra=[*PIPE_X2["extra"], *MUON, "--max_grad_norm", "0"])
    out, full, _ = runs("muon_pipe", **pipe)
    assert losses(full) == pytest.approx(zero0_muon_unclipped(runs), abs=MUON_ATOL)
    assert any(m.get("lr/muon") for m in full)
    resumed = resumed_at_step_4(runs, "muon_pipe_resumed", out, tmp_path, pipe["extra"],
                                config=pipe["config"], script=pipe["script"])
    assert losses(resumed) == losses(full)[4:]


def test_muon_onto_another_layout_is_refused_as_deepspeed_cannot_carry_it(
        monkeypatch, runs, tmp_path, text_file):
    """DeepSpeed's universal checkpoint reads Adam's moments from every group and finds none in
    Muon's (a KeyError: once it converts the checkpoint, the refusal can go); so a resume of a
    Muon run on another layout is refused in one line, before any process group starts."""
    out, _, _ = runs("muon", extra=MUON)
    with pytest.raises(KeyError, match="exp_avg"):
        universal.from_deepspeed(str(out / "checkpoints" / "step8"), str(tmp_path / "universal"))
    base = bad_input_base("zero1.json", out, text_file)
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", [
        *base, *TINY, *MUON, "--resume_from_checkpoint", "latest"])
    assert "--optimizer muon from a checkpoint of another layout: DeepSpeed's universal " \
        "checkpoint does not carry Muon's momentum" in line, line


def test_muon_on_a_bf16_zero0_pipeline_is_refused(monkeypatch, tmp_path, text_file):
    """DeepSpeed's bf16 optimizer, which a bf16 ZeRO-0 pipeline runs, raises on Muon: one line
    before any work instead (ZeRO-1 pipelines and every bf16 ZeRO recipe take it)."""
    base = bad_input_base("pipeline_zero0.json", tmp_path, text_file)
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain_pipeline.py", [
        *base, *MUON, "--bf16", "true", "--pipeline_stages", "2"], {"WORLD_SIZE": "2"})
    assert line == "error: --optimizer muon with --bf16 on a ZeRO-0 pipeline: DeepSpeed's bf16 " \
        "optimizer does not take Muon in a pipeline; use ds_configs/pipeline_zero1.json or fp32"


def test_muon_with_another_optimizer_in_the_json_is_refused(monkeypatch, tmp_path, text_file):
    line = refusal_with_json(monkeypatch, tmp_path, text_file, {"optimizer": {
        "type": "SGD", "params": {"lr": "auto"}}}, ["--optimizer", "muon"])
    assert "--optimizer muon: the DeepSpeed JSON names the optimizer 'SGD'" in line
