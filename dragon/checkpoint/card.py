"""What a run was, for the people who use its model: run.json next to the checkpoints (written at
start) and the README.md model card of every Hugging Face export."""

import json
import os
from dataclasses import asdict
import sys
import tempfile
from typing import Optional

from dragon.model.cost import parameter_count
from dragon.parallel.ds_config import zero_stage
from dragon.history import MetricHistory, metrics_path
from dragon.model import baseline
from dragon.model.baseline import is_bdh
from dragon.version import __version__
from transformers import PretrainedConfig

RUN_FILE = "run.json"


def run_info(inputs, islands: int, dp_world: int, tokens_per_step: int) -> dict:
    """The training configuration a model card names (inputs: dragon.run.inputs.RecipeInputs)."""
    diloco = inputs.diloco
    return {
        "dragon_version": __version__,
        "recipe": os.path.basename(sys.argv[0]),
        "command": sys.argv[1:],
        "zero_stage": zero_stage(inputs.ds_config),
        "bf16": bool(inputs.ds_config.get("bf16", {}).get("enabled")),
        "islands": islands,
        "diloco_inner_steps": diloco.diloco_inner_steps if diloco.enabled else None,
        "pipeline_stages": inputs.pipeline.pipeline_stages if inputs.pipeline else 1,
        "data_parallel": dp_world,
        "block_size": inputs.data.block_size,
        "tokens_per_step": tokens_per_step,
        "max_steps": inputs.train.max_steps,
        "carry_state": inputs.train.carry_state,
        "layout": asdict(inputs.layout),
        "wandb_run_id": os.environ.get("WANDB_RUN_ID"),  # where a resume logs on
        # `python recipes/<recipe> run.json [--flag value ...]` repeats the run (flags override)
        "arguments": inputs.arguments(),
    }


def _final_eval(run_dir: str, up_to: Optional[int]) -> tuple[Optional[int], Optional[float]]:
    """(step, eval_loss) of the run's last evaluation at or before step `up_to`."""
    history = MetricHistory(metrics_path(run_dir)).load()
    evals = [(s, m["eval_loss"]) for s, m in history.items()
             if m.get("eval_loss") is not None and (up_to is None or s <= up_to)]
    return max(evals) if evals else (None, None)


def _tokens_at(run_dir: str, step: Optional[int], info: dict) -> Optional[int]:
    """The tokens trained by step `step`: metrics.jsonl's count where that step was logged (a
    resume may have changed the batch), else the steps at run.json's batch."""
    logged = MetricHistory(metrics_path(run_dir)).load().get(step, {}).get("tokens")
    if logged is not None:
        return int(logged)
    return step * info["tokens_per_step"] if step and "tokens_per_step" in info else None


def model_card(config: PretrainedConfig, save_dir: str, step: Optional[int], source: str) -> str:
    """The README.md of an export of checkpoint step `step` (None: the end of the run) of the run
    whose checkpoints are in `save_dir`."""
    info = {}
    if os.path.isfile(os.path.join(save_dir, RUN_FILE)):
        with open(os.path.join(save_dir, RUN_FILE)) as f:
            info = json.load(f)
    steps = step if step is not None else info.get("max_steps")
    eval_step, eval_loss = _final_eval(os.path.dirname(os.path.abspath(save_dir)), step)
    tokens = _tokens_at(os.path.dirname(os.path.abspath(save_dir)), steps, info)
    lines = [
        "---", "library_name: transformers", "tags: [bdh, dragon, deepspeed]", "---", "",
        *_about(config, source), "",
        "## Training", "",
        "| | |", "|---|---|",
    ]
    rows = [
        ("recipe", info.get("recipe")),
        ("DeepSpeed", f"ZeRO-{info['zero_stage']}, {'bf16' if info['bf16'] else 'fp32'}"
         if "zero_stage" in info else None),
        ("DiLoCo islands", f"{info['islands']} (outer step every {info['diloco_inner_steps']})"
         if info.get("islands", 1) > 1 else None),
        ("pipeline stages", info.get("pipeline_stages") if info.get("pipeline_stages", 1) > 1
         else None),
        ("data-parallel ranks", info.get("data_parallel")),
        ("dragon version", info.get("dragon_version")),
        ("steps", steps),
        ("tokens", f"{tokens:,}" if tokens else None),
        ("block size", info.get("block_size")),
        ("carried state", "yes" if info.get("carry_state") else None),
        ("final validation loss", f"{eval_loss:.4f} (step {eval_step})" if eval_loss is not None
         else "not evaluated"),
    ]
    lines += [f"| {name} | {value} |" for name, value in rows if value is not None]
    remote = ", trust_remote_code=True" if is_bdh(config) else ""
    lines += [
        "", "## Load", "", "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        *(["# the model's code lies beside its weights (modeling_bdh.py); with dragon installed,",
           "# `import dragon` instead of trust_remote_code=True (AutoTokenizer reads the config "
           "too)"] if remote else []),
        f'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory"{remote})',
        f'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory"{remote})', "```", "",
    ]
    return "\n".join(lines)


def _about(config, source: str) -> list[str]:
    """The card's title, first line and architecture: of BDH, or of a --model_type baseline."""
    if not is_bdh(config):
        return [f"# A {config.model_type} baseline, {baseline.parameter_count(config):,} "
                "parameters", "",
                f"transformers' {config.model_type} model, trained with dragon beside BDH through "
                f"the same recipe, from {source}.", "", "## Architecture", "",
                f"{config.num_hidden_layers} layers, width {config.hidden_size}, "
                f"{config.num_attention_heads} heads, vocabulary {config.vocab_size}."]
    return [f"# BDH, {parameter_count(config):,} parameters", "",
            f"A BDH (Baby Dragon Hatchling) language model trained with dragon, from {source}.",
            "", "## Architecture", "",
            f"{config.n_layer} layers sharing one block, n_embd {config.n_embd}, {config.n_head} "
            f"heads of {config.n_neurons} neurons, vocabulary {config.vocab_size}, attention "
            f"{config.attention} (chunk {config.attention_chunk_size}), RoPE."]


def write_model_card(out_dir: str, config: PretrainedConfig, save_dir: str, step: Optional[int],
                     source: str) -> None:
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(model_card(config, save_dir, step, source))


def write_run_files(save_dir: str, inputs, config: PretrainedConfig, islands: int, dp_world: int,
                    tokens_per_step: int) -> None:
    """config.json, the tokenizer and run.json beside the checkpoints, so that recipes/export.py
    and sample.py can use any checkpoint and every export's model card names the run (inputs:
    dragon.run.inputs.RecipeInputs). Each file is written whole or not at all: a run killed as it
    starts leaves a resumable directory."""
    os.makedirs(save_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=save_dir, prefix=".run_files") as tmp:
        config.save_pretrained(tmp)
        if hasattr(inputs.tokenizer, "save_pretrained"):
            inputs.tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, RUN_FILE), "w") as f:
            json.dump(run_info(inputs, islands, dp_world, tokens_per_step), f, indent=2)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(save_dir, name))
