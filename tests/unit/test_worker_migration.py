"""worker.migration: a joiner's shadow iterations, their one-iteration shortcut and the extra ones a failure's
replacement runs past its limit while the recording says its next step would issue collectives of its own."""
from __future__ import annotations

from tmd import protocol as p
from worker.control import Control
from worker.migration import Migration
from worker.reports import Reporter


class _Groups:
    groups: dict = {}


def _migration():
    control = Control()
    control.start(p.Assign(role=p.WorkerRole.JOINER, rank=1, world_size=2, store_host="h", store_port=1,
                           generation=0, record_steps=3, record_dir="/r", migration_id=0, incident_id=1))
    control.attach(_Groups())
    sent = []
    return Migration(control, Reporter(sent.append, lambda: control.rank), {}, lambda: None), sent


def test_a_replacement_runs_another_shadow_iteration_while_the_recording_asks_up_to_its_limit():
    m, _ = _migration()
    asked = []

    def another(done):
        asked.append(done)
        return True  # e.g. DDP(static_graph=True): the job's step 2 regrouped its buckets

    assert list(m.shadow(2, report_warmed=False, pretouch=False, another=another, limit=3)) == [0, 1, 2]
    assert asked == [2] and m.shadow_steps == 3  # not asked again at the limit
    m, _ = _migration()
    assert list(m.shadow(2, report_warmed=False, pretouch=False, another=lambda d: False, limit=3)) == [0, 1]
    assert m.shadow_steps == 2


def test_the_one_iteration_shortcut_ends_the_shadow_iterations_before_any_extra_one():
    m, _ = _migration()
    steps = list(m.shadow(2, report_warmed=False, pretouch=False, enough_after_one=lambda: True,
                          another=lambda d: True, limit=3))
    assert steps == [0] and m.shadow_steps == 1
