"""Checkpoint retention: the policy, pruning real directories, resume discovery, and real 2-rank
jobs.
"""

import json
import math
import os
import random
import warnings

import pytest

from conftest import launch
from dragon.history import MetricHistory
from dragon.checkpoint.catalog import MARKER, find_resume_checkpoint, is_complete, list_checkpoints
from dragon.checkpoint.retention import (
    RetentionPolicy,
    default_history_path,
    prune,
)
from dragon.checkpoint.save_hook import attach_retention


# ---------------------------------------------------------------- the policy (pure)


def run_saves(policy: RetentionPolicy, saves, late: int = 0):
    """Drive select() like a training run: record the metrics known so far, save, keep what it
    selects.

    `saves` is a list of (step, value or None); with late=1 each value is recorded one save later.
    Returns the kept steps after every save.
    """
    metric = policy.metric_for_best_model or "eval_loss"
    history: dict[int, dict] = {}
    kept: dict[str, int] = {}
    trace = []
    for i, (step, _) in enumerate(saves):
        if i - late >= 0 and saves[i - late][1] is not None:
            history.setdefault(saves[i - late][0], {})[metric] = saves[i - late][1]
        kept[f"step{step}"] = step
        keep = policy.select(kept, history)
        assert keep <= set(kept)
        kept = {t: s for t, s in kept.items() if t in keep}
        trace.append(sorted(kept.values()))
    return trace


def test_best_far_outside_the_window_survives_everything_else_old_goes():
    losses = [5.0, 4.0, 0.5] + [
        1.0 + i / 10 for i in range(47)
    ]  # best at step 3, then worse forever
    trace = run_saves(RetentionPolicy(save_total_limit=2), list(enumerate(losses, 1)))
    assert trace[-1] == [3, 49, 50]
    assert all(len(kept) <= 3 for kept in trace)
    assert all(3 in kept for kept in trace[2:])


def test_new_best_replaces_the_old_one_which_is_then_deleted():
    trace = run_saves(
        RetentionPolicy(save_total_limit=2),
        [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 0.5), (6, 4.0), (7, 5.0), (8, 6.0)],
    )
    assert trace[3] == [2, 3, 4]
    assert trace[4] == [4, 5]  # step 5 is the new best and among the last 2: step 2 goes
    assert trace[-1] == [5, 7, 8]


def test_metric_one_save_late_corrects_the_best_at_the_next_save():
    saves = [(10, 5.0), (20, 1.0), (30, 3.0), (40, 4.0)]
    trace = run_saves(RetentionPolicy(save_total_limit=1), saves, late=1)
    # save 20: only step 10's value is known -> it is the best so far; save 30: step 20 corrects it
    assert trace == [[10], [10, 20], [20, 30], [20, 40]]


def test_a_later_record_of_the_same_step_wins(tmp_path):
    history = MetricHistory(tmp_path / "h.jsonl")
    history.record(1, {"eval_loss": 1.0, "loss": 9.0})
    history.record(2, {"eval_loss": 2.0})
    history.record(1, {"eval_loss": 3.0})  # step 1 re-evaluated: worse than step 2 after all
    assert history.load() == {1: {"eval_loss": 3.0, "loss": 9.0}, 2: {"eval_loss": 2.0}}
    policy = RetentionPolicy(save_total_limit=1)
    assert policy.select({"step1": 1, "step2": 2, "step3": 3}, history.load()) == {"step2", "step3"}


def test_ties_keep_the_earlier_checkpoint():
    trace = run_saves(
        RetentionPolicy(save_total_limit=1), [(1, 2.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 3.0)]
    )
    assert trace[-1] == [2, 5]
    greater = RetentionPolicy(
        save_total_limit=1, metric_for_best_model="acc", greater_is_better=True
    )
    assert run_saves(greater, [(1, 0.5), (2, 0.9), (3, 0.9), (4, 0.1)])[-1] == [2, 4]


def test_k_equals_one_and_no_metric_is_pure_keep_last():
    assert run_saves(
        RetentionPolicy(save_total_limit=1, metric_for_best_model=None),
        [(s, 1.0 / s) for s in range(1, 6)],
    ) == [[s] for s in range(1, 6)]
    assert run_saves(RetentionPolicy(save_total_limit=3), [(s, None) for s in range(1, 7)])[-1] == [
        4,
        5,
        6,
    ]


def test_greater_is_better():
    policy = RetentionPolicy(
        save_total_limit=2, metric_for_best_model="eval_accuracy", greater_is_better=True
    )
    trace = run_saves(policy, [(1, 0.2), (2, 0.8), (3, 0.3), (4, 0.4), (5, 0.1)])
    assert trace[-1] == [2, 4, 5]


@pytest.mark.parametrize("greater", [False, True])
def test_unknown_and_non_finite_metrics_are_never_the_best(greater):
    policy = RetentionPolicy(save_total_limit=1, greater_is_better=greater)
    history = {
        1: {"loss": 0.1},
        2: {"eval_loss": float("nan")},
        3: {"eval_loss": 2.0},
        4: {"eval_loss": float("-inf") if not greater else float("inf")},
    }
    checkpoints = {"step1": 1, "step2": 2, "step3": 3, "step4": 4, "step5": 5}
    assert policy.select(checkpoints, history) == {"step3", "step5"}


def oracle(
    checkpoints: dict[str, int], history: dict, k: int, metric: str, greater: bool
) -> set[str]:
    """Brute force: every checkpoint is kept iff it is among the K newest or no other beats it."""
    keep = set()
    for tag, step in checkpoints.items():
        newer = sum(1 for s in checkpoints.values() if s > step)
        value = history.get(step, {}).get(metric)
        known = value is not None and not math.isnan(value)

        def beats(other_step):
            v = history.get(other_step, {}).get(metric)
            if v is None or math.isnan(v):
                return False
            return (v > value if greater else v < value) or (v == value and other_step < step)

        if newer < k or (known and not any(beats(s) for s in checkpoints.values() if s != step)):
            keep.add(tag)
    return keep


@pytest.mark.parametrize("seed", range(8))
def test_policy_matches_a_brute_force_oracle_over_random_runs(seed):
    rng = random.Random(seed)
    for _ in range(40):
        k, greater = rng.randint(1, 4), rng.random() < 0.5
        policy = RetentionPolicy(
            save_total_limit=k, metric_for_best_model="m", greater_is_better=greater
        )
        history: dict[int, dict] = {}
        kept: dict[str, int] = {}
        step, pending = 0, []
        for _ in range(rng.randint(1, 30)):
            step += rng.randint(1, 3)
            pending.append(step)
            for s in list(
                pending
            ):  # each metric lands now, later, never, twice; values collide often
                roll = rng.random()
                if roll < 0.6:
                    history.setdefault(s, {})["m"] = (
                        float("nan") if rng.random() < 0.1 else float(rng.randint(0, 5))
                    )
                    if rng.random() < 0.8:
                        pending.remove(s)
                elif roll < 0.7:
                    pending.remove(s)
            kept[f"step{step}"] = step
            got = policy.select(kept, history)
            assert got == oracle(kept, history, k, "m", greater)
            kept = {t: s for t, s in kept.items() if t in got}
            assert len(kept) <= k + 1 and f"step{step}" in kept


@pytest.mark.parametrize("seed", range(4))
def test_timely_metrics_always_end_with_the_global_best(seed):
    """Whenever each value is recorded before the next save, the final set is last K plus the global
    best.
    """
    rng = random.Random(100 + seed)
    for _ in range(50):
        k, late = rng.randint(1, 3), rng.randint(0, 1)
        saves = [(s, float(rng.randint(0, 20))) for s in range(1, rng.randint(2, 40))]
        final = run_saves(RetentionPolicy(save_total_limit=k), saves, late=late)[-1]
        known = saves if late == 0 else saves[:-1]
        best = {min(known, key=lambda sv: (sv[1], sv[0]))[0]} if known else set()
        assert set(final) == {s for s, _ in saves[-k:]} | best


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(save_total_limit=0),
        dict(save_total_limit=-1),
        dict(save_total_limit=1.5),
        dict(save_total_limit=True),
        dict(greater_is_better="yes"),
        dict(metric_for_best_model=""),
        dict(metric_for_best_model=3),
    ],
)
def test_bad_policy_is_a_one_line_value_error(kwargs):
    with pytest.raises(ValueError) as e:
        RetentionPolicy(**kwargs)
    assert "\n" not in str(e.value)


def test_bad_attach_arguments():
    with pytest.raises(ValueError, match="RetentionPolicy"):
        attach_retention(object(), {"save_total_limit": 2}, {"eval_loss"})
    with pytest.raises(ValueError, match="collection"):
        attach_retention(object(), RetentionPolicy(), "eval_loss")


# ---------------------------------------------------------------- the history file


def test_history_is_readable_json_lines_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "run" / "metric_history.jsonl"
    history = MetricHistory(path)
    assert history.load() == {}
    history.record(5, {"eval_loss": 2.5, "loss": 3})
    with open(path, "a") as f:
        f.write('{"step": 10, "eval_lo')  # a crash mid-append
    assert [json.loads(line) for line in open(path).readlines()[:1]] == [
        {"step": 5, "eval_loss": 2.5, "loss": 3.0}
    ]
    assert MetricHistory(path).load() == {5: {"eval_loss": 2.5, "loss": 3.0}}
    with pytest.raises(ValueError):
        history.record("5", {"eval_loss": 1.0})
    with pytest.raises(ValueError):
        history.record(6, {"eval_loss": "low"})


def test_default_history_path_stays_out_of_accelerates_checkpoints_folder(tmp_path):
    assert default_history_path(str(tmp_path / "out")) == str(
        tmp_path / "out" / "metric_history.jsonl"
    )
    proj = tmp_path / "proj"
    assert default_history_path(str(proj / "checkpoints")) == str(proj / "metric_history.jsonl")


# ---------------------------------------------------------------- pruning real directories


def make_tag(
    save_dir,
    tag,
    step=None,
    complete=True,
    files=("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
):
    path = os.path.join(save_dir, tag)
    os.makedirs(path, exist_ok=True)
    for name in files:
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"weights")
    if complete:
        with open(os.path.join(path, MARKER), "w") as f:
            json.dump({"step": step, "tag": tag, "time": 0.0}, f)
    return path


def set_latest(save_dir, tag):
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)


def names(save_dir):
    return sorted(os.listdir(save_dir))


def losses(**by_step):
    return {int(s[1:]): {"eval_loss": v} for s, v in by_step.items()}


def test_prune_keeps_last_k_and_best_and_leaves_foreign_things_alone(tmp_path):
    d = str(tmp_path)
    for s in range(1, 6):
        make_tag(d, f"step{s}", s)
    set_latest(d, "step5")
    foreign = ["notes", "step_final", "stepX", "step9", "global_step3", "other_run"]
    for name in foreign:
        os.makedirs(os.path.join(d, name))
    for name in ("step9", "other_run"):  # named like a step, or full of weights, but not both
        open(
            os.path.join(d, name, "data.csv" if name == "step9" else "mp_rank_00_model_states.pt"),
            "w",
        ).close()
    set_latest(os.path.join(d, "step9"), "inner")
    make_tag(
        os.path.join(d, "step9"), "inner", 9
    )  # a whole save dir named like a tag: still not a tag dir
    make_tag(d, "global_step3", 3)  # another naming family: not this run's
    for name in ("README.txt", "metric_history.jsonl", "zero_to_fp32.py", "step7"):
        open(os.path.join(d, name), "w").close()
    deleted = prune(
        d, RetentionPolicy(save_total_limit=2), losses(s1=3.0, s2=1.0, s3=2.0, s4=4.0), "step5"
    )
    assert sorted(deleted) == ["step1", "step3"]
    assert names(d) == sorted(
        foreign
        + [
            "README.txt",
            "metric_history.jsonl",
            "zero_to_fp32.py",
            "step7",
            "latest",
            "step2",
            "step4",
            "step5",
        ]
    )


def test_a_checkpoints_conversions_for_another_layout_go_with_it(tmp_path):
    """step1's universal and ZeRO-0 forms (dragon.checkpoint.reshape) are deleted with it; a kept
    checkpoint's stay, as does a foreign directory named like one."""
    d = str(tmp_path)
    for s in range(1, 4):
        make_tag(d, f"step{s}", s)
    for name in ("step1_universal", "step1_zero0", "step3_universal", "step1_notes"):
        make_tag(d, name, complete=False)
    set_latest(d, "step3")
    prune(d, RetentionPolicy(save_total_limit=2, metric_for_best_model=None), {}, "step3")
    assert names(d) == ["latest", "step1_notes", "step2", "step3", "step3_universal"]


def test_prune_never_deletes_what_latest_names(tmp_path):
    d = str(tmp_path)
    for s in range(1, 5):
        make_tag(d, f"step{s}", s)
    set_latest(d, "step1")  # e.g. a save that did not update `latest`
    prune(d, RetentionPolicy(save_total_limit=1, metric_for_best_model=None), {}, "step4")
    assert names(d) == ["latest", "step1", "step4"]


def test_prune_tolerates_checkpoints_that_are_already_gone(tmp_path):
    d = str(tmp_path)
    for s in range(1, 5):
        make_tag(d, f"step{s}", s)

    class Racing(RetentionPolicy):
        """Another process deletes step1 between prune's listing and its deleting."""

        def select(self, checkpoints, history):
            import shutil

            shutil.rmtree(os.path.join(d, "step1"))
            return super().select(checkpoints, history)

    assert prune(d, Racing(save_total_limit=2, metric_for_best_model=None), {}, "step4") == [
        "step2"
    ]
    assert names(d) == ["step3", "step4"]
    assert prune(str(tmp_path / "missing"), RetentionPolicy(), {}) == []


def test_half_written_checkpoints_are_removed_by_the_next_prune(tmp_path):
    d = str(tmp_path)
    make_tag(
        d, "step1", files=("rng_state_0.pt",), complete=False
    )  # older than any marked one: not ours
    for s in (2, 3):
        make_tag(d, f"step{s}", s)
    make_tag(
        d, "step4", files=("rng_state_0.pt", "mp_rank_00_model_states.pt"), complete=False
    )  # crashed
    make_tag(d, "step5", 5)
    set_latest(d, "step3")
    assert not is_complete(os.path.join(d, "step4"))
    prune(d, RetentionPolicy(save_total_limit=3, metric_for_best_model=None), {}, "step5")
    assert names(d) == ["latest", "step1", "step2", "step3", "step5"]
    # the tag being written right now, and the one `latest` names, are spared even without a marker
    make_tag(d, "step6", files=("rng_state_0.pt",), complete=False)
    make_tag(d, "step7", files=("rng_state_0.pt",), complete=False)
    set_latest(d, "step6")
    prune(d, RetentionPolicy(save_total_limit=3, metric_for_best_model=None), {}, "step7")
    assert names(d) == ["latest", "step1", "step2", "step3", "step5", "step6", "step7"]


def test_a_crash_mid_delete_leaves_only_a_hidden_dir_that_the_next_prune_clears(tmp_path):
    d = str(tmp_path)
    for s in (1, 2):
        make_tag(d, f"step{s}", s)
    os.rename(
        make_tag(d, "step0", 0), os.path.join(d, ".deleting-step0")
    )  # rename done, rmtree not
    assert list_checkpoints(d) == {"step1": 1, "step2": 2}
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert find_resume_checkpoint(d) == (d, "step2")
    prune(d, RetentionPolicy(save_total_limit=2), {}, "step2")
    assert names(d) == ["step1", "step2"]


def make_accelerate_save(parent, i, step, complete=True):
    """accelerate's save_state under DeepSpeed: checkpoint_<i>/ holds a DeepSpeed save dir, tag
    pytorch_model.
    """
    save_dir = os.path.join(parent, f"checkpoint_{i}")
    make_tag(save_dir, "pytorch_model", step, complete)
    open(os.path.join(save_dir, "random_states_0.pkl"), "w").close()
    if complete:
        set_latest(save_dir, "pytorch_model")
    return save_dir


def test_accelerate_layout(tmp_path):
    parent = str(tmp_path / "checkpoints")
    for i in range(5):
        make_accelerate_save(parent, i, step=10 * (i + 1))
    make_accelerate_save(parent, 5, step=None, complete=False)  # crashed mid-save
    os.makedirs(os.path.join(parent, "checkpoint_9"))  # empty: not a checkpoint
    assert list_checkpoints(parent) == {f"checkpoint_{i}": 10 * (i + 1) for i in range(5)} | {
        "checkpoint_5": 5
    }
    make_accelerate_save(parent, 6, step=70)
    history = {
        10: {"eval_loss": 2.0},
        20: {"eval_loss": 0.1},
        30: {"eval_loss": 1.0},
        70: {"eval_loss": 3.0},
    }
    deleted = prune(parent, RetentionPolicy(save_total_limit=2), history, "checkpoint_6")
    assert sorted(deleted) == ["checkpoint_0", "checkpoint_2", "checkpoint_3", "checkpoint_5"]
    assert names(parent) == ["checkpoint_1", "checkpoint_4", "checkpoint_6", "checkpoint_9"]
    assert find_resume_checkpoint(parent) == (os.path.join(parent, "checkpoint_6"), "pytorch_model")


def test_pipeline_layer_files_count_as_a_checkpoint(tmp_path):
    d = str(tmp_path)
    make_tag(
        d,
        "global_step4",
        4,
        files=("layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt"),
    )
    make_tag(d, "global_step8", 8, files=("layer_00-model_states.pt", "mp_rank_00_model_states.pt"))
    assert list_checkpoints(d) == {"global_step4": 4, "global_step8": 8}
    prune(d, RetentionPolicy(save_total_limit=1, metric_for_best_model=None), {}, "global_step8")
    assert names(d) == ["global_step8"]


# ---------------------------------------------------------------- resume discovery


@pytest.fixture
def three_saves(tmp_path):
    d = str(tmp_path / "out")
    for s in (10, 20, 30):
        make_tag(d, f"step{s}", s)
    return d


def test_resume_from_latest(three_saves):
    set_latest(three_saves, "step20")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_resume_checkpoint(three_saves) == (three_saves, "step20")


@pytest.mark.parametrize(
    "latest, says",
    [
        (None, "no 'latest' file"),
        (b"\x00\xff garbage/../\n", "not a checkpoint"),
        (b"step99", "'step99'"),
        (b"step40", "incomplete"),
    ],
)
def test_resume_falls_back_to_the_newest_complete_with_a_warning(three_saves, latest, says):
    make_tag(three_saves, "step40", complete=False)
    if latest is not None:
        with open(os.path.join(three_saves, "latest"), "wb") as f:
            f.write(latest)
    with pytest.warns(UserWarning, match=says):
        assert find_resume_checkpoint(three_saves) == (three_saves, "step30")


def test_resume_with_nothing_complete_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        find_resume_checkpoint(str(tmp_path / "nowhere"))
    make_tag(str(tmp_path), "step1", complete=False)
    set_latest(str(tmp_path), "step1")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        find_resume_checkpoint(str(tmp_path))


# ---------------------------------------------------------------- real 2-rank jobs


def test_zero2_job_keeps_last_two_and_the_best_and_reloads_them(tmp_path):
    out = tmp_path / "out"
    proc = launch("torchrun", 2, "tests/scripts/retention_job.py", ["zero2", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result_zero2.json").read_text())
    ds_files = ["latest", "metric_history.jsonl", "zero_to_fp32.py", "zero_to_torch.py"]
    assert result["after_run"] == sorted(
        ds_files + ["step2", "step7", "step8"]
    )  # best (step 2) far back
    assert result["fresh_differs"]
    assert result["best"] == {"step": 2, "match": True}
    assert result["latest"] == {"step": 8, "match": True}
    # resumed with the history on disk: step 9 is a new best, so the old best goes
    assert result["after_resume"] == sorted(ds_files + ["step8", "step9"]) == names(out)
    assert (out / "latest").read_text() == "step9"
    assert all(is_complete(str(out / tag)) for tag in ("step8", "step9"))
    assert "eval_bleu" in result["bad_metric"] and not (out / "step10").exists()
    assert find_resume_checkpoint(str(out)) == (str(out), "step9")
    # node-local storage: every node's local rank 0 marked and pruned its own copy, with node 0's
    # history, and wrote its own `latest` (the history is rank 0's alone)
    nodes = tmp_path / "out_nodes"
    assert names(nodes / "node0") == sorted(ds_files + ["step2", "step3"])
    assert names(nodes / "node1") == ["latest", "step2", "step3"]
    assert all(
        is_complete(str(nodes / node / tag))
        for node in ("node0", "node1")
        for tag in ("step2", "step3")
    )
    assert find_resume_checkpoint(str(nodes / "node1")) == (str(nodes / "node1"), "step3")


def test_a_checkpointer_without_retention_saves_and_resumes(tmp_path):
    """The retention hook is optional: without it a Checkpointer's save is DeepSpeed's own plus
    the run's state (no completion marker), and a fresh engine resumed from it trains the next
    step to the same weights, bit for bit."""
    out = tmp_path / "plain"
    proc = launch("torchrun", 2, "tests/scripts/retention_job.py", ["plain", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result_plain.json").read_text())
    assert "rng_state_0.pt" in result["files"] and "rng_state_1.pt" in result["files"]
    assert MARKER not in result["files"] and result["latest"] == "step2"
    assert result["step"] == 2 and result["counter"] == 3 and result["step3_equal"]


def test_accelerate_save_state_goes_through_retention(tmp_path):
    out = tmp_path / "proj"
    proc = launch(
        "torchrun", 2, "tests/scripts/retention_job.py", ["accelerate", str(out)], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result_accelerate.json").read_text())
    assert result["engine_steps"] == [1, 2, 3, 4, 5]
    # checkpoint_<i> holds engine step i+1; the best eval_loss is at step 2 (checkpoint_1)
    assert names(out / "checkpoints") == ["checkpoint_1", "checkpoint_3", "checkpoint_4"]
    assert list_checkpoints(str(out / "checkpoints")) == {
        "checkpoint_1": 2,
        "checkpoint_3": 4,
        "checkpoint_4": 5,
    }
    assert (out / "metric_history.jsonl").exists()
    assert result["best_match"]
