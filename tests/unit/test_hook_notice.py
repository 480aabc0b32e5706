"""The SLURM epilog's notice to tmd (slurm/hooks.py TmdNotice) against a stand-in tmd: resent until tmd
acknowledges it (a copy lost with a crashing tmd, or to a slow handshake, is not the end of it), and bounded by the
deadline it is given when no acknowledgement comes."""
from __future__ import annotations

import importlib.util
import json
import os
import threading
import time

import pytest

from tests.support import stand_in_tmd
from tmd import protocol as p

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("tm_slurm_hooks", os.path.join(REPO, "slurm", "hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def job(tmp_path, keys):
    """A state dir whose job 7 names a tmd with ``keys`` (its tmd.json, written once the stand-in's address is
    known)."""
    state = tmp_path / "state"
    (state / "jobs" / "7").mkdir(parents=True)

    def link(address: str) -> None:
        (state / "jobs" / "7" / "tmd.json").write_text(json.dumps({"address": address, "keys": keys.path}))
    return str(state), keys, link


def notify(hooks, job, drop_first: int, wait_s: float):
    """Send job 7's notice from n2 to a stand-in tmd that acknowledges each copy after the first ``drop_first``
    (as a tmd that crashed with them unread) and wait ``wait_s`` at most. Returns (the TmdNotice, the notices
    the stand-in got, its address, the seconds waited)."""
    state, keys, link = job
    got: list = []
    with stand_in_tmd(keys) as (sock, address):
        link(address)

        def tmd() -> None:
            while sock.poll(1000):  # until the hook stops sending
                identity, frame = sock.recv_multipart()
                msg = p.decode(frame)
                got.append(msg)
                if len(got) > drop_first:
                    sock.send_multipart([identity, p.encode(p.NodeNoticeAck(node=msg.node, job_id=msg.job_id,
                                                                            hook=msg.hook))])
                    return
        t = threading.Thread(target=tmd, daemon=True)
        t.start()
        notice = hooks.TmdNotice(state, "7", "n2", "node left the job")
        t0 = time.monotonic()
        try:
            notice.send()
            notice.wait_ack(t0 + wait_s)
        finally:
            notice.close()
        waited = time.monotonic() - t0
        t.join(5)
    return notice, got, address, waited


def test_a_notice_tmd_dropped_is_resent_until_acknowledged(hooks, job):
    notice, got, address, _ = notify(hooks, job, drop_first=1, wait_s=5)
    assert len(got) == 2 and got[0] == got[1] == p.NodeNotice(node="n2", job_id="7", hook=p.HookKind.EPILOG,
                                                               detail="node left the job")
    assert notice.outcome.startswith(f"notice acknowledged by {address} in ") and "(2 sent)" in notice.outcome


def test_without_an_acknowledgement_the_wait_ends_at_its_deadline(hooks, job):
    notice, got, address, waited = notify(hooks, job, drop_first=100, wait_s=0.5)
    assert 0.5 <= waited < 1.5, waited
    assert notice.outcome.startswith(f"notice sent to {address} ") and "not acknowledged" in notice.outcome
    assert len(got) >= 2, "resent while waiting"


def test_no_tmd_json_means_no_notice_and_no_wait(hooks, tmp_path):
    notice = hooks.TmdNotice(str(tmp_path), "7", "n2", "x")
    t0 = time.monotonic()
    notice.send()
    notice.wait_ack(t0 + 5)
    notice.close()
    assert notice.outcome == "no tmd for this job" and time.monotonic() - t0 < 1


@pytest.mark.parametrize("budget_s, ran_out", [(0.2, True), (5.0, False)])
def test_the_budget_bounds_the_whole_hook(hooks, tmp_path, monkeypatch, budget_s, ran_out):
    """``--budget-s``: a prolog whose checks outlast it reports that it ran out of its budget (and passes: a slow
    hook never drains a node); one within it runs every check. A fresh hook process's age stands in for pytest's."""
    def slow_memory_check(min_free_mb: float):
        time.sleep(0.5)  # a check that takes longer than the small budget: what the budget is for
        return {"mem_available_mb": 1.0e6}, []

    monkeypatch.setattr(hooks, "_process_age_s", lambda: 0.0)
    monkeypatch.setattr(hooks, "check_memory", slow_memory_check)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    log = tmp_path / "hooks.jsonl"
    code = hooks.main(["prolog", "--budget-s", str(budget_s), "--log", str(log)])
    report = json.loads(log.read_text().splitlines()[-1])
    assert code == 0
    if ran_out:
        assert report["error"] == f"hook ran out of its {budget_s:g} s budget" and "disk" not in str(report["checks"])
    else:
        assert "error" not in report and "mem_available_mb" in report["checks"], report
