#!/usr/bin/env bash
# Multi-node pretraining under slurm: one torchrun per node, each starting one rank per GPU.
#   sbatch launch/slurm.sh                      (edit the #SBATCH lines for your cluster)
#SBATCH --job-name=bdh
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}
srun torchrun \
  --nnodes "$SLURM_NNODES" --nproc_per_node "${GPUS_PER_NODE:-8}" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
  recipes/pretrain.py --deepspeed ds_configs/zero3.json --bf16 \
  --output_dir "${OUTPUT_DIR:-runs/bdh-$SLURM_JOB_ID}" "$@"
