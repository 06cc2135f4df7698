"""Churn: elastic islands SIGKILLed at random for minutes (tests/scripts/churn_soak.py, started
in the background as the session starts, by pytest-xdist's controller under -n: tests/conftest.py's
churn_soak); the test runs last and reads its verdict."""

import re

import pytest


@pytest.mark.slow
def test_islands_killed_at_random_for_five_minutes_all_finish_on_identical_weights(soak_verdict):
    """Three elastic ZeRO-2 islands; every 30-60 s for 5 minutes a random one is SIGKILLed and
    started again with the same command (--diloco_join --resume_from_checkpoint auto). Every
    island's last launch exits 0 at the last step; the islands of each outer step end it on
    identical weights and theta_outer (==), the last step included; each island's metrics hold
    every step it trained once; no island ended before the kills did; and every island
    restarted from the last save that 16 steps follow, in a copy of the run with a fresh store,
    repeats those steps' losses and outer checksums bit for bit (the script's verdict, its exit
    status)."""
    returncode, output = soak_verdict
    assert returncode == 0, output[-3000:]
    kills = int(re.search(r"(\d+) kills in (\d+) s", output).group(1))
    assert kills >= 5, output
