"""The parallel layout: process groups, islands, the pipeline and the DeepSpeed config.

- layout: islands x stages x neuron shares x data parallel and ZeRO, one value (Layout)
- distributed: process-group start-up under any launcher, small all-reduces
- topology: islands x data ranks, each island its own torch.distributed world (enter_island)
- pipeline: BDH as a DeepSpeed PipelineModule (bdh_pipeline, carrying)
- neurons: BDH's tensor parallelism over its neurons (split_neurons, NeuronGroups)
- master_weights: this rank's fp32 master weights inside any DeepSpeed engine (MasterWeights)
- named_values: vectors over the master weights saved by parameter name, read on any layout
- ds_config: DeepSpeed JSON configs with "auto" values filled from the arguments
- deepspeed_fixes: the workarounds of DeepSpeed behaviours that set an engine's or optimizer's
  attributes (norm_on_every_rank, skip_nonfinite_updates, set_global_steps)
"""
