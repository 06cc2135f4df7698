"""Per-rank memory of a run: an estimate before it starts (--dry_run), and the measured peak.

Model states. Under bf16 ZeRO-1/2 and ZeRO-3 DeepSpeed's own estimators give them
(estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs: 16-bit weights
and gradients, fp32 master weights and Adam moments). Elsewhere bytes per parameter follow what
DeepSpeed allocates: fp32 weights (4) and gradients (4), Adam's two moments (8), and under ZeRO
1-3 a partition of fp32 master weights (4) of its own; a stage >= 1 partitions the optimizer
over the data-parallel ranks, >= 2 also the gradients, 3 also the weights (plus the largest
gathered layer). bf16 ZeRO-0 runs DeepSpeed's bf16 optimizer: 16-bit weights and gradients, fp32
gradients, master weights and moments (2 + 2 + 4 + 4 + 8).

Activations: the tensors autograd saves for backward in one micro-batch's forward, counted by
running the model on the meta device (no memory, no compute: the attention form and block size
as configured), plus three of the largest of them, which backward holds while it turns them into
gradients. A pipeline stage holds its share of the layers for up to `stages` micro-batches in
flight (1F1B). With layers recomputed in the backward (--gradient_checkpointing, the pipeline's
--activation_checkpoint_interval k) each span of k layers keeps only its input, and one span's
activations are rebuilt at a time, while its backward runs.

DiLoCo adds theta_outer and the outer optimizer's state (fp32, over this rank's master
weights); --carry_state the carried states of every row. --neuron_parallel K leaves a rank 1/K
of the shared block and of the N-wide activations (counted on a meta model that keeps 1/K).
"""

import os
import resource
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from dragon.model import baseline
from dragon.model.cost import parameter_count
from dragon.model.baseline import is_bdh
from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.parallel.layout import Layout
from dragon.parallel.neurons import keep_share

ADAM_BYTES, FP32 = 8, 4


def model_state_bytes(
    params: int, largest_layer: int, stage: int, bf16: bool, dp_world: int, offload: bool
) -> tuple[int, int]:
    """(device bytes, host bytes) of weights, gradients and optimizer state on one rank."""
    if bf16 and stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        host, device = estimate_zero2_model_states_mem_needs(params, dp_world, 1, offload, 1.0)
        return device, host if offload else 0
    if bf16 and stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        host, device, _ = estimate_zero3_model_states_mem_needs(
            params, largest_layer, dp_world, 1, offload, offload, False, 1.0
        )
        return device, host if offload else 0
    if bf16:  # ZeRO-0: DeepSpeed's bf16 optimizer, nothing partitioned
        return params * (2 + 2 + FP32 + FP32 + ADAM_BYTES), 0
    optimizer = (ADAM_BYTES + (FP32 if stage >= 1 else 0)) * params
    grads, weights = FP32 * params, FP32 * params
    if stage >= 1:
        optimizer //= dp_world
    if stage >= 2:
        grads //= dp_world
    if stage == 3:
        weights = weights // dp_world + FP32 * largest_layer
    if offload:
        return weights + (grads if stage < 2 else 0), optimizer + (grads if stage >= 2 else 0)
    return weights + grads + optimizer, 0


@dataclass
class SavedActivations:
    """What one micro-batch's forward saves for backward, in bytes: all of it, the part that the
    layers' calls save (`layers` calls), the most one call saves, one call's input, and the
    largest single tensor."""

    total: int
    in_layers: int
    one_layer: int
    layer_input: int
    largest: int
    layers: int

    def held(self, recompute_every: int = 0, layers: Optional[int] = None,
             in_flight: int = 1) -> int:
        """The bytes held at the peak for `in_flight` micro-batches through `layers` of the
        layers (a pipeline stage's share; the parts outside the layers are shared out with
        them), plus backward's working room. recompute_every=k: each span of k layers keeps only
        its input, and one span's activations exist at a time, while its backward runs."""
        layers = self.layers if layers is None else layers
        if not recompute_every:
            return (self.total + 3 * self.largest) * in_flight * layers // self.layers
        outside = (self.total - self.in_layers) * layers // self.layers
        spans = -(-layers // recompute_every)
        kept = in_flight * (outside + spans * self.layer_input)
        return kept + min(recompute_every, layers) * self.one_layer + 3 * self.largest


def saved_activations(
    config: BDHConfig, micro_batch: int, block: int, dtype: torch.dtype = torch.float32,
    neuron_parallel: int = 1,
) -> SavedActivations:
    """What autograd saves in one micro-batch's forward, counted on the meta device (with
    --neuron_parallel K, of a model that keeps 1/K of the neurons), told apart by the layer call
    that saved it: BDH's shared block is one module called n_layer times, a baseline's layers are
    modules of their own."""
    with torch.device("meta"):
        build = BDHForCausalLM if is_bdh(config) else AutoModelForCausalLM.from_config
        model = build(config).to(dtype)
    if neuron_parallel > 1:
        keep_share(model, 0, neuron_parallel)
    ids = torch.zeros(micro_batch, block, dtype=torch.long, device="meta")
    saved: dict[int, int] = {}  # a tensor's base -> its bytes, each counted once
    calls: list[dict[int, int]] = []  # per layer call, what it saves
    inputs: list[int] = []
    inside: list[bool] = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a view keeps its base alive, once
        size = base.numel() * base.element_size()
        if inside[0]:
            calls[-1][id(base)] = size
        saved.setdefault(id(base), size)
        return t

    def enter(module, args, kwargs) -> None:
        inside[0] = True
        calls.append({})
        x = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        inputs.append(x.numel() * x.element_size())

    def leave(module, args, output) -> None:
        inside[0] = False

    for module in model.modules():  # (the meta model, and its hooks, go at the return)
        if isinstance(module, GradientCheckpointingLayer):
            module.register_forward_pre_hook(enter, with_kwargs=True)
            module.register_forward_hook(leave)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    in_layers = set().union(*calls)
    return SavedActivations(
        total=sum(saved.values()),
        in_layers=sum(saved[i] for i in in_layers),
        one_layer=max((sum(c.values()) for c in calls), default=0),
        layer_input=max(inputs, default=0),
        largest=max(saved.values(), default=0),
        layers=max(len(calls), 1),
    )


def rank_parameters(config: BDHConfig, stages: int, neuron_parallel: int = 1) -> tuple[int, int]:
    """(parameters, largest layer's) of the most loaded rank's model: the whole model, or a
    pipeline stage (each holds the shared block, one end the embedding or head); with
    --neuron_parallel K a rank holds 1/K of the shared block. A --model_type baseline: the
    whole model, its largest layer taken as the embedding table."""
    if not is_bdh(config):
        return baseline.parameter_count(config), config.vocab_size * config.hidden_size
    whole = 3 * config.n_head * config.n_embd * config.n_neurons
    shared = whole // neuron_parallel
    table = config.vocab_size * config.n_embd
    params = parameter_count(config) - whole + shared if stages == 1 else shared + table
    return params, max(shared // 3, table)


def estimate(
    config: BDHConfig,
    ds_config: dict,
    block: int,
    layout: Layout,
    outer_states: int = 0,
    carried_rows: int = 0,
    recompute_every: int = 0,
) -> dict[str, int]:
    """Estimated bytes per rank of `layout`, by part; `outer_states` fp32 copies of the master
    weights for DiLoCo (theta_outer plus its optimizer's buffers), `carried_rows` rows of
    carried state, `recompute_every` k: layers recomputed k at a time in the backward
    (--gradient_checkpointing: 1; the pipeline's --activation_checkpoint_interval)."""
    dp_world, stages, neuron_parallel = layout.data_parallel, layout.stages, layout.neurons
    zero = ds_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    micro = ds_config["train_micro_batch_size_per_gpu"]
    params, largest = rank_parameters(config, stages, neuron_parallel)
    device, host = model_state_bytes(params, largest, stage, bf16, dp_world, offload)
    saved = saved_activations(config, micro, block, torch.bfloat16 if bf16 else torch.float32,
                              neuron_parallel)
    # A pipeline stage holds its share of the layers for up to `stages` micro-batches (1F1B).
    in_flight = min(stages, ds_config["gradient_accumulation_steps"])
    activations = saved.held(recompute_every, -(-saved.layers // stages), in_flight)
    master = params // dp_world if stage >= 1 else params
    recomputed = f" (recomputed {recompute_every} layer(s) at a time)" if recompute_every else ""
    parts = {"model states": device, f"activations{recomputed}": activations}
    if outer_states:
        parts["DiLoCo theta_outer and outer optimizer"] = outer_states * FP32 * master
    if carried_rows:
        from dragon.run.carry import state_bytes_per_row

        parts["carried state"] = carried_rows * state_bytes_per_row(config, neuron_parallel)
    if host:
        parts["host: offloaded model states"] = host
    return parts


_BASELINE: list[int] = []


def mark_baseline() -> None:
    """Note this process's resident memory before the model is built."""
    with open("/proc/self/statm") as f:
        _BASELINE[:] = [int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")]


def peak_bytes(device: Optional[torch.device] = None) -> int:
    """The measured peak: the accelerator's allocator peak, or on CPU the process's peak resident
    memory above the baseline mark_baseline noted."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(0, peak - (_BASELINE[0] if _BASELINE else 0))
