"""A one-node Slurm cluster on this machine for tests/test_slurm.py: Debian's slurmctld, slurmd and
munge (installed with apt-get when missing), configured under a temporary directory (SLURM_CONF),
started as root and stopped after, with what it started removed."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

PACKAGES = ["slurmctld", "slurmd", "munge"]
CONF = """ClusterName=dragon
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
JobRequeue=1
ReturnToService=2
MpiDefault=none
KillWait=30
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def why_not() -> Optional[str]:
    """None when this machine can run the cluster (installing the packages if needed), else the
    one line saying why not."""
    if os.geteuid() != 0:
        return "the Slurm tests start slurmctld, slurmd and munged as root; this user is not root"
    if all(shutil.which(p) for p in ("slurmctld", "slurmd", "munged", "sbatch")):
        return None
    if not shutil.which("apt-get"):
        return f"Slurm is not installed and there is no apt-get to install {PACKAGES}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "install", "-y", "-qq", *PACKAGES], ["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0 and shutil.which("slurmctld"):
            return None
    return f"apt-get could not install {PACKAGES}: {done.stderr.strip().splitlines()[-1:]}"


class Cluster:
    """The daemons, started in `root`; `env` is what a client (sbatch, squeue) runs with."""

    def __init__(self, root: Path):
        self.root, self.host = root, socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.started_munged = False

    def start(self) -> None:
        for name in ("state", "spool"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(CONF.format(host=self.host, root=self.root, cpus=os.cpu_count()))
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
                os.makedirs(folder, exist_ok=True)
            subprocess.run(["munged", "--force"], check=True, capture_output=True)
            self.started_munged = True
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], check=True, env=self.env,
                           capture_output=True)
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%t").stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node never became idle: {self.log_tail()}")
            time.sleep(0.5)

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)

    def state(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...); {} once it is gone."""
        shown = self.run("scontrol", "show", "job", job).stdout
        return dict(w.split("=", 1) for w in shown.split() if "=" in w)

    def wait(self, job: str, timeout: float = 600) -> dict[str, str]:
        """The job's fields once it has ended (COMPLETED, FAILED, ...)."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.state(job)
            if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                          "NODE_FAIL", "OUT_OF_MEMORY"):
                return fields
            if time.monotonic() > deadline:
                self.run("scancel", job)
                raise TimeoutError(f"job {job} still {fields.get('JobState')}")
            time.sleep(0.5)

    def log_tail(self) -> str:
        logs = [self.root / "slurmctld.log", self.root / "slurmd.log"]
        return " | ".join(p.read_text()[-3000:] for p in logs if p.exists())

    def stop(self) -> None:
        """Cancel every job, stop the daemons (and the munged this started)."""
        self.run("scancel", "--full", "-u", "root")
        for daemon in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{daemon}.pid"
            if pid_file.exists():
                _stop(int(pid_file.read_text()))
        if self.started_munged and Path("/run/munge/munged.pid").exists():
            _stop(int(Path("/run/munge/munged.pid").read_text()))


def _stop(pid: int) -> None:
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
