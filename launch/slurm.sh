#!/usr/bin/env bash
# Any recipe under Slurm: one torchrun per node (srun), one rank per GPU, a static rendezvous at
# the first node of the allocation, preemption saves and requeues.
#
#   sbatch --nodes 2 --gpus-per-node 8 launch/slurm.sh recipes/pretrain.py \
#       recipes/configs/bdh_100m_8gpu_zero2.yaml [FLAGS...]
#   sbatch --nodes 4 --gpus-per-node 8 launch/slurm.sh recipes/pretrain_pipeline.py \
#       recipes/configs/bdh_1b_4x8gpu_pipeline.yaml
#
# RECIPE [CONFIG] [FLAGS...] are the recipe's own command line. Ranks per node: the GPUs Slurm
# gives the node, else PROCS_PER_NODE (CPU nodes: 2 by default). Every start resumes its run
# with --resume_from_checkpoint auto (a flag of yours after it wins), so a first start, a requeue
# and a restart are the same command. Near the time limit (--signal=B:TERM@120) or on
# `scancel --batch --signal=TERM`, the ranks save at their next step and the job requeues itself.
#SBATCH --job-name=bdh
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:TERM@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: sbatch [options] launch/slurm.sh RECIPE [CONFIG] [FLAGS...]" >&2
  exit 2
fi
if [[ ! -f "$1" ]]; then
  echo "error: recipe $1 not found (run sbatch from the repository's root)" >&2
  exit 2
fi

nodes=${SLURM_NNODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l || true)}
if [[ "${gpus:-0}" -gt 0 ]]; then
  per_node=${PROCS_PER_NODE:-$gpus}
else
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  per_node=${PROCS_PER_NODE:-2}
fi
# A static rendezvous (no c10d store to hang on): the allocation's first node, a port per job.
master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
echo "slurm.sh: job $SLURM_JOB_ID (start $((${SLURM_RESTART_COUNT:-0} + 1))): $nodes node(s) x" \
  "$per_node rank(s), master $master:$port: $*"

preempted=0
on_term() {  # the batch shell's signal goes to the ranks once, through srun
  preempted=1
  kill -TERM "$step" 2>/dev/null || true
}
trap on_term TERM
recipe=$1
shift
config=()  # a config file comes first, before the flags
if [[ $# -gt 0 && "$1" != -* && "$1" =~ \.(yaml|yml|json)$ ]]; then
  config=("$1")
  shift
fi
srun --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes "$1" --node_rank "$SLURM_NODEID" \
  --nproc_per_node "$2" --master_addr "$3" --master_port "$4" "${@:5}"' _ \
  "$nodes" "$per_node" "$master" "$port" \
  "$recipe" "${config[@]}" --resume_from_checkpoint auto "$@" &
step=$!
status=0
wait "$step" || status=$?
while kill -0 "$step" 2>/dev/null; do  # a signal ends `wait` early: wait for the step itself
  wait "$step" || status=$?
done
if [[ $preempted == 1 ]]; then
  echo "slurm.sh: preempted; the ranks saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
