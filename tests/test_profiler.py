"""--profile_steps A:B: a torch.profiler trace of steps A..B per rank under the run's directory,
in the Chrome trace format TensorBoard's profiler plugin and Perfetto read, and rank 0's table of
the operators that took the most self CPU time, printed after step B. Bad windows are refused in
one line while the arguments are parsed."""

import json

import pytest
from conftest import REPO, ZERO2_GC, run_recipe_in_process

from dragon.run.args import parse_arguments


def test_a_run_writes_each_rank_s_trace_of_the_steps_and_prints_the_table(runs):
    """The ZeRO recipe on 2 ranks with --profile_steps 2:3: one trace per rank, whose events are
    aten operators inside the ProfilerStep#2 and #3 spans (no other step), and the table once."""
    out, _, proc = runs("zero2_gc", **ZERO2_GC)
    for rank in (0, 1):
        traces = list((out / "profile" / f"rank{rank}").glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, traces
        events = json.loads(traces[0].read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert {"aten::mm", "aten::bmm"} & names and any(n.startswith("aten::") for n in names)
        assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2",
                                                                       "ProfilerStep#3"}
    printed = proc.stdout + proc.stderr
    head = f"torch.profiler, steps 2-3 on rank 0 (traces in {out / 'profile'}): the top 10 " \
        "operators by self CPU time"
    assert printed.count(head) == 1, printed[-3000:]
    table = printed[printed.index(head):].splitlines()
    assert "Self CPU" in table[2] and any(row.split()[0].startswith("aten::") for row in
                                          table[4:14]), table[:16]


@pytest.mark.parametrize("window", ["5", "3:2", "a:b", "0:2", "2:9", ""])
def test_a_bad_window_is_refused_in_one_line(tmp_path, window):
    argv = ["--output_dir", str(tmp_path), "--max_steps", "8", "--profile_steps", window]
    with pytest.raises(ValueError) as refused:
        parse_arguments(argv=argv)
    quote = '; quote it in a YAML file ("2:3")' if window == "5" else ""
    assert str(refused.value) == (
        f"--profile_steps {window!r}: valid is A:B, the first and last step to profile, "
        f"1 <= A <= B <= --max_steps 8 (e.g. 2:3){quote}")


def test_a_yaml_file_s_unquoted_window_is_refused_with_the_fix(tmp_path):
    """YAML 1.1 reads `profile_steps: 2:3` as 123 (base 60): the line says to quote it."""
    config = tmp_path / "run.yaml"
    config.write_text("profile_steps: 2:3\n")
    with pytest.raises(ValueError, match=r"'123': valid is A:B.*quote it in a YAML file"):
        parse_arguments(argv=[str(config), "--output_dir", str(tmp_path), "--max_steps", "8"])
    config.write_text('profile_steps: "2:3"\n')
    _, _, args, _, _ = parse_arguments(argv=[str(config), "--output_dir", str(tmp_path)])
    assert args.profile_steps == "2:3"


def test_every_recipe_refuses_it_before_any_work_starts(monkeypatch, tmp_path):
    """The pipeline recipe (the arguments are every recipe's): exit with the one line, no
    process group, no data read."""
    argv = ["--deepspeed", str(REPO / "ds_configs/pipeline_zero0.json"), "--output_dir",
            str(tmp_path), "--profile_steps", "3:2"]
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain_pipeline.py", argv,
                                 {"WORLD_SIZE": "2"})
    assert line.startswith("error: --profile_steps '3:2': valid is A:B"), line
