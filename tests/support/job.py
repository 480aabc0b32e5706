"""The local-job harness the end-to-end tests, the benchmarks and the demo share: start ``tmd local`` on the demo
workload, find its address, drive a migration through tmctl's client, and read every rank's final state hash."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

from tmctl.client import Client, CoordinatorUnreachable, find_keys
from tmd import protocol as p


def tmd_command(run_dir: str, standbys: int, steps: int, tiny: bool, quiet: bool, script_args: tuple = (),
                tmd_args: tuple = (), nodes: int = 2, ranks_per_node: int = 2,
                script: str = "examples.train_gpt") -> list[str]:
    """``tmd local`` for ``nodes`` nodes x ``ranks_per_node`` ranks (2 x 2 by default) running ``script``
    (examples.train_gpt by default; ``script_args`` are appended to it, ``tmd_args`` to tmd's own options)."""
    cmd = [sys.executable, "-m", "tmd.cli", "local", "--nodes", str(nodes), "--ranks-per-node", str(ranks_per_node),
           "--standbys", str(standbys), "--run-dir", run_dir, *tmd_args]
    if quiet:
        cmd.append("--quiet")
    cmd += ["--", sys.executable, "-m", script, "--steps", str(steps), *script_args]
    return cmd + (["--tiny"] if tiny else [])


def end_job(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate ``tmd`` if it still runs (a failed test: tmd terminates its processes on SIGTERM) and wait for it,
    at most ``timeout_s`` seconds (then ``subprocess.TimeoutExpired``)."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=timeout_s)


def final_hashes(run_dir: str) -> dict[int, str]:
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "final", "rank*.json"))):
        with open(path) as f:
            d = json.load(f)
        out[d["rank"]] = d["state_sha256"]
    return out


def reference_hashes(run_dir: str, steps: int, script_args: tuple = (), nodes: int = 2, ranks_per_node: int = 2,
                     timeout_s: float = 300.0) -> dict[int, str]:
    """Run an uninterrupted job of ``steps`` steps (no standby, ``script_args`` for the demo workload) in
    ``run_dir`` and return every rank's final state sha256 {rank: hex}. Raises CalledProcessError on a non-zero
    exit, TimeoutExpired after ``timeout_s`` seconds."""
    subprocess.run(tmd_command(run_dir, 0, steps, True, True, script_args, nodes=nodes, ranks_per_node=ranks_per_node),
                   check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    return final_hashes(run_dir)


def wait_for_address(run_dir: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    path = p.layout.RunDir(run_dir).tmd_json
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tmd exited with {proc.returncode} before it was up")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)["address"]
        time.sleep(0.1)  # another process writes it: nothing to wait on
    raise TimeoutError(f"tmd did not write {path} within {timeout_s} s")


def job_client(run_dir: str, proc: subprocess.Popen, timeout_s: float = 10.0) -> Client:
    """A tmctl client of the job in ``run_dir`` (waits for its tmd.json), authenticated with the job's keys."""
    return Client(wait_for_address(run_dir, proc), timeout_s=timeout_s, keys_dir=find_keys(run_dir, None))


def migrate_when_ready(client: Client, proc: subprocess.Popen, at_step: int, source: str | list[str],
                       target: str | list[str]) -> dict:
    """Wait until training reaches ``at_step`` and every standby is warm, request the migration, follow it.
    ``source`` and ``target`` are a node each, or lists of as many nodes (moved in one migration)."""
    sources = [source] if isinstance(source, str) else list(source)
    targets = [target] if isinstance(target, str) else list(target)
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before the migration was requested")
        st = client.request(p.StatusRequest())
        warm = {n["name"] for n in st.nodes if n["warm"]}
        if st.step >= at_step and warm >= set(targets):
            break
        time.sleep(0.2)
    reply = client.request(p.MigrateRequest(sources=sources, targets=targets))
    if isinstance(reply, p.ErrorReply):
        raise RuntimeError(f"migration refused: {reply.message}")
    mid = reply.migration["id"]
    print(f"[job] migration {mid}: {','.join(sources)} -> {','.join(targets)} requested at step {st.step}", flush=True)
    seen = set()
    while True:
        m = client.request(p.MigrationRequest(migration_id=mid)).migration
        if m["state"] not in seen:
            seen.add(m["state"])
            print(f"[job] migration {mid}: {m['state']}" + (f" ({m['reason']})" if m["reason"] else ""), flush=True)
        if p.MigrationState(m["state"]).finished:
            break
        time.sleep(0.05)
    # downtime_s is known once the 5 steps after the switch step are done
    while m["state"] == p.MigrationState.COMMITTED and m["downtime_s"] is None and proc.poll() is None:
        time.sleep(0.2)
        try:
            m = client.request(p.MigrationRequest(migration_id=mid)).migration
        except CoordinatorUnreachable:
            break
    return m


def web_of(run_dir: str) -> tuple[str, str]:
    """The status page's address and the job's web token, from the run dir's tmd.json (``web``)."""
    with open(p.layout.RunDir(run_dir).tmd_json) as f:
        web = json.load(f)["web"]
    with open(web["token_file"]) as f:
        return web["url"], f.read().strip()


def scrape(run_dir: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the job's ``/metrics`` (with its token): ``(name, sorted (label, value) pairs) -> value``.
    Raises urllib.error.URLError when tmd does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url, token = web_of(run_dir)
    req = urllib.request.Request(url.rstrip("/") + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def diagnose(run_dir: str, settle_s: float = 1.0, lines: int = 15, stack_lines: int = 80,
             last_events: int = 30) -> str:
    """What a failed end-to-end test prints about the job in ``run_dir``: the last ``last_events`` journal
    events; each rank process still running is asked for its threads' stacks (SIGUSR1, see
    worker.session.init; written to its log) and, after ``settle_s`` seconds, each log's last ``lines`` lines
    from before that and at most ``stack_lines`` lines of what came after (the stacks)."""
    from tests.support import events

    try:
        journal = events(run_dir)
    except OSError as e:
        return f"no journal: {e}"
    logs = {path: os.path.getsize(path) for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log")))}
    dumped = []
    for e in journal:
        if e["event"] == p.Event.WORKER_REGISTERED and _is_rank_of(e["pid"], run_dir):
            os.kill(e["pid"], signal.SIGUSR1)
            dumped.append(f"{e['node']}/{e['local_rank']}")
    if dumped:
        time.sleep(settle_s)  # faulthandler writes from the signal handler: no event to wait on
    out = ["last events:", *(json.dumps(e)[:300] for e in journal[-last_events:]),
           f"stacks asked of the processes still running: {', '.join(dumped) or 'none'}"]
    for path, size in logs.items():
        with open(path, "rb") as f:
            before = f.read(size).decode(errors="replace").splitlines()[-lines:]
            after = f.read().decode(errors="replace").splitlines()[:stack_lines]
        out += [f"--- {os.path.basename(path)}", *before, f"--- {os.path.basename(path)}, since the signal", *after]
    return "\n".join(out)


def _is_rank_of(pid: int, run_dir: str) -> bool:
    """Whether ``pid`` still runs with ``TM_RUN_DIR`` set to ``run_dir`` (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return False
    return os.path.realpath(env.get(b"TM_RUN_DIR", b"").decode(errors="replace")) == os.path.realpath(run_dir)
