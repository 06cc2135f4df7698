#!/usr/bin/env bash
# Any recipe under Slurm: srun starts one process per rank (one task per GPU), with a static
# rendezvous at the allocation's first node; preemption saves and the job requeues itself.
#
#   sbatch --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 launch/slurm.sh \
#       recipes/pretrain.py recipes/configs/bdh_100m_8gpu_zero2.yaml [FLAGS...]
#   sbatch --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 launch/slurm.sh \
#       recipes/pretrain_pipeline.py recipes/configs/bdh_1b_4x8gpu_pipeline.yaml
#
# RECIPE [CONFIG] [FLAGS...] are the recipe's own command line; the ranks are the job's tasks.
# Every start resumes its run with --resume_from_checkpoint auto (a flag of yours after it wins),
# so a first start, a requeue and a restart are one command. Near the time limit
# (--signal=B:TERM@120) or on `scancel --batch --signal=TERM JOB`, this script sends every rank
# one SIGTERM; the ranks save at their next step and exit, and the job requeues itself.
# `scancel --signal=TERM JOB` (the ranks, not this script) saves and ends the job without it.
#SBATCH --job-name=bdh
#SBATCH --signal=B:TERM@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
if [[ $# -lt 1 || ! -f "$1" ]]; then
  echo "error: launch/slurm.sh RECIPE [CONFIG] [FLAGS...]: recipe ${1:-(none)} not found" \
    "(sbatch from the repository's root)" >&2
  exit 2
fi
recipe=$1
shift
config=()  # a config file comes first, before the flags
if [[ $# -gt 0 && "$1" != -* && "$1" =~ \.(yaml|yml|json)$ ]]; then
  config=("$1")
  shift
fi
if ! nvidia-smi -L >/dev/null 2>&1; then  # CPU nodes: DeepSpeed's CPU accelerator, gloo
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# A static rendezvous (no store to hang on): the allocation's first node, a port per job.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
echo "slurm.sh: job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)):" \
  "${SLURM_NTASKS:-1} rank(s) on ${SLURM_NNODES:-1} node(s), master $MASTER_ADDR:$MASTER_PORT"

preempted=0
on_term() {  # this script's signal goes to every rank once
  [[ $preempted == 1 ]] && return
  preempted=1
  scancel --signal=TERM "$SLURM_JOB_ID.0" || true
}
trap on_term TERM
srun --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID \
  WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=${SLURM_STEP_TASKS_PER_NODE%%(*}; exec python "$@"' \
  _ "$recipe" ${config[@]+"${config[@]}"} --resume_from_checkpoint auto "$@" &
step=$!
status=0
wait "$step" || status=$?
while kill -0 "$step" 2>/dev/null; do  # a signal ends `wait` early: wait for the ranks
  sleep 1
done
if [[ $preempted == 1 ]]; then  # the ranks' own status, not the interrupted wait's
  status=0
  wait "$step" || status=$?
fi
if [[ $preempted == 1 && $status == 0 ]]; then
  echo "slurm.sh: preempted, every rank saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
