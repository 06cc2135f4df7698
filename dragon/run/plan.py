"""--dry_run: the resolved plan of a run, printed after every check a real start runs, before any
process group, model or engine exists (dragon.run.preflight calls it and exits 0)."""

import json

from dragon.errors import PlanShown
from dragon.model.baseline import is_bdh
from dragon.model.cost import model_profile
from dragon.run.memory import estimate, mark_baseline
from dragon.run.metrics import GPU_PEAK_TFLOPS

MIB = 2**20


def plan_lines(inputs, config) -> list[str]:
    """The plan as printed lines (inputs: dragon.run.inputs.RecipeInputs; config: its
    BDHConfig)."""
    args, diloco, ds, layout = inputs.train, inputs.diloco, inputs.ds_config, inputs.layout
    stages, islands, dp_world = layout.stages, layout.islands, layout.data_parallel
    block = inputs.data.block_size
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    profile = model_profile(config, block + 1)
    tokens = micro * accum * dp_world * islands * block
    if inputs.data.streaming:
        train, epoch = "streamed", "steps per epoch unknown (streamed)"
    else:
        train = f"{len(inputs.train_set):,}"
        epoch = f"{len(inputs.train_set) // (micro * accum * dp_world * islands):,} steps per epoch"
    index = diloco.diloco_island_index
    lines = [f"dry run: {'pipeline' if layout.pipeline else 'ZeRO'} recipe, nothing is trained"]
    k = layout.neurons
    lines.append(
        f"layout: {islands} island(s) x {stages} pipeline stage(s) x {k} neuron share(s) x "
        f"{dp_world} data-parallel rank(s), ZeRO-{layout.zero_stage}"
        + (f" (this launch is island {index})" if layout.one_launch_per_island else "")
    )
    lines += layout.grid(index or 0)
    lines += layout.groups()
    if k > 1:
        lines.append(f"  each neuron share: N/{k} = {config.n_neurons // k} neurons per head")
    shape = (f"{config.n_layer} layers, attention {config.attention} (chunk "
             f"{config.attention_chunk_size})" if is_bdh(config) else
             f"a {config.model_type} baseline of {config.num_hidden_layers} layers, width "
             f"{config.hidden_size}")
    lines.append(
        f"model: {profile.parameters:,} parameters, {shape}; "
        f"{profile.train_flops_per_token / 1e6:,.1f} MFLOPs per token (forward + backward)"
    )
    lines.append(
        f"data: {train} train / {len(inputs.valid_set):,} valid samples of "
        f"{block + 1} tokens; {tokens:,} tokens per step; {epoch}; "
        f"{args.max_steps:,} steps = {args.max_steps * tokens:,} tokens"
    )
    lines += time_lines(inputs, profile.train_flops_per_token, args.max_steps * tokens)
    if diloco.enabled:
        lines.append(
            f"DiLoCo: outer step every {diloco.diloco_inner_steps} steps, {diloco.diloco_mode}, "
            f"compression {diloco.diloco_compress}"
            + (f", top-k {diloco.diloco_topk}" if diloco.diloco_topk and
               diloco.diloco_compress == "none" else "")
            + (f" (density {diloco.sparse_density():.4f} of every chunk of "
               f"{diloco.diloco_sparseloco_chunk} values, 2-bit values, error feedback decay "
               f"{diloco.diloco_sparseloco_decay})" if diloco.diloco_compress == "sparseloco"
               else "")
            + (f", {diloco.diloco_fragments} fragments in turn" if diloco.diloco_fragments > 1
               else "")
            + (", elastic" if diloco.diloco_elastic else "")
            + (f"; unequal islands, {_plan(diloco.island_steps(), diloco.diloco_inner_steps)}"
               if diloco.diloco_island_steps else "")
        )
    lines.append("DeepSpeed config (resolved):")
    lines += ["  " + line for line in json.dumps(ds, indent=2, sort_keys=True).splitlines()]
    lines += memory_lines(inputs, config)
    return lines


def time_lines(inputs, flops_per_token: float, tokens: int) -> list[str]:
    """The tokens to train, the passes over the data, and the time at --plan_mfu of the dense
    bf16 peak of --plan_accelerator on every device of the layout."""
    args, layout = inputs.train, inputs.layout
    epochs, over = inputs.epochs
    name = args.plan_accelerator.lower()
    devices = layout.island_size * layout.islands
    peak = GPU_PEAK_TFLOPS[name.upper()]
    seconds = tokens * flops_per_token / (devices * peak * 1e12 * args.plan_mfu)
    passes = f"{epochs:,.2f} epochs over {over}" if epochs is not None else \
        f"epochs unknown ({over})"
    return [
        f"plan: {tokens:,} tokens to train, {passes}",
        f"time to train: {_duration(seconds)} at {args.plan_mfu:.0%} MFU on {devices} x {name} "
        f"({peak:g} dense bf16 TFLOP/s each; --plan_accelerator {name} --plan_mfu "
        f"{args.plan_mfu:g})",
    ]


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:,.0f} s"


def memory_lines(inputs, config) -> list[str]:
    diloco, ds, args, layout = inputs.diloco, inputs.ds_config, inputs.train, inputs.layout
    outer = 0
    if diloco.enabled:  # theta_outer, plus SGD's momentum buffer when there is momentum
        outer = 1 + (diloco.diloco_outer_momentum > 0)
    rows = 0
    if args.carry_state:
        micro = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
        rows = micro + (args.per_device_eval_batch_size if args.eval_carried else 0)
    # --gradient_checkpointing recomputes every layer (the pipeline's interval 1)
    recompute = (inputs.pipeline.activation_checkpoint_interval if inputs.pipeline else
                 int(args.gradient_checkpointing))
    parts = estimate(config, ds, inputs.data.block_size, layout, outer, rows, recompute)
    device = sum(v for k, v in parts.items() if not k.startswith("host"))
    lines = ["memory per rank (estimate, dragon.run.memory):"]
    lines += [f"  {name}: {value / MIB:,.1f} MiB" for name, value in parts.items()]
    lines.append(f"  total: {device / MIB:,.1f} MiB")
    if layout.bf16:  # the estimate counts bf16 tensors at 2 bytes; not all of them are
        lines.append("  (bf16: CPU runs measured 1.3x (ZeRO-0) to 2.0x (ZeRO-3) this estimate, the "
                     "model alone 1.3x its activations; not yet measured on a GPU: "
                     "benchmarks/README.md)")
    return lines


def show_plan_or_begin(inputs, config) -> None:
    """The end of the checks: with --dry_run print the plan and stop the run (PlanShown, exit
    code 0); else memory_peak_mib counts from here (the model, the engine and training)."""
    if inputs.train.dry_run:
        print("\n".join(plan_lines(inputs, config)))
        raise PlanShown("--dry_run: the plan above; nothing was trained")
    mark_baseline()


def _plan(plan, h: int) -> str:
    """--diloco_island_steps in words."""
    if plan == "auto":
        return (f"steps per window of {h} set at every outer step from each island's measured "
                "step time, averages weighted by tokens")
    return f"steps per window of {h}: {', '.join(map(str, plan))}, averages weighted by tokens"
