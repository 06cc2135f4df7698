"""BDH as a DeepSpeed pipeline: real 2- and 4-process jobs on CPU, checked against the plain
model."""

import json
import shutil

import pytest
import torch
from conftest import (LOSS_ATOL, REPO, STEPS, bad_input_base, launch, losses,
                      run_recipe_in_process, run_tool)

from dragon import BDHConfig, BDHForCausalLM
from dragon.parallel.pipeline import model_from_pipeline_checkpoint, partition

PIPE = "recipes/pretrain_pipeline.py"
CONFIG = "pipeline_zero0.json"


def pipeline_run(runs, name, nproc=2, micro=4, extra=(), **kw):
    """The pipeline recipe with 4 micro-batches per step (gradient accumulation)."""
    return runs(
        name,
        nproc=nproc,
        micro=micro,
        config=CONFIG,
        script=PIPE,
        extra=[
            "--pipeline_stages",
            "2",
            "--gradient_accumulation_steps",
            str(16 // (micro * (nproc // 2))),
            *extra,
        ],
        **kw,
    )


def test_partition_balances_layers():
    config = BDHConfig(n_layer=6, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8)
    assert partition(config, 2) == [0, 4, 8]  # embed + 3 layers | 3 layers + head
    assert partition(config, 3) == [0, 3, 5, 8]
    assert partition(config, 2, "uniform") == [0, 4, 8]


def test_gradients_equal_plain_model(tmp_path):
    """Same weights, same 4 micro-batches: the pipeline's SGD(lr=1) update is the plain gradient."""
    torch.manual_seed(0)
    config = BDHConfig(n_layer=3, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, dropout=0.0)
    model = BDHForCausalLM(config)
    model.save_pretrained(
        tmp_path / "hf"
    )  # the pipeline starts from this directory (HF -> pipeline)
    batches = [torch.randint(0, 256, (2, 33)) for _ in range(4)]
    torch.save(batches, tmp_path / "batches.pt")
    proc = launch("torchrun", 2, "tests/scripts/pipeline_step.py", [str(tmp_path), "4"])
    assert proc.returncode == 0, proc.stderr[-4000:]

    plain_losses = [model(b, labels=b).loss for b in batches]
    plain_loss = torch.stack(plain_losses).mean()
    plain_loss.backward()
    reported = json.loads((tmp_path / "losses.json").read_text())
    assert reported["parts"] == [0, 3, 5]
    assert reported["before"] == pytest.approx(plain_loss.item(), abs=1e-6)
    assert reported["train"] == pytest.approx(plain_loss.item(), abs=1e-6)

    stage0, stage1 = (torch.load(tmp_path / f"stage_weights_{r}.pt") for r in (0, 1))
    shared = ("layer.encoder", "layer.encoder_v", "layer.decoder")
    for name in shared:  # the tied block is the same on both stages after the step
        assert torch.equal(stage0[name], stage1[name]), name
    after = {**stage0, **stage1}
    params = dict(model.named_parameters())
    for name, new in after.items():
        pipe_grad = params[name].detach() - new  # SGD, lr 1: w1 = w0 - g
        # w1 = w0 - g rounds to the weights' ulp (7.5e-9 below 0.125), and the pipeline sums its
        # micro-batches' gradients in another order: a few ulp, element by element
        diff = (pipe_grad - params[name].grad).abs().max().item()
        assert params[name].abs().max() < 0.125 and diff <= 2e-8, f"{name}: {diff:.2e}"

    # pipeline checkpoint -> Hugging Face model: the stepped weights, identical logits
    converted = model_from_pipeline_checkpoint(str(tmp_path / "ckpt" / "after"), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(after[name])
        ids = batches[0]
        torch.testing.assert_close(converted(ids).logits, model.eval()(ids).logits, atol=0, rtol=0)


def test_trajectory_equals_single_process(runs):
    """8 steps of the 2-stage pipeline equal 8 steps of the ZeRO recipe on one process."""
    out, pipe, proc = pipeline_run(runs, "pipe2")
    single_out, single, _ = runs(
        "single_accum",
        launcher="python",
        nproc=1,
        micro=4,
        extra=["--gradient_accumulation_steps", "4"],
    )
    assert len(pipe) == STEPS
    assert losses(pipe) == pytest.approx(losses(single), abs=LOSS_ATOL)
    assert losses(pipe, "eval_loss") == pytest.approx(losses(single, "eval_loss"), abs=LOSS_ATOL)
    assert "bubble" not in proc.stderr  # 4 micro-batches >= 2 stages
    # Both exports hold the same model.
    ids = torch.arange(64).view(2, 32)
    with torch.no_grad():
        a = BDHForCausalLM.from_pretrained(out / "final")(ids).logits
        b = BDHForCausalLM.from_pretrained(single_out / "final")(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    exported = run_tool("recipes/export.py", "--checkpoint", out / "checkpoints" / "step8",
                        "--output", out / "exported")
    assert exported.returncode == 0, exported.stderr[-3000:]
    with torch.no_grad():
        torch.testing.assert_close(
            BDHForCausalLM.from_pretrained(out / "exported")(ids).logits, a, atol=0, rtol=0
        )
    # The shared block, written once by each stage, is identical on both stages.
    tag = out / "checkpoints" / f"step{STEPS}"
    owners = sorted(p.name for p in tag.glob("layer_*-model_states.pt"))
    assert owners == [
        "layer_00-model_states.pt",
        "layer_01-model_states.pt",
        "layer_02-model_states.pt",
        "layer_03-model_states.pt",
    ]
    s0, s1 = (torch.load(tag / name) for name in owners[1:3])
    for key in ("encoder", "encoder_v", "decoder"):
        assert torch.equal(s0[key], s1[key]), key


def test_resume_continues_exactly(runs, tmp_path):
    out, full, _ = pipeline_run(runs, "pipe_dropout", extra=["--dropout", "0.2"])
    resumed_out = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step4", resumed_out / "checkpoints" / "step4")
    (resumed_out / "checkpoints" / "latest").write_text("step4")
    _, resumed, _ = pipeline_run(
        runs,
        "pipe_resumed",
        extra=["--dropout", "0.2", "--resume_from_checkpoint", "latest"],
        out=resumed_out,
    )
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == losses(full)[4:]


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same_losses(runs):
    """--activation_checkpoint_interval 1 recomputes each layer's activations in the backward
    pass, dropout masks included (DeepSpeed restores the RNG state it ran them with): the
    losses and evaluations of the same run without it, bit for bit."""
    dropout = ["--dropout", "0.2"]
    _, full, _ = pipeline_run(runs, "pipe_dropout", extra=dropout)
    _, recomputed, _ = pipeline_run(runs, "pipe_dropout_recomputed",
                                    extra=[*dropout, "--activation_checkpoint_interval", "1"])
    assert losses(recomputed) == losses(full)
    assert losses(recomputed, "eval_loss") == losses(full, "eval_loss")


def test_starts_from_hugging_face_directory(runs):
    """HF -> pipeline: a run started from the single-process export evaluates to its loss."""
    single_out, single, _ = runs(
        "single_accum",
        launcher="python",
        nproc=1,
        micro=4,
        extra=["--gradient_accumulation_steps", "4"],
    )
    _, cont, _ = pipeline_run(
        runs,
        "pipe_from_hf",
        extra=[
            "--model_name_or_path",
            str(single_out / "final"),
            "--learning_rate",
            "1e-12",
            "--warmup_steps",
            "0",
        ],
    )
    # With a vanishing learning rate the weights stay the exported ones: same validation loss.
    assert cont[3]["eval_loss"] == pytest.approx(single[-1]["eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_two_stages_by_two_data_parallel(runs):
    """4 processes (2 stages x 2 data-parallel) equal 2 stages on the same global batch."""
    _, four, _ = pipeline_run(runs, "pipe2x2", nproc=4, micro=2)
    _, two, _ = pipeline_run(runs, "pipe2")
    assert losses(four) == pytest.approx(losses(two), abs=LOSS_ATOL)
    assert losses(four, "eval_loss") == pytest.approx(losses(two, "eval_loss"), abs=LOSS_ATOL)


def test_too_few_micro_batches_warns_about_the_bubble(runs):
    _, metrics, proc = runs(
        "pipe_bubble",
        config=CONFIG,
        script=PIPE,
        extra=["--pipeline_stages", "2", "--max_steps", "2"],
    )
    assert "bubble idles 50%" in proc.stderr and len(metrics) == 2


@pytest.mark.parametrize(
    "argv,env,expected",
    [
        (["--pipeline_stages", "3"], {"WORLD_SIZE": "4"}, "world size 4 is not divisible"),
        (
            ["--pipeline_stages", "2", "--n_layer", "1"],
            {"WORLD_SIZE": "2"},
            "between 1 and n_layer=1",
        ),
        (
            ["--pipeline_stages", "2", "--deepspeed", str(REPO / "ds_configs/zero2.json")],
            {"WORLD_SIZE": "2"},
            "ZeRO stage 2 cannot shard a pipeline",
        ),
        (
            ["--pipeline_stages", "2"],
            {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"},
            "deepspeed --num_gpus N recipes/pretrain_pipeline.py",
        ),
        (
            ["--pipeline_stages", "2", "--partition_method", "random"],
            {"WORLD_SIZE": "2"},
            "valid are compute",
        ),
    ],
)
def test_bad_input_stops_before_start(monkeypatch, text_file, tmp_path, argv, env, expected):
    base = bad_input_base(CONFIG, tmp_path, text_file)
    assert expected in run_recipe_in_process(monkeypatch, PIPE, base + argv, env)


def test_zero1_pipeline_with_chunked_attention_equals_zero0_quadratic(runs):
    """ZeRO-1 over the stages, and the chunked form in them (the stages run the model's own layer
    code): the ZeRO-0 quadratic pipeline's losses."""
    _, zero1, _ = runs(
        "pipe2_zero1_chunked",
        config="pipeline_zero1.json",
        script=PIPE,
        micro=4,
        extra=["--pipeline_stages", "2", "--gradient_accumulation_steps", "4",
               "--attention", "chunked", "--attention_chunk_size", "16"],
    )
    _, zero0, _ = pipeline_run(runs, "pipe2")
    assert losses(zero1) == pytest.approx(losses(zero0), abs=LOSS_ATOL)
    assert losses(zero1, "eval_loss") == pytest.approx(losses(zero0, "eval_loss"), abs=LOSS_ATOL)
    assert all(m["grad_norm"] > 0 for m in zero1)  # ZeRO-1 records the (whole-pipeline) norm
