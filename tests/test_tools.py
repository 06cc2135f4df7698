"""Operator tools: the dry run (plan and memory estimate), plots, sampling, export with a card."""

import re
import runpy
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
    bad_input_base,
    job_env,
    launch_command,
    read_jsonl,
    run_recipe_in_process,
)

PIPE = "recipes/pretrain_pipeline.py"


def dry_run(monkeypatch, capsys, script: str, argv: list[str], world: int = 1) -> str:
    """The recipe's main() with --dry_run in this process: it exits 0 before any process group
    starts; returns what it printed."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(sys, "argv", [script, *argv, "--dry_run"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert stop.value.code in (0, None), stop.value
    assert not torch.distributed.is_initialized()
    return capsys.readouterr().out


def test_the_dry_run_prints_the_checked_plan(monkeypatch, capsys, tmp_path, text_file):
    """ZeRO-2 on 2 ranks, and 2 DiLoCo islands of 2-stage pipelines x 2 data-parallel ranks:
    the topology rank by rank, sizes, tokens, the resolved DeepSpeed config, the memory parts;
    nothing is written."""
    base = bad_input_base("zero2.json", tmp_path / "a", text_file)
    out = dry_run(monkeypatch, capsys, "recipes/pretrain.py", [*base, "--max_steps", "10"], 2)
    assert "topology: 1 island(s) x 1 pipeline stage(s) x 2 data-parallel rank(s)" in out
    assert "  rank 1: data rank 1 of 2" in out
    assert "tokens per step" in out and "10 steps = " in out
    assert '"train_batch_size": 16' in out and '"auto"' not in out and '"stage": 2' in out
    assert re.search(r"model states: [\d.,]+ MiB\n  activations: [\d.,]+ MiB\n  total", out)
    assert not (tmp_path / "a").exists()

    base = bad_input_base("pipeline_zero1.json", tmp_path / "b", text_file)
    extra = ["--pipeline_stages", "2", "--diloco_islands", "2", "--diloco_inner_steps", "4"]
    extra += ["--gradient_accumulation_steps", "2"]
    out = dry_run(monkeypatch, capsys, PIPE, [*base, *extra], 8)
    assert "topology: 2 island(s) x 2 pipeline stage(s) x 2 data-parallel rank(s)" in out
    assert "  rank 5: island 1, stage 0, data rank 1 of 2" in out
    assert "  rank 6: island 1, stage 1, data rank 0 of 2" in out
    assert "DiLoCo: outer step every 4 steps" in out
    assert "DiLoCo theta_outer and outer optimizer:" in out


@pytest.mark.parametrize(
    "script, config, argv, world, expected",
    [
        ("recipes/pretrain.py", "zero2.json", ["--n_head", "3"], 1, "n_embd"),
        (PIPE, "pipeline_zero0.json", ["--pipeline_stages", "3"], 4,
         "--pipeline_stages 3: the world size 4 is not divisible by it"),
        ("recipes/pretrain.py", "zero2.json", ["--carry_state", "--per_device_eval_batch_size",
                                               "100000"], 1, "validation set has"),
    ],
)
def test_the_dry_run_stops_with_the_real_start_s_error(
    monkeypatch, tmp_path, text_file, script, config, argv, world, expected
):
    """A config that would fail fails the dry run the same way: exit 1, one line."""
    base = bad_input_base(config, tmp_path, text_file)
    env = {"WORLD_SIZE": str(world)}
    real = run_recipe_in_process(monkeypatch, script, base + argv, env)
    assert expected in real
    assert run_recipe_in_process(monkeypatch, script, [*base, *argv, "--dry_run"], env) == real


MEMORY = (
    "--n_layer 2 --n_embd 256 --n_head 4 --mlp_internal_dim_multiplier 16 --block_size 256 "
    "--per_device_train_batch_size 8 --max_steps 3 --logging_steps 1 --eval_steps 100 "
    "--save_steps 100 --max_eval_samples 8 --sample_max_new_tokens 0 --disable_tqdm"
).split()


@pytest.mark.parametrize("config", ["zero0.json", "zero2.json"])
def test_the_memory_estimate_is_near_the_measured_peak(
    monkeypatch, capsys, tmp_path, text_file, config
):
    """A 3.3M-parameter BDH at block 256 (activations dominate, as they do for BDH): the dry
    run's per-rank total is within 25 % of the peak a real 3-step run measures (resident memory
    above what the process held before the model was built)."""
    argv = ["--deepspeed", str(REPO / "ds_configs" / config), "--output_dir", str(tmp_path)]
    argv += ["--train_file", str(text_file), *MEMORY]
    out = dry_run(monkeypatch, capsys, "recipes/pretrain.py", argv)
    estimate = float(re.search(r"total: ([\d,.]+) MiB", out).group(1).replace(",", ""))
    job = subprocess.run(launch_command("torchrun", 1, "recipes/pretrain.py", argv), cwd=REPO,
                         env=job_env(), capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    peak = max(m["memory_peak_mib"] for m in read_jsonl(tmp_path / "metrics.jsonl")
               if "memory_peak_mib" in m)
    print(f"{config}: estimate {estimate:.0f} MiB, measured peak {peak:.0f} MiB")
    assert abs(estimate / peak - 1) < 0.25, (estimate, peak)
