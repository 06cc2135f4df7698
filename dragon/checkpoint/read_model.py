"""A checkpoint of either recipe (any ZeRO stage, a pipeline, K neuron shares) or a Hugging Face
directory -> the fp32 model it holds: ZeRO 1-3 shards are merged with DeepSpeed's zero_to_fp32,
ZeRO-0 holds the module's own weights (in bf16 their fp32 masters beside them), a pipeline its
per-layer files, and K shares are each merged and then joined. The model's config is the
config.json the recipes write next to their checkpoints.
"""

import os
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dragon.checkpoint import universal
from dragon.checkpoint.catalog import run_files_dir
from dragon.checkpoint.neuron_shares import neuron_shares, share_as_its_own
from dragon.checkpoint.resolver import is_hf_directory
from dragon.model.baseline import is_bdh
from dragon.model.bdh import BDHForCausalLM
from dragon.parallel.neurons import join_shares
from dragon.parallel.pipeline import is_pipeline_checkpoint, model_from_pipeline_checkpoint

ROPE_KEY = "layer.attn.freqs"  # recomputed by the model, so a checkpoint may lack it


def model_from_state(state: dict, config, source: str):
    """BDH (or a --model_type baseline, transformers' own model) of `config` holding `state`."""
    model = BDHForCausalLM(config) if is_bdh(config) else AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    wrong = sorted(set(result.missing_keys) - {ROPE_KEY}) + sorted(result.unexpected_keys)
    if wrong:
        raise ValueError(f"{source} does not hold a BDH with this config (keys {wrong})")
    return model


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
        return model_from_state(join_shares(states, config), config, tag_dir)
    return model_from_state(_fp32_state(tag_dir), config, tag_dir)


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
