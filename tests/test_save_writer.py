"""The writer process of --save_async (dragon.checkpoint.background_saves,
dragon.checkpoint.writer), in one process: a file written from the shared buffer is the
synchronous save's file byte for byte, and the CRC-32 taken as it is written is the file's; a
writer that dies fails the save in one line rather than hanging it, and the next save starts
another; the writer dies with its rank; it removes the checkpoints a prune deleted. Also the
finiteness check that every save makes first.
The jobs: tests/test_save_async.py."""

import os
import signal
import subprocess
import sys
import time
import zlib
from collections import OrderedDict

import pytest
import torch

from dragon.checkpoint.background_saves import BackgroundSaves
from dragon.checkpoint.writes import GuardedWrites, SaveFailed


def a_state() -> dict:
    """Views of one storage, a Parameter with an attribute, a tensor that requires grad, an empty
    one, another dtype, a tensor twice, and objects that are no tensors."""
    flat = torch.randn(1000)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    weight.tag = "w"
    state = {"slice": flat[10:20], "square": flat[100:200].view(10, 10), "flat": flat,
             "weight": weight, "grad": torch.randn(5, requires_grad=True),
             "empty": torch.empty(0), "steps": torch.arange(7),
             "ordered": OrderedDict(x=torch.zeros(2, dtype=torch.bfloat16)),
             "meta": ("x", 2.5, None, b"abc", torch.Size([3, 4]))}
    state["again"] = state["slice"]
    return state


def background_save(saves: BackgroundSaves, write, state, path: str) -> GuardedWrites:
    writes = GuardedWrites()
    writes.background = saves
    writes.save(state, path, write)

    def agree() -> None:
        writes.agree(path)

    saves.then(agree)
    saves.start()
    return writes


def held_save(state, path: str) -> None:
    """torch.save, once `path`.release exists."""
    while not os.path.exists(path + ".release"):
        time.sleep(0.05)
    torch.save(state, path)


def test_a_background_file_is_the_synchronous_saves_file(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )
    state, path = a_state(), str(tmp_path / "state.pt")
    synchronous = GuardedWrites()
    synchronous.save(state, path, torch.save)
    expected = (tmp_path / "state.pt").read_bytes()
    assert synchronous.checksums == {path: zlib.crc32(expected)}
    assert torch.load(path, weights_only=False)["square"].equal(state["square"])
    os.remove(path)
    engine = TorchCheckpointEngine()
    engine.zipfile_serialization = True  # DeepSpeed's default
    saves = BackgroundSaves()
    for write in (torch.save, engine.save, torch.save):  # the buffer reused
        writes = background_save(saves, write, state, path)
        saves.complete()
        assert writes.error is None
        assert (tmp_path / "state.pt").read_bytes() == expected
        assert writes.checksums == synchronous.checksums
        os.remove(path)


def test_a_writer_that_dies_fails_the_save_and_the_next_save_starts_another(tmp_path):
    saves = BackgroundSaves()
    background_save(saves, held_save, a_state(), str(tmp_path / "held.pt"))
    assert not saves.written()
    os.kill(saves._writer.process.pid, signal.SIGKILL)
    with pytest.raises(SaveFailed, match=r"the writer process ended before it reported "
                                         r"\(exit status -9\)"):
        saves.complete()
    writes = background_save(saves, torch.save, a_state(), str(tmp_path / "next.pt"))
    saves.complete()
    assert writes.error is None and (tmp_path / "next.pt").exists()


RANK = """
import os, sys, time, torch
from dragon.checkpoint.background_saves import BackgroundSaves
from dragon.checkpoint.writes import GuardedWrites
from test_save_writer import background_save, held_save
saves = BackgroundSaves()
background_save(saves, held_save, {"x": torch.ones(3)}, sys.argv[1])
print(saves._writer.process.pid, flush=True)
time.sleep(600)
"""


def test_the_writer_dies_with_its_rank(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "held.pt")], env=env,
                            stdout=subprocess.PIPE, text=True)
    writer = int(rank.stdout.readline())
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    deadline = time.time() + 120  # the writer may still be importing torch
    while os.path.exists(f"/proc/{writer}") and _state(writer) != "Z":
        assert time.time() < deadline, "the writer outlived its rank"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_the_finiteness_check_of_a_save_sees_one_bad_value(dtype, value):
    """dragon.checkpoint.checkpointer.weights_finite, one pass over each tensor: one NaN or inf
    anywhere, in a contiguous tensor or a strided view."""
    from dragon.checkpoint.checkpointer import _finite

    weights = torch.randn(100_003).to(dtype)
    assert _finite(weights) and _finite(weights[::3]) and _finite(torch.empty(0))
    for where in (0, 17, 50_001, 99_999, 100_002):
        bad = weights.clone()
        bad[where] = value
        assert not _finite(bad) and not _finite(bad[where % 3::3]), where


def test_the_writer_removes_a_deleted_checkpoint_and_complete_waits_for_it(tmp_path):
    trash = tmp_path / ".deleting-step2"
    (trash / "global_step2").mkdir(parents=True)
    (trash / "global_step2" / "optim.pt").write_bytes(b"x" * 2**20)
    saves = BackgroundSaves()
    saves.remove(str(trash))
    saves.complete()
    assert not trash.exists()
