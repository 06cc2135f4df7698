#!/usr/bin/env bash
# Launch a recipe on every local GPU, or on 2 CPU processes where there is no GPU.
#   bash launch/train.sh recipes/pretrain.py --deepspeed ds_configs/zero2.json --output_dir runs/x
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [[ "$gpus" -gt 0 ]]; then
  nproc=${NPROC:-$gpus}
else
  # DeepSpeed's CPU accelerator with gloo; one thread per rank on small machines.
  export DS_ACCELERATOR=cpu
  # glibc's malloc on transparent huge pages: a large step faults far less and runs faster, a
  # small one is unchanged (benchmarks/README.md); a value already set wins.
  export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
  nproc=${NPROC:-2}
fi
exec torchrun --standalone --nproc_per_node "$nproc" "$@"
