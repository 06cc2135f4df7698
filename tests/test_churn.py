"""Churn: elastic islands SIGKILLed at random for minutes (tests/scripts/churn_soak.py)."""

import re
import subprocess
import sys

import pytest
from conftest import REPO, job_env


@pytest.mark.slow
def test_islands_killed_at_random_for_five_minutes_all_finish_on_identical_weights(tmp_path):
    """Three elastic ZeRO-2 islands; every 30-60 s for 5 minutes a random one is SIGKILLed and
    started again with the same command (--diloco_join --resume_from_checkpoint auto). Every
    island's last launch exits 0 at the last step; the islands of each outer step end it on
    identical weights and theta_outer (==), the last step included; each island's metrics hold
    every step it trained once; and no island ended before the kills did (the script's verdict,
    its exit status)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tests/scripts/churn_soak.py"), "--minutes", "5",
         "--out", str(tmp_path)],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=1500,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    kills = int(re.search(r"(\d+) kills in (\d+) s", done.stdout).group(1))
    assert kills >= 5, done.stdout
