"""The named configs of recipes/configs/: each plans within its GPU's memory under the world size
its header names (the header's own `Plan:` command), its header states that plan's memory and
tokens per step, and it trains 4 steps on CPU shrunk.

The shrink (conftest.SHRINK, plus per config the world in WORLDS) keeps a config's layout (ZeRO
stage, recipe, --neuron_parallel, pipeline stages, DiLoCo mode, codec and fragments) and makes it
small, at 1 to 4 ranks.
"""

import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO, SHRINK, SHRUNK_STEPS as STEPS, dry_run_in_process, launch, losses, \
    read_jsonl, run_recipe_in_process, with_local_data

CONFIGS = sorted((REPO / "recipes" / "configs").glob("*.yaml"))
GPU_BYTES = 80 * 10**9  # the 80 GB class every config assumes
MIB = 2**20
# name -> (ranks, flags): the layout at 1 to 4 ranks; the quickstart keeps its own sizes.
WORLDS = {
    "bdh_25m_1gpu": (1, SHRINK),
    "bdh_100m_8gpu_zero2": (2, SHRINK),
    "bdh_1b_8gpu_neurons": (2, SHRINK + ["--neuron_parallel", "2"]),
    # 2 stages x K=2 x 1 data-parallel rank
    "bdh_1b_4x8gpu_pipeline": (4, SHRINK + ["--neuron_parallel", "2"]),
    # 2 islands of K=2 ranks, an outer step every 4 steps with its 4 fragments, delayed, int4
    "bdh_1b_diloco_4islands": (4, SHRINK + ["--neuron_parallel", "2", "--diloco_islands", "2",
                                            "--diloco_inner_steps", str(STEPS)]),
    "quickstart_cpu": (2, f"--max_steps {STEPS} --logging_steps 1 --eval_steps {STEPS}"
                          f" --save_steps {STEPS} --max_eval_samples 16"
                          " --sample_max_new_tokens 0 --disable_tqdm".split()),
}


FIELDS = ("GPU assumed", "Launch", "Plan", "Memory per device (dry-run estimate)",
          "Tokens per step", "Time to train (plan)", "Measured on a GPU", "Data", "Sizes")
GPU_CONFIGS = [c for c in CONFIGS if c.stem != "quickstart_cpu"]


def header(config: Path) -> dict[str, str]:
    """The header's `Field: value` fields (FIELDS); the indented lines after a field continue it,
    a trailing backslash dropped."""
    fields, name = {}, None
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        if name and line.startswith("#   "):
            fields[name] = fields[name].removesuffix("\\").rstrip() + " " + line[1:].strip()
            continue
        name = next((f for f in FIELDS if line.startswith(f"# {f}: ")), None)
        if name:
            fields[name] = line[len(name) + 4:].strip()
    return fields


def test_every_config_is_named_and_has_a_header():
    assert {c.stem for c in CONFIGS} == set(WORLDS)
    for config in CONFIGS:
        fields = header(config)
        assert set(fields) == set(FIELDS), config.name


def plan_argv(config: Path, folder: Path, data_file: Path) -> tuple[str, list[str], dict]:
    """(script, arguments, launcher variables) of the header's `Plan:` command, writing to
    `folder`, its hub data replaced by `data_file` (conftest.with_local_data)."""
    words = shlex.split(header(config)["Plan"])
    env = dict(w.split("=", 1) for w in words if re.match(r"[A-Z_]+=", w))
    python, script, *argv = [w for w in words if not re.match(r"[A-Z_]+=", w)]
    assert python == "python" and argv[0] == f"recipes/configs/{config.name}"
    assert argv[-1] == "--dry_run"
    argv = [str(config), *argv[1:-1], "--output_dir", str(folder / "out")]
    return script, with_local_data(argv, data_file, folder), env


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_plans_within_its_memory(monkeypatch, capsys, tmp_path, long_text_file, config):
    fields = header(config)
    script, argv, env = plan_argv(config, tmp_path, long_text_file)
    # the plan of a real start; only its data (~2 MB here) and where it would write differ
    dry_run_in_process(monkeypatch, script, [*argv, "--max_data_epochs", "1e9"], env)
    printed = capsys.readouterr()
    plan = printed.out
    total = float(re.search(r"^  total: ([\d,.]+) MiB$", plan, re.M).group(1).replace(",", ""))
    assert total * MIB <= GPU_BYTES, f"{config.name}: {total:,.1f} MiB per device"
    # the header's figure is the plan's, within what a refinement of the estimate may move it
    stated = float(fields["Memory per device (dry-run estimate)"].split()[0].replace(",", ""))
    assert abs(stated - total) <= 0.05 * total, (config.name, stated, total)
    tokens = re.search(r"; ([\d,]+) tokens per step;", plan).group(1)
    assert fields["Tokens per step"].startswith(f"{tokens} ("), (config.name, tokens)
    time = re.search(r"^time to train: (.*)$", plan, re.M).group(1)
    assert fields["Time to train (plan)"] == time, (config.name, time)
    # a real size's plan reads the 2 MB over and over: said in one line before it starts
    repeats = [line for line in printed.err.splitlines() if line.startswith("warning: ")]
    if config in GPU_CONFIGS:
        assert len(repeats) == 1 and " epochs over --train_file " in repeats[0], printed.err
    else:
        assert not repeats and "0.15 epochs over the built-in corpus" in plan


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: c.stem)
def test_a_config_past_100_epochs_of_its_data_is_refused(monkeypatch, tmp_path, long_text_file,
                                                         config):
    script, argv, env = plan_argv(config, tmp_path, long_text_file)
    line = run_recipe_in_process(monkeypatch, script, argv, env)
    assert re.match(r"error: --max_steps \d+ plans [\d,.]+ epochs over --train_file .*, more "
                    r"than --max_data_epochs 100; give more data", line), line


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_trains_shrunk(tmp_path, text_file, config):
    ranks, shrink = WORLDS[config.stem]
    script = re.search(r"(recipes/pretrain\w*\.py)", header(config)["Launch"]).group(1)
    out = tmp_path / "run"
    argv = with_local_data([config, *shrink, "--output_dir", out], text_file, tmp_path)
    proc = launch("torchrun", ranks, script, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = out / "metrics.jsonl"
    if not metrics.exists():  # DiLoCo islands: island 0's
        metrics = out / "island0" / "metrics.jsonl"
    trained = losses(read_jsonl(metrics))
    assert len(trained) == STEPS and all(0 < loss < 10 for loss in trained), trained
