"""dragon.checkpoint.save_hook on a real one-process DeepSpeed engine: saves that a user's own loop
calls through engine.save_checkpoint, with --save_async's background writer."""

import torch
from test_deepspeed_fixes import engine_of, one_process_world  # noqa: F401 (the fixture)

from dragon.checkpoint.catalog import is_complete, read_latest
from dragon.checkpoint.checkpointer import Checkpointer
from dragon.checkpoint.retention import RetentionPolicy
from dragon.checkpoint.save_hook import attach_retention


def test_a_save_called_while_a_background_save_is_in_flight_completes_both(tmp_path):
    """Two direct engine.save_checkpoint calls with the first one's files still in the writer: the
    second waits for the first to complete (else the first's prune would take the second, not
    yet marked, for a half-written checkpoint), and both end complete, `latest` on the second."""
    engine = engine_of(torch.nn.Linear(2, 1), {})
    attach_retention(engine, RetentionPolicy(save_total_limit=5, metric_for_best_model=None))
    checkpointer = Checkpointer(engine, str(tmp_path), save_async=True)
    for step in (1, 2):
        engine.save_checkpoint(str(tmp_path), tag=f"step{step}", client_state={"step": step})
    checkpointer.wait()
    assert is_complete(str(tmp_path / "step1")) and is_complete(str(tmp_path / "step2"))
    assert read_latest(str(tmp_path)) == "step2"
