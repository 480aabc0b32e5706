"""Straggler detection: the detector on synthetic counters (a real job: tests/e2e/test_user_errors.py, the job
that never manages its model)."""
import pytest

from tmd.health import StragglerDetector


def feed(det, t0, seconds, share, ranks=range(4), step=0.5):
    """Heartbeats every ``step`` s for ``seconds``; ``share[rank]``: fraction of time in collectives."""
    t = t0
    flagged, cleared = [], []
    busy = feed.busy
    while t < t0 + seconds:
        t += step
        for r in ranks:
            busy[r] = busy.get(r, 0.0) + share[r] * step
            det.observe(r, t, busy[r])
        new, gone = det.evaluate(t)
        flagged += new
        cleared += gone
    return t, flagged, cleared


@pytest.mark.timeout(10)
def test_late_rank_is_flagged_after_patience_and_cleared_after_recovery():
    feed.busy = {}
    det = StragglerDetector(window_s=2, lateness_threshold=0.2, patience=3)
    t, flagged, _ = feed(det, 0, 10, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
    assert flagged == [] and not det.flagged  # balanced ranks: nobody
    t, flagged, _ = feed(det, t, 10, {0: 0.6, 1: 0.6, 2: 0.6, 3: 0.05})  # rank 3 late: its peers wait
    assert flagged == [3] and set(det.flagged) == {3} and det.lateness[3] > 0.4
    t, flagged, cleared = feed(det, t, 12, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
    assert cleared == [3] and not det.flagged


@pytest.mark.timeout(10)
def test_one_slow_step_and_two_rank_jobs_are_not_stragglers():
    feed.busy = {}
    det = StragglerDetector(window_s=2, lateness_threshold=0.2, patience=3)
    t, _, _ = feed(det, 0, 6, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
    t, flagged, _ = feed(det, t, 1.5, {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.0})  # one long step on rank 3
    t, flagged2, _ = feed(det, t, 8, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
    assert flagged == flagged2 == [] and not det.flagged
    feed.busy = {}
    two = StragglerDetector(window_s=2, patience=1)
    _, flagged, _ = feed(two, 0, 10, {0: 0.9, 1: 0.0}, ranks=range(2))
    assert flagged == []


@pytest.mark.timeout(10)
def test_reset_starts_every_window_over():
    feed.busy = {}
    det = StragglerDetector(window_s=2, lateness_threshold=0.2, patience=3)
    t, _, _ = feed(det, 0, 4, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
    t, flagged, _ = feed(det, t, 4, {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.0})  # late windows, not yet flagged
    assert flagged == []
    det.reset(t)  # an incident started: the late windows so far count for nothing
    t, flagged, _ = feed(det, t, 4, {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.0})
    assert flagged == []
    t, flagged, _ = feed(det, t, 4, {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.0})  # without a reset: flagged in time
    assert flagged == [3]


@pytest.mark.timeout(10)
def test_evacuation_judges_nobody_during_an_incident_and_starts_over_after_it():
    from types import SimpleNamespace

    from tmd.evacuation import Evacuation
    from tmd.journal import Journal
    from tmd.registry import Registry

    control = SimpleNamespace(registry=Registry(["n1", "n2"], 2, []), journal=Journal(None), current_incident=None)
    det = StragglerDetector(window_s=2, lateness_threshold=0.2, patience=3)
    ev = Evacuation(control, stragglers=det)
    feed.busy = {}
    t = 0.0
    for phase, incident in ((6, "incident"), (5, None)):  # halted survivors wait on the lost ranks; then resumed
        control.current_incident = incident
        end = t + phase
        while t < end:
            t += 0.5
            for r, share in {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.0}.items():
                feed.busy[r] = feed.busy.get(r, 0.0) + share * 0.5
                det.observe(r, t, feed.busy[r])
            ev.tick(t)
    assert not det.flagged  # 6 s halted + 5 s after: without the resets rank 3 would be flagged


@pytest.mark.timeout(10)
def test_a_rank_moved_to_another_process_leaves_its_straggler_flag_and_gpu_verdict_behind():
    """Rank 3 is a straggler on n2 and its GPU reports a critical XID; a migration moves n2's ranks to s1. The
    flag and the verdict were about n2's process and GPU: s1 must not be taken for a suspect (it would take a
    healthy node's guard) or for a bad GPU (it would be evacuated again)."""
    from types import SimpleNamespace

    from tmd.evacuation import Evacuation
    from tmd.journal import Journal
    from tmd.protocol.vocab import Event
    from tmd.registry import Registry, Worker

    reg = Registry(["n1", "n2"], 2, ["s1"])
    control = SimpleNamespace(registry=reg, journal=Journal(None), current_incident=None)
    ev = Evacuation(control, stragglers=StragglerDetector(window_s=2, lateness_threshold=0.2, patience=3))
    ev.evacuate = lambda node, reason, quiet=False: True  # no migration machinery here
    for node in ("n1", "n2", "s1"):
        for local in (0, 1):
            reg.add_worker(Worker(f"{node}/{local}".encode(), node, local, 1, "h"))
    t, busy = 0.0, {}
    while t < 10:
        t += 0.5
        for rank, share in {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.0}.items():
            busy[rank] = busy.get(rank, 0.0) + share * 0.5
            gpu = {"uuid": "GPU-n2-1", "index": 1, "xids": [79]} if rank == 3 else {}
            ev.observe(reg.rank_owner[rank], {"busy_s": busy[rank], "gpu": gpu}, t)
        ev.tick(t)
    n2 = reg.nodes["n2"]
    assert ev.flagged(n2) == [3] and ev.gpu_unhealthy(n2)
    s1 = reg.nodes["s1"]  # the commit: s1's processes hold ranks 2, 3 (tmd.registry.hand_over's effect)
    for local, rank in ((0, 2), (1, 3)):
        w = s1.workers[local]
        w.rank, reg.rank_owner[rank] = rank, w
    s1.ranks, n2.ranks = [2, 3], []
    ev.observe(s1.workers[1], {"busy_s": 0.0, "gpu": {"uuid": "GPU-s1-1", "index": 1, "xids": []}}, t + 0.5)
    assert ev.flagged(s1) == [] and not ev.gpu_unhealthy(s1)
    (cleared,) = [e for e in control.journal.since(0, 100) if e["event"] == Event.STRAGGLER_CLEARED]
    assert cleared["rank"] == 3 and cleared["node"] == "s1" and "moved" in cleared["reason"]
