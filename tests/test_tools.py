"""Operator tools: the dry run (plan and memory estimate), plots, sampling, export with a card."""

import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch
from conftest import (
    DILOCO_ZERO3,
    PIPE_X2,
    REPO,
    bad_input_base,
    job_env,
    launch_command,
    read_jsonl,
    run_recipe_in_process,
    run_tool,
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
    assert "layout: 1 island(s) x 1 pipeline stage(s) x 1 neuron share(s) x 2 data-parallel " \
        "rank(s), ZeRO-2" in out
    assert "  rank 1: data rank 1 of 2" in out
    assert "  data-parallel groups: [0, 1]" in out
    assert "tokens per step" in out and "10 steps = " in out
    assert '"train_batch_size": 16' in out and '"auto"' not in out and '"stage": 2' in out
    assert re.search(r"model states: [\d.,]+ MiB\n  activations: [\d.,]+ MiB\n  total", out)
    assert not (tmp_path / "a").exists()

    base = bad_input_base("pipeline_zero1.json", tmp_path / "b", text_file)
    extra = ["--pipeline_stages", "2", "--diloco_islands", "2", "--diloco_inner_steps", "4"]
    extra += ["--gradient_accumulation_steps", "2", "--diloco_island_steps", "4,3"]
    out = dry_run(monkeypatch, capsys, PIPE, [*base, *extra], 8)
    assert "layout: 2 island(s) x 2 pipeline stage(s) x 1 neuron share(s) x 2 data-parallel " \
        "rank(s), ZeRO-1" in out
    assert "  rank 5: island 1, stage 0, data rank 1 of 2" in out
    assert "  rank 6: island 1, stage 1, data rank 0 of 2" in out
    assert "  island 1: launch ranks 4-7" in out
    assert "    stage 1: ranks 2-3" in out and "    stage 1 data-parallel groups: [2, 3]" in out
    assert "DiLoCo: outer step every 4 steps" in out
    assert "; unequal islands, steps per window of 4: 4, 3, averages weighted by tokens" in out
    assert "DiLoCo theta_outer and outer optimizer:" in out


def test_the_dry_run_shows_each_rank_s_share_of_the_neurons(monkeypatch, capsys, tmp_path,
                                                             text_file):
    """--neuron_parallel 2 on 2 ranks against 1 rank (both one data-parallel rank): each rank's
    share is named, and its estimated activations are those of a model with half the neurons."""
    base = [*bad_input_base("zero2.json", tmp_path / "a", text_file), "--block_size", "256"]
    parts = {}
    for k in (1, 2):
        out = dry_run(monkeypatch, capsys, "recipes/pretrain.py",
                      [*base, "--neuron_parallel", str(k)], k)
        parts[k] = {name: float(mib.replace(",", "")) for name, mib in
                    re.findall(r"  (model states|activations): ([\d.,]+) MiB", out)}
    assert "layout: 1 island(s) x 1 pipeline stage(s) x 2 neuron share(s) x 1 data-parallel " \
        "rank(s), ZeRO-2" in out
    assert "  rank 1: neurons 1 of 2, data rank 0 of 1" in out
    assert "  neuron groups: [0, 1]" in out and "each neuron share: N/2 = 1024 neurons" in out
    assert 0.45 < parts[2]["activations"] / parts[1]["activations"] < 0.6
    assert 0.45 < parts[2]["model states"] / parts[1]["model states"] < 0.6


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
    "--per_device_train_batch_size 8 --max_steps 2 --logging_steps 1 --eval_steps 100 "
    "--save_steps 100 --max_eval_samples 8 --sample_max_new_tokens 0 --disable_tqdm"
).split()


def test_the_memory_estimate_is_near_the_measured_peak(monkeypatch, capsys, tmp_path, text_file):
    """A 3.3M-parameter BDH at block 256 under ZeRO-2 (activations dominate, as they do for BDH):
    the dry run's per-rank total is within 25 % of the peak a real 2-step run measures (resident
    memory above what the process held before the model was built; benchmarks/memory.py has
    more stages)."""
    config = "zero2.json"
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


@pytest.fixture(scope="module")
def made(runs) -> dict:
    """Real 8-step runs, each saving at steps 4 and 8: a 2-stage pipeline, and 2 DiLoCo islands of
    one ZeRO-3 rank each (H = 4), the session's (test_reshape resumes them too)."""
    return {"pipeline": runs("pipe_x2", **PIPE_X2)[0],
            "diloco": runs("diloco_zero3", **DILOCO_ZERO3)[0]}


def recipe_in_process(script: str, argv: list[str]) -> str:
    """A tool run in this process to success (conftest.run_tool); returns its stdout."""
    proc = run_tool(script, *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recipe_in_process.stderr = proc.stderr
    return proc.stdout


def test_plots_of_one_run_and_of_two_overlaid(monkeypatch, capsys, made, tmp_path):
    """The PNG has the requested size (read back); the axes cover every step logged; a DiLoCo
    run is drawn per island, with its cross-island bytes."""
    from matplotlib.image import imread

    one, two = tmp_path / "one.png", tmp_path / "two.png"
    recipe_in_process("recipes/plot.py",
                      [str(made["pipeline"]), "--output", str(one), "--width", "6", "--height", "4",
                       "--dpi", "50"])
    assert imread(one).shape[:2] == (200, 300)
    recipe_in_process("recipes/plot.py",
                      [str(made["pipeline"]), str(made["diloco"]), "--output", str(two)])
    assert imread(two).shape[:2] == (800, 1500)
    tool = runpy.run_path(str(REPO / "recipes/plot.py"))
    lines = tool["series"](str(made["pipeline"]), "dp") + tool["series"](str(made["diloco"]), "dl")
    assert [name for name, _ in lines] == ["dp", "dl island0", "dl island1"]
    fig = tool["plot"](lines, (15, 8), 100)
    by_step, by_tokens, _ = fig.axes[:3]
    low, high = by_step.get_xlim()
    assert low <= 1 and high >= 8
    assert by_tokens.get_xlim()[1] >= max(m.get("tokens", 0) for _, h in lines for m in h.values())
    legend = [t.get_text() for t in fig.axes[4].get_legend().get_texts()]
    assert legend == ["dl island0", "dl island1"]  # only DiLoCo sends between islands


def test_a_run_without_islands_is_plotted_without_an_empty_panel(made):
    """A run without DiLoCo has no cross-island panel; every panel has a y label and a line;
    training and validation loss share the first; validation bits per byte and the pipeline's
    sparsity (each stage measures its own layers) have their own."""
    tool = runpy.run_path(str(REPO / "recipes/plot.py"))
    fig = tool["plot"](tool["series"](str(made["pipeline"]), "dp"), (10, 8), 50)
    assert len(fig.axes) == 6 and not any("DiLoCo" in ax.get_title() for ax in fig.axes)
    assert all(ax.get_ylabel() and ax.lines for ax in fig.axes)
    assert "validation" in fig.axes[0].get_title() and len(fig.axes[0].lines) == 3
    assert "bits per byte" in fig.axes[4].get_title()  # eval_bpb at each evaluation
    assert "active on validation" in fig.axes[5].get_title()


def test_sampling_a_run_without_a_checkpoint_says_what_to_pass(monkeypatch, tmp_path):
    """sample.py on a run that saved nothing yet: one line that names the tool and what to pass."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", ["sample.py", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "recipes/sample.py"), run_name="__main__")
    message = str(stop.value)
    assert message.startswith("error: sample: ") and "no complete checkpoint" in message
    assert "a Hugging Face directory" in message and "\n" not in message


def greedy(path, *extra) -> str:
    argv = [str(path), "--prompt", "def ", "--max_new_tokens", "12", *extra]
    return recipe_in_process("recipes/sample.py", argv)


def test_sampling_from_each_checkpoint_kind_equals_its_export(
    monkeypatch, capsys, made, tmp_path
):
    """Greedy text from a pipeline checkpoint and a DiLoCo run's directory (island 0's best
    checkpoint, ZeRO-3) equals the greedy text of the Hugging Face export of the
    same weights; only the text is on stdout."""
    for name, path in (
        ("pipeline", made["pipeline"] / "checkpoints" / "step4"),
        ("diloco", made["diloco"]),
    ):
        text = greedy(path)
        assert text.startswith("def ") and text.count("\n") >= 1, text
        hf = tmp_path / name
        recipe_in_process("recipes/export.py",
                          ["--checkpoint", str(path), "--output", str(hf)])
        assert greedy(hf) == text, name
    island0 = made["diloco"] / "island0"
    losses = {m["step"]: m["eval_loss"] for m in read_jsonl(island0 / "metrics.jsonl")
              if "eval_loss" in m}
    greedy(made["diloco"])
    assert f"step{min(losses, key=losses.get)}\n" in recipe_in_process.stderr
    greedy(made["diloco"], "--checkpoint", "latest")
    assert "step8\n" in recipe_in_process.stderr
    # sampling at temperature 1: a seed gives one text, another seed another, neither greedy's
    sampled = [greedy(made["pipeline"], "--temperature", "1", "--seed", seed)
               for seed in ("3", "3", "4")]
    assert sampled[0] == sampled[1] != sampled[2]
    assert greedy(made["pipeline"]) not in sampled


def test_export_round_trips_logits_and_its_card_names_the_validation_loss(
    monkeypatch, capsys, made, tmp_path
):
    """The export of a DiLoCo island's ZeRO-3 checkpoint gives the checkpoint's logits exactly;
    its model card names the stage, the islands, the steps, the tokens and the last validation
    loss; the run's own final/ export has a card too."""
    from dragon.checkpoint.read_model import model_from_checkpoint
    from dragon.model.bdh import BDHForCausalLM

    tag = made["diloco"] / "island0" / "checkpoints" / "step8"
    recipe_in_process("recipes/export.py",
                      ["--checkpoint", str(tag), "--output", str(tmp_path / "hf")])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model_from_checkpoint(str(tag)).eval()(ids).logits
        theirs = BDHForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    assert torch.equal(ours, theirs)
    loss = [m["eval_loss"] for m in read_jsonl(made["diloco"] / "island0" / "metrics.jsonl")
            if m["step"] == 8 and "eval_loss" in m][0]
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"| final validation loss | {loss:.4f} (step 8) |" in card
    assert "| DeepSpeed | ZeRO-3, fp32 |" in card and "| steps | 8 |" in card
    assert "| tokens | " in card and "import dragon" in card
    assert "| recipe | pretrain.py |" in card
    assert "| DiLoCo islands | 2 (outer step every 4) |" in card
    assert f"{loss:.4f} (step 8)" in (made["diloco"] / "final" / "README.md").read_text()


def test_deepspeed_zero_to_fp32_works_on_our_checkpoints(made, tmp_path):
    """The zero_to_fp32.py DeepSpeed copies next to the checkpoints merges ours into the same
    weights our export has."""
    from safetensors.torch import load_file

    from dragon.checkpoint.read_model import model_from_checkpoint

    save_dir = made["diloco"] / "island0" / "checkpoints"
    script = save_dir / "zero_to_fp32.py"
    assert script.exists()
    job = subprocess.run([sys.executable, str(script), str(save_dir), str(tmp_path / "out"),
                          "-t", "step8", "--safe_serialization"], capture_output=True, text=True,
                         env=job_env(), timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    merged = load_file(tmp_path / "out" / "model.safetensors")
    ours = model_from_checkpoint(str(save_dir / "step8")).state_dict()
    assert set(merged) <= set(ours)
    for name, value in merged.items():
        assert torch.equal(value, ours[name]), name


def test_a_diloco_checkpoint_holds_theta_outer(made):
    """Each island saves right after an outer step, which writes theta_outer into its weights:
    the export of island 0's (ZeRO-3) checkpoint has the float64 sum and sum of squares of the
    theta_outer in its DiLoCo state (equal within 1e-9 relative)."""
    from dragon.checkpoint.read_model import model_from_checkpoint

    tag = made["diloco"] / "island0" / "checkpoints" / "step8"
    state = torch.load(tag / "diloco_state_0.pt", weights_only=False)
    outer = torch.cat([t for pieces in state["named"]["outer"].values()
                       for _, _, t in pieces]).double()
    model = model_from_checkpoint(str(tag))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    for ours, theirs in ((weights.sum(), outer.sum()), (weights.pow(2).sum(), outer.pow(2).sum())):
        assert abs(float(ours) / float(theirs) - 1) < 1e-9


# Run where dragon cannot be imported: python -c WITHOUT_DRAGON EXPORT_DIR PROMPT prints the
# prompt's ids and the greedy continuation that transformers alone gives.
WITHOUT_DRAGON = """import json, sys
try:
    import dragon
    sys.exit("dragon is importable")
except ImportError:
    pass
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
ids = tokenizer(sys.argv[2], return_tensors="pt", add_special_tokens=False).input_ids
out = model.generate(ids, max_new_tokens=12, do_sample=False)
print(json.dumps({"prompt": ids[0].tolist(), "ids": out[0].tolist(),
                  "text": tokenizer.decode(out[0]), "class": type(model).__module__}))
"""


def test_an_export_loads_and_generates_without_dragon(monkeypatch, capsys, made, tmp_path):
    """recipes/export.py of a pipeline checkpoint and a run's own final/ (ZeRO-3 islands): with
    the model's code beside the weights (auto_map) and the byte tokenizer saved as transformers
    reads it, AutoModelForCausalLM (trust_remote_code) and AutoTokenizer load them in a process
    where `import dragon` fails, and generate() gives dragon's own greedy ids."""
    from dragon.model.bdh import BDHForCausalLM

    recipe_in_process("recipes/export.py",
                      ["--checkpoint", str(made["pipeline"] / "checkpoints" / "step8"),
                       "--output", str(tmp_path / "hf")])
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "dragon.py").write_text("raise ImportError('dragon is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=str(blocked), HF_MODULES_CACHE=str(tmp_path / "modules"))
    prompt = "def héllo"
    for export in (tmp_path / "hf", made["diloco"] / "final"):
        assert (export / "modeling_bdh.py").exists() and (export / "tokenizer.json").exists()
        job = subprocess.run([sys.executable, "-c", WITHOUT_DRAGON, str(export), prompt],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL)
        assert job.returncode == 0, job.stderr[-3000:]
        got = json.loads(job.stdout.strip().splitlines()[-1])
        assert got["prompt"] == list(prompt.encode("utf-8"))
        assert "transformers_modules" in got["class"]  # the code beside the weights
        with torch.no_grad():
            ours = BDHForCausalLM.from_pretrained(export).eval().generate(
                torch.tensor([got["prompt"]]), max_new_tokens=12, do_sample=False)
        assert got["ids"] == ours[0].tolist()
        assert got["text"].startswith(prompt)


def test_lm_evaluation_harness_scores_an_export_as_dragon_does(made, tmp_path):
    """lm_eval (the harness's CLI, offline) on a run's final/ export with the shipped local task
    (launch/lm_eval): every log-likelihood it computes is dragon's own for the same bytes within
    1e-5, and it reports an accuracy."""
    from dragon.model.bdh import BDHForCausalLM

    export = made["diloco"] / "final"
    env = dict(job_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    job = subprocess.run(
        ["lm_eval", "--model", "hf", "--model_args",
         f"pretrained={export},trust_remote_code=True,dtype=float32,prefix_token_id=10",
         "--tasks", "python_syntax", "--include_path", "launch/lm_eval", "--device", "cpu",
         "--batch_size", "1", "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    assert re.search(r"\|python_syntax\|.*\|acc\s*\|", job.stdout), job.stdout[-2000:]
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_*.jsonl")
               for line in path.read_text().splitlines()]
    assert len(samples) == 6
    model = BDHForCausalLM.from_pretrained(export).eval()
    for sample in samples:
        context = list(sample["doc"]["context"].encode())
        for choice, response in zip(sample["doc"]["choices"], sample["filtered_resps"]):
            continuation = list(choice.encode())
            with torch.no_grad():
                logits = model(torch.tensor([context + continuation])).logits[0, :-1]
            logp = torch.log_softmax(logits.double(), -1)
            ours = sum(float(logp[len(context) - 1 + j, t]) for j, t in enumerate(continuation))
            assert abs(ours - float(response[0])) < 1e-5, (sample["doc"], choice)
