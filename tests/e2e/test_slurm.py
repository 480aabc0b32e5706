"""SLURM mode end to end, on a real throw-away SLURM cluster on this host (no mocks of SLURM), in multi-host mode.

``slurm/local-cluster.sh up DIR --multihost`` brings up munge, slurmctld and 5 slurmd (n1..n5) with the TrainMover
prolog/epilog installed, each slurmd in a network namespace of its own with its own address on a bridge
(tmd/netns.py), slurmctld on the bridge's address: nothing works by 127.0.0.1. tmd (in the batch script on n1), the
ranks srun starts, the standbys and the hooks each live in their node's namespace and reach each other as separate
hosts would. n4 and n5 are held by the reservation ``standby``. Bad input is tried first, on the bare cluster. Then
one training job (``sbatch slurm/train.sbatch``: 2 nodes x 1 rank, the tiny GPT) with ``tmd slurm --keep-standbys 1
--iface tm0`` serves the rest, in order: tmd submits a standby job itself; every node uses its own address on tm0
(``tmctl status``); a bug makes tmd crash and it is restarted in its process (tmd.supervise) while the ranks train
on; ``migrate --to any,any`` with one warm standby is refused; an admin's drain of n2 migrates it to the standby
(after the restart), n2's epilog notice reaches tmd and n2 becomes DRAINED; tmd submits a new standby job, which
warms up; a kill -9 of the node holding the migrated ranks recovers onto that new standby, and tmd drains the failed
node ("trainmover: ..."); the third standby job pends in the full reservation (shown by ``tmctl status``, nothing
more submitted) and migrate to it times out; the final state is bit-identical to an uninterrupted run, tmd
cancelled the standby jobs it submitted before the training job ended, no standby job outlives it, and the
prolog/epilog reports of every node. Then a second job (1 node x 1 rank, ``--checkpoint-dir``, ``--keep-standbys 1``)
loses its only rank to kill -9 and restarts from its checkpoint on its standby node inside the allocation (no
requeue), bit-identical to an uninterrupted run.

The prolog and epilog are also run alone, as slurmd would (no cluster needed). Without SLURM (the Debian packages,
root) or network namespaces the cluster tests skip, with the reason; under CI=true they fail instead.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tmctl.localjob import end_padding, events, final_hashes, pace_args, wait_until
from tests.support import stand_in_tmd
from tmd import netns
from tmd.slurm import Poller, SlurmError, run_slurm
from tmd.standby_pool import PoolPolicy, StandbyPoolConfig, sbatch_argv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_SH = os.path.join(REPO, "slurm", "local-cluster.sh")
# The job outlives the tests that need it running: 800 x PACE_S = 48 s of steps, against about 20 s (300 steps) from
# its step 5 to the last of them (tmd's crash and restart, the drain migration, a new standby's warm-up, the kill -9
# recovery, a pending standby's 3 s wait) on a 2-core machine. The padding lasts while its pace file exists
# (examples.pacing): test_job_completes removes it, and the steps left run at their own speed.
STEPS = 800
PACE_S = 0.06  # pads each step (numerics unchanged)
CLIENT_TIMEOUT_S = 20  # every SLURM client call of these tests
IFACE = "tm0"  # each node namespace's end of its veth (tmd.netns.BRIDGE_NS_IF)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def slurm_missing() -> str:
    """Why the local cluster cannot come up here, or ''."""
    missing = [b for b in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo")
               if shutil.which(b) is None]
    if missing:
        return f"SLURM is not installed (missing {', '.join(missing)}; scripts/setup.sh installs it as root)"
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd runs as root)"
    if not (netns.available() and shutil.which("nsenter")):
        return "the multi-host SLURM cluster needs ip/tc, nsenter and network namespaces"
    return ""


def cluster_processes(cluster_dir: str):
    """(pid, comm, environ entries, cmdline) of every live process carrying this cluster's SLURM_CONF (not this
    one, no zombie)."""
    needle = f"SLURM_CONF={cluster_dir}/etc/slurm.conf".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if not zombie and needle in env and int(pid) != os.getpid():
            yield int(pid), comm, env, cmdline


def leftovers(cluster_dir: str) -> list[str]:
    """Processes that still carry this cluster's SLURM_CONF and belong to it (daemons, steps, job processes)."""
    return [f"{pid} {comm}" for pid, comm, env, _ in cluster_processes(cluster_dir)
            if comm in ("slurmd", "slurmctld", "slurmstepd", "srun", "munged")
            or any(e.startswith(b"SLURM_JOB_ID=") for e in env)]


class Cluster:
    def __init__(self, path: str) -> None:
        self.dir = path
        self.state_dir = os.path.join(path, "tmstate")
        self.env = {
            **os.environ,
            "SLURM_CONF": os.path.join(path, "etc", "slurm.conf"),
            "TM_STATE_DIR": self.state_dir,
            "TM_PYTHON": sys.executable,
            "TM_TMD_ARGS": f"--quiet --poll-s 0.5 --iface {IFACE}",  # tmd binds n1's tm0 address; each rank its own
            "OMP_NUM_THREADS": "1",
        }
        for var in ("SLURM_JOB_ID", "TM_HOST", "TM_GLOO_HOST", "TM_IFNAME"):
            self.env.pop(var, None)
        self.netns: dict[str, str] = {}  # etc/netns.env: NETNS_n<i>, ADDR_n<i>, NETNS_BRIDGE

    def run(self, *argv: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, env={**self.env, **env}, cwd=REPO, capture_output=True, text=True,
                           timeout=CLIENT_TIMEOUT_S)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def sbatch(self, *args: str, **env: str) -> str:
        """Submit; the job runs in the cluster dir (SLURM writes resize scripts into a job's working dir)."""
        return self.run("sbatch", "--parsable", f"--chdir={self.dir}", *args, **env).stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        return self.run("squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T").stdout.strip()

    def tmctl(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tmctl.cli", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def cluster():
    why = slurm_missing()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the SLURM tests cannot run: {why}")
        pytest.skip(why)
    path = tempfile.mkdtemp(prefix="tm-slurm-")  # not under pytest's 0700 tmp: munged's socket dir must be reachable
    c = Cluster(path)
    t0 = time.monotonic()
    up = subprocess.run([CLUSTER_SH, "up", path, "--hooks", sys.executable, "--multihost"], env=c.env,
                        capture_output=True, text=True, timeout=150)
    c.up_s = time.monotonic() - t0
    try:
        assert up.returncode == 0, f"local cluster did not come up: {up.stderr.strip()}"
        print(f"\n[slurm] cluster up in {c.up_s:.2f} s", flush=True)
        with open(os.path.join(path, "etc", "netns.env")) as f:
            c.netns = dict(line.strip().split("=", 1) for line in f if "=" in line)
        yield c
    finally:
        t0 = time.monotonic()
        down = subprocess.run([CLUSTER_SH, "down", path], env=c.env, capture_output=True, text=True, timeout=120)
        print(f"\n[slurm] cluster down in {time.monotonic() - t0:.2f} s", flush=True)
        left = leftovers(path)
        bridge = c.netns.get("NETNS_BRIDGE")
        bridge_left = bridge and subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode == 0
        if down.returncode == 0 and not left and not bridge_left:
            shutil.rmtree(path, ignore_errors=True)
        assert down.returncode == 0, down.stderr
        assert not left, f"still running after teardown: {left}"
        assert not bridge_left, f"bridge {bridge} left after teardown"


# ----------------------------------------------------------------------------------------------------------------
# The hooks alone, as slurmd runs them (bare environment, no PATH): no cluster needed
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def hooks(tmp_path):
    dest, state, log = tmp_path / "hooks", tmp_path / "state", tmp_path / "hooks.log"
    r = subprocess.run([os.path.join(REPO, "slurm", "install-hooks.sh"), "--python", sys.executable, "--dest",
                        str(dest), "--state-dir", str(state), "--log", str(log)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert "prolog: ok" in r.stdout and "epilog: ok" in r.stdout

    def run(hook: str, *args: str, job: str = "77", node: str = "nx") -> tuple[subprocess.CompletedProcess, dict]:
        env = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(os.getuid()), "SLURMD_NODENAME": node}
        argv = [str(dest / hook)] if not args else [sys.executable, "-I", os.path.join(REPO, "slurm", "hooks.py"),
                                                   hook, "--state-dir", str(state), *args]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10)
        with open(state / "jobs" / job / "hooks" / f"{hook}.{node}.json") as f:
            return r, json.load(f)
    run.state = state
    return run


@pytest.mark.timeout(60)
def test_hooks_that_fail_their_check_replace_nothing_and_an_option_without_a_value_is_refused(tmp_path):
    """Outside test: `install-hooks.sh -- --budget-s abc` said "failed its check" but left the failing hooks
    installed (every job's prolog on the node would fail, and SLURM drain it); `--python` alone said "unbound
    variable"."""
    script, dest = os.path.join(REPO, "slurm", "install-hooks.sh"), tmp_path / "hooks"

    def install(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([script, *args], capture_output=True, text=True, timeout=30)

    assert install("--python", sys.executable, "--dest", str(dest)).returncode == 0
    good = (dest / "prolog").read_text()
    bad = install("--python", sys.executable, "--dest", str(dest), "--", "--budget-s", "abc")
    assert bad.returncode == 1 and "nothing was installed" in bad.stderr and "invalid float value" in bad.stderr
    assert (dest / "prolog").read_text() == good and sorted(p.name for p in dest.iterdir()) == ["epilog", "prolog"]
    alone = install("--python")
    assert alone.returncode == 2 and alone.stderr.strip() == "install-hooks: error: --python needs a value"


@pytest.mark.timeout(30)
def test_prolog_passes_on_a_healthy_node_without_gpus_in_under_a_second(hooks):
    r, report = hooks("prolog")
    assert r.returncode == 0 and r.stderr == "", r
    assert report["ok"] and report["duration_s"] < 1.0, report
    assert {"mem_available_mb", "disk_free_mb", "load1", "gpus"} <= report["checks"].keys()


@pytest.mark.timeout(30)
def test_prolog_fails_an_unfit_node_with_one_line(hooks):
    r, report = hooks("prolog", "--min-free-mem-mb", "1e12")
    assert r.returncode == 1 and not report["ok"]
    assert r.stderr.count("\n") == 1 and "node unfit: only" in r.stderr and "MiB memory available" in r.stderr


@pytest.mark.timeout(30)
def test_epilog_kills_leftovers_and_notifies_tmd(hooks):
    from tmd import protocol as p
    from tmd.protocol.keys import JobKeys, role_of_frame

    (hooks.state / "jobs" / "77").mkdir(parents=True)
    keys = JobKeys.create(str(hooks.state / "jobs" / "77" / "keys"))  # the epilog authenticates with the hook key
    with stand_in_tmd(keys) as (sock, address):
        (hooks.state / "jobs" / "77" / "tmd.json").write_text(json.dumps({"address": address, "keys": keys.path}))
        env = {**os.environ, "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "nx", "TM_COORDINATOR": "tcp://x:1"}
        stray = subprocess.Popen(["sleep", "60"], env=env)
        other = subprocess.Popen(["sleep", "60"], env={**env, "SLURMD_NODENAME": "ny"})  # another node on this host
        got = []

        def acknowledge():  # as tmd does
            if sock.poll(5000):
                identity, frame = sock.recv_multipart(copy=False)
                got.append((role_of_frame(frame), p.decode(frame.bytes)))
                sock.send_multipart([identity.bytes, p.encode(p.NodeNoticeAck(node="nx", job_id="77", hook="epilog"))])
        tmd = threading.Thread(target=acknowledge)
        tmd.start()
        try:
            r, report = hooks("epilog")
            tmd.join(5)
            assert r.returncode == 0 and report["ok"], (r, report)
            assert report["checks"]["killed"] == [stray.pid] and stray.wait(timeout=5) == -9
            assert other.poll() is None
            assert report["duration_s"] < 1.0, report
            assert got == [(p.Sender.HOOK, p.NodeNotice(node="nx", job_id="77", hook="epilog",
                                                         detail="node left the job"))], "no NodeNotice"
            assert report["notice"].startswith(f"notice acknowledged by {address} in "), report
        finally:
            tmd.join(5)
            for proc in (stray, other):
                proc.kill()
                proc.wait()


# ----------------------------------------------------------------------------------------------------------------
# Bad input, on the bare cluster
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)  # includes bringing the cluster up
def test_tmctl_for_a_job_without_tmd_fails_with_one_line(cluster):
    r = cluster.tmctl("status", "--job", "424242")
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: no tmd.json at "), r.stderr
    assert "jobs/424242/tmd.json (from --job 424242)" in r.stderr


@pytest.mark.timeout(60)
def test_a_reservation_that_does_not_exist(cluster, monkeypatch):
    r = cluster.run("sbatch", "--parsable", "--reservation=nope", "slurm/standby.sbatch", "1", check=False)
    assert r.returncode != 0 and "reservation" in r.stderr.lower(), r
    # tmd's poller says so (tmd journals it and trains on without standbys)
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    snap = Poller("1", "nope", timeout_s=10).poll_once()
    good = Poller("1", "standby", timeout_s=10).poll_once()
    assert snap.reservation_ok is False and snap.standby_jobs == {} and not snap.errors, snap
    assert good.reservation_ok is True and not good.errors, good
    # the standby pool's sbatch, through the same client wrapper: refused in one line, and the pool backs off
    config = StandbyPoolConfig(keep=1, script=os.path.join(REPO, "slurm", "standby.sbatch"))
    pool = PoolPolicy(config)
    assert pool.due(0, reservation_ok=True)
    pool.submitting()
    with pytest.raises(SlurmError) as e:
        run_slurm(sbatch_argv(config, "nope", "1", cluster.dir), 10, cluster.dir)
    assert "\n" not in str(e.value) and "reservation" in str(e.value).lower(), e.value
    assert pool.refused(str(e.value)) == config.backoff_s and not pool.due(0, reservation_ok=True)
    assert "reservation" in pool.to_dict(0)["reason"].lower()


@pytest.mark.timeout(60)
def test_a_standby_job_for_a_job_that_does_not_exist_ends_with_an_error(cluster):
    out = os.path.join(cluster.dir, "standby-bad.out")
    jid = cluster.sbatch("--output", out, "slurm/standby.sbatch", "999999")
    wait_until(lambda: cluster.job_state(jid) in ("FAILED", "COMPLETED"), 40, f"standby job {jid} to end")
    assert cluster.job_state(jid) == "FAILED"
    with open(out) as f:
        assert "error: there is no SLURM job 999999 to stand by for" in f.read()


# ----------------------------------------------------------------------------------------------------------------
# One training job with `--keep-standbys 1`: tmd submits its standby jobs itself
# ----------------------------------------------------------------------------------------------------------------
# The training job's "interpreter": python, with a tmd bug that appears once the test creates the file TRIGGER (the
# first daemon's ticks fail until its loop ends as a crash; tmd.supervise restarts it). Test code only.
CRASHING_TMD = """#!{python}
import os, runpy, sys
from tmd.daemon import Daemon
tick = Daemon._tick
def buggy_tick(self):
    if self.resumed is None and os.path.exists({trigger!r}):
        raise RuntimeError("a bug injected by test_slurm.py")
    return tick(self)
Daemon._tick = buggy_tick
if sys.argv[1:3] != ["-m", "tmd.cli"]:
    sys.exit("usage: python -m tmd.cli ...")
sys.argv = ["tmd.cli"] + sys.argv[3:]
runpy.run_module("tmd.cli", run_name="__main__", alter_sys=True)
"""


class SlurmJob:
    """A training job submitted with sbatch (tmctl.localjob.Job is a ``tmd local`` one): asked through the tmctl
    command line, as an operator would, and read through its journal."""

    def __init__(self, cluster: Cluster, job_id: str, run_dir: str, crash_trigger: str) -> None:
        self.cluster, self.id, self.run_dir, self.crash_trigger = cluster, job_id, run_dir, crash_trigger

    def status(self) -> dict:
        r = self.cluster.tmctl("status", "--json", "--job", self.id, "--timeout", "5")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def events(self) -> list[dict]:
        try:
            return events(self.run_dir)
        except FileNotFoundError:
            return []  # tmd has not started yet

    def event(self, name: str, **match) -> dict | None:
        return next((e for e in self.events() if e["event"] == name and all(e.get(k) == v for k, v in match.items())),
                    None)

    def submitted(self) -> list[str]:
        """The standby jobs tmd submitted, in order."""
        return [e["slurm_job"] for e in self.events() if e["event"] == "standby_job_submitted"]

    def warm_standby(self, slurm_job: str) -> str | None:
        """The warm standby node of standby job ``slurm_job``, or None."""
        return next((n["name"] for n in self.status()["nodes"] if n["warm"] and n["slurm_job"] == slurm_job), None)

    def addresses(self) -> dict[str, tuple[str, str]]:
        """Each node's (interface, address) as ``tmctl status --json`` shows them."""
        return {n["name"]: (n["iface"], n["address"]) for n in self.status()["nodes"]}

    def sinfo(self, node: str) -> tuple[str, str]:
        """What an admin sees: (state, reason) of ``node``."""
        out = self.cluster.run("sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%T|%E").stdout
        state, _, reason = out.strip().splitlines()[0].partition("|")
        return state, reason


@pytest.fixture(scope="module")
def job(cluster):
    run_dir = os.path.join(cluster.dir, "run")
    trigger = os.path.join(cluster.dir, "crash-tmd")
    python = os.path.join(cluster.dir, "crashing-tmd-python")
    with open(python, "w") as f:
        f.write(CRASHING_TMD.format(python=sys.executable, trigger=trigger))
    os.chmod(python, 0o755)
    jid = cluster.sbatch("--output", os.path.join(cluster.dir, "train-%j.out"), "slurm/train.sbatch",
                         sys.executable, "-m", "examples.train_gpt", "--steps", str(STEPS), "--tiny",
                         "--min-step-time-s", str(PACE_S), *pace_args(run_dir), TM_RUN_DIR=run_dir, TM_PYTHON=python,
                         TM_TMD_ARGS=cluster.env["TM_TMD_ARGS"] + " --keep-standbys 1")
    j = SlurmJob(cluster, jid, run_dir, trigger)
    wait_until(lambda: os.path.exists(os.path.join(cluster.state_dir, "jobs", jid, "tmd.json")), 60, "tmd.json")

    def ready():
        st = j.status()
        return st["step"] > 5 and j.submitted() and j.warm_standby(j.submitted()[0]) and st
    st = wait_until(ready, 90, "training and a warm standby of the job tmd submitted")
    assert [n["name"] for n in st["nodes"] if n["role"] == "active"] == ["n1", "n2"]
    assert st["slurm"]["pool"]["keep"] == 1 and st["slurm"]["pool"]["submitted"] == j.submitted()
    yield j
    for s in [jid, *j.submitted()]:
        cluster.run("scancel", s, check=False)


@pytest.mark.timeout(270)  # includes submitting the job and waiting for its warm standby
def test_every_node_uses_its_own_address_on_the_interface_asked_for(job):
    addr = job.cluster.netns
    with open(os.path.join(job.cluster.dir, "etc", "slurm.conf")) as f:
        assert "127.0.0.1" not in f.read()  # slurmctld and every slurmd on the bridge
    with open(os.path.join(job.cluster.state_dir, "jobs", job.id, "tmd.json")) as f:
        assert json.load(f)["address"].startswith(f"tcp://{addr['ADDR_n1']}:")  # tmd on its batch host's tm0
    standby = job.warm_standby(job.submitted()[0])
    assert job.addresses() == {name: (IFACE, addr[f"ADDR_{name}"]) for name in ("n1", "n2", standby)}
    assert len({addr[f"ADDR_n{i}"] for i in range(1, 6)}) == 5 and not any(
        a.startswith("127.") for k, a in addr.items() if k.startswith("ADDR_"))
    r = job.cluster.tmctl("--job", job.id, "status")  # the table an operator reads
    assert r.returncode == 0 and f"{IFACE} {addr['ADDR_n2']}" in r.stdout, r


@pytest.mark.timeout(150)
def test_a_tmd_crash_is_restarted_in_process_and_the_ranks_train_on(job):
    started = job.event("tmd_started")
    step = job.status()["step"]
    with open(job.crash_trigger, "w"):
        pass
    crashed = wait_until(lambda: job.event("tmd_crashed"), 30, "tmd to crash")
    restarted = wait_until(lambda: job.event("tmd_restarted"), 30, "tmd to be restarted")
    assert "a bug injected by test_slurm.py" in crashed["error"]
    assert restarted["address"] == started["address"], "the same address: the ranks reconnect by themselves"
    st = wait_until(lambda: (lambda st: st["step"] > step + 10 and st)(job.status()), 60,
                    "the restarted tmd to answer and training to go on")
    assert [n["name"] for n in st["nodes"] if n["role"] == "active"] == ["n1", "n2"]
    assert wait_until(lambda: job.warm_standby(job.submitted()[0]), 30, "the pool's standby, still warm")
    print(f"\n[slurm] crash -> tmd restarted in {restarted['ts'] - crashed['ts']:.2f} s", flush=True)


@pytest.mark.timeout(150)
def test_draining_n2_migrates_it_to_the_pool_standby_and_the_pool_refills(job):
    c = job.cluster
    first = job.submitted()[0]
    standby = job.warm_standby(first)
    # distinct standbys: two `any` while one is warm is refused, naming how many are warm
    r = c.tmctl("--job", job.id, "migrate", "--from", "n1,n2", "--to", "any,any")
    assert r.returncode == 2 and "needs 2 warm standbys" in r.stderr and f"1 is warm: {standby}" in r.stderr, r
    t0 = time.time()
    c.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=maintenance")
    ev = wait_until(lambda: job.event("drain_migration", node="n2"), 30, "the drain migration to start")
    assert "maintenance" in ev["reason"] and ev["target"] == standby, ev
    done = wait_until(lambda: job.event("migration_committed", migration_id=ev["migration_id"]) or
                      job.event("migration_aborted", migration_id=ev["migration_id"]), 90, "the drain migration")
    assert done["event"] == "migration_committed", done  # after tmd's restart
    print(f"\n[slurm] drain -> committed in {done['ts'] - t0:.2f} s", flush=True)
    roles = {n["name"]: n["role"] for n in job.status()["nodes"]}
    assert roles["n2"] == "left" and roles[standby] == "active"
    # n2 goes back to SLURM (the job shrinks, its epilog tells tmd, which acknowledges), so the admin's drain
    # completes
    wait_until(lambda: job.event("slurm_node_released", node="n2"), 30, "n2 released from the job")
    wait_until(lambda: job.event("slurm_hook", hook="epilog", node="n2", slurm_job=job.id), 30,
               "tmd to journal n2's epilog notice")
    wait_until(lambda: job.sinfo("n2")[0] == "drained", 30, "n2 drained")
    # the pool replaces the consumed standby: a new standby job, warm, on its own address
    second = wait_until(lambda: job.submitted()[1:2], 30, "a second standby job")[0]
    spare = wait_until(lambda: job.warm_standby(second), 60, f"standby job {second} to hold a warm standby")
    assert job.addresses()[spare] == (IFACE, c.netns[f"ADDR_{spare}"])


@pytest.mark.timeout(150)
def test_a_kill_9_recovers_onto_the_new_standby_and_the_failed_node_is_drained(job):
    c = job.cluster
    first, second = job.submitted()[:2]
    spare = job.warm_standby(second)
    victim = next(n["name"] for n in job.status()["nodes"] if n["role"] == "active" and n["slurm_job"] == first)
    pids = rank_pids(c.dir, victim)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    done = wait_until(lambda: job.event("recovery_done") or job.event("recovery_failed"), 90, "the recovery")
    assert done["event"] == "recovery_done" and done["standbys"] == {victim: spare}, done
    assert job.event("standby_promoted")["standby"] == spare
    roles = {n["name"]: n["role"] for n in job.status()["nodes"]}
    assert roles[victim] == "failed" and roles[spare] == "active" and roles["n1"] == "active"
    # the failed node is drained with tmd's reason, its standby job cancelled: SLURM has it DRAINED
    drained = wait_until(lambda: job.event("slurm_node_drained", node=victim), 30, f"{victim} drained by tmd")
    assert drained["reason"].startswith(f"trainmover: job {job.id}: "), drained
    state, reason = wait_until(lambda: (lambda sr: sr[0] == "drained" and sr)(job.sinfo(victim)), 30,
                               f"{victim} DRAINED")
    assert reason.startswith("trainmover: job"), reason
    # the pool submits a third standby job; the reservation is full (a drained node, one in use): it pends, and
    # tmctl status says why
    third = wait_until(lambda: job.submitted()[2:3], 30, "a third standby job")[0]
    wait_until(lambda: job.event("standby_job_waiting", slurm_job=third), 30, f"tmd to see {third} pending")
    pending = job.status()["slurm"]["pool"]["pending"]
    assert [p["slurm_job"] for p in pending] == [third] and pending[0]["state"] == "PENDING", pending
    shown = " ".join(c.tmctl("--job", job.id, "status").stdout.split())  # (rich wraps long lines)
    assert f"job {third} PENDING" in shown and f"drained by tmd (failed): {victim}" in shown, shown
    # an admin's view (docs/slurm.md): the standby jobs tmd submitted, the nodes drained (n2 by the admin)
    queue = c.run("squeue", "--reservation=standby", "--name=tm-standby", "--format=%i %T %N %r %o").stdout
    drained = c.run("sinfo", "--Node", "--states=drain,drained", "--format=%N %T %E").stdout
    assert any(line.split()[:2] == [third, "PENDING"] for line in queue.splitlines()), queue
    assert f"{victim} drained trainmover: job {job.id}: " in drained and "n2 drained maintenance" in drained, drained
    print(f"\n[slurm] admin's view:\n{queue}{drained}", flush=True)


@pytest.mark.timeout(60)
def test_a_standby_job_that_never_starts_makes_migrate_time_out_and_nothing_loops(job):
    c = job.cluster
    never = job.submitted()[2]  # pending: the reservation is full
    step = job.status()["step"]
    t0 = time.monotonic()
    r = c.tmctl("--job", job.id, "migrate", "--from", "n1", "--to", never, "--wait-standby-s", "3")
    assert time.monotonic() - t0 >= 3
    assert r.returncode == 1, r
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: timed out after 3 s waiting for standby '{never}': standby job {never} "
                               "has not started: PENDING"), r.stderr
    wait_until(lambda: job.status()["step"] > step + 5, 30, "training to go on")
    assert len(job.submitted()) == 3, "the pending job counts as on its way: nothing more was submitted"


def rank_pids(cluster_dir: str, node: str) -> list[int]:
    """The rank processes of ``node`` (not their srun clients) in this cluster."""
    return [pid for pid, comm, env, cmdline in cluster_processes(cluster_dir)
            if f"TM_NODE={node}".encode() in env and b"examples.train_gpt" in cmdline and comm != "srun"]


@pytest.fixture(scope="module")
def reference(cluster):
    """An uninterrupted run of the same job (2 nodes x 1 rank, same script and seed) in local mode, started when
    first asked for (after the migrations: it runs while the SLURM job finishes); call it for the final hashes."""
    run_dir = os.path.join(cluster.dir, "reference")
    cmd = [sys.executable, "-m", "tmd.cli", "local", "--nodes", "2", "--ranks-per-node", "1", "--standbys", "0",
           "--run-dir", run_dir, "--quiet", "--", sys.executable, "-m", "examples.train_gpt", "--steps", str(STEPS),
           "--tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def hashes() -> dict[int, str]:
        assert proc.wait(timeout=240) == 0
        return final_hashes(run_dir)
    yield hashes
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(300)
def test_job_completes_bit_identical_and_no_standby_job_outlives_it(job, reference):
    c = job.cluster
    end_padding(job.run_dir)  # the faults are over: the steps left at their own speed
    wait_until(lambda: c.job_state(job.id) in ENDED, 200, "the training job to end")
    assert c.job_state(job.id) == "COMPLETED", open(os.path.join(c.dir, f"train-{job.id}.out")).read()[-3000:]
    # tmd cancelled the pending standby job it submitted before it ended; the running one ends by itself
    first, second, third = job.submitted()
    assert c.job_state(third) == "CANCELLED"
    for s in (first, second):
        wait_until(lambda s=s: c.job_state(s) in ("CANCELLED", "COMPLETED"), 30, f"standby job {s} to end")
    cancelled = job.event("standby_jobs_cancelled", reason=f"job {job.id} ended")
    assert cancelled and cancelled["slurm_jobs"] == [third], cancelled
    got, ref = final_hashes(job.run_dir), reference()
    assert len(ref) == 2 and len(set(ref.values())) == 1
    assert got == ref
    names = [e["event"] for e in job.events()]
    assert names.count("migration_committed") == 1 and "migration_aborted" not in names
    assert names.count("recovery_done") == 1 and names.count("tmd_restarted") == 1
    assert "job_failed" not in names


@pytest.mark.timeout(150)  # includes tearing the cluster down
def test_prolog_and_epilog_ran_on_every_node(job):
    c = job.cluster
    wanted = {job.id: ["n1", "n2"], **{s: [] for s in job.submitted()}}
    for e in job.events():
        if e["event"] == "standby_job_running":
            wanted[e["slurm_job"]] = e["nodes"]
    assert sorted(n for s in job.submitted() for n in wanted[s]) == ["n4", "n5"]
    durations = {}
    for jid, nodes in wanted.items():
        for hook in ("prolog", "epilog"):
            for node in nodes:
                path = os.path.join(c.state_dir, "jobs", jid, "hooks", f"{hook}.{node}.json")
                wait_until(lambda path=path: os.path.exists(path), 20, f"{path}")
                with open(path) as f:
                    r = json.load(f)
                assert r["ok"] and "error" not in r, json.dumps(r)
                assert r["duration_s"] < 3.0, r  # the local cluster's budget (slurm/local-cluster.sh)
                durations[f"{hook} {node} (job {jid})"] = r["duration_s"]
    # tmd journalled the prolog of each node (the epilog of n2: test_draining_n2_...), also one written after
    # squeue listed its job as RUNNING (printed: seconds from tmd's adoption of the job to its journal)
    running = {e["slurm_job"]: e["ts"] for e in job.events() if e["event"] == "standby_job_running"}
    prologs = {(e["node"], e["slurm_job"]): e["ts"] for e in job.events()
               if e["event"] == "slurm_hook" and e["hook"] == "prolog"}
    assert prologs.keys() == {(n, jid) for jid, nodes in wanted.items() for n in nodes}
    late = {f"{n} (job {j})": round(ts - running[j], 2) for (n, j), ts in prologs.items() if j in running}
    print(f"\n[slurm] hook durations (s): {json.dumps(durations)}; standby prologs journalled after adoption (s): "
          f"{json.dumps(late)}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# A second job, once the first is over: its only node lost, it restarts from its checkpoint inside its allocation
# ----------------------------------------------------------------------------------------------------------------
REBUILD_STEPS = 300


@pytest.mark.timeout(240)
def test_a_job_that_lost_every_rank_restarts_from_its_checkpoint_on_its_standby_inside_the_allocation(job):
    """1 node x 1 rank, ``--checkpoint-dir``, ``--keep-standbys 1``: kill -9 of the rank leaves no replica, so tmd
    restarts the job from its newest checkpoint without a requeue (tmd.slurm.SlurmCluster.rebuild_world): the
    rank starts again on the pool's standby node, in the standby job's allocation, the failed node is drained,
    and the final state equals an uninterrupted local run's."""
    c = job.cluster
    wait_until(lambda: c.job_state(job.id) in ENDED, 120, "the first training job to end")  # n5 is free again
    run_dir, checkpoints = os.path.join(c.dir, "rebuild"), os.path.join(c.dir, "rebuild-checkpoints")
    ref_dir = os.path.join(c.dir, "rebuild-reference")
    script = ("-m", "examples.train_gpt", "--steps", str(REBUILD_STEPS), "--tiny")
    reference = subprocess.Popen([sys.executable, "-m", "tmd.cli", "local", "--nodes", "1", "--ranks-per-node", "1",
                                  "--standbys", "0", "--run-dir", ref_dir, "--quiet", "--", sys.executable, *script],
                                 stdout=subprocess.DEVNULL, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        jid = c.sbatch("--nodes", "1", "--output", os.path.join(c.dir, "train-%j.out"), "slurm/train.sbatch",
                       sys.executable, *script, "--min-step-time-s", str(PACE_S), *pace_args(run_dir),
                       TM_RUN_DIR=run_dir, TM_TMD_ARGS=c.env["TM_TMD_ARGS"] + f" --keep-standbys 1 --checkpoint-dir "
                                                                              f"{checkpoints} --checkpoint-every 10")
        second = SlurmJob(c, jid, run_dir, "")
        wait_until(lambda: second.event("checkpoint_committed") and second.submitted() and
                   second.warm_standby(second.submitted()[0]), 120, "a checkpoint and a warm standby")
        standby = second.warm_standby(second.submitted()[0])
        node, = [n["name"] for n in second.status()["nodes"] if n["role"] == "active"]
        pids = rank_pids(c.dir, node)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        rebuilt = wait_until(lambda: second.event("world_rebuilt"), 60, "the world rebuilt inside the allocation")
        assert rebuilt["nodes"] == [standby] and rebuilt["replaced"] == {"0": standby}, rebuilt
        wait_until(lambda: second.status()["step"] > rebuilt["step"] + 1, 60, "training after the restart")
        end_padding(run_dir)
        wait_until(lambda: c.job_state(jid) in ENDED, 120, "the second training job to end")
        assert c.job_state(jid) == "COMPLETED", open(os.path.join(c.dir, f"train-{jid}.out")).read()[-3000:]
        assert reference.wait(timeout=120) == 0
    finally:
        if reference.poll() is None:
            reference.kill()
    assert final_hashes(run_dir) == final_hashes(ref_dir)
    names = [e["event"] for e in second.events()]
    assert names.count("job_restarting") == 1 and "job_requeued" not in names and "job_failed" not in names
    restarting = second.event("job_restarting")
    assert restarting["step"] == rebuilt["step"] and restarting["ts"] <= rebuilt["ts"]
    failed = second.event("node_failed", node=node)  # the kill hit the rank
    assert failed and failed["ts"] < restarting["ts"] and failed["ranks"] == [0], failed
    drained = second.event("slurm_node_drained", node=node)
    assert drained and drained["reason"].startswith(f"trainmover: job {jid}: "), drained
