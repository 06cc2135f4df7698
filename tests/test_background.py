"""The outer exchange on its own thread (dragon.diloco.background) and --diloco_fragment_delay
auto (dragon.diloco.landing): every codec, whole or in fragments, trains bit for bit as the
exchange issued from the training thread does, and islands end identical; `auto` on a link
between two namespace nodes lands later on a slower link, says once when the link is slower than
the window, and resumes bit for bit after a SIGKILL with fragments in flight."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, free_port, job_env, losses
from test_diloco import island_metrics, islands_run
from test_fragments import DELAYED_INT4

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import background_islands as toy  # noqa: E402


@pytest.fixture(scope="module")
def toy_islands(tmp_path_factory) -> list[dict]:
    """tests/scripts/background_islands.py as two real islands (one launch each)."""
    out, store = tmp_path_factory.mktemp("background"), f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests/scripts/background_islands.py"),
                               str(i), store, str(out / f"island{i}.json")], cwd=REPO,
                              env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out / f"island{i}.json").read_text()) for i in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("codec", list(toy.CODECS))
@pytest.mark.parametrize("fragments", [1, toy.F])
def test_every_codec_on_the_exchange_thread_equals_the_training_thread(toy_islands, codec,
                                                                       fragments):
    """Delayed mode, a fixed delay of 1 with 4 fragments: the weights and theta_outer after
    every inner step are the same bits with the exchange on its own thread as with its
    collectives issued from the training thread (as before the thread), on both islands, and
    both islands end on the same weights and theta_outer."""
    name = f"{codec}-f{fragments}"
    for island in toy_islands:
        inline, thread = island[f"{name}-inline"], island[f"{name}-thread"]
        assert [m["step"] for m in thread] == list(range(1, toy.STEPS + 1))
        for a, b in zip(inline, thread):
            assert a["weights"] == b["weights"] and a["outer"] == b["outer"], (name, a["step"])
        assert [m["metrics"].get("outer_landed") for m in inline] == [
            m["metrics"].get("outer_landed") for m in thread]
        assert inline[0]["weights"] != inline[-1]["weights"]  # it trained
    ends = [island[f"{name}-thread"][-1] for island in toy_islands]
    assert ends[0]["weights"] == ends[1]["weights"] and ends[0]["outer"] == ends[1]["outer"]


@pytest.mark.slow
def test_auto_landings_agree_across_islands(toy_islands):
    """`auto` (4 int4 fragments): both islands land every fragment at the same step, within H
    steps of its sync, log it as outer_landed_after, and end identical."""
    rows = [[(m["step"], m["metrics"].get("outer_landed"), m["metrics"].get("outer_landed_after"))
             for m in island["auto"]] for island in toy_islands]
    assert rows[0] == rows[1]
    after = [a for _, landed, a in rows[0] if a is not None]
    assert len(after) >= toy.F and all(1 <= a <= toy.H for a in after), rows[0]
    ends = [island["auto"][-1] for island in toy_islands]
    assert ends[0]["weights"] == ends[1]["weights"] and ends[0]["outer"] == ends[1]["outer"]


@pytest.mark.slow
def test_int4_fragments_on_the_exchange_thread_train_as_on_the_training_thread(runs):
    """Real ZeRO-2 islands (2 x 2 ranks), 4 int4 fragments, delay 1: every loss and every
    checksum of the weights and theta_outer the same bits with and without the thread."""
    thread = islands_run(runs, "fragments_zero2_int4", nproc=4, micro=2, extra=DELAYED_INT4)
    inline = islands_run(runs, "fragments_zero2_int4_inline", nproc=4, micro=2,
                         extra=[*DELAYED_INT4, "--diloco_exchange_thread", "false"])
    for island in (0, 1):
        a, b = island_metrics(thread, island), island_metrics(inline, island)
        assert losses(a) == losses(b)
        for key in ("weights_sum", "outer_sum", "outer_landed"):
            assert [m.get(key) for m in a] == [m.get(key) for m in b], key
