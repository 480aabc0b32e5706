"""The recovery executor on its own (worker.recovery): a survivor's rollback to its own snapshot, the redone step
drawn from where the interrupted attempt began, a refused plan, and a replacement's plan carried out during its
shadow iterations. No processes: the groups and the state transfers are stubs (tests.unit.rank_rooms)."""
import threading
import time

import pytest
import torch

from tmd import protocol as p
from worker import rank_state
from worker.step_exchange import NO_FINGERPRINT
from tests.unit.rank_rooms import Groups, World, blob, fsdp_rank, loader_steps, make, one_step, with_loader

pytestmark = pytest.mark.timeout(10)


# --- rolling back -------------------------------------------------------------------------------------------------
def test_a_survivor_rolls_back_to_its_own_snapshot(monkeypatch):
    rec, model, opt, sched = fsdp_rank(monkeypatch, 2)
    World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    for step in range(2):
        one_step(rec, model, opt, sched, step)
    rec.begin_step()
    rec.exchange.snapshots.kept[1] = rec.exchange.snapshots.own[1]  # the buddy's copy arrived
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = rank_state.deserialize(rec.exchange.snapshots.own[1].rank_state)["cpu_rng"]
    for step in range(2, 4):
        one_step(rec, model, opt, sched, step)
    torch.rand(7)  # the RNG moved on too
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=2, sends=[], rollback_step=1))
    assert rec.recovery._carry_out(rec.control.plan, 3, torch.get_rng_state()) == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(torch.get_rng_state(), rng) and rec.ledger.committed_step == 1
    assert rec.exchange.kept is None and rec.exchange.snapshots.want and rec.exchange.verify_next
    assert rec.sent[-1].phase == p.RecoveryPhase.RECOVERED and rec.sent[-1].committed_step == 1
    # what was loaded is a copy: training on does not change the snapshot
    one_step(rec, model, opt, sched, 2)
    assert all(torch.equal(rec.exchange.snapshots.own[1].states["model"][k], v) for k, v in weights.items())


@pytest.mark.parametrize("done", [False, True])
def test_a_survivor_draws_the_redone_step_from_where_the_interrupted_attempt_began(monkeypatch, done):
    """The interrupted step's batches moved the rank-local loader; a survivor that did not commit that step loads
    the loader's state as the attempt began before the plan is carried out, so the redone step serves the same
    position once. A survivor that committed the step anyway keeps the state it stands at."""
    rec, model, opt, loader = with_loader(monkeypatch)
    loader_steps(rec, model, opt, loader, 2)
    at_begin = (loader.served, loader.cursor.clone())
    rec.control.set_step(2)
    rec.begin_step()
    model(loader.batch(2)).sum().backward()  # the interrupted attempt drew its batch
    after = (loader.served, loader.cursor.clone())
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=3 if done else 2, sends=[]))
    assert rec.recovery.recover(2, done) == (3 if done else 2)
    expected = after if done else at_begin
    assert loader.served == expected[0] and torch.equal(loader.cursor, expected[1])
    if not done:  # the redone step draws once, from the attempt's start, and the kept copy is not aliased
        rec.begin_step()
        loader.batch(2)
        assert loader.served == after[0] and torch.equal(loader.cursor, after[1])
        assert rec.ledger.local_copies["data"]["served"] == at_begin[0]


def test_a_rollback_to_a_snapshot_not_held_is_refused():
    rec = make(rank=0, every=2)
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=5, sends=[], rollback_step=4))
    with pytest.raises(RuntimeError, match="holds no complete snapshot of it"):
        rec.recovery._carry_out(rec.control.plan, 7, None)


# --- a replacement's plan carried out during its shadow iterations (Recovery.prefetch) ------------------------------
class JoinerGroups(Groups):
    """Groups of a joiner: the mode and tolerance it takes when it becomes active, and every build counted."""

    def __init__(self):
        super().__init__()
        self.built = []
        self.modes = []

    def build_all(self, generation, store):
        self.built.append(generation)
        return {"world": f"gen{generation}"}

    def set_mode(self, mode):
        self.modes.append(mode)

    def set_tolerant(self):
        pass


def replacement(monkeypatch, rank=2, own=True):
    """A joiner replacing lost rank ``rank`` of incident 1, managing a small model; its state transfers are
    stubs that hand over a source model's state and (if ``own``) this rank's own rank state (and count the
    receptions)."""
    from worker import recovery as wr

    rec = make(rank=rank, role=p.WorkerRole.JOINER, incident_id=1, groups=JoinerGroups())
    model = torch.nn.Linear(3, 2)
    rec.manage({"model": model}, rank_local=False)
    source = torch.nn.Linear(3, 2)
    received = []

    def recv_state(pg, src):
        received.append(pg)
        return {"model": {k: v.clone() for k, v in source.state_dict().items()}}, \
            {"step": 8, "rank_state": rank_state.serialize({})} if own else \
            {"step": 8, "rng": torch.Generator().manual_seed(1).get_state(), "rank_state": None}, 100, 0.0

    monkeypatch.setattr(wr.mb, "build_inner", lambda *a, **k: object())
    monkeypatch.setattr(wr.mb, "release_in_background", lambda pg: None)
    monkeypatch.setattr(wr.transfer, "recv_state", recv_state)
    rec.received, rec.model, rec.source = received, model, source
    return rec


def plan(incident_id=1, generation=1, sends=((0, 2),)):
    return p.Recover(incident_id=incident_id, generation=generation, resume_step=8, sends=[list(s) for s in sends],
                     rollback_step=-1)


def test_a_plan_that_comes_during_the_shadow_iterations_is_carried_out_meanwhile_then_loaded(monkeypatch):
    rec = replacement(monkeypatch)
    rec.recovery.prefetch()
    rec.control.on_recover(plan())
    assert rec.control.wait_until(lambda: rec.control.groups.built == [1], 5.0)  # while the shadow runs
    assert len(rec.received) == 1
    assert not torch.equal(rec.model.weight, rec.source.weight)  # loaded only after the shadow iterations
    assert rec.recovery.replace(1) == 8
    assert len(rec.received) == 1 and rec.control.groups.built == [1]  # no second attempt
    assert torch.equal(rec.model.weight, rec.source.weight) and rec.control.groups.installed == [{"world": "gen1"}]
    assert [m.phase for m in rec.sent] == [p.RecoveryPhase.WARMED, p.RecoveryPhase.RECOVERED]
    assert rec.control.role == p.WorkerRole.ACTIVE and rec.control.plan is None


def test_a_plan_that_comes_after_the_shadow_iterations_is_carried_out_once(monkeypatch):
    rec = replacement(monkeypatch)
    rec.recovery.prefetch()
    timer = threading.Timer(0.2, rec.control.on_recover, (plan(),))
    timer.start()
    assert rec.recovery.replace(1) == 8  # the plan came while replace() waited: the prefetch launched nothing
    timer.join()
    assert len(rec.received) == 1 and rec.control.groups.built == [1]
    assert torch.equal(rec.model.weight, rec.source.weight)


def test_a_prefetched_plan_superseded_by_a_newer_one_is_dropped(monkeypatch):
    rec = replacement(monkeypatch)
    rec.recovery.prefetch()
    rec.control.on_recover(plan(incident_id=1, generation=1))
    assert rec.control.wait_until(lambda: rec.control.groups.built == [1], 5.0)
    rec.control.on_recover(plan(incident_id=2, generation=2, sends=((1, 2),)))  # a second failure's plan
    assert rec.recovery.replace(1) == 8
    assert rec.control.groups.built == [1, 2] and rec.control.groups.installed == [{"world": "gen2"}]
    assert rec.sent[-1].phase == p.RecoveryPhase.RECOVERED and rec.sent[-1].incident_id == 2


def test_a_receiver_sent_no_rank_state_of_its_own_fails_the_recovery_and_loads_nothing(monkeypatch):
    """It took its sender's RNG and loaded no rank-local state (a silent divergence: every rank ends on one rank's
    RNG, outside review); now the recovery fails, loudly, before anything is loaded (a fresh standby takes over)."""
    from worker import recovery as wr

    rec = replacement(monkeypatch, own=False)  # sent the sender's RNG in place of its own state (the old sender)
    exits = []

    def exit_process(code, why):
        exits.append(why)
        raise SystemExit(int(code))

    monkeypatch.setattr(wr, "exit_process", exit_process)
    rng = torch.get_rng_state()
    rec.control.on_recover(plan())
    with pytest.raises(SystemExit):
        rec.recovery.replace(1)
    assert "was sent no rank state of its own" in exits[0] and rec.sent[-1].ok is False
    assert not torch.equal(rec.model.weight, rec.source.weight) and torch.equal(torch.get_rng_state(), rng)
    assert rec.control.groups.installed == []


def test_a_sender_keeping_no_rank_state_of_its_receiver_fails_instead_of_sending(monkeypatch):
    """The copy kept is of step 1; a plan resuming at step 3 needs the receiver's state after step 2."""
    from worker import recovery as wr

    rec, model, opt, loader = with_loader(monkeypatch)
    loader_steps(rec, model, opt, loader, 2)
    sent = []
    monkeypatch.setattr(wr.mb, "build_inner", lambda *a, **k: object())
    monkeypatch.setattr(wr.mb, "release_in_background", lambda pg: None)
    monkeypatch.setattr(wr.transfer, "send_state", lambda pg, objects, extra: sent.append(extra))
    rec.control.on_halt(p.Halt(incident_id=1, reason="n2 lost", failed_ranks=[2, 3]))
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=3, sends=[[0, 2]], rollback_step=-1))
    with pytest.raises(RuntimeError, match="keeps no rank state .* of rank 2 at step 2"):
        rec.recovery._carry_out(rec.control.plan, 2, torch.get_rng_state())
    assert sent == []
    rec.control.on_recover(p.Recover(incident_id=1, generation=1, resume_step=2, sends=[[0, 2]], rollback_step=-1))
    assert rec.recovery._carry_out(rec.control.plan, 1, torch.get_rng_state()) == 2  # step 1's copy: sent
    assert sent[0]["rank_state"] == rec.exchange.own_state(2, 1) and "rng" not in sent[0]


def test_a_replacement_is_never_prefetched_into_sending_its_live_state(monkeypatch):
    rec = replacement(monkeypatch)
    rec.recovery.prefetch()
    rec.control.on_recover(plan(sends=((2, 3), (0, 2))))  # (no plan tmd makes: a replacement is no source)
    time.sleep(0.2)
    assert rec.control.groups.built == [] and rec.received == []
