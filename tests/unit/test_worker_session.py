"""worker.session.dump_stacks_on: SIGUSR1 writes every thread's stack and the rank goes on (in a subprocess)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_signal_writes_every_threads_stack_and_a_scripts_own_handler_is_left_alone():
    code = ("import os, signal, threading\n"
            "from worker.session import dump_stacks_on\n"
            "stop = threading.Event()\n"
            "threading.Thread(target=stop.wait, name='waiter').start()\n"
            "assert dump_stacks_on(signal.SIGUSR1)\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "stop.set()\n"
            "signal.signal(signal.SIGUSR2, lambda *a: print('own handler ran'))\n"
            "installed = dump_stacks_on(signal.SIGUSR2)\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\n"
            "print('went on', installed)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["own handler ran", "went on False"]
    assert "Current thread" in r.stderr and r.stderr.count("Thread 0x") >= 1  # the main thread and the waiter
    assert "in wait" in r.stderr  # the waiter's frame


# --- an exception that ends the process -------------------------------------------------------------------------
class _Latched:
    """Groups whose movers latched a failed collective (a peer died during this step)."""

    def failure(self):
        return "a collective failed: n2/0 is gone"


def _ended_by(exc_factory, monkeypatch):
    """Rank 0 at step 7 with a failure latched, its excepthooks installed over a recording previous hook; ``exc``
    (made by ``exc_factory``, raised and caught for its traceback) handed to ``sys.excepthook`` as Python does for
    an exception that ends the process. Returns (the RankFailed reports sent, what the previous hook got)."""
    import threading

    from tests.unit.rank_rooms import make
    from tmd import protocol as p

    rec = make(rank=0, groups=_Latched())
    rec.control.set_step(7)
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: printed.append(exc))
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    rec.session._install_excepthooks()
    try:
        raise exc_factory(rec)
    except BaseException as e:  # noqa: BLE001
        sys.excepthook(type(e), e, e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)  # reported once per process
    return [m for m in rec.sent if isinstance(m, p.RankFailed)], printed


def test_an_uncaught_step_aborted_is_reported_as_such_with_what_to_do(monkeypatch):
    from tmd.protocol.vocab import FailureKind

    def refused(rec):  # what a managed optimizer's step() raises once the collective failure is latched
        try:
            rec.ledger.refuse()
        except Exception as e:  # noqa: BLE001
            return e
        raise AssertionError("the step was not refused")

    reports, printed = _ended_by(refused, monkeypatch)
    assert len(printed) == 2 and type(printed[0]).__name__ == "StepAborted"  # still printed by Python's hook
    (msg,) = reports
    assert (msg.rank, msg.step, msg.kind) == (0, 7, FailureKind.STEP_ABORTED_UNCAUGHT)
    assert msg.error.startswith("rank 0 step 7: update refused, a collective failed: n2/0 is gone. In a "
                                "session.steps() loop, catch worker.StepAborted and continue")
    assert "session.run" in msg.error and "StepAborted" in msg.traceback


def test_another_exception_that_ends_the_process_while_a_peer_failure_is_latched_is_reported_with_what_to_do(
        monkeypatch):
    """(outside review r01) A script in the plain loop died of an EOFError while a failure was latched and nothing
    was reported: tmd said only that every surviving rank exited. Now RankFailed names the exception."""
    from tmd.protocol.vocab import FailureKind

    reports, printed = _ended_by(lambda rec: EOFError("Ran out of input"), monkeypatch)
    assert len(printed) == 2 and type(printed[0]) is EOFError  # still printed by Python's hook
    (msg,) = reports  # once
    assert (msg.rank, msg.step, msg.kind) == (0, 7, FailureKind.SCRIPT_ERROR)
    assert msg.error.startswith("EOFError: Ran out of input (raised while a peer's failure was latched: a collective "
                                "failed: n2/0 is gone; this rank is lost with it). Use session.run(step_fn, total)")
    assert "EOFError" in msg.traceback


def test_an_exception_that_ends_a_thread_while_a_peer_failure_is_latched_is_not_reported(monkeypatch):
    """A thread's end is not the rank's: the process may still recover."""
    import threading

    from tests.unit.rank_rooms import make

    rec = make(rank=0, groups=_Latched())
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: None)
    rec.session._install_excepthooks()
    t = threading.Thread(target=lambda: (_ for _ in ()).throw(RuntimeError("gloo: connection closed")))
    t.start()
    t.join()
    assert rec.sent == []


def test_a_zero_redundancy_optimizer_is_refused_with_what_to_manage_instead():
    """Its state_dict() needs a collective (consolidate_state_dict): managed, every step would fail at once."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tests.unit.rank_rooms import make

    rec = make(rank=0)
    zero = object.__new__(ZeroRedundancyOptimizer)  # (building one needs a process group; the type is what counts)
    with pytest.raises(TypeError, match=r"is a ZeroRedundancyOptimizer.*session.manage\(optimizer=optimizer.optim\)"):
        rec.session.manage(optimizer=zero)
    assert "optimizer" not in rec.session.objects and rec.ledger.optimizers == []


def test_a_group_created_after_the_recorded_steps_is_reported_naming_it_and_the_step(tmp_path):
    """(outside review m01) A group created at step 8 was refused only in a joiner's sandbox that reached step 8: a
    migration whose joiners did not committed, then the stayers' collective on it failed. An active rank reports it
    as RankWarning(late_group), which refuses migrations and recoveries (tmd.faults)."""
    import threading

    from tests.unit.rank_rooms import make
    from tmd import protocol as p

    rec = make(rank=0)
    s = rec.session
    s._assign = p.Assign(role=p.WorkerRole.ACTIVE, rank=0, world_size=4, store_host="h", store_port=1, generation=0,
                         record_steps=3, record_dir=str(tmp_path), migration_id=0, incident_id=0)
    rec.control.set_step(2)
    s._group_created("pg2", [0, 1])  # still recording: a joiner replays it
    rec.control.set_step(8)
    s._record_writer = threading.Thread()  # the recording of the first 3 steps was written
    s._group_created("pg3", [0, 1, 2, 3])
    warnings = [m for m in rec.sent if isinstance(m, p.RankWarning)]
    assert [(w.rank, w.code) for w in warnings] == [(0, p.WarningCode.LATE_GROUP)]
    assert warnings[0].message.startswith("process group pg3 (ranks [0, 1, 2, 3]) was created at step 8, after the "
                                          "job recorded its first 3 steps")
    # a job relaunched with the recording of its first run kept: a group that run recorded is no late one
    s._record_writer, s._recording_kept = None, True
    open(p.layout.recording_path(str(tmp_path), 0, "pg2"), "w").close()
    s._group_created("pg2", [0, 1])
    assert len([m for m in rec.sent if isinstance(m, p.RankWarning)]) == 1
    s._group_created("pg4", [0, 1])
    assert len([m for m in rec.sent if isinstance(m, p.RankWarning)]) == 2


def test_a_step_without_an_update_is_committed_at_its_end_with_every_rank_s_state(monkeypatch):
    """A step whose optimizer.step() is skipped (a GradScaler's overflow, a skipped batch) still counts as committed
    in the loop. Its exchange ran nowhere (only in an optimizer's pre-hook), so a recovery resuming after it found
    no copy of the lost rank's state and the receiver silently took its sender's RNG (outside review). The step's
    end runs the exchange and commits the step; a step with its update issues no extra exchange."""
    import torch

    from tests.unit.rank_rooms import loader_steps, with_loader
    from worker import rank_state
    from worker.step_exchange import unpack

    rec, model, opt, loader = with_loader(monkeypatch)
    gathered = []
    monkeypatch.setattr(rank_state, "all_gather_bytes", lambda data, _g=rank_state.all_gather_bytes: (
        gathered.append(rec.control.step), _g(data))[1])
    loader_steps(rec, model, opt, loader, 2)
    rec.session._close_step()  # step 1 committed by its update: nothing more
    assert gathered == [0, 1] and rec.ledger.committed_step == 1
    rec.control.set_step(2)
    rec.begin_step()
    model(loader.batch(2)).sum().backward()
    opt.zero_grad()  # no update in step 2
    drawn = torch.get_rng_state()
    rec.session._close_step()
    assert gathered == [0, 1, 2] and rec.ledger.committed_step == 2 and rec.ledger.committed(2)
    own = rank_state.deserialize(rec.exchange.own_state(0, 2))
    assert own["local"]["data"]["served"] == 3 and torch.equal(own["cpu_rng"], drawn)
    assert unpack(rec.exchange.kept[1][2])[2] == b""  # the peers' parts of step 2 are kept too (stub: empty)
    rec.session._close_step()  # once per step
    assert gathered == [0, 1, 2]
