"""A real SLURM cluster on this machine, for the tests: one ``munged``, one ``slurmctld``
and one ``slurmd`` per node, each node in a UTS namespace of its own (its own host name) at a
loopback address and port of its own (``n1`` at 127.0.0.1 ... ``n4`` at 127.0.0.4). Two
partitions of two nodes: ``debug`` (n1, n2, the default) for the tests' jobs, side by side,
and ``loss`` (n3, n4) for the one test that takes a node away, whose loss then ends no
other test's job.

Everything lives in one directory: the configuration, the munge key and socket, the state,
the spool, the logs and one pid file per daemon started. ``up`` is idempotent (a cluster
whose daemons all run and whose nodes answer is left as it is), every wait is bounded, and
``down`` ends exactly the processes ``up`` started, by their pids. It needs root (the
daemons run as root, ``unshare --uts``) and Debian's ``slurm-wlm`` and ``munge``;
:func:`unavailable` says in one line why a machine cannot run it.

    python -m tests.slurm_cluster up DIR      # prints the SLURM_CONF to export
    python -m tests.slurm_cluster down DIR
    python -m tests.slurm_cluster status DIR
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

NODES = (("n1", "127.0.0.1"), ("n2", "127.0.0.2"), ("n3", "127.0.0.3"), ("n4", "127.0.0.4"))
LOSS_PARTITION = "loss"  # the nodes a test may lose (sbatch -p loss); no other job runs there
# (name, its nodes) of each partition; the first is the default.
PARTITIONS = (("debug", ("n1", "n2")), (LOSS_PARTITION, ("n3", "n4")))
# SLURM's own programs; munged and unshare complete the list of what the cluster needs.
PROGRAMS = (
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scontrol",
    "scancel",
    "sinfo",
    "munged",
    "unshare",
)
# A requeued batch job waits cred_expire + 1 s before it may run again (120 s by default).
CRED_EXPIRE_SECS = 10
UP_TIMEOUT_SECS = 60.0
UP_STATES = ("idle", "alloc", "mix", "comp", "resv", "plnd")
DOWN_TIMEOUT_SECS = 15.0


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (one line), or None if it can."""
    if sys.platform != "linux":
        return "a SLURM cluster needs Linux"
    if os.geteuid() != 0:
        return "a SLURM cluster needs root (its daemons, unshare --uts)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        names = ", ".join(missing)
        return f"SLURM is not installed (no {names}: apt-get install slurm-wlm munge)"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie of ours counts as ended.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass(frozen=True)
class Cluster:
    """The cluster whose files are in ``root``."""

    root: Path
    nodes: tuple[tuple[str, str], ...] = NODES  # (name, loopback address) of each node
    partitions: tuple[tuple[str, tuple[str, ...]], ...] = PARTITIONS
    first_job: int = 1  # job ids from here: two clusters' jobs are never the same number

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> Mapping[str, str]:
        """What a client command (srun, sbatch, scontrol) needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _pidfile(self, name: str) -> Path:
        return self.root / "pids" / f"{name}.pid"

    def pids(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for path in sorted((self.root / "pids").glob("*.pid")):
            try:
                found[path.stem] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return found

    def _lost_mark(self, name: str) -> Path:
        return self.root / "pids" / f"{name}.lost"

    def lost(self) -> set[str]:
        """The nodes a test has lost on purpose (``lose_node``) and not yet restored."""
        return {name for name, _ in self.nodes if self._lost_mark(name).exists()}

    def running(self) -> bool:
        """Every daemon this directory started runs and every node is up (``UP_STATES``;
        not down, drained or failed)."""
        return self._daemons_alive() and self._nodes_up()

    def _daemons_alive(self) -> bool:
        """Every daemon runs, but for the nodes lost on purpose."""
        pids = self.pids()
        lost = self.lost()
        expected = {"munged", "slurmctld", *(name for name, _ in self.nodes if name not in lost)}
        return expected <= set(pids) and all(alive(pids[name]) for name in expected)

    def _nodes_up(self, names: Iterable[str] | None = None) -> bool:
        """Each of these nodes (every node of the cluster if None) is up."""
        wanted = [name for name, _ in self.nodes] if names is None else list(names)
        try:
            done = subprocess.run(
                [_program("sinfo"), "-h", "-N", "-o", "%N %t"],
                env=dict(self.env),
                capture_output=True,
                text=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        # Up is any state a job can run in or has just run in (idle, alloc, mix, comp:
        # completing); a node that is down, drained, failed or unknown is not.
        return done.returncode == 0 and all(
            states.get(name, "unk").rstrip("*~#!%$@^-+").startswith(UP_STATES) for name in wanted
        )

    def _kept_up(self) -> bool:
        """Every node but those lost on purpose is up."""
        lost = self.lost()
        return self._nodes_up(name for name, _ in self.nodes if name not in lost)

    def up(self) -> None:
        """Bring the cluster up (or leave it up); raises ``RuntimeError`` with the logs'
        tails if it is not up within ``UP_TIMEOUT_SECS``."""
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if self._daemons_alive():
            # Up already (or coming up): never torn down under the jobs of its users, nor
            # for a node a test has lost on purpose (it brings it back itself).
            self._wait_for(self._kept_up, "every node up")
            return
        self.down()  # a half-started cluster: end what runs, start again
        for sub in ("pids", "state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._start("munged", self._munged())
        self._wait_for(lambda: (self.root / "munge" / "socket").exists(), "munged's socket")
        self._start("slurmctld", [_program("slurmctld"), "-D", "-c", "-f", str(self.conf)])
        for name, _ in self.nodes:
            self._lost_mark(name).unlink(missing_ok=True)
            self._start_node(name)
        self._wait_for(self._nodes_up, "every node idle")

    def _start_node(self, name: str) -> None:
        # Its own host name: the tasks on this node see `hostname` == name.
        self._start(
            name,
            [_program("unshare"), "--uts", "sh", "-c",
             f'hostname {name} && exec {_program("slurmd")} -D -f "{self.conf}" -N {name}'],
        )  # fmt: skip

    def lose_node(self, name: str) -> None:
        """The node is lost: its ``slurmd`` and every process on it (its UTS namespace:
        slurmstepd, the tasks) SIGKILLed at once, as a machine that dies. ``restore_node``
        brings it back."""
        pid = self.pids()[name]
        where = uts_namespace(pid)
        if where is None or where == uts_namespace(os.getpid()):
            raise RuntimeError(f"node {name}'s slurmd (pid {pid}) has no namespace of its own")
        # Marked lost first: an ``up`` meanwhile (another test's) leaves the cluster as it is.
        self._lost_mark(name).touch()
        self._pidfile(name).unlink(missing_ok=True)
        for each in [pid, *in_namespaces({where})]:
            try:
                os.kill(each, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restore_node(self, name: str) -> None:
        """Start the node's ``slurmd`` again (if it is not running) and wait until it is
        up: ReturnToService=2 lets a node that was down take jobs again."""
        pid = self.pids().get(name)
        if pid is None or not alive(pid):
            self._start_node(name)
        self._lost_mark(name).unlink(missing_ok=True)
        self._wait_for(lambda: self._nodes_up([name]), f"node {name} up again")

    def _munged(self) -> list[str]:
        munge = self.root / "munge"
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        munge.chmod(0o700)
        return [
            _program("munged"), "--foreground", "--force",
            f"--socket={munge / 'socket'}", f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
            f"--seed-file={munge / 'seed'}",
        ]  # fmt: skip

    def _write_config(self) -> None:
        r = self.root
        ctld_port = _free_port()
        lines = [
            "ClusterName=asvtest",
            f"FirstJobId={self.first_job}",
            f"SlurmctldHost={socket.gethostname()}",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'socket'},cred_expire={CRED_EXPIRE_SECS}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'state' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            # A job that became eligible (a requeued one's begin time passed) starts within
            # seconds, not at the next minute's pass.
            "SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # A batch script that exits 42 (preempted after its final save) is requeued.
            "RequeueExit=42",
            "KillWait=5",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
        ]
        for name, addr in self.nodes:
            lines.append(
                f"NodeName={name} NodeAddr={addr} NodeHostname={name} Port={_free_port()} "
                "CPUs=2 RealMemory=4000 State=UNKNOWN"
            )
        for i, (partition, members) in enumerate(self.partitions):
            # A test's job takes one core of each of its nodes (CR_Core, a task per node)
            # and may share it (FORCE:4): the tests' jobs run side by side, never queued
            # behind each other.
            lines.append(
                f"PartitionName={partition} Nodes={','.join(members)} "
                f"Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP "
                "OverSubscribe=FORCE:4"
            )
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\nCgroupAutomount=no\n"
        )

    def _start(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        with log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.env),
                start_new_session=True,  # our signals (a test's Ctrl-C) do not reach it
            )
        self._pidfile(name).write_text(str(proc.pid))

    def _wait_for(self, ready: object, what: str) -> None:
        assert callable(ready)
        deadline = time.monotonic() + UP_TIMEOUT_SECS
        while not ready():
            dead = [n for n, p in self.pids().items() if not alive(p)]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} ended" if dead else f"not {what} in {UP_TIMEOUT_SECS:g} s"
                raise RuntimeError(f"the SLURM cluster did not come up: {why}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def down(self) -> None:
        """End every daemon this directory started, by pid: SIGTERM, then SIGKILL after
        ``DOWN_TIMEOUT_SECS``. Jobs' processes end with their slurmd's session."""
        pids = self.pids()
        # Each node's processes (slurmd, its slurmstepd and the tasks, which leave slurmd's
        # session) share the node's UTS namespace, and nothing else on the machine does.
        nodes = {
            uts_namespace(pids[name])
            for name, _ in self.nodes
            if name in pids and alive(pids[name])
        }
        nodes.discard(uts_namespace(os.getpid()))
        nodes.discard(None)
        if nodes:
            subprocess.run(  # jobs first: slurmd sees its steps end
                [_program("scancel"), "--full", "--quiet", "--user=root"],
                env=dict(self.env), capture_output=True, timeout=10, check=False,
            )  # fmt: skip
        for pid in pids.values():
            if alive(pid):
                _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_TIMEOUT_SECS
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids.values():
            if alive(pid):
                _signal_group(pid, signal.SIGKILL)
        for pid in in_namespaces(nodes):
            _signal_group(pid, signal.SIGKILL)
        for name in pids:
            self._pidfile(name).unlink(missing_ok=True)


def uts_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return None


def in_namespaces(namespaces: set[str | None]) -> list[int]:
    """The processes whose UTS namespace is one of these."""
    if not namespaces:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and uts_namespace(int(entry.name)) in namespaces:
            found.append(int(entry.name))
    return found


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """The daemon's session: each was started in a session of its own, so its job steps'
    processes (slurmstepd and the tasks) end with it."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


SHARED_ENV = "ASV_SLURM_DIR"  # the suite's one cluster (tests/conftest.py sets it)


def shared() -> Cluster:
    """The suite's one cluster, brought up by the first test that needs it (under a lock:
    pytest-xdist's workers share it) and down when the suite ends (tests/conftest.py).
    Two clusters at once on one machine are avoided: their nodes would share names and
    addresses."""
    import fcntl

    root = Path(os.environ.get(SHARED_ENV) or Path(tempfile.gettempdir()) / "asv-slurm-suite")
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cluster.up()
    return cluster


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down", "status"):
        print("usage: python -m tests.slurm_cluster up|down|status DIR", file=sys.stderr)
        return 2
    cluster = Cluster(Path(argv[1]).resolve())
    if argv[0] == "up":
        cluster.up()
        print(f"export SLURM_CONF={cluster.conf}")
    elif argv[0] == "down":
        cluster.down()
    else:
        up = cluster.running()
        print("up" if up else "down")
        return 0 if up else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
