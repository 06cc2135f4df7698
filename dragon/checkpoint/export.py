"""Trained weights -> a Hugging Face BDH directory (save_pretrained), from a live engine at the end
of a recipe (export_run) or from a model read out of any checkpoint (dragon.checkpoint.read_model;
recipes/export.py).

From an engine, ZeRO's fp32 master weights are gathered (a collective under ZeRO-3; it works with
bf16 at every stage and with node-local checkpoint storage); a pipeline, whose stages each hold
part of the model, is read back from the checkpoint the run just saved.
"""

import os
import time

import torch
from transformers import AutoModelForCausalLM

from dragon.checkpoint.card import write_model_card
from dragon.checkpoint.checkpointer import tag_for
from dragon.checkpoint.read_model import model_from_state
from dragon.checkpoint.writes import GuardedWrites, SaveFailed
from dragon.errors import TrainingFailed
from dragon.model.baseline import is_bdh
from dragon.model.remote_code import write_remote_code
from dragon.parallel.distributed import rank
from dragon.parallel.neurons import whole_tensors
from dragon.parallel.pipeline import model_from_pipeline_checkpoint


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
        model = model_from_state(state, config, "the engine") if rank() == 0 else None
    writes = GuardedWrites()
    if model is not None:
        writes.run(save_model, model, out_dir)
    writes.agree(f"the export to {out_dir}")  # SaveFailed on every rank if rank 0 failed


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
    (inputs: dragon.run.inputs.RecipeInputs)."""
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
