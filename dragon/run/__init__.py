"""What a recipe needs around its loop: inputs, checks, metrics, faults and the run's state.

- args: the argument dataclasses (ModelArguments, TrainingArguments, PipelineArguments)
- diloco_args: DiLoCo's command line (DiLoCoArguments) and the DiLoCoConfig it gives
- preflight: every check before a process group starts (RecipeInputs)
- metrics: metrics.jsonl (its one writer and reader), throughput, MFU, logging
- faults: preemption signals and non-finite steps (StepGuard)
- loop: TrainingRun, the bookkeeping around a recipe's step
- setup: what every recipe does before and after its loop (set_up, tear_down)
- evaluation: the validation loss, bits per byte and sparsity of an evaluation
- accelerator: the accelerate recipe's checks and Accelerator
- exits: how a recipe process ends (run_recipe)
- carry: attention states carried from step to step (CarriedState)
- optim, memory, plan: the client optimizer, memory estimates, --dry_run
"""
