"""recipes/pretrain_accelerate.py: an accelerate user's recipe trains as the ZeRO recipe does, its
saves are accelerate's through dragon's retention, its trackers are accelerate's. (Its SIGKILL
resume: tests/test_checkpoints.py.)"""

import json

import pytest
import torch
from conftest import LOSS_ATOL, REPO, TINY, launch, losses, run_tool
from test_checkpoints import STEPS, tag_dir, uninterrupted_run

from dragon.checkpoint.catalog import list_checkpoints
from dragon.model.bdh import BDHForCausalLM


@pytest.mark.slow
def test_the_accelerate_recipe_trains_as_the_zero_recipe(tmp_path_factory, text_file):
    """Under `accelerate launch` on 2 processes (zero2.yaml: ds_configs/zero2.json), dropout on,
    carried state: every step's loss, learning rate and gradient norm, and every evaluation, are
    the ZeRO recipe's under torchrun within 2e-5; each save is a complete accelerate checkpoint
    (checkpoint_<step>, DeepSpeed's files and the run's state in its pytorch_model tag, the
    completion marker) kept as the ZeRO recipe keeps its own; accelerate's TensorBoard tracker
    holds every logged loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics = uninterrupted_run("accelerate", tmp_path_factory, text_file)
    zero2, reference = uninterrupted_run("zero2", tmp_path_factory, text_file)
    assert len(losses(metrics)) == STEPS
    for key in ("loss", "lr", "grad_norm", "eval_loss", "eval_bpb", "eval_loss_carried"):
        assert losses(metrics, key) == pytest.approx(losses(reference, key), abs=LOSS_ATOL), key
    # saved at 4, 8 and 12; retention kept the last two (the best among them), as in the ZeRO run
    assert list_checkpoints(str(out / "checkpoints")) == {"checkpoint_8": 8, "checkpoint_12": 12}
    assert list_checkpoints(str(zero2 / "checkpoints")) == {"step8": 8, "step12": 12}
    for step in (8, 12):
        files = {p.name for p in tag_dir("accelerate", out, step).iterdir()}
        assert {"dragon_complete.json", "mp_rank_00_model_states.pt", "rng_state_1.pt",
                "data_1.pt", "progress_1.pt", "carried_state_1.pt"} <= files
    events = EventAccumulator(str(out / "monitor" / "dragon"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert logged == [(m["step"], pytest.approx(m["loss"], abs=1e-6)) for m in metrics
                      if "loss" in m]


@pytest.mark.parametrize("case", ["csv", "zero_checkpoint", "save_async"])
def test_what_the_accelerate_recipe_leaves_to_the_zero_recipe_is_refused(
        case, tmp_path, tmp_path_factory, text_file):
    """A csv tracker, or a resume from the ZeRO recipe's checkpoint (DiLoCo and --neuron_parallel
    alike): one line naming it and the recipe that takes it, before any process group starts."""
    base = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(tmp_path),
            "--train_file", str(text_file), "--n_layer", "2", "--n_embd", "32", "--n_head", "2",
            "--block_size", "64"]
    if case == "csv":
        extra = ["--report_to", "csv"]
        what = "--report_to csv (accelerate has no csv tracker; metrics.jsonl holds every line)"
    elif case == "save_async":  # asked for in the JSON's checkpoint section
        config = json.loads((REPO / "ds_configs/zero2.json").read_text())
        config["checkpoint"] = {"writer": {"type": "python", "decoupled": True}}
        (tmp_path / "decoupled.json").write_text(json.dumps(config))
        extra = ["--deepspeed", str(tmp_path / "decoupled.json")]
        what = ("--save_async or the JSON's checkpoint.writer.decoupled (accelerate's save_state "
                "writes before it returns; recipes/pretrain_pipeline.py takes it too)")
    else:
        zero2, _ = uninterrupted_run("zero2", tmp_path_factory, text_file)
        tag_dir = zero2 / "checkpoints" / "step12"
        extra = ["--resume_from_checkpoint", str(tag_dir), *TINY]
        what = (f"--resume_from_checkpoint {tag_dir}: step12 is not an accelerate save (this "
                "recipe resumes its own checkpoint_<step>)")
    proc = launch("python", 1, "recipes/pretrain_accelerate.py", [*base, *extra], timeout=120)
    assert proc.returncode == 1
    # (datasets' progress bars while it reads and packs the corpus the first time in a session
    # aside: the refusal comes after the data, and the cache is the session's)
    lines = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines()
             if line and "examples/s]" not in line and " examples [" not in line]
    assert lines == [f"error: recipes/pretrain_accelerate.py: not with {what}; "
                     "recipes/pretrain.py takes it"], lines


@pytest.mark.slow
def test_export_and_sample_read_an_accelerate_run(tmp_path_factory, text_file, tmp_path):
    """recipes/export.py and sample.py take the accelerate run's directory: its best checkpoint
    (checkpoint_12, whose tag lies one level deeper) exports to the weights of the run's own
    final/ export, bit for bit, and samples the same text."""
    out, metrics = uninterrupted_run("accelerate", tmp_path_factory, text_file)
    evals = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert evals[12] < evals[8]  # so the best kept checkpoint is the last
    proc = run_tool("recipes/export.py", "--checkpoint", out, "--output", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from {out / 'checkpoints' / 'checkpoint_12' / 'pytorch_model'}" in proc.stdout
    ours, final = (BDHForCausalLM.from_pretrained(p) for p in (tmp_path / "hf", out / "final"))
    for (name, a), (_, b) in zip(ours.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name
    texts = [run_tool("recipes/sample.py", path, "--prompt", "def ", "--max_new_tokens",
                      "12").stdout for path in (out, out / "final")]
    assert texts[0] == texts[1] and texts[0].startswith("def ")
