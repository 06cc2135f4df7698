"""Trained weights -> a Hugging Face BDH directory (save_pretrained), from a live engine at the end
of a recipe or from any checkpoint of either recipe offline.

From an engine, ZeRO's fp32 master weights are gathered (a collective under ZeRO-3; it works with
bf16 at every stage and with node-local checkpoint storage); a pipeline, whose stages each hold
part of the model, is read back from the checkpoint the run just saved. From a checkpoint, ZeRO
1-3 shards are merged with DeepSpeed's zero_to_fp32, ZeRO-0 holds the module's own weights, and a
pipeline its per-layer files. The model's config is the config.json the recipes write next to
their checkpoints.
"""

import os
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dragon.checkpoint import universal
from dragon.checkpoint.card import write_model_card
from dragon.checkpoint.checkpointer import tag_for
from dragon.checkpoint.writes import GuardedWrites, SaveFailed
from dragon.errors import TrainingFailed
from dragon.parallel.distributed import rank
from dragon.checkpoint.neuron_shares import neuron_shares, share_as_its_own
from dragon.parallel.neurons import join_shares, whole_tensors
from dragon.model.baseline import is_bdh
from dragon.model.bdh import BDHForCausalLM
from dragon.model.remote_code import write_remote_code
from dragon.parallel.pipeline import is_pipeline_checkpoint, model_from_pipeline_checkpoint
from dragon.checkpoint.catalog import run_files_dir
from dragon.checkpoint.resolver import is_hf_directory

ROPE_KEY = "layer.attn.freqs"  # recomputed by the model, so a checkpoint may lack it


def _model_from_state(state: dict, config, source: str):
    """BDH (or a --model_type baseline, transformers' own model) of `config` holding `state`."""
    model = BDHForCausalLM(config) if is_bdh(config) else AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    wrong = sorted(set(result.missing_keys) - {ROPE_KEY}) + sorted(result.unexpected_keys)
    if wrong:
        raise ValueError(f"{source} does not hold a BDH with this config (keys {wrong})")
    return model


def full_fp32_state_dict(engine) -> dict[str, torch.Tensor]:
    """The module's full fp32 weights from DeepSpeed's master copy; a collective under ZeRO-3."""
    from deepspeed.utils import safe_get_full_fp32_param

    state = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        state[name] = (full if full is not None else param.detach()).float().cpu().clone()
    return state


def check_export_dir(out_dir: str, overwrite: bool) -> None:
    """Raise ValueError unless `out_dir` is new or empty, or `overwrite` lets an export replace
    its own files there (the others stay): a user's files are never replaced silently."""
    found = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if found and not overwrite:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"--output {out_dir}: holds files ({shown}); choose a new or empty "
                         "directory, or pass --overwrite to replace an export's files there")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--output {out_dir}: is a file, not a directory")


def save_model(model, out_dir: str) -> None:
    """model.save_pretrained(out_dir) with the model's code beside it, its files readable as the
    umask allows (transformers writes the weights owner-only, which others on a shared machine
    then cannot load)."""
    started = time.time() - 1  # file times may be whole seconds
    model.save_pretrained(out_dir)
    if is_bdh(model.config):  # loadable with trust_remote_code where dragon is not installed
        write_remote_code(out_dir)
    mask = os.umask(0)
    os.umask(mask)
    for name in os.listdir(out_dir):  # only the files it just wrote
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) and os.path.getmtime(path) >= started:
            os.chmod(path, 0o666 & ~mask)


def export_engine(engine, config, out_dir: str, tag_dir: str) -> None:
    """save_pretrained of a recipe's trained model into out_dir; every rank calls, rank 0 writes.

    `tag_dir` is the checkpoint the run saved last (a pipeline is read back from it)."""
    if getattr(engine, "pipeline_parallelism", False):
        model = model_from_pipeline_checkpoint(tag_dir, config) if rank() == 0 else None
    else:
        state = whole_tensors(engine.module, full_fp32_state_dict(engine))  # every neuron
        model = _model_from_state(state, config, "the engine") if rank() == 0 else None
    writes = GuardedWrites()
    if model is not None:
        writes.run(save_model, model, out_dir)
    writes.agree(f"the export to {out_dir}")  # SaveFailed on every rank if rank 0 failed


def model_from_checkpoint(tag_dir: str):
    """The fp32 model of one checkpoint tag directory of either recipe (any ZeRO stage)."""
    tag_dir = os.path.normpath(tag_dir)
    save_dir = run_files_dir(tag_dir)
    if not os.path.isdir(tag_dir):
        raise ValueError(f"--checkpoint {tag_dir}: no such directory")
    if not os.path.isfile(os.path.join(save_dir, "config.json")):
        raise ValueError(f"no config.json in {save_dir}; it is written by the recipes at start")
    config = AutoConfig.from_pretrained(save_dir)  # BDH's, or a --model_type baseline's
    if is_pipeline_checkpoint(tag_dir):
        return model_from_pipeline_checkpoint(tag_dir, config)
    shares = neuron_shares(tag_dir)
    if len(shares) > 1:  # --neuron_parallel: each share's model merged, then their neurons joined
        with tempfile.TemporaryDirectory() as tmp:
            states = [_fp32_state(share_as_its_own(tag_dir, share, tmp)) for share in shares]
        return _model_from_state(join_shares(states, config), config, tag_dir)
    return _model_from_state(_fp32_state(tag_dir), config, tag_dir)


def _fp32_state(tag_dir: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of a ZeRO checkpoint tag directory of one model (any stage)."""
    save_dir, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    optimizer_files = [f for f in os.listdir(tag_dir) if f.endswith("optim_states.pt")]
    if optimizer_files:  # ZeRO 1-3: merge the fp32 master partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
    # ZeRO-0: the module's weights, or in bf16 their fp32 masters
    module = torch.load(os.path.join(tag_dir, universal.STATES), map_location="cpu",
                        weights_only=False)["module"]
    return {**module, **universal.fp32_weights(tag_dir)}


def load_model(path: str):
    """The fp32 model of a Hugging Face directory or a checkpoint tag directory."""
    if is_hf_directory(path):
        return AutoModelForCausalLM.from_pretrained(path)
    return model_from_checkpoint(path)


def complete_export(out_dir: str, tokenizer, config, save_dir: str, step: int) -> None:
    """Beside a run's exported weights (rank 0): its tokenizer and its model card."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out_dir)
    write_model_card(out_dir, config, save_dir, step, f"the end of its run (step {step})")


def print_sample(model_dir: str, tokenizer, prompt: str, max_new_tokens: int) -> None:
    """A sample of the exported model, printed (top-5 sampling, with the state cache)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=5)
    print(f"--- sample from {model_dir} ---\n{tokenizer.decode(out[0].tolist())}\n---", flush=True)


def export_run(engine, inputs, config, save_dir: str, step: int) -> str:
    """<output_dir>/final at the end of a run: its weights (every rank calls; a pipeline's are read
    back from the checkpoint of the last step), tokenizer and model card; returns the directory
    (inputs: dragon.run.preflight.RecipeInputs)."""
    final_dir = os.path.join(inputs.train.output_dir, "final")
    tag_dir = os.path.join(save_dir, tag_for(step))
    try:
        export_engine(engine, config, final_dir, tag_dir)
        writes = GuardedWrites()
        if rank() == 0:
            writes.run(complete_export, final_dir, inputs.tokenizer, config, save_dir, step)
        writes.agree(f"the model card in {final_dir}")
    except SaveFailed as failure:  # the weights are safe in the last checkpoint
        raise TrainingFailed(f"step {step}: {failure}; the trained weights are in {tag_dir} "
                             "(recipes/export.py exports them)") from None
    return final_dir
