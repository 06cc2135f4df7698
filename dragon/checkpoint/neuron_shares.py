"""A checkpoint of split neurons (--neuron_parallel K) as the whole model's universal checkpoint.

Each of the K shares' DeepSpeed files (mp_rank_0k in their names) is a lone model's checkpoint of
its share of the neurons. Each is converted on its own (dragon.checkpoint.universal), then every
parameter's fp32 weight and Adam moments are joined by neuron (dragon.parallel.neurons
.join_shares; the replicated embedding and head from share 0) into one universal folder of the
whole model. That folder resumes on any layout: one share (K = 1) as any unsplit checkpoint does,
and K' shares because the split marks each sharded parameter with the cut DeepSpeed's universal
loader takes its share by (dragon.parallel.neurons.universal_cut).
"""

import os
import re
import tempfile

import torch
from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS

from dragon.checkpoint import universal
from dragon.model.bdh import BDHConfig
from dragon.model.attention import rope_frequencies
from dragon.parallel.neurons import SHARDED, join_shares


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


def universal_from_shares(tag_dir: str, out: str, config: BDHConfig) -> None:
    """The whole model's normalized universal folder from a checkpoint of K neuron shares."""
    shares = neuron_shares(tag_dir)
    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for share in shares:
            folder = os.path.join(tmp, f"{share}_universal")
            lone = share_as_its_own(tag_dir, share, tmp)
            _one_model_parallel_rank(lone)
            if universal.is_zero0(tag_dir):
                universal.from_zero0(lone, folder)
            else:
                universal.from_deepspeed(lone, folder)
            folders.append(folder)
        first = folders[0]
        states = torch.load(universal.model_states_file(first), map_location="cpu",
                            weights_only=False)
        names = list(universal.parameter_shapes(states))
        zero = os.path.join(out, "zero")
        for name in names:
            os.makedirs(os.path.join(zero, name))
            for key in ("fp32", *universal.MOMENTS):
                parts = [{name: _param(folder, name, key)} for folder in folders]
                whole = join_shares(parts, config)[name] if name in SHARDED else parts[0][name]
                torch.save({"param": whole, "cat_dim": 0}, os.path.join(zero, name, f"{key}.pt"))
            torch.save(torch.load(os.path.join(first, "zero", name, "step.pt"),
                                  weights_only=False), os.path.join(zero, name, "step.pt"))
        optimizer = torch.load(os.path.join(first, "zero", "optimizer_state.pt"),
                               weights_only=False)
        torch.save(optimizer, os.path.join(zero, "optimizer_state.pt"))
        module = [torch.load(universal.model_states_file(f), map_location="cpu",
                             weights_only=False)["module"] for f in folders]
        states["module"] = join_shares(module, config)
        if "layer.attn.freqs" in module[0]:  # the buffer as a whole model holds it
            states["module"]["layer.attn.freqs"] = rope_frequencies(config.n_neurons)
        states["mp_world_size"] = 1
        states["param_shapes"] = [{n: states["module"][n].shape for n in names}]
        universal.write_states(states, out)


def _one_model_parallel_rank(linked: str) -> None:
    """Its model states files as copies that record one model-parallel rank (ds_to_universal
    reads the count there)."""
    for name in os.listdir(linked):
        if name.endswith("model_states.pt"):
            path = os.path.join(linked, name)
            states = torch.load(path, map_location="cpu", weights_only=False)
            os.remove(path)
            dims = dict(states.get(CHECKPOINT_PARALLEL_DIMS) or {}, tp_degree=1)
            torch.save(dict(states, mp_world_size=1, **{CHECKPOINT_PARALLEL_DIMS: dims}), path)


def _param(folder: str, name: str, key: str) -> torch.Tensor:
    return torch.load(os.path.join(folder, "zero", name, f"{key}.pt"), weights_only=False)["param"]
