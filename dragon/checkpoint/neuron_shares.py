"""A checkpoint of split neurons (--neuron_parallel K), or of a ZeRO-1 pipeline's stages, as the
whole model's universal checkpoint.

Each of the K shares' DeepSpeed files (mp_rank_0k in their names) is a lone model's checkpoint of
its share of the neurons; each stage's, its stage's parameters (the shared block, the embedding
on the first, the head on the last; every stage's copy of the block steps on the same gradient,
so the first stage's is taken). Each is converted on its own (dragon.checkpoint.universal), then
every parameter's fp32 weight and Adam moments are joined by neuron (dragon.parallel.neurons
.join_shares; the replicated embedding and head from share 0) into one universal folder of the
whole model. That folder resumes on any layout: one share (K = 1) as any unsplit checkpoint does,
and K' shares because the split marks each sharded parameter with the cut DeepSpeed's universal
loader takes its share by (dragon.parallel.neurons.universal_cut). A ZeRO-0 launch of K' shares
reads one file per share (mp_rank_0j): `write_zero0_shares` cuts them from the whole model's.
"""

import os
import re
import shutil
import tempfile
from typing import Optional

import torch
from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS

from dragon.checkpoint import universal
from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.model.attention import rope_frequencies
from dragon.parallel.neurons import SHARDED, join_shares, share_of
from dragon.checkpoint.pipeline_files import stage_parameters
from dragon.parallel.pipeline import plain_names


def neuron_shares(tag_dir: str) -> list[str]:
    """The model-parallel ranks' marks in a tag directory's DeepSpeed files ("mp_rank_00", ...):
    one unless --neuron_parallel split the neurons."""
    found = {m.group(0) for name in os.listdir(tag_dir) if (m := re.search(r"mp_rank_\d+", name))}
    return sorted(found) or ["mp_rank_00"]


def share_as_its_own(tag_dir: str, share: str, tmp: str) -> str:
    """A tag directory in `tmp` whose links show one share's files as a lone model's (named
    mp_rank_00), the layout zero_to_fp32 and ds_to_universal read."""
    linked = os.path.join(tmp, share, os.path.basename(tag_dir))
    os.makedirs(linked)
    for name in os.listdir(tag_dir):
        if share in name:
            os.symlink(os.path.join(os.path.abspath(tag_dir), name),
                       os.path.join(linked, name.replace(share, "mp_rank_00")))
    return linked


def universal_from_shares(tag_dir: str, out: str, config: BDHConfig, stages: int = 1) -> None:
    """The whole model's normalized universal folder from a checkpoint whose model-parallel
    ranks (mp_rank_XX, stage-major) are `stages` pipeline stages x K neuron shares."""
    parts = neuron_shares(tag_dir)
    k = len(parts) // stages
    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for index, part in enumerate(parts):
            folder = os.path.join(tmp, f"{part}_universal")
            lone = share_as_its_own(tag_dir, part, tmp)
            shapes = _stage_shapes(tag_dir, config, index // k, stages, (index % k, k)) \
                if stages > 1 else None
            _one_model_parallel_rank(lone, shapes)
            if universal.is_zero0(tag_dir):
                universal.from_zero0(lone, folder)
            else:
                universal.from_deepspeed(lone, folder)
            folders.append(folder)
        # where each of the whole model's parameters is: (its name there, the parts' folders:
        # the block's on stage 0, the embedding's on stage 0, the head's on the last stage)
        where = {}
        if stages > 1:
            held = {"embed.weight": folders[:1], "lm_head": folders[-k:][:1]}
            where = {plain: (ours, held.get(plain, folders[:k]))
                     for ours, plain in plain_names(config).items()}
        names = [n for n, _ in BDHForCausalLM(config).named_parameters()] if stages > 1 else \
            list(universal.parameter_shapes(_states(folders[0])))
        zero, weights = os.path.join(out, "zero"), {}
        for name in names:
            saved_as, held_by = where.get(name, (name, folders))
            os.makedirs(os.path.join(zero, name))
            for key in ("fp32", *universal.MOMENTS):
                shares = [{name: _param(folder, saved_as, key)} for folder in held_by]
                whole = join_shares(shares, config)[name] if name in SHARDED else shares[0][name]
                torch.save({"param": whole, "cat_dim": 0}, os.path.join(zero, name, f"{key}.pt"))
                if key == "fp32":
                    weights[name] = whole
            shutil.copy(os.path.join(held_by[0], "zero", saved_as, "step.pt"),
                        os.path.join(zero, name, "step.pt"))
        shutil.copy(os.path.join(folders[0], "zero", "optimizer_state.pt"), zero)
        states = _states(folders[0])
        states["module"] = dict(weights, **{"layer.attn.freqs": rope_frequencies(config.n_neurons)})
        states.update(mp_world_size=1, buffer_names=["layer.attn.freqs"],
                      param_shapes=[{n: weights[n].shape for n in names}])
        states.pop(CHECKPOINT_PARALLEL_DIMS, None)
        universal.write_states(states, out)


def write_zero0_shares(folder: str, out: str, config: BDHConfig, k: int, bf16: bool) -> None:
    """K ZeRO-0 checkpoints of neuron shares (mp_rank_0j_model_states.pt; fp32, or bf16 with
    fp32 masters) from the whole model's normalized universal `folder`."""
    whole = universal.zero0_states(folder)
    os.makedirs(out, exist_ok=True)
    for j in range(k):
        states = share_states(whole, config, j, k)
        torch.save(universal.bf16_form(states) if bf16 else states,
                   os.path.join(out, f"mp_rank_{j:02d}_model_states.pt"))


def share_states(whole: dict, config: BDHConfig, j: int, k: int) -> dict:
    """Share j of k of a whole model's fp32 ZeRO-0 model states: its weights and Adam moments cut
    by neuron (dragon.parallel.neurons.share_of)."""
    names = list(universal.parameter_shapes(whole))
    module = {n: share_of(n, t, config, j, k) for n, t in whole["module"].items()}
    state = {i: {key: share_of(names[i], t, config, j, k) if t.dim() else t
                 for key, t in moments.items()}
             for i, moments in whole["optimizer"]["state"].items()}
    return dict(whole, module=module, mp_world_size=k, optimizer=dict(whole["optimizer"],
                state=state), param_shapes=[{n: module[n].shape for n in names}])


def _states(folder: str) -> dict:
    return torch.load(universal.model_states_file(folder), map_location="cpu", weights_only=False)


def _one_model_parallel_rank(linked: str, shapes: Optional[dict] = None) -> None:
    """Its model states files as copies that record one model-parallel rank (ds_to_universal
    reads the count there) and, where DeepSpeed recorded none, the parameter `shapes`."""
    for name in os.listdir(linked):
        if name.endswith("model_states.pt"):
            path = os.path.join(linked, name)
            states = torch.load(path, map_location="cpu", weights_only=False)
            os.remove(path)
            dims = dict(states.get(CHECKPOINT_PARALLEL_DIMS) or {}, tp_degree=1, pp_degree=1)
            if states.get("param_shapes") is None and shapes:
                states["param_shapes"] = [shapes]
            torch.save(dict(states, mp_world_size=1, **{CHECKPOINT_PARALLEL_DIMS: dims}), path)


def _stage_shapes(tag_dir: str, config: BDHConfig, stage: int, stages: int,
                  share: tuple[int, int]) -> dict[str, torch.Size]:
    """A pipeline stage's parameter shapes under the PipelineModule's names, in its optimizer's
    order, from the stage's layer files: DeepSpeed records them only under ZeRO, and a bf16
    pipeline's optimizer keeps files of its own under ZeRO-0 too."""
    j, k = share
    model = f"-model_{j:02d}" if k > 1 else ""
    path = lambda i: os.path.join(tag_dir, f"layer_{i:02d}{model}-model_states.pt")  # noqa: E731
    layer = lambda i: torch.load(path(i), map_location="cpu", weights_only=False,  # noqa: E731
                                 mmap=True)
    block = next(layer(i) for i in range(1, config.n_layer + 1) if os.path.isfile(path(i)))
    tensors = dict(block, **{"embed.weight": layer(0)["embed.weight"],
                             "lm_head": layer(config.n_layer + 1)["lm_head"]})
    ours = {plain: name for name, plain in plain_names(config).items()}
    return {ours[plain]: tensors[plain.removeprefix("layer.")].shape
            for plain in stage_parameters(stage, stages)}


def _param(folder: str, name: str, key: str) -> torch.Tensor:
    return torch.load(os.path.join(folder, "zero", name, f"{key}.pt"), weights_only=False)["param"]
