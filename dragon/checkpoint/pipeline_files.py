"""A pipeline checkpoint (dragon.parallel.pipeline, ZeRO-0, fp32) as a plain model's ZeRO-0
checkpoint, and
back, so that dragon.checkpoint.reshape converts between the recipes and between pipeline shapes.

A pipeline checkpoint holds the weights in layer files (layer_00: the embedding; the first layer
of each stage: the shared block; layer_<n+1>: the head) and each stage's torch Adam in
mp_rank_<stage>_model_states.pt, over that stage's parameters in the PipelineModule's order: the
tied shared block first (DeepSpeed registers tied modules before the layers), then the
embedding (first stage) and the head (last stage). Every stage's copy of the shared block steps
on the same all-reduced gradient, so the first stage's Adam state is the block's.
"""

import glob
import os
import shutil

import torch

from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.parallel.pipeline import (SHARED_KEY, SHARED_WEIGHTS, model_from_pipeline_checkpoint,
                                     plain_names)

SHARED = [f"layer.{name}" for name in SHARED_WEIGHTS]


def _load(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


def stage_parameters(stage: int, stages: int) -> list[str]:
    """The plain model's names of one stage's parameters, in its optimizer's order."""
    return SHARED + (["embed.weight"] if stage == 0 else []) + (
        ["lm_head"] if stage == stages - 1 else [])


def _config(tag_dir: str) -> BDHConfig:
    return BDHConfig.from_pretrained(os.path.dirname(os.path.normpath(tag_dir)))


def stage_files(tag_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))


def zero0_states_of_pipeline(tag_dir: str) -> dict:
    """The model states of a plain model's fp32 ZeRO-0 checkpoint equal to a pipeline's."""
    model = model_from_pipeline_checkpoint(tag_dir, _config(tag_dir))
    names = [name for name, _ in model.named_parameters()]
    files = stage_files(tag_dir)
    state, groups = {}, None
    for stage, path in enumerate(files):
        optimizer = _load(path)["optimizer"]
        indices = [i for group in optimizer["param_groups"] for i in group["params"]]
        held = stage_parameters(stage, len(files))
        if len(indices) != len(held):
            raise ValueError(f"{path}: {len(indices)} optimizer parameters, a BDH pipeline stage "
                             f"holds {len(held)}")
        for index, name in zip(indices, held):
            state.setdefault(name, optimizer["state"].get(index, {}))
        groups = groups or optimizer["param_groups"]
    shapes = dict(model.named_parameters())
    for name, values in state.items():
        if "exp_avg" in values and values["exp_avg"].shape != shapes[name].shape:
            raise ValueError(f"{tag_dir}: Adam state of {name} has shape "
                             f"{tuple(values['exp_avg'].shape)}, the model's is "
                             f"{tuple(shapes[name].shape)}")
    optimizer = {"state": {i: state[name] for i, name in enumerate(names)},
                 "param_groups": [dict(groups[0], params=list(range(len(names))))]}
    buffers = [name for name, _ in model.named_buffers()]
    return dict(_load(files[0]), module=model.state_dict(), optimizer=optimizer,
                buffer_names=buffers, param_shapes=None, mp_world_size=1)


def write_pipeline(states: dict, config: BDHConfig, parts: list[int], out: str,
                   share: tuple[int, int] = (0, 1)) -> None:
    """A pipeline checkpoint of stage boundaries `parts` from a plain model's fp32 ZeRO-0 model
    states; with `share` (j, K), K > 1: neuron share j's files of a pipeline of K shares, from
    that share's states (dragon.checkpoint.neuron_shares.share_states)."""
    module, n, stages = states["module"], config.n_layer, len(parts) - 1
    j, k = share
    os.makedirs(out, exist_ok=True)

    def layer(index: int, tensors: dict) -> None:
        model = f"-model_{j:02d}" if k > 1 else ""  # DeepSpeed's name of a model-parallel rank's
        torch.save(tensors, os.path.join(out, f"layer_{index:02d}{model}-model_states.pt"))

    layer(0, {"embed.weight": module["embed.weight"]})
    block = {k[len("layer."):]: v for k, v in module.items() if k.startswith("layer.")}
    for owner in sorted({max(parts[s], 1) for s in range(stages)}):
        layer(owner, block)
    layer(n + 1, {"lm_head": module["lm_head"]})
    names = [name for name, _ in BDHForCausalLM(config).named_parameters()]
    optimizer = states["optimizer"]
    buffers = [f"tied_modules.{SHARED_KEY}.{k[len('layer.'):]}" for k in states["buffer_names"]
               if k.startswith("layer.")]
    for stage in range(stages):
        held = stage_parameters(stage, stages)
        state = {i: optimizer["state"][names.index(name)] for i, name in enumerate(held)
                 if names.index(name) in optimizer["state"]}
        group = dict(optimizer["param_groups"][0], params=list(range(len(held))))
        torch.save(  # DeepSpeed numbers a pipeline's model-parallel ranks stage by stage
            dict(states, module=None, optimizer={"state": state, "param_groups": [group]},
                 buffer_names=buffers, param_shapes=None,
                 mp_world_size=stages * k, dp_world_size=1),
            os.path.join(out, f"mp_rank_{stage * k + j:02d}_model_states.pt"),
        )


def pipeline_universal(universal_dir: str, config: BDHConfig, out: str) -> None:
    """out/zero: the whole model's universal folder under the names a PipelineModule gives its
    parameters (the tied block's, the embedding's layer 0, the head's layer n + 1), so that a
    ZeRO-1 pipeline engine loads its stage's weights and Adam moments from it. Each parameter's
    folder is a link into the universal folder beside `out`."""
    source, zero = os.path.join(universal_dir, "zero"), os.path.join(out, "zero")
    os.makedirs(zero, exist_ok=True)
    for ours, whole in plain_names(config).items():
        target = os.path.relpath(os.path.join(source, whole), zero)
        os.symlink(target, os.path.join(zero, ours), target_is_directory=True)
    shutil.copy(os.path.join(source, "optimizer_state.pt"), zero)
