"""recipes/pretrain.py as users run it: real DeepSpeed engines in real multi-process jobs on CPU."""

import json
import math
import os
import shutil
import stat
import subprocess

import pytest
import torch
from conftest import (
    LOSS_ATOL,
    PIPE_X2,
    REPO,
    STEPS,
    TINY,
    bad_input_base,
    job_env,
    launch,
    launch_command,
    losses,
    read_jsonl,
    run_recipe_in_process,
    run_tool,
)

from dragon import BDHForCausalLM
from dragon.checkpoint.catalog import MARKER, is_complete


def final_logits(out):
    model = BDHForCausalLM.from_pretrained(out / "final").eval()
    ids = torch.arange(64).view(2, 32) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


def test_metrics_file_and_learning(runs):
    out, metrics, _ = runs("zero2")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_second", "mfu"} <= m.keys()
        assert m["grad_norm"] > 0 and m["tokens_per_second"] > 0 and 0 < m["mfu"] < 1
    assert [m["step"] for m in metrics if "eval_loss" in m] == [4, 8]
    assert metrics[0]["loss"] == pytest.approx(math.log(256), abs=0.1)  # uniform over bytes at init
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3
    assert metrics[1]["lr"] == pytest.approx(3e-3)  # end of the 2-step warm-up, then cosine down
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [
        "step4",
        "step8",
    ]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step8"
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_stages_train_identically(runs, stage, tmp_path):
    """ZeRO 0, 1 and 3 give ZeRO-2's losses and final weights (stage 1 also with the csv monitor
    on).
    """
    config = f"zero{stage}.json"
    if stage == 1:  # DeepSpeed's own monitor, switched on in the JSON as a user would
        cfg = json.loads((REPO / "ds_configs" / config).read_text())
        cfg["csv_monitor"] = {"enabled": True, "job_name": "bdh"}
        config = str(tmp_path / "zero1_csv.json")
        (tmp_path / "zero1_csv.json").write_text(json.dumps(cfg))
    out, metrics, _ = runs(f"zero{stage}", config=config)
    ref_out, ref, _ = runs("zero2")
    assert losses(metrics) == pytest.approx(losses(ref), abs=LOSS_ATOL)
    assert losses(metrics, "eval_loss") == pytest.approx(losses(ref, "eval_loss"), abs=LOSS_ATOL)
    torch.testing.assert_close(final_logits(out), final_logits(ref_out), atol=1e-4, rtol=1e-4)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step8"
    if stage == 1:
        csvs = list((out / "monitor").rglob("*.csv"))
        assert any("loss" in p.name for p in csvs), csvs


def wandb_history(run_dir) -> list[dict]:
    """The history rows of wandb's offline run file (wandb's own reader of its format)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(next(run_dir.glob("wandb/latest-run/*.wandb"))))
    rows = []
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})
    return rows


def test_report_to_feeds_every_metrics_line_to_each_tracker(runs, monkeypatch):
    """--report_to tensorboard,csv,wandb (wandb offline): each tracker holds the loss of every
    step and every evaluation, as metrics.jsonl has them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    out, metrics, _ = runs("trackers", launcher="python", nproc=1, micro=8,
                           extra=["--report_to", "tensorboard,csv,wandb"])
    expected = {key: [(m["step"], m[key]) for m in metrics if key in m]
                for key in ("loss", "eval_loss")}
    events = EventAccumulator(str(out / "monitor" / "bdh"))
    events.Reload()
    wandb_rows = wandb_history(out / "monitor")
    for key, want in expected.items():
        scalars = events.Scalars(f"dragon/{key}")  # fp32 values
        assert [e.step for e in scalars] == [step for step, _ in want]
        assert [e.value for e in scalars] == pytest.approx([value for _, value in want])
        with open(out / "monitor" / "bdh" / f"dragon_{key}.csv") as f:
            rows = [line.split(",") for line in f.read().split()[1:]]
        assert [(int(step), float(value)) for step, value in rows] == want
        assert [(r["dragon/step"], r[f"dragon/{key}"]) for r in wandb_rows
                if f"dragon/{key}" in r] == want


def test_two_ranks_equal_one_rank(runs):
    """2 ranks x micro-batch 4 see the same global batches as 1 rank x 8: same losses."""
    _, one, _ = runs("one_rank", launcher="python", nproc=1, micro=8)
    _, two, _ = runs("zero2")
    assert losses(one) == pytest.approx(losses(two), abs=LOSS_ATOL)
    assert losses(one, "eval_loss") == pytest.approx(losses(two, "eval_loss"), abs=LOSS_ATOL)
    assert losses(one, "grad_norm") == pytest.approx(losses(two, "grad_norm"), rel=1e-4)


def test_resume_continues_exactly(runs, tmp_path):
    """Resuming at step 4 replays steps 5-8 of the uninterrupted run (dropout on: RNG restored)."""
    dropout = ["--dropout", "0.2"]
    full_out, full, _ = runs("dropout", extra=dropout)
    resumed_out = tmp_path / "resumed"
    shutil.copytree(full_out / "checkpoints" / "step4", resumed_out / "checkpoints" / "step4")
    (resumed_out / "checkpoints" / "latest").write_text("step4")
    _, resumed, _ = runs(
        "resumed", extra=[*dropout, "--resume_from_checkpoint", "latest"], out=resumed_out
    )
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    # Same ranks, same reduction order, same data and RNG: bit-identical.
    assert losses(resumed) == losses(full)[4:]
    assert losses(resumed, "eval_loss") == losses(full, "eval_loss")[1:]


def test_bf16_runs(runs):
    out, metrics, _ = runs("bf16", extra=["--bf16"])
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    model = BDHForCausalLM.from_pretrained(out / "final")
    assert (
        model.layer.attn.freqs.dtype == torch.float32 and model.layer.encoder.dtype == torch.float32
    )


def test_main_job_on_builtin_corpus(tmp_path):
    """No data flags: the standard-library corpus, a sample printed from the exported model."""
    out = tmp_path / "main"
    args = [
        "--deepspeed",
        str(REPO / "ds_configs/zero2.json"),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        *TINY[:-3],
        "--sample_max_new_tokens",
        "20",
        "--sample_prompt",
        "import ",
    ]
    proc = launch("torchrun", 2, "recipes/pretrain.py", args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--- sample from" in proc.stdout and "import " in proc.stdout
    assert len(read_jsonl(out / "metrics.jsonl")) == 3


def test_a_copied_recipe_runs_from_anywhere(runs, text_file, tmp_path):
    """recipes/pretrain.py copied alone into an empty directory and run from there, with the
    installed dragon and no checkout on the path: the recipe in place's losses, bit for bit."""
    project = tmp_path / "my_project"
    project.mkdir()
    shutil.copy(REPO / "recipes" / "pretrain.py", project / "train.py")
    out = tmp_path / "copied"
    args = ["--deepspeed", str(REPO / "ds_configs" / "zero2.json"), "--output_dir", str(out),
            "--train_file", str(text_file), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY]
    command = launch_command("torchrun", 2, str(project / "train.py"), args)
    env = job_env()
    del env["PYTHONPATH"]  # dragon as pip installed it
    proc = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, reference, _ = runs("zero2")
    assert losses(read_jsonl(out / "metrics.jsonl")) == losses(reference)
    assert (out / "final" / "model.safetensors").exists()


def test_an_extended_run_keeps_its_schedule_and_says_so(runs, tmp_path):
    """Resumed from its last step with a larger --max_steps, a run says where it resumed and that
    it keeps the schedule it was planned with: the rate stays at the schedule's final value
    instead of stretching the schedule again."""
    full_out, full, _ = runs("zero2")
    out = tmp_path / "extended"
    shutil.copytree(full_out / "checkpoints", out / "checkpoints")
    extra = ["--resume_from_checkpoint", "latest", "--max_steps", str(STEPS + 4)]
    _, metrics, proc = runs("extended", extra=extra, out=out)
    final_lr = full[-1]["lr"]
    assert final_lr == pytest.approx(3e-4)  # the cosine's floor: 0.1 of the peak
    assert [m["step"] for m in metrics] == list(range(STEPS + 1, STEPS + 5))
    assert [m["lr"] for m in metrics] == [final_lr] * 4
    log = proc.stdout + proc.stderr
    assert f"resumed from {out / 'checkpoints' / f'step{STEPS}'} at step {STEPS}" in log
    assert (f"the LR schedule planned for {STEPS} steps is kept; from step {STEPS} to "
            f"{STEPS + 4} the rate stays at its final 0.0003") in log


def test_a_refusal_in_a_two_rank_launch_prints_one_line(text_file, tmp_path):
    """Bad input under a 2-rank launcher: one `error:` line (rank 0's), naming the value given
    and the flag the number comes from."""
    args = [*bad_input_base("zero2.json", tmp_path / "x", text_file),
            "--block_size", "8000", "--per_device_train_batch_size", "1"]
    proc = launch("torchrun", 2, "recipes/pretrain.py", args)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: --block_size 8000: the validation set has"), errors
    assert "(--per_device_eval_batch_size 8 x 2 ranks)" in errors[0]


def test_an_export_is_readable_by_others(runs):
    """The exported weights get the umask's permissions, like every other file (transformers
    writes them owner-only)."""
    out, _, _ = runs("zero2")
    mask = os.umask(0)
    os.umask(mask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((out / "final" / name).stat().st_mode) == 0o666 & ~mask, name


@pytest.mark.slow
def test_torch_compile_trains_like_eager(runs):
    """--torch_compile (engine.compile(), inductor on CPU) gives eager's losses: the compiled
    kernels fuse and reorder fp32 sums, so within 1e-4 rather than bit for bit."""
    _, compiled, _ = runs("zero2_compiled", extra=["--torch_compile"])
    _, ref, _ = runs("zero2")
    assert losses(compiled) == pytest.approx(losses(ref), abs=1e-4)


@pytest.mark.slow
def test_deepspeed_launcher_and_chunked_attention_equal_torchrun_and_quadratic(runs):
    """2 ranks under the deepspeed launcher with the chunked form (4 chunks of 16 per 65-token
    sample, the last one padded) follow torchrun's run, whose "auto" form is quadratic at this
    length: the launcher and the form each leave the losses as they are."""
    out, metrics, _ = runs("deepspeed_chunked", launcher="deepspeed",
                           extra=["--attention", "chunked", "--attention_chunk_size", "16"])
    _, ref, _ = runs("zero2")
    assert losses(metrics) == pytest.approx(losses(ref), abs=LOSS_ATOL)
    assert losses(metrics, "eval_loss") == pytest.approx(losses(ref, "eval_loss"), abs=LOSS_ATOL)
    assert BDHForCausalLM.from_pretrained(out / "final").config.attention == "chunked"


@pytest.mark.slow
@pytest.mark.parametrize("yaml", ["zero2.yaml", "zero3.yaml"])
def test_accelerate_launch_equals_torchrun(runs, yaml):
    """Every rank still sees its own data under accelerate: the losses are torchrun's. Under
    zero2.yaml the run accumulates 2 micro-batches of 2, which equals micro-batches of 4."""
    accum = dict(micro=2, extra=["--gradient_accumulation_steps", "2"]) if yaml == "zero2.yaml" \
        else {}
    _, metrics, _ = runs(f"accelerate_{yaml}", launcher="accelerate", config=yaml, **accum)
    _, ref, _ = runs("zero2")
    assert losses(metrics) == pytest.approx(losses(ref), abs=LOSS_ATOL)


def test_export_cli_turns_checkpoint_into_model(runs, tmp_path):
    """recipes/export.py merges the ZeRO-3 shards of the last checkpoint into the final model."""
    out, _, _ = runs("zero3", config="zero3.json")
    proc = run_tool("recipes/export.py", "--checkpoint", out / "checkpoints" / "step8",
                    "--output", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = BDHForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.arange(64).view(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, final_logits(out), atol=0, rtol=0)


def test_export_never_replaces_a_users_files_silently(runs, tmp_path):
    """recipes/export.py into a directory holding a user's files is refused in one line and
    writes nothing; with --overwrite it writes the export's files and leaves the others."""
    out, _, _ = runs("zero3", config="zero3.json")
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    (target / "config.json").write_text("{}")
    argv = ["--checkpoint", str(out / "checkpoints" / "step8"), "--output", str(target)]
    proc = run_tool("recipes/export.py", *argv)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --output {target}: holds files (config.json, notes.txt)"
    ), proc.stderr[-2000:]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "notes.txt"]
    assert (target / "config.json").read_text() == "{}"
    proc = run_tool("recipes/export.py", *argv, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "notes.txt").read_text() == "keep me"
    assert BDHForCausalLM.from_pretrained(target).config.n_layer == 2


@pytest.mark.parametrize(
    "argv,env,expected",
    [
        (
            ["--train_file", "/nonexistent/corpus.txt"],
            {},
            "'/nonexistent/corpus.txt' does not exist",
        ),
        (["--deepspeed", "/nonexistent.json"], {}, "--deepspeed /nonexistent.json: no such file"),
        (["--block_size", "100000000"], {}, "shorter than one block"),
        ([], {"WORLD_SIZE": "100000"}, "fewer than the 100000 data-parallel ranks"),
        (["--save_total_limit", "0"], {}, "save_total_limit must be an integer >= 1"),
        (
            ["--metric_for_best_model", "bleu"],
            {},
            "--metric_for_best_model 'bleu' is never recorded",
        ),
        (["--resume_from_checkpoint", "/nonexistent/ckpt"], {}, "no such directory"),
        (["--lr_scheduler_type", "sideways"], {}, "valid are linear, cosine"),
        (["--n_head", "3"], {}, "not divisible by n_head=3"),
        (["--attention", "flash"], {}, "BDHConfig.attention='flash': valid are auto, quadratic"),
        (["--nan_policy", "ignore"], {}, "--nan_policy='ignore': valid are skip, stop"),
        (["--save_failure", "retry"], {}, "--save_failure='retry': valid are stop, continue"),
        (["--max_bad_steps", "0"], {}, "--max_bad_steps=0: must be >= 1"),
        (["--diloco_inner_steps", "2", "--diloco_topk", "0.02", "--diloco_compress", "int4"], {},
         "--diloco_topk 0.02 sends its own code; drop --diloco_compress int4"),
        (["--diloco_inner_steps", "2", "--diloco_topk", "1.5"], {},
         "--diloco_topk 1.5: must be in [0, 1)"),
        (["--neuron_parallel", "0"], {}, "--neuron_parallel=0: must be >= 1"),
        (["--model_type", "t5"], {}, "--model_type 't5': valid are bdh, gpt2, llama"),
        (["--model_type", "gpt2", "--neuron_parallel", "2"], {"WORLD_SIZE": "2"},
         "--model_type gpt2: not with --neuron_parallel (BDH's neurons); drop it, or train "
         "--model_type bdh"),
        (["--model_type", "llama", "--n_embd", "30", "--n_head", "2"], {},
         "--model_type llama: a head of 15 dimensions cannot be rotated in pairs (RoPE)"),
        (["--report_to", "tensorboard,mlflow"], {}, "--report_to 'tensorboard,mlflow': 'mlflow' "
         "is not a tracker; valid are tensorboard, csv, wandb, comet or none"),
        (["--neuron_parallel", "3"], {"WORLD_SIZE": "3"},
         "--neuron_parallel 3: N=2048 neurons per head must split into 3 even shares (valid: "
         "divisors of 1024)"),
        (["--neuron_parallel", "2"], {"WORLD_SIZE": "3"},
         "--neuron_parallel 2: the world size 3 is not divisible by it (valid: a divisor of 3)"),
        (["--neuron_parallel", "2", "--diloco_inner_steps", "4", "--diloco_islands", "2",
          "--diloco_fragments", "3"], {"WORLD_SIZE": "4"},
         "--diloco_fragments 3: each of the 2 neuron shares holds 1024 neurons per head, not a "
         "multiple of it; use a divisor of 1024"),
    ],
)
def test_bad_input_stops_before_start(monkeypatch, text_file, tmp_path, argv, env, expected):
    """Each mistake is one line naming the bad value, before any process group starts."""
    base = bad_input_base("zero2.json", tmp_path, text_file)
    assert expected in run_recipe_in_process(monkeypatch, "recipes/pretrain.py", base + argv, env)


def test_unknown_zero_stage_is_refused(monkeypatch, text_file, tmp_path):
    config = tmp_path / "stage5.json"
    config.write_text('{"zero_optimization": {"stage": 5}}')
    argv = [*bad_input_base("zero2.json", tmp_path, text_file), "--deepspeed", str(config)]
    message = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv)
    assert "zero_optimization.stage 5: valid are 0, 1, 2 and 3" in message


@pytest.mark.parametrize(
    "text,expected",
    [
        (
            '{"zero_optimization": {"stage": 2},\n "gradient_clipping": 1.0,,\n}',
            "not valid JSON (Expecting property name enclosed in double quotes: line 2 column 27",
        ),
        (
            '{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4}',
            "train_batch_size=7 != train_micro_batch_size_per_gpu=4 x "
            "gradient_accumulation_steps=1 x world size 1",
        ),
    ],
)
def test_bad_deepspeed_json_is_refused(monkeypatch, text_file, tmp_path, text, expected):
    config = tmp_path / "bad.json"
    config.write_text(text)
    argv = [*bad_input_base("zero2.json", tmp_path, text_file), "--deepspeed", str(config)]
    assert expected in run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv)


def fake_checkpoint(save_dir, tag="step4", **sizes):
    """A complete-looking checkpoint of a model with `sizes`, as the recipes leave one."""
    from dragon.model.bdh import BDHConfig

    BDHConfig(**{"n_layer": 2, "n_embd": 32, "n_head": 2, **sizes}).save_pretrained(save_dir)
    (save_dir / tag).mkdir()
    (save_dir / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (save_dir / tag / MARKER).write_text('{"step": 4}')
    (save_dir / "latest").write_text(tag)


def test_output_dir_of_another_run_is_refused(monkeypatch, text_file, tmp_path):
    """A new run never trains into another run's checkpoints, unless told to
    (--overwrite_output_dir)."""
    fake_checkpoint(tmp_path / "checkpoints")
    argv = bad_input_base("zero2.json", tmp_path, text_file)
    message = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv)
    assert "checkpoints already holds checkpoints (step4)" in message
    assert "--resume_from_checkpoint latest, or pass --overwrite_output_dir" in message
    # told to: the new run trains there, and the other run's checkpoint stays beside its own
    proc = launch("python", 1, "recipes/pretrain.py", [
        *argv, "--overwrite_output_dir", "--max_steps", "2", "--save_steps", "2", "--eval_steps",
        "2", "--logging_steps", "1", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--max_eval_samples", "4",
        "--sample_max_new_tokens", "0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in m] == [1, 2]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step2"
    assert is_complete(tmp_path / "checkpoints" / "step2")
    assert (tmp_path / "checkpoints" / "step4" / MARKER).read_text() == '{"step": 4}'


def test_resume_from_a_different_model_size_is_refused(monkeypatch, text_file, tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", n_embd=64)
    resume = ["--resume_from_checkpoint", "latest"]
    argv = bad_input_base("zero2.json", tmp_path, text_file) + resume
    message = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv)
    assert "holds a model with n_embd=64, this run builds n_embd=32" in message


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2_offload.json", "zero3_offload.json"])
def test_cpu_offload_configs_train_like_zero2(runs, config):
    """DeepSpeedCPUAdam on offloaded fp32 states follows torch AdamW's trajectory: within 1e-4, as
    docs/troubleshooting.md states (its fused update orders the sums its own way)."""
    _, metrics, _ = runs(config.removesuffix(".json"), config=config)
    _, ref, _ = runs("zero2")
    assert losses(metrics) == pytest.approx(losses(ref), abs=1e-4)


def test_every_evaluation_logs_bits_per_byte(runs):
    """eval_bpb beside every eval_loss; with the byte tokenizer each predicted token is one byte
    of text, so it is eval_loss / ln 2 (the ZeRO and the pipeline recipe)."""
    for metrics in (runs("zero2")[1], runs("pipe_x2", **PIPE_X2)[1]):
        evaluated = [m for m in metrics if "eval_loss" in m]
        assert len(evaluated) == 2
        for m in evaluated:
            assert m["eval_bpb"] == pytest.approx(m["eval_loss"] / math.log(2), rel=1e-12)


def test_every_evaluation_logs_how_sparse_the_activations_are(runs):
    """Per layer, the fraction of positive x, y and x * y over the validation batches and ranks
    (the ZeRO recipe); x * y fires only where both do."""
    evaluated = [m for m in runs("zero2")[1] if "eval_loss" in m]
    for m in evaluated:
        sparsity = {k: v for k, v in m.items() if k.startswith("sparsity/")}
        assert len(sparsity) == 3 * 2  # TINY: 2 layers
        for i in range(2):
            x, y, xy = (m[f"sparsity/layer{i}/{kind}"] for kind in ("x", "y", "xy"))
            assert 0 < xy <= min(x, y) < 1
