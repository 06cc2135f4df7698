"""Shared set-up: CPU DeepSpeed environment, the pre-built comm op, and a runner for real jobs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def shm_comm_op():
    """Build DeepSpeed's CPU comm op once (~50 s on a new machine) before any job needs it."""
    code = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch(launcher: str, nproc: int, script: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a recipe under a real launcher: torchrun, deepspeed, accelerate or none (plain python)."""
    port = str(free_port())
    if launcher == "torchrun":
        cmd = ["torchrun", "--nproc_per_node", str(nproc), "--master_port", port]
    elif launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", port]
    elif launcher == "accelerate":
        cmd = ["accelerate", "launch", "--num_processes", str(nproc), "--main_process_port", port]
    elif launcher == "python":
        cmd = [sys.executable]
    else:
        raise ValueError(launcher)
    if launcher == "accelerate":
        cmd += ["--config_file", str(REPO / "launch/accelerate" / args[0])]
        args = args[1:]
    proc = subprocess.run(cmd + [str(REPO / script)] + args, cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=timeout)
    return proc


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A small real text corpus (~400 KB of the standard library) so jobs pack quickly."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_text() for name in ("argparse.py", "dataclasses.py", "functools.py", "typing.py")]
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n".join(parts))
    return path
