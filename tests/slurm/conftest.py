"""A real two-node SLURM cluster for the slurm/ tests, started once per pytest run.

The cluster is the project's tests/slurm/local_cluster.sh (slurm-wlm + munge, two slurmd on this
machine, as root), in its own state folder and on free ports, stopped at the end of the run. A
cluster that is already up (SLURM_CONF set and `sinfo` answering) is used as it is.

Under CI=true these tests must run: `.ci/run` installs the Debian packages, and a cluster that
cannot start is a failure. Elsewhere they skip, saying why (not root, no slurm-wlm installed:
`sudo bash tests/slurm/local_cluster.sh install`).
"""

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("local_cluster.sh")


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"SLURM tests must run under CI=true, but {reason}", pytrace=False)
    pytest.skip(f"no SLURM cluster: {reason}")


def _answers(env) -> bool:
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%D %t"], env=env, capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and sum(
        int(line.split()[0]) for line in proc.stdout.splitlines() if "idle" in line or "mix" in line
        or "alloc" in line) >= 2


def _free_port_block(count: int = 4) -> int:
    for base in range(17100, 30000, 37):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free block of ports for the SLURM daemons")


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a running two-node cluster (set in os.environ for the tests' subprocesses)."""
    if os.environ.get("SLURM_CONF") and _answers(os.environ):
        yield os.environ["SLURM_CONF"]
        return
    missing = [tool for tool in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(tool) is None
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        _unavailable(f"{', '.join(missing)} not installed (`bash tests/slurm/local_cluster.sh install` as root)")
    if os.geteuid() != 0:
        _unavailable("starting the local cluster needs root (slurmd, munge)")
    state = Path(tempfile.mkdtemp(prefix="iiet-slurm-"))
    proc = subprocess.run(["bash", str(SCRIPT), "start", str(state), str(_free_port_block())],
                          capture_output=True, text=True, timeout=180)
    conf = str(state / "slurm.conf")
    env = {**os.environ, "SLURM_CONF": conf}
    if proc.returncode != 0 or not _answers(env):
        subprocess.run(["bash", str(SCRIPT), "stop", str(state)], capture_output=True)
        logs = "".join(p.read_text(errors="replace")[-1500:] for p in state.glob("*.log"))
        _unavailable(f"the local cluster did not start: {proc.stderr[-1500:]}\n{logs}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run(["scancel", "--user", str(os.getuid())], env=env, capture_output=True)
        subprocess.run(["bash", str(SCRIPT), "stop", str(state)], capture_output=True)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        shutil.rmtree(state, ignore_errors=True)
