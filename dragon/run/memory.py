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
flight (1F1B).

DiLoCo adds theta_outer and the outer optimizer's state (fp32, over this rank's master
weights); --carry_state the carried states of every row. --neuron_parallel K leaves a rank 1/K
of the shared block and of the N-wide activations (counted on a meta model that keeps 1/K).
"""

import os
import resource
from typing import Optional

import torch
from transformers import AutoModelForCausalLM

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


def activation_bytes(
    config: BDHConfig, micro_batch: int, block: int, dtype: torch.dtype = torch.float32,
    neuron_parallel: int = 1,
) -> int:
    """What one micro-batch's forward keeps for backward, plus backward's working room (with
    --neuron_parallel K, of a model that keeps 1/K of the neurons)."""
    with torch.device("meta"):
        build = BDHForCausalLM if is_bdh(config) else AutoModelForCausalLM.from_config
        model = build(config).to(dtype)
    if neuron_parallel > 1:
        keep_share(model, 0, neuron_parallel)
    ids = torch.zeros(micro_batch, block, dtype=torch.long, device="meta")
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a view keeps its base alive, once
        saved[id(base)] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(saved.values()) + 3 * max(saved.values(), default=0)


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
) -> dict[str, int]:
    """Estimated bytes per rank of `layout`, by part; `outer_states` fp32 copies of the master
    weights for DiLoCo (theta_outer plus its optimizer's buffers), `carried_rows` rows of
    carried state."""
    dp_world, stages, neuron_parallel = layout.data_parallel, layout.stages, layout.neurons
    zero = ds_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    micro = ds_config["train_micro_batch_size_per_gpu"]
    params, largest = rank_parameters(config, stages, neuron_parallel)
    device, host = model_state_bytes(params, largest, stage, bf16, dp_world, offload)
    activations = activation_bytes(config, micro, block, torch.bfloat16 if bf16 else torch.float32,
                                   neuron_parallel)
    if stages > 1:
        in_flight = min(stages, ds_config["gradient_accumulation_steps"])
        activations = activations * in_flight * -(-config.n_layer // stages) // config.n_layer
    master = params // dp_world if stage >= 1 else params
    parts = {"model states": device, "activations": activations}
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
