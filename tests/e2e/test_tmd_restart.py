"""tmd killed with SIGKILL during training: the ranks train on; ``tmd resume`` re-learns the job from the workers'
re-registration and the journal, and the job can migrate again (tmd/resume.py).

End to end in local mode with real processes (2 nodes x 2 ranks, standby s1, a tiny GPT), checked bit for bit
against an uninterrupted run; and the journal replay alone on made-up journals.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import zmq

from tmctl.client import CoordinatorUnreachable
from tmctl.localjob import (end_job, end_padding, events, final_hashes, job_client, pace_args, scrape, start_tmd,
                            tmd_command, tmd_log, wait_until, web_of)
from tmd import protocol as p
from tmd.protocol.keys import JobKeys
from tmd.resume import ResumeError, load
from worker.fork_server import SERVER_NAME


pytestmark = pytest.mark.timeout(240)

STEPS = 400
# Padded so the job (400 x 0.06 s = 24 s) outlives tmd's kill, the rogue coordinators, 20 steps without tmd,
# the resume and a migration: about 12 s from step 5 to the migration's downtime figure on a quiet 2-core machine.
# Neither changes the numerics. The padding ends with the migration (the pace file, examples.pacing).
ARGS = ("--group-size", "2", "--min-step-time-s", "0.06")
# Detection settings other than the defaults (tmd.config; larger, so nothing fails sooner): the resumed tmd must
# run with them, not with the defaults.
DETECTION = {"heartbeat_timeout_s": 12.0, "suspect_after_s": 1.5, "blocked_after_s": 0.5}
TMD_ARGS = tuple(a for name, value in DETECTION.items() for a in ("--" + name.replace("_", "-"), str(value)))


def rank0_step(run_dir: str) -> int:
    """The last step rank 0 logged (it prints every 5 steps to its log file), -1 before the first."""
    path = os.path.join(run_dir, "logs", "n1.0.log")
    if not os.path.exists(path):
        return -1
    with open(path, errors="replace") as f:
        steps = re.findall(r"^step\s+(\d+)/", f.read(), re.MULTILINE)
    return int(steps[-1]) if steps else -1


def since_restart(run_dir: str) -> list[dict]:
    """The journal's entries from the last ``tmd_restarted`` on (all of them before a restart)."""
    journal = events(run_dir)
    starts = [i for i, ev in enumerate(journal) if ev["event"] == "tmd_restarted"]
    return journal[starts[-1] if starts else 0:]


def test_sigkilled_tmd_is_resumed_and_the_job_migrates_again(tmp_path, gpt_reference):
    # the uninterrupted run, before the job (alone: a busy machine slows heartbeats)
    reference = gpt_reference(STEPS)
    run_dir = str(tmp_path / "job")
    tmd = start_tmd(tmd_command(run_dir, 1, STEPS, True, True, ARGS + pace_args(run_dir), TMD_ARGS), tmd_log(run_dir))
    resumed = None
    workers: list[psutil.Process] = []
    try:
        client = job_client(run_dir, tmd)
        status = lambda: client.request(p.StatusRequest())  # noqa: E731
        job = status().job
        wait_until(lambda: status().step > 5 and any(n["warm"] for n in status().nodes), 120,
                   "training and a warm s1")
        workers = [c for c in psutil.Process(tmd.pid).children() if c.name() != SERVER_NAME]
        assert len(workers) == 6
        page, _ = web_of(run_dir)
        config = status().config
        assert config["detection"] == DETECTION
        steps_before = wait_until(lambda: scrape(run_dir).get(("trainmover_steps_total", (("job", job),))), 30,
                                  "steps counted")

        os.kill(tmd.pid, signal.SIGKILL)
        assert tmd.wait(timeout=10) == -signal.SIGKILL
        killed = time.time()
        # Training goes on without tmd: rank 0 keeps logging steps, every process is still there.
        at_kill = rank0_step(run_dir)
        # A rogue coordinator binds tmd's address while tmd is down (plain, then CURVE with a key of its own):
        # the workers pin the job's tmd key, so no handshake completes and the rogue hears nothing.
        for curve in (False, True):
            ctx = zmq.Context()  # its own: term() returns once the port is released
            rogue = ctx.socket(zmq.ROUTER)
            rogue.setsockopt(zmq.LINGER, 0)
            if curve:
                rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
                rogue.curve_server = True
            rogue.bind(client.address)
            assert rogue.poll(1500) == 0, "a worker talked to a rogue coordinator"
            rogue.close()
            ctx.term()
        wait_until(lambda: rank0_step(run_dir) >= at_kill + 20, 30, "training to go on without tmd")
        assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)

        launched = time.time()
        resumed = subprocess.Popen([sys.executable, "-m", "tmd.cli", "resume", "--run-dir", run_dir, "--quiet"],
                                   stdout=subprocess.DEVNULL)

        def relearned():
            try:
                st = status()
            except CoordinatorUnreachable:  # still starting (it replays the journal, imports torch): ask again
                return None
            nodes = {n["name"]: n for n in st.nodes}
            ok = all(nodes[n]["processes"] == 2 and nodes[n]["role"] == "active" for n in ("n1", "n2"))
            return st if ok and nodes["s1"]["warm"] and sorted(r for n in ("n1", "n2") for r in nodes[n]["ranks"]) \
                == [0, 1, 2, 3] else None

        try:
            wait_until(lambda: resumed.poll() is None and relearned(), 60, "the restarted tmd to re-learn the job")
        except AssertionError as e:  # say who did not come back
            raise AssertionError(f"{e}; journal since the restart: " + "; ".join(
                f"{ev['event']} {ev.get('worker') or ev.get('node', '')}/{ev.get('local_rank', '')} "
                f"{ev.get('reason', '')}" for ev in since_restart(run_dir) if ev["event"] != "step_times")) from None
        r = subprocess.run([sys.executable, "-m", "tmctl.cli", "status", "--json", "--run-dir", run_dir],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert {n["name"]: n["ranks"] for n in st["nodes"]} == {"n1": [0, 1], "n2": [2, 3], "s1": []}
        assert st["step"] > at_kill
        # the job's settings, restored from the journal; the detection section is the resumed detector's own
        assert st["config"] == config
        # the page and metrics are back at the same address, with the counters gone on from the journal
        assert web_of(run_dir)[0] == page == st["page"]
        assert scrape(run_dir)[("trainmover_steps_total", (("job", job),))] >= steps_before

        r = subprocess.run([sys.executable, "-m", "tmctl.cli", "migrate", "--from", "n2", "--to", "s1", "--json",
                            "--timeout-s", "90", "--run-dir", run_dir], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        m = json.loads(r.stdout.strip().splitlines()[-1])
        assert m["state"] == "committed" and m["id"] == 1 and m["generation"] == 1
        assert m["bytes_moved"] > 10_000
        end_padding(run_dir)  # the steps left at their own speed

        assert resumed.wait(timeout=120) == 0  # every rank finished: the resumed tmd ends the job
    finally:
        for proc in (tmd, resumed):
            if proc is not None:
                end_job(proc)
        for w in workers:  # orphans of the killed tmd, if the resumed one did not end them
            if w.is_running():
                w.kill()

    assert final_hashes(run_dir) == reference
    ev = events(run_dir)
    seqs = [e["seq"] for e in ev]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "the journal's seq goes on across the restart"
    names = [e["event"] for e in ev]
    assert names.count("tmd_started") == 1 and names.count("tmd_restarted") == 1
    restart = next(e for e in ev if e["event"] == "tmd_restarted")
    relearn = next(e for e in ev if e["event"] == "job_relearned")
    assert names.count("worker_rejoined") == 6 and "rejoin_refused" not in names
    journalled = [e for e in ev if e["event"] == "job_config"]  # at the start, then at the restart: no override
    assert [e["config"] for e in journalled] == [config, config] and journalled[1]["overrides"] == {}
    assert names.count("migration_committed") == 1 and names[-1] == "tmd_stopped"
    assert restart["address"] == next(e for e in ev if e["event"] == "tmd_started")["address"]
    n2_exits = [e for e in ev if e["event"] == "process_exit" and e["node"] == "n2"]
    assert len(n2_exits) == 2 and all(e["expected"] for e in n2_exits)
    # adopted by the restarted tmd: their exit code is unknown (None, not a made-up -1), and they had reported done
    assert all(e["returncode"] is None and e["exit_code_known"] is False and e["reported_done"] for e in n2_exits)
    print(f"\n[restart] killed -> tmd resume launched (training checked): {launched - killed:.2f} s; "
          f"launched -> restarted tmd up (journalled): {restart['ts'] - launched:.2f} s; "
          f"up -> all ranks re-learned: {relearn['after_s']:.3f} s; training went on meanwhile: step {at_kill} at the "
          f"kill, {relearn['step']} re-learned; migration after the restart: {m['phases_s']}")


# --- the journal replay alone ------------------------------------------------------------------------------------
def _write_job(tmp_path, *evs: dict, pid: int = 999_999_999) -> str:
    (tmp_path / "tmd.json").write_text(json.dumps({"address": "tcp://127.0.0.1:5555", "pid": pid, "job": "j",
                                                   "run_dir": str(tmp_path), "command": ["train"]}))
    start = {"event": "tmd_started", "job": "j", "world_size": 4, "nodes": ["n1", "n2"], "standbys": ["s1", "s2"],
             "store_port": 1, "record_steps": 3}
    with open(tmp_path / "events.jsonl", "w") as f:
        for i, e in enumerate([start, *evs]):
            f.write(json.dumps({"seq": i + 1, "ts": 1000.0 + i, **e}) + "\n")
        f.write('{"seq": 99, "ts": 1')  # a line cut short by the kill
    return str(tmp_path)


def test_replay_after_migrations_and_a_recovery(tmp_path):
    run_dir = _write_job(
        tmp_path,
        {"event": "migration_requested", "migration_id": 1, "source": "n2", "target": "s1", "generation": 1},
        {"event": "migration_transferred", "migration_id": 1, "source": "n2", "target": "s1"},
        {"event": "migration_committed", "migration_id": 1, "source": "n2", "target": "s1"},
        {"event": "node_failed", "node": "n1", "ranks": [0, 1]},
        {"event": "recovery_started", "incident_id": 1, "adopted": {}},
        {"event": "standby_promoted", "incident_id": 1, "failed_node": "n1", "standby": "s2", "ranks": [0, 1]},
        {"event": "recovery_plan", "incident_id": 1, "generation": 2, "resume_step": 50, "sends": []},
        {"event": "recovery_done", "incident_id": 1, "standbys": {"n1": "s2"}},
        {"event": "standby_added", "node": "s3"},
    )
    st = load(run_dir)
    assert st.roles == {"n1": ("failed", []), "n2": ("left", []), "s1": ("active", [2, 3]), "s2": ("active", [0, 1]),
                        "s3": ("standby", [])}
    assert (st.generation, st.last_migration_id, st.last_seq, st.config.replay.record_steps) == (2, 1, 10, 3)
    assert st.ranks_per_node == 2 and st.command == ["train"] and st.cut_migration is None


def test_replay_of_a_migration_cut_by_the_crash(tmp_path):
    requested = {"event": "migration_requested", "migration_id": 4, "source": "n1", "target": "s2"}  # no generation
    st = load(_write_job(tmp_path, requested))
    assert st.roles["s2"] == ("standby", []) and st.roles["n1"] == ("active", [0, 1])
    assert st.cut_migration == {"id": 4, "sources": ["n1"], "targets": ["s2"], "commit": False}
    assert st.generation == 1  # counted: every migration takes a generation
    # once every joiner had its state the decision was to commit: the restart completes it
    st = load(_write_job(tmp_path, requested, {"event": "migration_transferred", "migration_id": 4}))
    assert st.cut_migration["commit"] and st.roles["s2"] == ("active", [0, 1]) and st.roles["n1"] == ("left", [])


def test_nothing_to_resume(tmp_path):
    with pytest.raises(ResumeError, match="no job to resume"):
        load(str(tmp_path))
    with pytest.raises(ResumeError, match="stopped with exit code 0"):
        load(_write_job(tmp_path, {"event": "job_finished"}, {"event": "tmd_stopped", "exit_code": 0}))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "tmd"])  # stands in for tmd
    try:
        # Popen returns once execve closed the child's close-on-exec pipe, which the kernel does before it sets
        # the new image's arguments: /proc/<pid>/cmdline can read empty for a moment after (seen once in CI)
        wait_until(lambda: "tmd" in psutil.Process(alive.pid).cmdline(), 10, "the stand-in tmd's command line")
        with pytest.raises(ResumeError, match=f"still runs \\(pid {alive.pid}\\)"):
            load(_write_job(tmp_path, pid=alive.pid))
    finally:
        alive.kill()
        alive.wait()


# --- a restarted daemon in process (no worker processes, no sockets to workers) ---------------------------------
def test_restarted_daemon_relearns_from_rejoins(tmp_path):
    from tmd.daemon import Daemon

    (tmp_path / "tmd.json").write_text(json.dumps({"address": "tcp://127.0.0.1:1", "pid": 999_999_999, "job": "j"}))
    start = {"event": "tmd_started", "job": "j", "world_size": 2, "nodes": ["n1", "n2"], "standbys": ["s1"],
             "record_steps": 2}
    cut = {"event": "migration_requested", "migration_id": 3, "source": "n2", "target": "s1", "generation": 2}
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({"seq": i + 1, "ts": 1.0, **e}) + "\n"
                                                   for i, e in enumerate([start, cut])))
    st = load(str(tmp_path))
    JobKeys.create(str(tmp_path / "keys"))  # a resumed tmd reuses the job's keys: its workers pinned its public key
    d = Daemon(st.job, str(tmp_path), st.nodes, st.ranks_per_node, st.standbys, st.config, echo=False, resume=st)
    sent: list[tuple[bytes, p.Message]] = []
    d.reply = lambda identity, msg: sent.append((identity, msg))  # observe, no sockets
    try:
        d.on_frames([b"n1/0/a", p.encode(p.Heartbeat(step=40, counters={}))])
        d.on_frames([b"n1/0/a", p.encode(p.Heartbeat(step=40, counters={}))])  # asked again only after a second
        assert sent == [(b"n1/0/a", p.Reregister(store_host="127.0.0.1", store_port=d.store.port, generation=2))]
        d.on_frames([b"s1/0/b", p.encode(p.Rejoin(node="s1", local_rank=0, pid=11, host="h", rank=1, role="joiner", step=2, generation=3))])
        assert sent[-1] == (b"s1/0/b", p.Release(reason="joiner of a migration tmd's restart aborted, or a guard", exit_code=0))
        d.on_frames([b"n1/0/a", p.encode(p.Rejoin(node="n1", local_rank=0, pid=12, host="h", rank=0, role="active", step=41, generation=0))])
        assert sent[-1] == (b"n1/0/a", p.Decide(migration_id=3, commit=False, reason="tmd restarted during the migration"))
        assert not d.registry.all_ranks_assigned()
        d.on_frames([b"n2/0/c", p.encode(p.Rejoin(node="n2", local_rank=0, pid=13, host="h", rank=1, role="active", step=42, generation=0))])
        assert d.registry.all_ranks_assigned() and d.registry.current_step() == 42
        assert d.registry.generations.current == 2 and d.migrations.first_id == 4
        names = [e["event"] for e in d.journal.since(0, 100)]
        assert names[:2] == ["tmd_restarted", "migration_aborted"] and d.journal.since(0, 1)[0]["seq"] == 3
        assert names.count("worker_rejoined") == 2 and names[-1] == "job_relearned" and "rejoin_refused" in names
    finally:
        d.close()
