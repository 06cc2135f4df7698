"""Shared set-up: CPU DeepSpeed environment, the pre-built comm op, and a runner for real jobs."""

import contextlib
import fcntl
import io
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
XDIST = "PYTEST_XDIST_WORKER" in os.environ  # a worker of pytest-xdist
sys.path.insert(0, str(REPO))  # test this checkout, whatever `pip install -e` points at

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


COMM_OP = ("from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; "
           "ShareMemCommBuilder().load()")


@pytest.fixture(scope="session", autouse=True)
def shm_comm_op():
    """Build DeepSpeed's CPU comm op once (~50 s on a new machine) before any job needs it."""
    subprocess.run([sys.executable, "-c", COMM_OP], check=True, capture_output=True, timeout=600)


SOAK_DIR = "DRAGON_TEST_SOAK_DIR"  # where pytest-xdist's controller runs the soak


@pytest.fixture(scope="session", autouse=True)
def churn_soak(request, shm_comm_op, tmp_path_factory):
    """tests/test_churn.py's soak, started in the background as the session starts when its test
    is selected: five minutes of kills, its islands mostly resting in held steps, beside the
    other tests instead of after them. Its test runs last and waits for the verdict. Under
    pytest-xdist the controller starts it (pytest_xdist_node_collection_finished), so that no
    worker waits for it while there are other tests to run."""
    if XDIST or not any("soak_verdict" in item.fixturenames for item in request.session.items):
        yield None
        return
    proc = start_soak(tmp_path_factory.mktemp("churn"))
    yield proc
    stop_soak(proc)  # the session ended before its test did


@pytest.fixture
def soak_verdict(churn_soak) -> tuple[int, str]:
    """The soak's exit status and what it printed, once it ends."""
    if churn_soak is None:  # pytest-xdist: the controller's soak writes both into its folder
        folder = Path(os.environ[SOAK_DIR])
        for _ in range(1500):
            if (folder / "returncode").exists():
                break
            time.sleep(1)
        return int((folder / "returncode").read_text()), (folder / "output").read_text()
    try:
        output = churn_soak.communicate(timeout=1500)[0]
    finally:
        stop_soak(churn_soak)
    return churn_soak.returncode, output


def start_soak(folder: Path, record: bool = False) -> subprocess.Popen:
    """The soak under `folder`; `record`: its output and exit status written to files there
    (what else is there to read them); else they come through a pipe."""
    command = [sys.executable, str(REPO / "tests/scripts/churn_soak.py"), "--minutes", "5",
               "--out", str(folder / "run")]
    if record:
        command = ["sh", "-c", '{ "$0" -c "$1" && shift && "$@"; } > output 2>&1; '
                   "echo $? > returncode.tmp && mv returncode.tmp returncode",
                   sys.executable, COMM_OP, *command]
    return subprocess.Popen(command, cwd=folder if record else REPO, env=job_env(),
                            stdout=None if record else subprocess.PIPE,
                            stderr=None if record else subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop_soak(proc: subprocess.Popen) -> None:
    """The soak and its islands, SIGKILLed if still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_SOAK: dict = {}  # pytest-xdist's controller: the soak's folder and its process


def pytest_configure(config):
    """pytest-xdist's controller: a folder for the soak, named to the workers it starts."""
    if not XDIST and getattr(config.option, "numprocesses", None):
        _SOAK["folder"] = os.environ[SOAK_DIR] = tempfile.mkdtemp(prefix="dragon-soak-")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller starts the soak once a worker has collected its test."""
    if "proc" not in _SOAK and any("test_churn.py::" in i for i in ids):
        _SOAK["proc"] = start_soak(Path(_SOAK["folder"]), record=True)


def pytest_unconfigure(config):
    if "proc" in _SOAK:
        stop_soak(_SOAK.pop("proc"))  # the session ended before the soak did
    if "folder" in _SOAK:
        shutil.rmtree(_SOAK.pop("folder"), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The soak's test last, as the soak runs beside every other test."""
    items.sort(key=lambda item: "soak_verdict" in item.fixturenames)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    if any(key.startswith("DRAGON_FAULT_") for key in extra):  # tests/faults makes them happen
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO)])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_tool(script: str, *argv) -> subprocess.CompletedProcess:
    """A tool that starts no process group (recipes/export.py, verify_checkpoints.py) run in this
    process as `python script argv` runs it: its exit status and what it printed. It spares the
    seconds of imports a new interpreter takes."""
    out, err, argv_before = io.StringIO(), io.StringIO(), sys.argv
    sys.argv, code = [script, *map(str, argv)], 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as stop:  # as the interpreter reports it
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if isinstance(stop.code, str):
            err.write(stop.code + "\n")
    finally:
        sys.argv = argv_before
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue(), err.getvalue())


def launch_command(launcher: str, nproc: int, script: str, args: list[str]) -> list[str]:
    """The command line of a recipe under a real launcher: torchrun, deepspeed, accelerate or
    python.
    """
    port = str(free_port())
    if launcher == "torchrun":
        cmd = ["torchrun", "--nproc_per_node", str(nproc), "--master_port", port]
    elif launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", port]
    elif launcher == "accelerate":
        cmd = [
            "accelerate",
            "launch",
            "--num_processes",
            str(nproc),
            "--main_process_port",
            port,
            "--config_file",
            str(REPO / "launch/accelerate" / args[0]),
        ]
        args = args[1:]
    elif launcher == "python":
        cmd = [sys.executable]
    else:
        raise ValueError(launcher)
    return cmd + [str(REPO / script)] + [str(a) for a in args]


def launch(
    launcher: str, nproc: int, script: str, args: list[str], timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run a recipe to completion under a real launcher."""
    return subprocess.run(
        launch_command(launcher, nproc, script, args),
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A small real text corpus (~400 KB of the standard library) so jobs pack quickly."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [
        (stdlib / name).read_text()
        for name in ("argparse.py", "dataclasses.py", "functools.py", "typing.py")
    ]
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n".join(parts))
    return path


# A tiny BDH so a 2-rank job takes seconds; dropout 0 so runs can be compared number for number.
TINY = (
    "--n_layer 2 --n_embd 32 --n_head 2 --mlp_internal_dim_multiplier 8 --block_size 64"
    " --dropout 0.0 --learning_rate 3e-3 --warmup_steps 2 --logging_steps 1 --eval_steps 4"
    " --save_steps 4 --max_eval_samples 32 --per_device_eval_batch_size 8"
    " --sample_max_new_tokens 0 --disable_tqdm"
).split()
STEPS = 8
# What a test appends to a command of the guide or a named config to run it small on CPU, with
# its layout kept: a tiny BDH, 64-byte sequences, 2 micro-batches of 2, fp32 (bf16 is slow on
# these CPUs), 4 steps with an evaluation and a save at the end, no sample.
SHRUNK_STEPS = 4
SHRINK = (
    "--n_layer 2 --n_embd 32 --n_head 2 --mlp_internal_dim_multiplier 8 --block_size 64"
    " --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --bf16 false"
    f" --max_steps {SHRUNK_STEPS} --warmup_steps 1 --logging_steps 1 --eval_steps {SHRUNK_STEPS}"
    f" --save_steps {SHRUNK_STEPS} --max_eval_samples 16 --per_device_eval_batch_size 4"
    " --sample_max_new_tokens 0 --disable_tqdm"
).split()
# Stateful training, evaluated on few enough validation blocks for one stream per row.
CARRY = ["--carry_state", "--max_eval_samples", "64"]
# fp32 on CPU: ranks sum gradients in a different order than one rank does, and ZeRO stages
# partition and reduce in buckets; the differences are rounding, a few ulp of a loss near 4.
LOSS_ATOL = 2e-5


# Runs several test modules share (conftest.Runs keyword arguments): a 2-stage ZeRO-0 pipeline
# of 2 micro-batches, and DiLoCo islands.
PIPE_X2 = dict(config="pipeline_zero0.json", script="recipes/pretrain_pipeline.py",
               extra=["--pipeline_stages", "2", "--gradient_accumulation_steps", "2"])
DILOCO_ZERO3 = dict(config="zero3.json", extra=["--diloco_islands", "2", "--diloco_inner_steps",
                                                "4", "--diloco_checksum"])
# ZeRO-2 recomputing every layer in the backward, with steps 2-3 profiled: the runs the
# gradient-checkpointing and profiler tests share (profiling changes no loss)
ZERO2_GC = dict(extra=["--gradient_checkpointing", "--profile_steps", "2:3"])
# 2 islands of one ZeRO-0 rank each with dropout, H 2, delayed outer steps
DILOCO_DELAYED = dict(config="zero0.json", extra=[
    "--dropout", "0.2", "--diloco_islands", "2", "--diloco_inner_steps", "2", "--diloco_checksum",
    "--diloco_mode", "delayed"])


class Runs:
    """Runs of the recipe made once per session and compared by several tests. A name is one run:
    asking for it with other arguments is an error, so no result depends on which test ran
    first. Its record (its arguments and what it printed) lies beside its folder, under a lock,
    so that pytest-xdist's workers share one run of each name."""

    def __init__(self, root, text_file):
        self.root, self.text_file = root, text_file

    def __call__(
        self,
        name,
        launcher="torchrun",
        nproc=2,
        config="zero2.json",
        micro=4,
        extra=(),
        out=None,
        script="recipes/pretrain.py",
    ):
        key = [launcher, nproc, config, micro, list(map(str, extra)), str(out), script]
        record = self.root / f"{name}.json"
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if record.exists():
                done = json.loads(record.read_text())
                if done["key"] != key:  # a name is one run, whichever test asks first
                    raise ValueError(f"runs({name!r}) asked with other arguments: {key} "
                                     f"!= {done['key']}")
            else:
                out = out or self.root / name
                proc = launch(launcher, nproc, script,
                              self.arguments(out, launcher, config, micro, extra))
                assert proc.returncode == 0, \
                    f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
                done = dict(key=key, out=str(out), args=proc.args, stdout=proc.stdout,
                            stderr=proc.stderr)
                record.write_text(json.dumps(done))
        out = Path(done["out"])
        metrics = out / "metrics.jsonl"
        if not metrics.exists():  # DiLoCo islands: <out>/island<i>/metrics.jsonl
            metrics = out / "island0" / "metrics.jsonl"
        proc = subprocess.CompletedProcess(done["args"], 0, done["stdout"], done["stderr"])
        return out, read_jsonl(metrics), proc

    def arguments(self, out, launcher="torchrun", config="zero2.json", micro=4, extra=()):
        """The recipe's arguments of a run into `out`."""
        cfg = (
            [config]
            if launcher == "accelerate"
            else ["--deepspeed", str(REPO / "ds_configs" / config)]
        )
        if config.startswith("/"):
            cfg = ["--deepspeed", config]
        return [*cfg, "--output_dir", str(out), "--train_file", str(self.text_file),
                "--max_steps", str(STEPS), "--per_device_train_batch_size", str(micro), *TINY,
                *extra]


@pytest.fixture(scope="session")
def runs(tmp_path_factory, text_file):
    if not XDIST:
        return Runs(tmp_path_factory.mktemp("runs"), text_file)
    shared = tmp_path_factory.getbasetemp().parent / "runs"  # the workers' common folder
    shared.mkdir(exist_ok=True)
    return Runs(shared, text_file)


def bad_input_base(config: str, out, text_file) -> list[str]:
    """A small valid run's arguments; a test of bad input adds one mistake to them."""
    return [
        "--deepspeed",
        str(REPO / "ds_configs" / config),
        "--output_dir",
        str(out),
        "--train_file",
        str(text_file),
        *"--n_layer 2 --n_embd 32 --n_head 2 --block_size 64".split(),
    ]


@pytest.fixture(scope="session")
def long_text_file(tmp_path_factory, text_file) -> Path:
    """The test corpus 5 times (~2 MB): a stream of 2,049-token blocks that holds the 256
    validation blocks and a global batch of a named config."""
    path = tmp_path_factory.mktemp("long") / "corpus.txt"
    path.write_text("\n".join([text_file.read_text()] * 5))
    return path


@pytest.fixture(scope="session")
def four_shards(tmp_path_factory):
    """4 JSON-lines files of random hexadecimal words: a stream of 4 shards whose 16-byte
    blocks are all distinct."""
    import random

    root = tmp_path_factory.mktemp("four") / "shards"
    root.mkdir()
    draw = random.Random(0)
    for k in range(4):
        rows = [{"text": " ".join(f"{draw.getrandbits(32):08x}" for _ in range(1 + i % 9))}
                for i in range(300 + 40 * k)]
        (root / f"{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def with_local_data(words: list, data_file, folder: Path) -> list[str]:
    """`words` with every named config (recipes/configs/) that names a hub dataset replaced by a
    copy in `folder` that reads `data_file`: the hub is out of reach here."""
    import yaml

    found = []
    for word in map(str, words):
        path = Path(word) if os.path.isabs(word) else REPO / word
        if word.endswith(".yaml") and path.parent == REPO / "recipes" / "configs":
            values = yaml.safe_load(path.read_text())
            if values.pop("dataset_name", None):
                values.pop("dataset_config_name", None)
                values["train_file"] = str(data_file)
                word = str(folder / path.name)
                Path(word).write_text(yaml.safe_dump(values))
        found.append(word)
    return found


def losses(metrics, key="loss"):
    return [m[key] for m in metrics if key in m]


def run_recipe_in_process(
    monkeypatch, script: str, argv: list[str], env: dict | None = None
) -> str:
    """Run a recipe's main() in this process; bad input must stop it, before any process group
    starts, with one line. Returns that line."""
    import runpy

    import torch

    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert not torch.distributed.is_initialized()
    message = str(stop.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def dry_run_in_process(monkeypatch, script: str, argv: list[str], env: dict) -> None:
    """Run a recipe's --dry_run in this process under the launcher variables `env` (WORLD_SIZE
    for the world it plans); it must end with exit code 0, its plan printed."""
    import runpy

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [script, *argv, "--dry_run"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert stop.value.code in (0, None), (script, stop.value)
