"""metrics.jsonl on a resume: the rows past the resumed step (and a line torn by a crash) move to
metrics.replaced.jsonl with the time of the resume, so nothing is deleted and every step is read
once."""

import json

from dragon.history import MetricHistory, replaced_path


def rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_a_resume_moves_the_replayed_rows_out_and_keeps_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    history = MetricHistory(path)
    for step in range(1, 7):
        history.record(step, {"loss": 10.0 - step})
    history.record(4, {"eval_loss": 5.0})
    with open(path, "a") as f:
        f.write('{"step": 7, "lo')  # a crash mid-append
    assert history.replace_after(4) == 3
    assert rows(path) == [{"step": s, "loss": 10.0 - s} for s in range(1, 5)] + [
        {"step": 4, "eval_loss": 5.0}]
    moved = rows(replaced_path(str(path)))
    assert [m.get("step") for m in moved] == [5, 6, None]
    assert moved[2]["torn"] == '{"step": 7, "lo'
    assert all(m["replaced_at"].endswith("Z") for m in moved)
    history.record(5, {"loss": 1.0})  # the continued timeline appends after the kept rows
    assert history.load()[5] == {"loss": 1.0}
    assert history.replace_after(5) == 0  # nothing past step 5: the files stay as they are
    assert len(rows(replaced_path(str(path)))) == 3
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_no_history_is_nothing_to_replace(tmp_path):
    assert MetricHistory(tmp_path / "metrics.jsonl").replace_after(3) == 0
    assert not (tmp_path / "metrics.replaced.jsonl").exists()
