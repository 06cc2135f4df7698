"""benchmarks/iso_compute.py --smoke: every family through the real recipe for a few steps at the
smallest budget (BDH alone on the second corpus), and both plots written."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_iso_compute_smoke(tmp_path):
    subprocess.run([sys.executable, "benchmarks/iso_compute.py", "--smoke", "--out",
                    str(tmp_path)], cwd=REPO, check=True, capture_output=True, timeout=600)
    for name in ("iso_compute_flops.png", "iso_compute_seconds.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert sorted((r["corpus"], r["family"], r["size"]) for r in runs) == [
        *(("built-in", f, 0) for f in ("bdh", "gpt2", "llama")), ("pydoc", "bdh", 0)]
    assert all(0 < r["eval_bpb"] < 9 and r["mfu"] > 0 and r["flops"] > 0 for r in runs)


def test_gpu_check_runs_on_a_cpu_small(tmp_path):
    """benchmarks/gpu_check.py --device cpu --small: a config as it is and one shrunk to a neuron
    share, each through its recipe, with its figures."""
    rows_file = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu",
                           "--small", "--steps", "6", "--configs", "bdh_25m_1gpu",
                           "bdh_1b_8gpu_neurons", "--json", str(rows_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(rows_file.read_text())}
    assert set(rows) == {"bdh_25m_1gpu", "bdh_1b_8gpu_neurons"}
    assert "one neuron share of 8" in rows["bdh_1b_8gpu_neurons"]["changed"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["plan_hours"] > 0
        assert row["peak_mib"] > 0 and row["estimate_mib"] > 0
    assert "| bdh_25m_1gpu | 1 |" in done.stdout
