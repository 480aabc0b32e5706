"""SLURM mode end to end, on a real throw-away SLURM cluster on this host (no mocks of SLURM).

``slurm/local-cluster.sh`` brings up munge, slurmctld and 5 slurmd (n1..n5) with the TrainMover prolog/epilog
installed; n4 and n5 are held by the reservation ``standby``. Bad input is tried first, on the bare cluster. Then one
training job (``sbatch slurm/train.sbatch``: 2 nodes x 1 rank, the tiny GPT) and two standby jobs in the reservation
serve the rest, in order: ``tmctl migrate`` of the job's second node to a standby, a standby job that never starts
(migrate waits, then times out), an admin's drain of the first node (migrated automatically), the final state
bit-identical to an uninterrupted run, and the prolog/epilog reports of every node.

The prolog and epilog are also run alone, as slurmd would (no cluster needed). Without SLURM (the Debian packages, or
root) the cluster tests skip, with the reason; under CI=true they fail instead.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tmctl.localjob import events, final_hashes, wait_until
from tests.support import stand_in_tmd
from tmd.slurm import Poller

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_SH = os.path.join(REPO, "slurm", "local-cluster.sh")
# The job outlives the tests that need it running: 500 x PACE_S = 30 s of steps, against about 10 s from its step 5
# to the drain migration's end (migrate, a pending standby's 3 s wait, the drain) on a 2-core machine.
STEPS = 500
PACE_S = 0.06  # pads each step (numerics unchanged)
CLIENT_TIMEOUT_S = 20  # every SLURM client call of these tests


def slurm_missing() -> str:
    """Why the local cluster cannot come up here, or ''."""
    missing = [b for b in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo")
               if shutil.which(b) is None]
    if missing:
        return f"SLURM is not installed (missing {', '.join(missing)}; scripts/setup.sh installs it as root)"
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd runs as root)"
    return ""


def leftovers(cluster_dir: str) -> list[str]:
    """Processes that still carry this cluster's SLURM_CONF and belong to it (daemons, steps, job processes)."""
    needle = f"SLURM_CONF={cluster_dir}/etc/slurm.conf".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if zombie or needle not in env or int(pid) == os.getpid():
            continue
        if comm in ("slurmd", "slurmctld", "slurmstepd", "srun", "munged") or any(e.startswith(b"SLURM_JOB_ID=") for e in env):
            out.append(f"{pid} {comm}")
    return out


class Cluster:
    def __init__(self, path: str) -> None:
        self.dir = path
        self.state_dir = os.path.join(path, "tmstate")
        self.env = {
            **os.environ,
            "SLURM_CONF": os.path.join(path, "etc", "slurm.conf"),
            "TM_STATE_DIR": self.state_dir,
            "TM_PYTHON": sys.executable,
            "TM_GLOO_HOST": "127.0.0.1",
            "TM_HOST": "127.0.0.1",
            "TM_TMD_ARGS": "--quiet --poll-s 0.5",
            "OMP_NUM_THREADS": "1",
        }
        self.env.pop("SLURM_JOB_ID", None)

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
    up = subprocess.run([CLUSTER_SH, "up", path, "--hooks", sys.executable], env=c.env, capture_output=True,
                        text=True, timeout=120)
    c.up_s = time.monotonic() - t0
    try:
        assert up.returncode == 0, f"local cluster did not come up: {up.stderr.strip()}"
        print(f"\n[slurm] cluster up in {c.up_s:.2f} s", flush=True)
        yield c
    finally:
        t0 = time.monotonic()
        down = subprocess.run([CLUSTER_SH, "down", path], env=c.env, capture_output=True, text=True, timeout=120)
        print(f"\n[slurm] cluster down in {time.monotonic() - t0:.2f} s", flush=True)
        left = leftovers(path)
        if down.returncode == 0 and not left:
            shutil.rmtree(path, ignore_errors=True)
        assert down.returncode == 0, down.stderr
        assert not left, f"still running after teardown: {left}"


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
        try:
            r, report = hooks("epilog")
            assert r.returncode == 0 and report["ok"], (r, report)
            assert report["checks"]["killed"] == [stray.pid] and stray.wait(timeout=5) == -9
            assert other.poll() is None
            assert report["duration_s"] < 1.0, report
            assert sock.poll(5000), "no NodeNotice"
            _, frame = sock.recv_multipart(copy=False)
            assert role_of_frame(frame) == p.Sender.HOOK
            assert p.decode(frame.bytes) == p.NodeNotice(node="nx", job_id="77", hook="epilog",
                                                         detail="node left the job")
        finally:
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


@pytest.mark.timeout(60)
def test_a_standby_job_for_a_job_that_does_not_exist_ends_with_an_error(cluster):
    out = os.path.join(cluster.dir, "standby-bad.out")
    jid = cluster.sbatch("--output", out, "slurm/standby.sbatch", "999999")
    wait_until(lambda: cluster.job_state(jid) in ("FAILED", "COMPLETED"), 40, f"standby job {jid} to end")
    assert cluster.job_state(jid) == "FAILED"
    with open(out) as f:
        assert "error: there is no SLURM job 999999 to stand by for" in f.read()


# ----------------------------------------------------------------------------------------------------------------
# One training job with two standby jobs
# ----------------------------------------------------------------------------------------------------------------
class SlurmJob:
    """A training job submitted with sbatch (tmctl.localjob.Job is a ``tmd local`` one): asked through the tmctl
    command line, as an operator would, and read through its journal."""

    def __init__(self, cluster: Cluster, job_id: str, run_dir: str, standby_jobs: list[str]) -> None:
        self.cluster, self.id, self.run_dir, self.standby_jobs = cluster, job_id, run_dir, standby_jobs

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


@pytest.fixture(scope="module")
def job(cluster):
    run_dir = os.path.join(cluster.dir, "run")
    jid = cluster.sbatch("--output", os.path.join(cluster.dir, "train-%j.out"), "slurm/train.sbatch",
                         sys.executable, "-m", "examples.train_gpt", "--steps", str(STEPS), "--tiny",
                         "--min-step-time-s", str(PACE_S), TM_RUN_DIR=run_dir)
    standbys = [cluster.sbatch("--reservation=standby", "--output", os.path.join(cluster.dir, "standby-%j.out"),
                               "slurm/standby.sbatch", jid) for _ in range(2)]
    j = SlurmJob(cluster, jid, run_dir, standbys)
    wait_until(lambda: os.path.exists(os.path.join(cluster.state_dir, "jobs", jid, "tmd.json")), 60, "tmd.json")

    def ready():
        st = j.status()
        return st["step"] > 5 and sum(1 for n in st["nodes"] if n["warm"]) == 2 and st
    st = wait_until(ready, 90, "training and two warm standbys")
    assert [n["name"] for n in st["nodes"] if n["role"] == "active"] == ["n1", "n2"]
    yield j
    for s in [jid, *standbys]:
        cluster.run("scancel", s, check=False)


@pytest.mark.timeout(270)  # includes submitting the jobs and waiting for warm standbys
def test_tmctl_migrate_to_a_standby_node_commits(job):
    st = job.status()
    standby = sorted(n["name"] for n in st["nodes"] if n["role"] == "standby" and n["warm"])[0]
    assert {n["name"]: n["slurm_job"] for n in st["nodes"]}[standby] in job.standby_jobs
    r = job.cluster.tmctl("--job", job.id, "migrate", "--from", "n2", "--to", standby, "--json", "--timeout-s", "90")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["state"] == "committed" and m["source"] == "n2" and m["target"] == standby
    roles = {n["name"]: (n["role"], n["ranks"]) for n in job.status()["nodes"]}
    assert roles[standby] == ("active", [1]) and roles["n2"][0] == "left"
    # n2 is handed back to SLURM (the job shrinks); its epilog tells tmd that it left the job
    wait_until(lambda: job.event("slurm_node_released", node="n2"), 30, "n2 released from the job")
    wait_until(lambda: job.event("slurm_hook", hook="epilog", node="n2", slurm_job=job.id), 30, "n2's epilog notice")


@pytest.mark.timeout(60)
def test_a_standby_job_that_never_starts_makes_migrate_time_out(job):
    c = job.cluster
    # The reservation's nodes are taken: this standby job stays pending.
    never = c.sbatch("--reservation=standby", "--output", "/dev/null", "slurm/standby.sbatch", job.id)
    try:
        wait_until(lambda: job.event("standby_job_waiting", slurm_job=never), 20, "tmd to see the pending standby job")
        step = job.status()["step"]
        t0 = time.monotonic()
        r = c.tmctl("--job", job.id, "migrate", "--from", "n1", "--to", never, "--wait-standby-s", "3")
        assert time.monotonic() - t0 >= 3
        assert r.returncode == 1, r
        assert r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"error: timed out after 3 s waiting for standby '{never}': standby job {never} "
                                   "has not started: PENDING"), r.stderr
        wait_until(lambda: job.status()["step"] > step + 5, 30, "training to go on")
    finally:
        c.run("scancel", never, check=False)


@pytest.mark.timeout(120)
def test_draining_a_node_migrates_it_automatically(job):
    c = job.cluster
    t0 = time.time()
    c.run("scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=maintenance")
    ev = wait_until(lambda: job.event("drain_migration", node="n1"), 30, "the drain migration to start")
    assert "maintenance" in ev["reason"] and ev["slurm_reason"].startswith("maintenance"), ev
    mid = ev["migration_id"]
    done = wait_until(lambda: job.event("migration_committed", migration_id=mid) or
                      job.event("migration_aborted", migration_id=mid), 90, "the drain migration to end")
    assert done["event"] == "migration_committed", done
    print(f"\n[slurm] drain -> committed in {done['ts'] - t0:.2f} s "
          f"(drain seen after {ev['ts'] - t0:.2f} s)", flush=True)
    roles = {n["name"]: n["role"] for n in job.status()["nodes"]}
    assert roles["n1"] == "left" and roles[ev["target"]] == "active"
    # n1 is the batch host (tmd runs there): it stays in the job and SLURM drains it when the job ends
    wait_until(lambda: job.event("slurm_node_kept", node="n1"), 30, "n1 kept as batch host")


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
def test_job_completes_bit_identical_to_an_uninterrupted_run(job, reference):
    c = job.cluster
    wait_until(lambda: c.job_state(job.id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 200,
               "the training job to end")
    assert c.job_state(job.id) == "COMPLETED", open(os.path.join(c.dir, f"train-{job.id}.out")).read()[-3000:]
    got, ref = final_hashes(job.run_dir), reference()
    assert len(ref) == 2 and len(set(ref.values())) == 1
    assert got == ref
    names = [e["event"] for e in job.events()]
    assert names.count("migration_committed") == 2 and "migration_aborted" not in names
    assert "job_failed" not in names


@pytest.mark.timeout(150)  # includes tearing the cluster down
def test_prolog_and_epilog_ran_on_every_node(job):
    c = job.cluster
    # Standby jobs end by themselves once the training job has ended.
    for s in job.standby_jobs:
        wait_until(lambda s=s: c.job_state(s) == "COMPLETED", 30, f"standby job {s} to end")
    wanted = {job.id: ["n1", "n2"], job.standby_jobs[0]: [], job.standby_jobs[1]: []}
    for e in job.events():
        if e["event"] == "standby_job_running":
            wanted[e["slurm_job"]] = e["nodes"]
    assert sorted(wanted[job.standby_jobs[0]] + wanted[job.standby_jobs[1]]) == ["n4", "n5"]
    durations = {}
    for jid, nodes in wanted.items():
        for hook in ("prolog", "epilog"):
            for node in nodes:
                path = os.path.join(c.state_dir, "jobs", jid, "hooks", f"{hook}.{node}.json")
                wait_until(lambda path=path: os.path.exists(path), 20, f"{path}")
                with open(path) as f:
                    r = json.load(f)
                assert r["ok"] and "error" not in r, json.dumps(r)
                assert r["duration_s"] < 1.0, r
                durations[f"{hook} {node} (job {jid})"] = r["duration_s"]
    # tmd journalled the prolog of each node, and the epilog of n2 (released while the job ran)
    prologs = {(e["node"], e["slurm_job"]) for e in job.events() if e["event"] == "slurm_hook" and e["hook"] == "prolog"}
    assert prologs == {(n, jid) for jid, nodes in wanted.items() for n in nodes}
    print(f"\n[slurm] hook durations (s): {json.dumps(durations)}", flush=True)
