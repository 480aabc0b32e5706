"""The one ordered pipeline of optimizer step hooks (worker.step_hooks): its stages run in the stated order around
the script's own hooks, whenever either was registered, and a void update stops before the pre-copy sees it."""
import pytest
import torch

from tmd import protocol as p
from worker.step_hooks import StepHooks
from worker.step_ledger import StepAborted
from tests.unit.rank_rooms import NODE_OF, World, blob, make

from worker.step_exchange import NO_FINGERPRINT

pytestmark = pytest.mark.timeout(10)


def recording(calls, refuse=False):
    """A pipeline whose stages append their names to ``calls`` (``refuse``: the refusal raises StepAborted)."""

    def refusal():
        calls.append("refuse")
        if refuse:
            raise StepAborted("void")

    return StepHooks(exchange=lambda: calls.append("exchange"), refuse=refusal,
                     commit=lambda opt: calls.append("commit"), keep=lambda: calls.append("keep"))


def script_hooks(opt, calls, when):
    opt.register_step_pre_hook(lambda o, a, k: calls.append(f"script pre ({when})"))
    opt.register_step_post_hook(lambda o, a, k: calls.append(f"script post ({when})"))


def sgd():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_stages_run_in_the_stated_order_around_the_script_s_hooks_whenever_these_were_registered():
    calls = []
    model, opt = sgd()
    hooks = recording(calls)
    script_hooks(opt, calls, "before manage")
    hooks.add(opt)
    script_hooks(opt, calls, "after manage")
    hooks.attach_precopy(opt, lambda o, a, k: calls.append("pre-copy before"),
                         lambda o, a, k: calls.append("pre-copy after"))
    model(torch.ones(1, 3)).sum().backward()
    opt.register_step_pre_hook(lambda o, a, k: calls.append("update"))  # stands for the update: last pre-hook
    opt.step()
    assert calls == [
        "exchange", "refuse", "script pre (before manage)", "script pre (after manage)", "pre-copy before",
        "update",
        "pre-copy after", "commit", "keep", "script post (before manage)", "script post (after manage)",
    ]
    assert not hooks.precopy_in_place(opt)  # a pre-hook registered after the pre-copy: it is no longer last
    calls.clear()
    hooks.detach_precopy(opt)
    opt.step()
    assert "pre-copy before" not in calls and "pre-copy after" not in calls


def test_a_refused_update_reaches_neither_the_script_s_hooks_nor_the_pre_copy():
    calls = []
    model, opt = sgd()
    script_hooks(opt, calls, "before manage")
    hooks = recording(calls, refuse=True)
    hooks.add(opt)
    hooks.attach_precopy(opt, lambda o, a, k: calls.append("pre-copy before"),
                         lambda o, a, k: calls.append("pre-copy after"))
    assert hooks.precopy_in_place(opt)
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.detach().clone()
    with pytest.raises(StepAborted):
        opt.step()
    assert calls == ["exchange", "refuse"] and torch.equal(model.weight, before)


def test_in_a_session_a_halted_step_is_refused_before_the_pre_copy_queues_its_gradients(monkeypatch):
    """The session's own pipeline (worker.session): the exchange runs, tmd's halt arrives with it, the update is
    refused, and the pre-copy's stage, attached as a leaver's is, never sees the step; a step that is not void
    reaches it after the exchange and is committed after the pre-copy's post-update stage."""
    rec = make(rank=0)
    model, opt = sgd()
    rec.manage({"model": model, "optimizer": opt})
    world = World(rec, [None] + [blob(NO_FINGERPRINT, n) for n in ("n1", "n2", "n2")], monkeypatch)
    seen = []
    rec.hooks.attach_precopy(opt, lambda o, a, k: seen.append(("queued", len(world.calls))),
                             lambda o, a, k: seen.append(("packed", rec.ledger.committed_step)))
    rec.control.set_step(0)
    rec.begin_step()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert seen == [("queued", 1), ("packed", -1)] and rec.ledger.committed_step == 0
    rec.control.set_step(1)
    rec.begin_step()
    model(torch.ones(1, 3)).sum().backward()
    gather = world.gather

    def halted_meanwhile(data):  # tmd's halt comes while the exchange's collectives run
        rec.control.on_halt(p.Halt(incident_id=1, reason=f"{NODE_OF[2]} lost", failed_ranks=[2, 3]))
        return gather(data)

    monkeypatch.setattr("worker.rank_state.all_gather_bytes", halted_meanwhile)
    with pytest.raises(StepAborted, match="step 1: update refused, halted by tmd"):
        opt.step()
    assert seen == [("queued", 1), ("packed", -1)] and rec.ledger.committed_step == 0
