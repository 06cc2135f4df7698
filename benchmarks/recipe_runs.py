"""One recipe run under torchrun on CPU, for the benchmark scripts: its metrics.jsonl records."""

import json
import os
import subprocess
import zlib
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def run_recipe(out: Path, nproc: int, args: list[str], metrics_dir: str = "",
               script: str = "recipes/pretrain.py", env: Optional[dict] = None) -> list[dict]:
    """`script` (the ZeRO recipe) --output_dir out *args on nproc CPU ranks (one thread each),
    with `env` added to the environment; the records of <out>/<metrics_dir>/metrics.jsonl."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               **(env or {}))
    port = 29700 + zlib.crc32(str(out).encode()) % 200
    cmd = ["torchrun", "--nproc_per_node", str(nproc), "--master_port", str(port)]
    cmd += [script, "--output_dir", str(out), *args]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    path = out / metrics_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
