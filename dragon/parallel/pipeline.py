"""BDH as a DeepSpeed PipelineModule: an embedding stage, n_layer uses of one tied block, a head.

Every BDH layer uses the same `encoder`, `encoder_v` and `decoder`, so the layers are
`TiedLayerSpec`s of one key: DeepSpeed builds one copy of the block per stage and all-reduces
its gradient across the stages that hold it, every step. The loss is the plain model's.
"""

import glob
import os
from contextlib import contextmanager
from functools import partial
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.runtime.utils import partition_balanced, partition_uniform
from torch import nn
from torch.utils.checkpoint import checkpoint

from dragon.model.attention import BDHCache
from dragon.model.bdh import (
    BDHConfig,
    BDHForCausalLM,
    BDHLayer,
    causal_lm_loss,
    embed_tokens,
    lm_logits,
)
from dragon.model.cost import parameter_count
from dragon.parallel.neurons import connect_layer, join_shares, keep_layer_share

SHARED_KEY = "bdh_shared_block"
SHARED_WEIGHTS = ["encoder", "encoder_v", "decoder"]
PARTITION_METHODS = ("compute", "uniform", "parameters")


class EmbedStage(nn.Module):
    def __init__(self, config: BDHConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_tokens(self.embed, input_ids)


class HeadStage(nn.Module):
    def __init__(self, config: BDHConfig):
        super().__init__()
        self.lm_head = nn.Parameter(torch.zeros(config.n_embd, config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lm_logits(x, self.lm_head)


class StageLayer(BDHLayer):
    """The shared block as a stage holds it, called once per layer of the stage. Inside
    carrying(pipe, caches) call k of the engine's schedule is layer k % L of the stage's L layers
    for micro-batch k // L, and continues that micro-batch's cache (the engine runs each stage's
    forwards in micro-batch order)."""

    def __init__(self, config: BDHConfig):
        super().__init__(config)
        self.layers_on_stage = 1  # set by bdh_pipeline
        self.first_layer = 0  # the model's index of the stage's first layer (bdh_pipeline)
        self.caches: Optional[list[BDHCache]] = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.caches is None:
            return super().forward(x)
        micro_batch, j = divmod(self.calls, self.layers_on_stage)
        cache = self.caches[micro_batch % len(self.caches)]
        x, cache.states[j] = super().forward(x, cache.states[j], cache.position, True)
        if j == self.layers_on_stage - 1:
            cache.position += x.size(-2)
        self.calls += 1
        return x


def stage_layer(pipe: PipelineModule) -> StageLayer:
    """This stage's copy of the shared block (every stage holds at least one layer)."""
    return pipe.tied_modules[SHARED_KEY]


@contextmanager
def carrying(pipe: PipelineModule, caches: Optional[list[BDHCache]]) -> Iterator[None]:
    """Within: micro-batch m of the engine's schedule continues caches[m % len(caches)] through
    this stage's layers (caches of stage_layer(pipe).layers_on_stage layers). None, or a list of
    None: no state."""
    layer = stage_layer(pipe)
    layer.caches = caches if caches and caches[0] is not None else None
    layer.calls = 0
    try:
        yield
    finally:
        layer.caches = None


def _run_shared(layer: StageLayer, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def partition(config: BDHConfig, num_stages: int, method: str = "compute") -> list[int]:
    """Stage boundaries over the specs [embed, layer_1..layer_n, head], as DeepSpeed computes them.

    "compute" balances BDH layers, which all cost the same; the embedding and the head cost
    under 1 % of one layer (D*V against 3*nh*D*N multiply-adds per token). Counting parameters
    would mislead in general, since every stage holding a layer holds the whole shared block.
    """
    n = config.n_layer
    if method == "uniform":
        return [int(p) for p in partition_uniform(n + 2, num_stages)]
    if method == "parameters":
        embed = config.vocab_size * config.n_embd
        weights = [embed] + [parameter_count(config) - 2 * embed] * n + [embed]
    else:
        weights = [0] + [1] * n + [0]
    return [int(p) for p in partition_balanced(weights, num_stages)]


def check_pipeline(config: BDHConfig, num_stages: int, method: str) -> None:
    """One-line errors for a pipeline that cannot be built."""
    if method not in PARTITION_METHODS:
        raise ValueError(f"--partition_method {method!r}: valid are {', '.join(PARTITION_METHODS)}")
    if not 1 <= num_stages <= config.n_layer:
        raise ValueError(
            f"--pipeline_stages {num_stages}: must be between 1 and n_layer={config.n_layer}, "
            "so that every stage holds at least one BDH layer"
        )
    parts = partition(config, num_stages, method)
    empty = [s for s in range(num_stages) if parts[s] == parts[s + 1]]
    if empty:
        raise ValueError(
            f"--partition_method {method} leaves stage(s) {empty} without layers; use 'compute'"
        )


def pipeline_specs(config: BDHConfig, parts: list[int]) -> list:
    """The layer specs; on each stage the first use of the shared block owns it in checkpoints."""
    # Later uses go through forward_fn, so each stage writes (and reloads) the block once
    # instead of once per layer.
    owners = {max(parts[s], 1) for s in range(len(parts) - 1)}
    layers = [
        TiedLayerSpec(
            SHARED_KEY,
            StageLayer,
            config,
            tied_weight_attr=SHARED_WEIGHTS,
            forward_fn=None if i in owners else _run_shared,
        )
        for i in range(1, config.n_layer + 1)
    ]
    return [LayerSpec(EmbedStage, config), *layers, LayerSpec(HeadStage, config)]


def bdh_pipeline(
    model: BDHForCausalLM,
    num_stages: int,
    partition_method: str = "compute",
    activation_checkpoint_interval: int = 0,
    neurons: int = 1,
) -> PipelineModule:
    """A PipelineModule holding `model`'s weights (call after the process group exists); with
    `neurons` = K > 1 each stage's K adjacent ranks split its copy of the shared block's neurons
    (DeepSpeed's (pipe, data, model) topology: the model axis is the neuron share)."""
    config = model.config
    check_pipeline(config, num_stages, partition_method)
    parts = partition(config, num_stages, partition_method)
    ds_method = f"type:{StageLayer.__name__}" if partition_method == "compute" else partition_method
    shape = {"num_stages": num_stages}
    if neurons > 1:  # tied copies are then tied within each share, across the stages
        data = dist.get_world_size() // (num_stages * neurons)
        shape = {"topology": PipeModelDataParallelTopology(num_stages, neurons, data)}
    pipe = PipelineModule(
        layers=pipeline_specs(config, parts),
        loss_fn=causal_lm_loss,
        partition_method=ds_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        # DeepSpeed's own checkpoint function is re-entrant: a stage's first span, whose input
        # (token ids) needs no gradient, would give an output with none and the backward fails.
        # torch's non-re-entrant one replays that span's RNG too, so dropout masks repeat.
        activation_checkpoint_func=partial(checkpoint, use_reentrant=False),
        # DeepSpeed recomputes a span only if a module in it has parameters: a later use of the
        # shared block on a stage is a functools.partial of _run_shared, which has none, so
        # without these names only each stage's first layer would be recomputed.
        checkpointable_layers=[EmbedStage.__name__, StageLayer.__name__, HeadStage.__name__,
                               partial.__name__],
        **shape,
    )
    if [int(p) for p in pipe.parts] != parts:
        raise RuntimeError(
            f"DeepSpeed partitioned the pipeline as {list(pipe.parts)}, expected {parts}"
        )
    start, stop = parts[pipe.stage_id], parts[pipe.stage_id + 1]
    stage_layer(pipe).layers_on_stage = len(range(max(start, 1), min(stop, config.n_layer + 1)))
    stage_layer(pipe).first_layer = max(start, 1) - 1
    load_into_pipeline(pipe, model)
    pipe.config = config  # what the stages are parts of (DiLoCo's state names the plain model's)
    share = pipe._grid.get_slice_parallel_rank()
    if neurons > 1:
        group = pipe._grid.get_slice_parallel_group()
        keep_layer_share(stage_layer(pipe), config, share, neurons)
        connect_layer(stage_layer(pipe), group)
        pipe.neuron_split = (group, neurons)
    # DeepSpeed sums gradient norms over a pipeline's stages and neuron shares but,
    # Megatron-style, counts a parameter outside the first rank of them only if it is marked
    # model-parallel; unmarked, the head's gradient would be left out of clipping. Every
    # parameter lives on one stage except the shared block's later copies, which DeepSpeed marks
    # ds_pipe_replicated; the embedding and head are on every share of their stage.
    for p in pipe.parameters():
        copy = getattr(p, "ds_pipe_replicated", False)
        sharded = getattr(p, "tensor_model_parallel", False)
        p.model_parallel = not copy and (sharded or share == 0)
        p.tensor_model_parallel = sharded and not copy  # DeepSpeed counts either mark
    return pipe


def plain_names(config: BDHConfig) -> dict[str, str]:
    """A BDH PipelineModule's parameter names -> the plain model's: the tied block's, the
    embedding's (layer 0) and the head's (layer n + 1)."""
    names = {f"tied_modules.{SHARED_KEY}.{name}": f"layer.{name}" for name in SHARED_WEIGHTS}
    names.update({"0.embed.weight": "embed.weight", f"{config.n_layer + 1}.lm_head": "lm_head"})
    return names


@torch.no_grad()
def load_into_pipeline(pipe: PipelineModule, model: BDHForCausalLM) -> None:
    """Copy a plain model's weights into this rank's stage modules."""
    for module in pipe.modules():
        if isinstance(module, EmbedStage):
            module.embed.weight.copy_(model.embed.weight)
        elif isinstance(module, HeadStage):
            module.lm_head.copy_(model.lm_head)
        elif isinstance(module, BDHLayer):
            for name in SHARED_WEIGHTS:
                getattr(module, name).copy_(getattr(model.layer, name))


def is_pipeline_checkpoint(tag_dir: str) -> bool:
    return bool(glob.glob(os.path.join(tag_dir, "layer_00-*model_states.pt")))


def pipeline_neuron_shares(tag_dir: str) -> int:
    """K of a pipeline checkpoint whose stages split the neurons (layer files per share:
    layer_XX-model_YY-model_states.pt), 1 otherwise."""
    return max(1, len(glob.glob(os.path.join(tag_dir, "layer_00-model_*-model_states.pt"))))


def model_from_pipeline_checkpoint(tag_dir: str, config: BDHConfig) -> BDHForCausalLM:
    """A BDHForCausalLM (fp32) from a pipeline checkpoint's layer files (with neuron shares,
    each share's shared block joined into every neuron)."""
    k = pipeline_neuron_shares(tag_dir)

    def layer_file(i: int, share: int = 0) -> Optional[str]:
        model = f"-model_{share:02d}" if k > 1 else ""
        path = os.path.join(tag_dir, f"layer_{i:02d}{model}-model_states.pt")
        return path if os.path.isfile(path) else None

    def load(path: str) -> dict:
        return torch.load(path, map_location="cpu", weights_only=True)

    n = config.n_layer
    owner = next((i for i in range(1, n + 1) if layer_file(i)), None)
    if not (layer_file(0) and layer_file(n + 1) and owner):
        raise ValueError(
            f"{tag_dir}: not a BDH pipeline checkpoint with n_layer={n} "
            f"(need layer_00, a layer_01..layer_{n:02d} and layer_{n + 1:02d} files)"
        )
    shares = [{f"layer.{name}": t for name, t in load(layer_file(owner, s)).items()
               if name in SHARED_WEIGHTS} for s in range(k)]
    state = {
        "embed.weight": load(layer_file(0))["embed.weight"],
        "lm_head": load(layer_file(n + 1))["lm_head"],
        **join_shares(shares, config),
    }
    model = BDHForCausalLM(config)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model
