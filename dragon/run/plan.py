"""--dry_run: the resolved plan of a run, printed after every check a real start runs, before any
process group, model or engine exists (dragon.run.preflight calls it and exits 0)."""

import json

from dragon.errors import PlanShown
from dragon.model.baseline import is_bdh
from dragon.model.cost import model_profile
from dragon.parallel.distributed import launcher_world_size
from dragon.run.memory import estimate, mark_baseline

MIB = 2**20


def rank_layout(world: int, islands: int, stages: int, one_launch_per_island: bool) -> list[str]:
    """One line per launch rank: its island, pipeline stage and data-parallel rank (DeepSpeed's
    pipe-major order inside an island: rank = stage x data-parallel degree + data rank)."""
    size = world if one_launch_per_island else world // islands
    dp = size // stages
    lines = []
    for r in range(world):
        island, local = (0, r) if one_launch_per_island else divmod(r, size)
        stage, data = divmod(local, dp)
        where = [f"island {island}"] if islands > 1 else []
        where += [f"stage {stage}"] if stages > 1 else []
        lines.append(f"  rank {r}: {', '.join(where + [f'data rank {data} of {dp}'])}")
    return lines


def plan_lines(inputs, config, dp_world: int) -> list[str]:
    """The plan as printed lines (inputs: dragon.run.preflight.RecipeInputs; config: its
    BDHConfig)."""
    args, diloco, ds = inputs.train, inputs.diloco, inputs.ds_config
    stages = inputs.pipeline.pipeline_stages if inputs.pipeline else 1
    islands = diloco.diloco_islands if diloco.enabled else 1
    block = inputs.data.block_size
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    world = launcher_world_size()
    profile = model_profile(config, block + 1)
    tokens = micro * accum * dp_world * islands * block
    if inputs.data.streaming:
        train, epoch = "streamed", "steps per epoch unknown (streamed)"
    else:
        train = f"{len(inputs.train_set):,}"
        epoch = f"{len(inputs.train_set) // (micro * accum * dp_world * islands):,} steps per epoch"
    one_launch = diloco.diloco_island_index is not None
    lines = [f"dry run: {'pipeline' if stages > 1 else 'ZeRO'} recipe, nothing is trained"]
    k = args.neuron_parallel
    lines.append(
        f"topology: {islands} island(s) x {stages} pipeline stage(s) x {dp_world} "
        "data-parallel rank(s)" + (f" x {k} neuron shares" if k > 1 else "")
        + (f" (this launch is island {diloco.diloco_island_index})" if one_launch else "")
    )
    if k > 1:  # adjacent ranks share out the neurons (dragon.parallel.neurons.NeuronGroups)
        lines += [f"  rank {r}: neurons {r % k} of {k} (N/{k} = {config.n_neurons // k} per "
                  f"head), data rank {r // k} of {dp_world}" for r in range(world)]
    else:
        lines += rank_layout(world, islands, stages, one_launch)
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
    if diloco.enabled:
        lines.append(
            f"DiLoCo: outer step every {diloco.diloco_inner_steps} steps, {diloco.diloco_mode}, "
            f"compression {diloco.diloco_compress}"
            + (f", top-k {diloco.diloco_topk}" if diloco.diloco_topk else "")
            + (f", {diloco.diloco_fragments} fragments in turn" if diloco.diloco_fragments > 1
               else "")
            + (", elastic" if diloco.diloco_elastic else "")
        )
    lines.append("DeepSpeed config (resolved):")
    lines += ["  " + line for line in json.dumps(ds, indent=2, sort_keys=True).splitlines()]
    lines += memory_lines(inputs, config, dp_world, stages)
    return lines


def memory_lines(inputs, config, dp_world: int, stages: int) -> list[str]:
    diloco, ds, args = inputs.diloco, inputs.ds_config, inputs.train
    outer = 0
    if diloco.enabled:  # theta_outer, plus SGD's momentum buffer when there is momentum
        outer = 1 + (diloco.diloco_outer_momentum > 0)
    rows = 0
    if args.carry_state:
        micro = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
        rows = micro + (args.per_device_eval_batch_size if args.eval_carried else 0)
    parts = estimate(config, ds, inputs.data.block_size, dp_world, stages, outer, rows,
                     args.neuron_parallel)
    device = sum(v for k, v in parts.items() if not k.startswith("host"))
    lines = ["memory per rank (estimate, dragon.run.memory):"]
    lines += [f"  {name}: {value / MIB:,.1f} MiB" for name, value in parts.items()]
    lines.append(f"  total: {device / MIB:,.1f} MiB")
    return lines


def show_plan_or_begin(inputs, config, dp_world: int) -> None:
    """The end of the checks: with --dry_run print the plan and stop the run (PlanShown, exit
    code 0); else memory_peak_mib counts from here (the model, the engine and training)."""
    if inputs.train.dry_run:
        print("\n".join(plan_lines(inputs, config, dp_world)))
        raise PlanShown("--dry_run: the plan above; nothing was trained")
    mark_baseline()
