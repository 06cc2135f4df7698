"""Resume on another layout (dragon.checkpoint.reshape): a ZeRO checkpoint of any stage continues
on another
number of ranks or ZeRO stage, with the losses of the uninterrupted run."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import (
    DILOCO_ZERO3,
    LOSS_ATOL,
    PIPE_X2,
    REPO,
    job_env,
    launch_command,
    losses,
    read_jsonl,
)
from test_checkpoints import finish, recipe_args

# Every layout trains the same global batch of 8 samples.
LAYOUTS = {
    "zero0 x1": ("zero0.json", 1, ["--gradient_accumulation_steps", "2"]),
    "zero1 x1": ("zero1.json", 1, ["--gradient_accumulation_steps", "2"]),
    "zero2 x2": ("zero2.json", 2, []),
    "zero2 x4": ("zero2.json", 4, ["--per_device_train_batch_size", "2"]),
    "zero3 x2": ("zero3.json", 2, []),
    "pipe x2": ("pipeline_zero0.json", 2, []),  # 2 stages, accumulation 2 (the test recipe's)
    "pipe 1 stage x1": ("pipeline_zero0.json", 1, ["--pipeline_stages", "1"]),
    "zero2 x1, 4 a step": ("zero2.json", 1, []),  # half the global batch
    "bf16 zero0 x2": ("zero0.json", 2, ["--bf16", "true"]),
    "bf16 zero2 x2": ("zero2.json", 2, ["--bf16", "true"]),
    "pipe bf16 x2": ("pipeline_zero0.json", 2, ["--bf16", "true"]),
    "pipe bf16 K2 x4": ("pipeline_zero0.json", 4, ["--bf16", "true", "--neuron_parallel", "2"]),
}


def job(layout, out, text_file, extra=()):
    """A recipe job on `layout`, 8 steps, saving at 4 and 8."""
    config, ranks, layout_extra = LAYOUTS[layout]
    kind = "pipeline" if layout.startswith("pipe") else "zero2"
    script, args = recipe_args(kind, out, text_file, "8", [*layout_extra, *extra])
    args += ["--deepspeed", str(REPO / "ds_configs" / config), "--dropout", "0.0"]
    return subprocess.Popen(launch_command("torchrun", ranks, script, args), cwd=REPO,
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


# Layouts whose uninterrupted run is one of the session's (conftest.Runs: the same arguments as
# job()'s), which test_recipe and test_tools use too.
SHARED = {"zero2 x2": ("zero2", dict(config="zero2.json")),
          "zero3 x2": ("zero3", dict(config="zero3.json")), "pipe x2": ("pipe_x2", PIPE_X2)}


@pytest.fixture(scope="module")
def uninterrupted(runs, tmp_path_factory, text_file):
    """layout -> the directory of an uninterrupted 8-step run on it."""
    done = {}

    def run(layout):
        if layout in SHARED:
            name, spec = SHARED[layout]
            return runs(name, **spec)[0]
        if layout not in done:
            done[layout] = tmp_path_factory.mktemp(layout.replace(" ", ""))
            finish(job(layout, done[layout], text_file))
        return done[layout]

    return run


def resumed_from_step4(src, dst):
    """A copy of a finished run's checkpoints up to step 4, to resume from."""
    shutil.copytree(src / "checkpoints", dst / "checkpoints",
                    ignore=shutil.ignore_patterns("step8", "latest"))
    return str(dst / "checkpoints" / "step4")


def describe(layout) -> str:
    config, ranks, _ = LAYOUTS[layout]
    bf16 = " in bf16" if "bf16" in layout else ""
    if layout.startswith("pipe"):
        shares = " x 2 neuron shares" if "K2" in layout else ""
        stages = "1 stage" if "1 stage" in layout else "2 stages"
        return f"a pipeline of {stages} with ZeRO-0 on 1 data-parallel rank(s){shares}{bf16}"
    return f"ZeRO-{config[4]} on {ranks} data-parallel rank(s){bf16}"


def continues(base, other, saved: str, resumed: str, bound: float, apart=None) -> None:
    """Steps 5-8 and the evaluation of the run resumed in `other` are the uninterrupted run's
    in `base` within `bound` (bit for bit on the saved layout); prints the gaps. `apart`: the
    resumed layout's own uninterrupted run, where the two layouts' arithmetic differs (bf16 sums):
    the bound is then at least twice how far the two uninterrupted runs are apart on this CPU."""
    def late(run):
        return {m["step"]: m for m in read_jsonl(run / "metrics.jsonl") if m["step"] > 4}

    expected, got = late(base), late(other)
    assert sorted(got) == sorted(expected) == [5, 6, 7, 8]
    for key in ("loss", "eval_loss"):
        ours, theirs = losses(got.values(), key), losses(expected.values(), key)
        assert len(ours) == len(theirs) > 0
        if saved == resumed:
            assert ours == theirs, key
        gap = max(abs(a - b) for a, b in zip(ours, theirs))
        allowed = bound if apart is None else max(bound, 2 * max(
            abs(a - b) for a, b in zip(losses(late(apart).values(), key), theirs)))
        print(f"| {describe(saved)} | {describe(resumed)} | {key} | {gap:.1e} | {allowed:.1e} |")
        assert gap < allowed, (key, ours, theirs)


@pytest.mark.parametrize(
    "saved, resumed",
    [("zero2 x2", "zero1 x1"), ("zero3 x2", "zero2 x4"), ("zero0 x1", "zero3 x2"),
     ("zero3 x2", "zero0 x1"), ("pipe x2", "zero2 x2"),
     ("bf16 zero0 x2", "bf16 zero2 x2"), ("bf16 zero2 x2", "bf16 zero0 x2")],
)
def test_a_zero_checkpoint_resumes_on_another_layout_with_the_same_losses(
    uninterrupted, tmp_path, text_file, saved, resumed
):
    """ZeRO-2 on 2 ranks to ZeRO-1 on 1 rank with accumulation 2, ZeRO-3 on 2 ranks to ZeRO-2 on
    4, ZeRO-0 on 1 rank to ZeRO-3 on 2, ZeRO-3 on 2 ranks to ZeRO-0 on 1 (converted ahead by
    recipes/reshape_checkpoint.py, which checks the weights, and reused): steps 5-8 of the
    resumed run equal the uninterrupted run's within 2e-5 (2 ranks already equal 1 rank with
    accumulation 2 within it), as do the evaluation losses; so do a 2-stage pipeline resumed
    by the ZeRO recipe on 2 ranks (the pipeline equals the plain model within it; into a
    pipeline: test_layouts' neuron-split cases and the bf16 test below); so do bf16 ZeRO-0
    (its fp32 masters kept beside Adam by DeepSpeed's unfused bf16 optimizer) and bf16 ZeRO-2
    resumed on each other, within 2e-5 or twice the gap between the two layouts' own
    uninterrupted runs, whichever is larger (they sum gradients at different precisions). So
    the weights, Adam's moments and step
    and the LR schedule came across (fresh moments, or bf16-rounded masters, would change steps
    5-8 by far more); the resume says from what it converted to what."""
    base = uninterrupted(saved)
    other = tmp_path / "reshaped"
    tag = resumed_from_step4(base, other)
    offline = resumed == "zero0 x1"  # converted ahead by recipes/reshape_checkpoint.py
    if offline:
        stdout, _ = finish(subprocess.Popen(
            [sys.executable, "recipes/reshape_checkpoint.py", "--checkpoint", tag,
             "--zero_stage", "0"], cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
        assert f"wrote {tag}_zero0: ZeRO-3 on 2 data-parallel rank(s) for ZeRO-0" in stdout
        assert "its 5 fp32 weights equal the checkpoint's bit for bit" in stdout
        written = os.stat(f"{tag}_zero0/mp_rank_00_model_states.pt").st_mtime_ns
    _, stderr = finish(job(resumed, other, text_file, ["--resume_from_checkpoint", tag]))
    if offline:  # the resume reuses the conversion
        assert os.stat(f"{tag}_zero0/mp_rank_00_model_states.pt").st_mtime_ns == written
    assert (f"resume: converting the checkpoint from {describe(saved)} to {describe(resumed)}"
            in stderr)
    # bf16 ZeRO-0 and ZeRO-2 sum the gradients at different precisions: the gap is in the math
    apart = uninterrupted(resumed) if saved.startswith("bf16") else None
    continues(base, other, saved, resumed, 2e-5, apart)


def test_a_changed_global_batch_warns_and_trains(uninterrupted, tmp_path, text_file):
    """ZeRO-2 on 2 ranks (8 samples a step) resumed on 1 rank with 4 a step: the conversion, a
    warning that the data order then differs, and steps 5-8 train from the saved weights (the
    first loss is below the saved run's first by far, and the validation loss goes on falling
    from the saved run's at step 4)."""
    other = tmp_path / "half"
    tag = resumed_from_step4(uninterrupted("zero2 x2"), other)
    _, stderr = finish(job("zero2 x1, 4 a step", other, text_file,
                           ["--resume_from_checkpoint", tag]))
    assert re.search(r"^resume: the global batch changes from 8 to 4 samples \(.*\): applied "
                     r"from step 4; the data order differs from the uninterrupted run's", stderr,
                     re.M), stderr[-3000:]
    got = read_jsonl(other / "metrics.jsonl")
    saved = {m["step"]: m for m in read_jsonl(uninterrupted("zero2 x2") / "metrics.jsonl")}
    assert [m["step"] for m in got] == [5, 6, 7, 8]
    assert got[0]["loss"] < saved[1]["loss"] - 0.2
    assert got[-1]["eval_loss"] < saved[4]["eval_loss"]


@pytest.mark.slow
def test_a_pipeline_resumes_on_other_stage_boundaries(uninterrupted, tmp_path, text_file):
    """A 2-stage pipeline's checkpoint (embedding and layer 1 | layer 2 and head) resumed as one
    stage on one rank (every layer): the resume says what it converts, and steps 5-8 equal the
    uninterrupted 2-stage run's within 2e-5 (the stages pass the same activations; the tied
    block's gradients are summed in another order)."""
    base = uninterrupted("pipe x2")
    other = tmp_path / "one"
    tag = resumed_from_step4(base, other)
    _, stderr = finish(job("pipe 1 stage x1", other, text_file, ["--resume_from_checkpoint", tag]))
    assert (f"resume: converting the checkpoint from {describe('pipe x2')} to "
            f"{describe('pipe 1 stage x1')}") in stderr, stderr[-3000:]
    continues(base, other, "pipe x2", "pipe 1 stage x1", LOSS_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("pipe bf16 K2 x4", "pipe bf16 K2 x4"),
                                            ("pipe bf16 K2 x4", "bf16 zero2 x2"),
                                            ("bf16 zero2 x2", "pipe bf16 x2")])
def test_a_bf16_pipeline_resumes_on_its_own_layout_and_on_another(uninterrupted, tmp_path,
                                                                  text_file, saved, resumed):
    """A bf16 pipeline runs DeepSpeed's bf16 optimizer, whose fp32 masters and Adam moments are in
    files of its own under ZeRO-0 too. On its own layout (2 stages x K=2) its resume equals the
    uninterrupted run bit for bit; as bf16 ZeRO-2 on 2 ranks, and a bf16 ZeRO-2 checkpoint as a
    2-stage bf16 pipeline, steps 5-8 and the evaluation stay within 1e-4 of the saved run. The
    pipeline sums its micro-batches' gradients in bf16 and ZeRO in fp32, so the two layouts'
    own uninterrupted runs differ by 1.4e-4 there; fresh moments or bf16-rounded masters would
    change steps 6-8 by more."""
    base = uninterrupted(saved)
    other = tmp_path / "resumed"
    tag = resumed_from_step4(base, other)
    _, stderr = finish(job(resumed, other, text_file, ["--resume_from_checkpoint", tag]))
    if saved != resumed:
        assert (f"resume: converting the checkpoint from {describe(saved)} to "
                f"{describe(resumed)}") in stderr
    continues(base, other, saved, resumed, 1e-4)


def islands_job(ranks, out, text_file, extra=()):
    """A ZeRO-2 job of 8 steps on `ranks` ranks (islands of one rank each with --diloco_islands)."""
    script, args = recipe_args("zero2", out, text_file, "8", extra)
    args += ["--dropout", "0.0"]
    return subprocess.Popen(launch_command("torchrun", ranks, script, args), cwd=REPO,
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


DILOCO = DILOCO_ZERO3["extra"]


@pytest.fixture(scope="module")
def two_islands(runs):
    """Two ZeRO-3 islands of one rank (sync, H 4, Nesterov outer steps), 8 steps, saved at 4:
    the session's (test_tools reads it too)."""
    return runs("diloco_zero3", **DILOCO_ZERO3)[0]


@pytest.mark.slow
def test_a_diloco_run_resumes_by_another_number_of_islands(two_islands, tmp_path, text_file):
    """Two ZeRO-3 islands (sync, H 4) saved at step 4. Resumed without islands by ZeRO-2 on 2
    ranks (the same global batch), step 5 starts from theta_outer on the same 8 samples: its
    loss is the mean of the islands' step-5 losses within 2e-5. Resumed by 3 ZeRO-2 islands
    (each island's outer state moved to ZeRO-2's partition), island 2 takes island 0's
    checkpoint: after the outer step at 8 all three hold bit-identical weights and theta_outer
    (its outer momentum is theirs)."""
    diloco, base = DILOCO, two_islands
    ran = [read_jsonl(base / f"island{i}" / "metrics.jsonl") for i in (0, 1)]
    three = ["--diloco_islands", "3", *diloco[2:]]
    for name, ranks, extra in (("one", 2, []), ("three", 3, three)):
        out = tmp_path / name
        for i in (0, 1):
            resumed_from_step4(base / f"island{i}", out / f"island{i}")
        _, stderr = finish(islands_job(ranks, out, text_file,
                                       [*extra, "--resume_from_checkpoint", "latest"]))
        if name == "one":
            assert "the run was saved by 2 island(s) and resumes by 1: island 0 continues from " \
                "its own checkpoint; islands [1] are left out" in stderr
            step5 = next(m["loss"] for m in read_jsonl(out / "metrics.jsonl") if m["step"] == 5)
            expected = sum(next(m["loss"] for m in r if m["step"] == 5) for r in ran) / 2
            print(f"| 2 islands | no islands, 2 ranks | step-5 loss vs islands' mean | "
                  f"{abs(step5 - expected):.1e} |")
            assert abs(step5 - expected) < 2e-5, (step5, expected)
        else:
            assert "resumes by 3: island 2 continues from island 0's checkpoint" in stderr
            last = [read_jsonl(out / f"island{i}" / "metrics.jsonl")[-1] for i in (0, 1, 2)]
            assert all(m["step"] == 8 and "outer_step" in m for m in last)
            for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
                assert last[0][key] == last[1][key] == last[2][key], key


@pytest.mark.slow
def test_diloco_islands_resume_on_more_ranks_each(two_islands, tmp_path, text_file):
    """The two ZeRO-3 islands of one rank resume from step 4 as two ZeRO-2 islands of two ranks
    (the same global batch): each rank's theta_outer and outer momentum are cut from the saved
    ones for its new partition. Each island's steps 5-8 equal its uninterrupted losses within 2e-5
    (2 ranks equal 1), and after the outer step at 8, which applies the momentum of the one at
    4, theta_outer's sum and sum of squares equal the uninterrupted ones within 1e-6 relative.
    """
    out = tmp_path / "wider"
    for i in (0, 1):
        resumed_from_step4(two_islands / f"island{i}", out / f"island{i}")
    _, stderr = finish(islands_job(4, out, text_file, [
        *DILOCO, "--per_device_train_batch_size", "2", "--resume_from_checkpoint", "latest"]))
    assert ("resume: converting the checkpoint from ZeRO-3 on 1 data-parallel rank(s) to ZeRO-2 "
            "on 2 data-parallel rank(s)") in stderr
    for i in (0, 1):
        expected = [m for m in read_jsonl(two_islands / f"island{i}" / "metrics.jsonl")
                    if m["step"] > 4]
        got = read_jsonl(out / f"island{i}" / "metrics.jsonl")
        assert [m["step"] for m in got] == [m["step"] for m in expected] == [5, 6, 7, 8]
        gap = max(abs(a - b) for a, b in zip(losses(got), losses(expected)))
        print(f"| 2 ZeRO-3 islands x 1 rank | 2 ZeRO-2 islands x 2 ranks | island {i} loss | "
              f"{gap:.1e} |")
        assert gap < 2e-5, (losses(got), losses(expected))
        for key in ("outer_sum", "outer_sumsq"):
            ours, theirs = got[-1][key], expected[-1][key]
            print(f"| 2 ZeRO-3 islands x 1 rank | 2 ZeRO-2 islands x 2 ranks | island {i} {key} "
                  f"at step 8 | {abs(ours - theirs) / abs(theirs):.1e} relative |")
            assert ours == pytest.approx(theirs, rel=1e-6), key
