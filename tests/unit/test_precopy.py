"""Pre-copy with optimizer replay (worker.precopy) over a real 2-rank gloo group: the leaver trains on one
thread while the joiner follows on another; at the switch step both hold bit-identical state."""
import collections
import concurrent.futures as cf
import time

import pytest
import torch

from tests.unit.test_transfer import Stream, flat_state, pair, same
from worker import precopy, transfer

pytestmark = pytest.mark.timeout(60)

WARM, START, SWITCH = 3, 3, 6  # steps 0..2 before the pre-copy, 3..5 followed, switch at 6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.norm = torch.nn.BatchNorm1d(32)  # buffers change in forward
        self.drop = torch.nn.Dropout(0.3)  # draws from the RNG
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x)))))


def build(seed, opt_cls=torch.optim.AdamW):
    torch.manual_seed(seed)
    model, ema = Net(), Net()
    opt = opt_cls(model.parameters(), lr=0.05, weight_decay=0.01) if opt_cls is torch.optim.AdamW \
        else opt_cls(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = Stream()
    return {"model": model, "optimizer": opt, "scheduler": sched, "ema": ema, "data": data}


def train_step(objs, step, zero_in_place=False, clamp=False):
    model, opt = objs["model"], objs["optimizer"]
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad(set_to_none=not zero_in_place)
    objs["scheduler"].step()
    if clamp:
        with torch.no_grad():
            model.a.weight.clamp_(-0.2, 0.2)  # an in-place change outside the step: seen by version counters
    with torch.no_grad():
        for e, p in zip(objs["ema"].parameters(), model.parameters()):
            e.data.mul_(0.9).add_(p.data, alpha=0.1)  # through .data: no version bump, so always sent
    objs["data"].next_step = step + 1
    if "history" in objs:
        objs["history"].append(step)


class History:
    """Plain state that changes shape every step: a list that grows, a Counter and a dict that gain keys, a string
    that grows, and a tensor that grows (not an optimizer's: the tail always sends it)."""

    def __init__(self):
        self.steps, self.seen, self.notes, self.text = [], collections.Counter(), {}, ""
        self.log = torch.zeros(0)

    def append(self, step):
        self.steps.append(step)
        self.seen[step % 3] += 1
        self.notes[f"s{step}"] = (step, [step] * (step % 2))
        self.text += str(step)
        self.log = torch.cat([self.log, torch.tensor([step * 0.5])])

    def state_dict(self):
        return {"steps": list(self.steps), "seen": collections.Counter(self.seen), "notes": dict(self.notes),
                "text": self.text, "log": self.log}

    def load_state_dict(self, state):
        self.steps, self.seen, self.notes = list(state["steps"]), collections.Counter(state["seen"]), \
            dict(state["notes"])
        self.text, self.log = state["text"], state["log"].clone()


def migrate(opt_cls=torch.optim.AdamW, hook=None, pre_hook=False, late_hook=None, grad_buffers=None, history=False,
            **step_kw):
    """Train the leaver to the switch step with a pre-copy at START; return (leaver, joiner, precopy, extra,
    tail bytes). ``grad_buffers(joiner)`` makes the joiner's gradient receive buffers (default: the joiner's
    precopy.gradient_buffers, as worker.migration makes them)."""
    leaver, joiner = build(1, opt_cls), build(2, opt_cls)
    if history:  # the joiner's own (from its shadow iterations) is shorter than the leaver's
        leaver["history"], joiner["history"] = History(), History()
        joiner["history"].append(0)
    if hook is not None:
        opt = leaver["optimizer"]
        (opt.register_step_pre_hook if pre_hook else opt.register_step_post_hook)(hook)
    a, b = pair()

    def leave():
        for step in range(WARM):
            train_step(leaver, step, **step_kw)
        pc = precopy.Precopy(a, 7, leaver)
        pc.start(START)
        if late_hook is not None:
            leaver["optimizer"].register_step_pre_hook(late_hook)
        for step in range(START, SWITCH):
            if step == SWITCH - 1:
                pc.last_step()  # as worker.migration does: its gradients are sent in place
            train_step(leaver, step, **step_kw)
        full = pc.moved
        moved, seconds = pc.finish(SWITCH, torch.get_rng_state())
        pc.delivered(20)  # returns once the joiner loaded the tail
        return pc, moved - full

    precopied = []  # (bytes, seconds) of the pre-copy, reported by the joiner before the tail
    pretouched = transfer.pretouch(transfer.plan_buffers(joiner))  # the joiner's receive buffers
    assert pretouched
    grads = (grad_buffers or precopy.gradient_buffers)(joiner)

    def loaded(*a):
        assert pretouched == []  # freed once the pre-copy was loaded: not in the switch step
        precopied.append(a)

    with cf.ThreadPoolExecutor(2) as ex:
        left = ex.submit(leave)
        joined = ex.submit(precopy.follow, b, joiner, pretouched, grads, on_precopy=loaded)
        pc, tail = left.result(timeout=50)
        extra, moved, _ = joined.result(timeout=50)
    assert moved == pc.moved
    assert len(precopied) == 1 and 0 < precopied[0][0] < moved
    return leaver, joiner, pc, extra, tail


def test_followed_joiner_is_bit_identical_and_the_tail_is_small():
    leaver, joiner, pc, extra, tail = migrate()
    assert pc.off == {}
    assert pc.replayed == {"optimizer": SWITCH - START}
    assert same(flat_state(leaver), flat_state(joiner))
    assert extra["step"] == SWITCH and torch.equal(extra["rng"], torch.get_rng_state()) is not None
    # kept: the model's 6 parameters, AdamW's step, exp_avg and exp_avg_sq of each; sent: the EMA copy (6
    # parameters, 3 batch-norm buffers) and the model's 3 buffers
    assert (pc.kept, pc.sent) == (6 + 3 * 6, 6 + 3 + 3)
    assert joiner["scheduler"].last_epoch == leaver["scheduler"].last_epoch == SWITCH
    # the replay leaves no gradient behind: the script zeroes after its step, and the switch step's backward must
    # not add to the last replayed step's gradients
    assert all(p.grad is None for p in joiner["model"].parameters())


def test_plain_state_that_changes_shape_after_the_precopy_arrives_as_the_leavers():
    """A list that grows every step (and a Counter, a dict and a string that do): at the switch step the leaver's
    structure is not the joiner's (nor the pre-copy's). The tail carries the leaver's structure, and the joiner
    makes the state from it, keeping the tensors its replay made identical; the pre-copy sends only those."""
    leaver, joiner, pc, extra, tail = migrate(history=True)
    h, j = leaver["history"], joiner["history"]
    assert h.steps == list(range(SWITCH)) and j.steps == h.steps and j.seen == h.seen and type(j.seen) is \
        collections.Counter and j.notes == h.notes and j.text == h.text and torch.equal(j.log, h.log)
    assert same(flat_state(leaver), flat_state(joiner))
    assert pc.off == {} and (pc.kept, pc.sent) == (6 + 3 * 6, 6 + 3 + 3 + 1)  # + the history's log tensor


def test_a_joiner_whose_tensors_differ_after_loading_is_refused_before_transferred():
    """A module's load_state_dict casts another dtype silently: the joiner checks every received tensor against its
    own state after loading, and refuses the state before it reports ``transferred`` (the migration aborts)."""
    leaver, joiner = stepped(1), stepped(2)
    joiner["ema"] = joiner["ema"].double()
    a, b = pair()
    precopied = []
    with cf.ThreadPoolExecutor(2) as ex:
        sent = ex.submit(transfer.send_state, a, leaver, {"kind": precopy.Kind.PRECOPY.value, "step": 3})
        with pytest.raises(transfer.TransferRefused, match="ema: the tensor at a.weight is torch.float32 "
                                                           r"\[32, 8\] on the leaver, torch.float64"):
            precopy.follow(b, joiner, on_precopy=lambda *x: precopied.append(x))
        sent.result(timeout=20)
    assert precopied == []


def test_sgd_with_zero_grad_in_place_and_clamping():
    leaver, joiner, pc, _, tail = migrate(torch.optim.SGD, zero_in_place=True, clamp=True)
    # the clamp changes a parameter outside the step: SGD's tensors then travel in the tail, and it is still exact
    assert "outside its step" in pc.off["optimizer"]
    assert pc.kept == 0
    assert same(flat_state(leaver), flat_state(joiner))


def test_the_last_step_s_gradients_travel_unpacked_and_a_zero_grad_in_place_cannot_tear_them(monkeypatch):
    packed = []  # per gradient message: was it packed first (send_state got on_packed)?
    send = transfer.send_state

    def spy(pg, objects, extra, *a, **kw):
        if extra.get("kind") == precopy.Kind.GRADS:
            packed.append(kw.get("on_packed") is not None)
        return send(pg, objects, extra, *a, **kw)

    monkeypatch.setattr(transfer, "send_state", spy)
    leaver, joiner, pc, _, _ = migrate(zero_in_place=True)
    assert packed == [True] * (SWITCH - START - 1) + [False]
    assert pc.off == {} and pc.replayed == {"optimizer": SWITCH - START}
    assert same(flat_state(leaver), flat_state(joiner))


def test_the_joiner_receives_every_step_s_gradients_into_its_touched_buffers(monkeypatch):
    made, used = [], []
    replay = precopy._replay

    def buffers(objects):
        made.extend(precopy.gradient_buffers(objects))
        return made

    def spy(objects, name, state):
        used.append({g.untyped_storage().data_ptr() for g in state["grads"]})
        return replay(objects, name, state)

    monkeypatch.setattr(precopy, "_replay", spy)
    leaver, joiner, pc, _, _ = migrate(grad_buffers=buffers)
    assert len(made) == 1 and made[0].numel() == sum(p.numel() for p in joiner["model"].parameters())
    assert used == [{made[0].untyped_storage().data_ptr()}] * (SWITCH - START)  # one buffer, every step
    assert same(flat_state(leaver), flat_state(joiner))


def test_the_scripts_step_hooks_run_around_the_replay_and_stay_exact():
    calls = []

    def count(opt, args, kwargs):  # a pre-hook that only reads: replay stays on
        calls.append(len(opt.param_groups))

    leaver, joiner, pc, _, _ = migrate(hook=count, pre_hook=True)
    assert pc.off == {} and len(calls) == SWITCH and pc.kept > 0
    assert same(flat_state(leaver), flat_state(joiner))

    def shrink(opt, args, kwargs):  # a post-hook that changes the parameters in place, after the update
        with torch.no_grad():
            for p in (q for g in opt.param_groups for q in g["params"]):
                p.mul_(0.999)

    leaver, joiner, pc, _, _ = migrate(hook=shrink)
    # the post-hook here runs first, so the change shows in the version counters: replay turns off and the
    # parameters and moments travel in the tail
    assert "outside its step" in pc.off["optimizer"]
    assert same(flat_state(leaver), flat_state(joiner))


def test_a_hook_registered_after_the_precopy_started_turns_replay_off():
    leaver, joiner, pc, _, _ = migrate(late_hook=lambda opt, args, kwargs: None)
    assert "registered after the pre-copy" in pc.off["optimizer"]
    assert same(flat_state(leaver), flat_state(joiner))


def tail_of(objs, sent=()):
    """A tail of ``objs``' states as the leaver builds it, with every tensor kept but the ``sent`` positions."""
    out = {}
    for name, obj in objs.items():
        leaves, digest = precopy.flatten(obj.state_dict())
        at = [i for i in sent if i < len(leaves)] if name == "model" else []
        out[name] = {"structure": digest, "leaves": len(leaves), "sent": at,
                     "values": [v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor) or i in at]}
    return out


def test_the_structure_digest_sees_keys_kinds_dtypes_and_shapes_but_not_values():
    def digest(state):
        return precopy.flatten(state)[1]

    base = {"w": torch.zeros(2, 3), "lr": 0.1, "betas": (0.9, 0.99), 3: [1, "a"]}
    assert digest(base) == digest({"w": torch.ones(2, 3), "lr": 0.5, "betas": (0.8, 0.9), 3: [7, "b"]})
    for other in ({"w": torch.zeros(3, 2), "lr": 0.1, "betas": (0.9, 0.99), 3: [1, "a"]},  # shape
                  {"w": torch.zeros(2, 3, dtype=torch.float64), "lr": 0.1, "betas": (0.9, 0.99), 3: [1, "a"]},
                  {"v": torch.zeros(2, 3), "lr": 0.1, "betas": (0.9, 0.99), 3: [1, "a"]},  # key
                  {"w": torch.zeros(2, 3), "lr": 0.1, "betas": [0.9, 0.99], 3: [1, "a"]},  # list, not tuple
                  {"w": torch.zeros(2, 3), "lr": 0.1, "betas": (0.9, 0.99), "3": [1, "a"]},  # str key, not int
                  {"w": torch.zeros(2, 3), "lr": torch.tensor(0.1), "betas": (0.9, 0.99), 3: [1, "a"]},
                  {"w": torch.zeros(2, 3), "lr": 0.1, "betas": (0.9, 0.99), 3: [1, "a", None]}):
        assert digest(other) != digest(base), other
    leaves, _ = precopy.flatten(base)
    assert [type(v).__name__ for v in leaves] == ["Tensor", "float", "float", "float", "int", "str"]
    state = precopy.unflatten(base, [torch.ones(2, 3), 0.2, 0.1, 0.2, 9, "z"])
    assert state["lr"] == 0.2 and state["betas"] == (0.1, 0.2) and state[3] == [9, "z"] and state["w"].sum() == 6


def stepped(seed):
    """build(seed) after one training step: the optimizer holds state tensors."""
    objs = build(seed)
    train_step(objs, 0)
    return objs


def tensors_of(obj):
    return [t for t in precopy.flatten(obj.state_dict())[0] if isinstance(t, torch.Tensor)]


def test_a_tail_whose_leaves_are_all_the_joiners_loads_nothing(monkeypatch):
    joiner = stepped(2)
    loaded = []
    for name, obj in joiner.items():
        monkeypatch.setattr(obj, "load_state_dict", lambda *a, name=name, **k: loaded.append(name))
    precopy.load_tail(joiner, tail_of(joiner))
    assert loaded == []


def test_a_tail_loads_only_the_values_and_tensors_that_differ():
    joiner = stepped(2)
    tensors = tensors_of(joiner["optimizer"])
    assert len(tensors) == 6 * 3  # step, exp_avg, exp_avg_sq of each parameter
    tail = tail_of(joiner, sent=[0])  # the model's first tensor (a.weight) by value
    tail["model"]["values"][0] = torch.full((32, 8), 0.5)
    values = tail["optimizer"]["values"]
    lr = joiner["optimizer"].param_groups[0]["lr"]
    values[values.index(lr)] = lr / 2  # the learning rate, as a scheduler changed it
    precopy.load_tail(joiner, tail)
    assert torch.equal(joiner["model"].a.weight, torch.full((32, 8), 0.5))
    assert joiner["optimizer"].param_groups[0]["lr"] == lr / 2
    # the optimizer's state tensors stay the joiner's own objects (loaded by reference, not copied)
    after = tensors_of(joiner["optimizer"])
    assert len(after) == len(tensors) and all(a is b for a, b in zip(after, tensors))


def test_a_changed_learning_rate_alone_is_set_without_loading_the_optimizer(monkeypatch):
    joiner = stepped(2)
    opt = joiner["optimizer"]
    monkeypatch.setattr(opt, "load_state_dict", lambda *a, **k: pytest.fail("the optimizer was loaded whole"))
    tail = tail_of(joiner)
    lr = opt.param_groups[0]["lr"]
    values = tail["optimizer"]["values"]
    values[values.index(lr)] = lr / 2
    precopy.load_tail(joiner, tail)
    assert opt.param_groups[0]["lr"] == lr / 2


@pytest.mark.parametrize("edit, match", [
    (lambda t: t["model"].update(structure="0" * 64), "malformed structure"),
    (lambda t: t["model"].update(leaves=t["model"]["leaves"] + 1), "do not agree"),
    (lambda t: t["model"].pop("sent"), "malformed tail"),
    (lambda t: t.update(model=[1, 2]), "malformed tail"),
    (lambda t: t["model"].update(sent=[10 ** 6]), "bad positions"),
    (lambda t: t["model"].update(sent=[0, 0]), "bad positions"),
    (lambda t: t["model"].update(sent=["0"]), "bad positions"),
    (lambda t: t["optimizer"].update(sent=[t["optimizer"]["leaves"] - 1]), "bad positions"),  # a value's
    (lambda t: t["model"]["values"].append(1.0), "more than"),
    (lambda t: t["optimizer"]["values"].pop(), "fewer than"),
    (lambda t: t["optimizer"]["values"].__setitem__(0, torch.zeros(1)), "a tensor where"),
    (lambda t: t["optimizer"]["values"].__setitem__(-1, [0]), "a container"),
    (lambda t: t["optimizer"].update(leaves=torch.zeros(2)), "malformed structure"),
    (lambda t: t["model"]["values"].__setitem__(0, torch.zeros(8, 32)), "another dtype or shape"),
    (lambda t: t["model"]["values"].__setitem__(0, torch.zeros(32, 8, dtype=torch.float64)), "another dtype"),
])
def test_a_tail_that_does_not_fit_is_refused_and_nothing_loads(edit, match):
    joiner = stepped(2)
    before = flat_state(joiner)
    tail = tail_of(joiner, sent=[0])
    tail["model"]["values"][0] = torch.zeros(32, 8)  # changes that would load, were the tail accepted
    values = tail["optimizer"]["values"]
    values[values.index(joiner["optimizer"].param_groups[0]["lr"])] = 1.0
    edit(tail)
    with pytest.raises(transfer.TransferRefused, match=match):
        precopy.load_tail(joiner, tail)
    assert same(before, flat_state(joiner))
    with pytest.raises(KeyError):
        precopy.load_tail(joiner, {"model": tail_of(joiner)["model"]})


def test_randomly_corrupted_tails_are_refused_cleanly_or_load_what_they_say():
    """Random edits of a tail's fields and values (what a corrupted header that still carries a valid MAC could
    hold): load_tail either loads or raises TransferRefused / KeyError with nothing loaded; never another error."""
    import random

    rng = random.Random(0)
    junk = [None, True, 0, -1, 10 ** 9, 1.5, float("nan"), "", "x" * 70, b"\x00", [], [0], [[1]], {}, {"a": 1},
            (1, 2), torch.zeros(2), torch.zeros(32, 8)]
    joiner = stepped(2)
    refused = loaded = 0
    for _ in range(300):
        tail = tail_of(joiner, sent=[0])
        name = rng.choice(["model", "optimizer"])
        field = rng.choice(["structure", "leaves", "sent", "values", "values", "values"])
        if field == "values" and tail[name]["values"]:
            values = tail[name]["values"]
            values[rng.randrange(len(values))] = rng.choice(junk)
        elif field == "sent":
            tail[name]["sent"] = rng.choice(junk + [[1], [0, 2], [3, 1]])
        else:
            tail[name][field] = rng.choice(junk)
        before = flat_state(joiner)
        try:
            precopy.load_tail(joiner, tail)
            loaded += 1
        except (transfer.TransferRefused, KeyError):
            refused += 1
            assert same(before, flat_state(joiner))
        joiner = stepped(2)  # a fresh joiner for the next edit
    assert refused > 100 and loaded > 0, (refused, loaded)


def test_a_joiner_of_another_model_refuses_the_tail():
    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 32, bias=False)

    leaver, joiner = stepped(1), stepped(2)
    joiner["model"] = Wider()
    with pytest.raises(transfer.TransferRefused, match="another structure"):
        precopy.load_tail(joiner, tail_of(leaver))


def test_gradients_for_a_non_optimizer_are_refused():
    objs = build(3)
    with pytest.raises(transfer.TransferRefused):
        precopy._replay(objs, "model", {"grads": [], "groups": []})
    with pytest.raises(transfer.TransferRefused):
        precopy._replay(objs, "optimizer", {"grads": [None], "groups": [{}]})
    n = len(list(objs["model"].parameters()))
    with pytest.raises(transfer.TransferRefused):  # a group's hyperparameters missing
        precopy._replay(objs, "optimizer", {"grads": [None] * n, "groups": [{"lr": 1.0}]})


def test_without_a_precopy_one_full_message_is_loaded():
    leaver, joiner = build(1), build(2)
    for step in range(WARM):
        train_step(leaver, step)
    a, b = pair()
    with cf.ThreadPoolExecutor(2) as ex:
        sent = ex.submit(transfer.send_state, a, leaver, {"kind": precopy.Kind.FULL.value, "step": WARM})
        extra, moved, _ = precopy.follow(b, joiner, on_precopy=lambda *a: pytest.fail("not a pre-copy"))
        assert sent.result(timeout=20)[0] == moved
    assert extra["step"] == WARM
    assert same(flat_state(leaver), flat_state(joiner))


def test_a_first_message_that_is_not_a_state_is_refused():
    leaver, joiner = build(1), build(2)
    a, b = pair()
    with cf.ThreadPoolExecutor(2) as ex:
        ex.submit(transfer.send_state, a, leaver, {"kind": precopy.Kind.TAIL.value, "step": 1})
        with pytest.raises(transfer.TransferRefused, match="first message"):
            precopy.follow(b, joiner)


def test_a_sender_that_falls_behind_turns_replay_off_instead_of_stalling(monkeypatch):
    monkeypatch.setattr(precopy, "PACK_TIMEOUT_S", 0.05)
    slow = precopy.Precopy._send_grads

    def late(self, job, name, groups):
        time.sleep(0.3)  # still busy when the post-hook waits
        slow(self, job, name, groups)

    monkeypatch.setattr(precopy.Precopy, "_send_grads", late)
    leaver, joiner, pc, _, _ = migrate()
    assert "not packed within" in pc.off["optimizer"]
    assert same(flat_state(leaver), flat_state(joiner))


def test_in_the_last_step_a_slow_send_is_waited_for_and_replay_stays_on(monkeypatch):
    # turning replay off there would only move the whole optimizer state in the tail
    monkeypatch.setattr(precopy, "PACK_TIMEOUT_S", 0.05)
    send = precopy.Precopy._send_grads

    def late(self, job, name, groups):
        if job.in_place:
            time.sleep(0.3)  # the last step's send: longer than PACK_TIMEOUT_S
        send(self, job, name, groups)

    monkeypatch.setattr(precopy.Precopy, "_send_grads", late)
    leaver, joiner, pc, _, _ = migrate(zero_in_place=True)
    assert pc.off == {} and pc.replayed == {"optimizer": SWITCH - START}
    assert same(flat_state(leaver), flat_state(joiner))


def test_in_the_last_step_a_send_not_begun_in_time_goes_from_a_copy_and_the_leaver_goes_on(monkeypatch):
    # the sender is still busy with the step before (a joiner slow to take it): the leaver does not wait for the
    # joiner in its last step, and a zero_grad in place after it cannot tear what is sent
    monkeypatch.setattr(precopy, "PACK_TIMEOUT_S", 0.05)
    send, copy = precopy.Precopy._send_grads, precopy._Job.copy_unless_started
    events = []

    sends = []

    def slow_before_the_last(self, job, name, groups):
        if job.in_place:
            events.append(("last send begins", time.perf_counter()))
        send(self, job, name, groups)
        sends.append(job)
        if len(sends) == SWITCH - START - 1:
            time.sleep(0.3)  # the step before the last one's: packed (its post-hook went on), then the sender lingers

    def spy(job):
        copied = copy(job)
        events.append((f"copied {copied}", time.perf_counter()))
        return copied

    monkeypatch.setattr(precopy.Precopy, "_send_grads", slow_before_the_last)
    monkeypatch.setattr(precopy._Job, "copy_unless_started", spy)
    leaver, joiner, pc, _, _ = migrate(zero_in_place=True)
    assert [e for e, _ in events] == ["copied True", "last send begins"]
    assert pc.off == {} and pc.replayed == {"optimizer": SWITCH - START}
    assert same(flat_state(leaver), flat_state(joiner))


# --- DTensor optimizers (FSDP2, tensor parallel) ------------------------------------------------------------------
# Both ends stand for rank 1 of a 4-rank world on torch's fake process group (the ``mesh`` fixture): an
# AdamW step on DTensors is elementwise on the local shards and issues no collective.
def sharded_pair(mesh):
    from tests.unit.test_transfer import sharded

    return sharded(mesh, 1), sharded(mesh, 2)


def dtensor_step(objs, step):
    from tests.unit.test_transfer import dtensor

    weight = objs["model"].weight
    g = torch.Generator().manual_seed(step)
    weight.grad = dtensor(mesh=weight.device_mesh, local=torch.randn(weight.to_local().shape, generator=g),
                          placements=list(weight.placements), shape=weight.shape)
    objs["optimizer"].step()
    objs["optimizer"].zero_grad()


@pytest.mark.parametrize("communicates", [False, True])
def test_a_dtensor_optimizer_is_replayed_unless_its_step_communicates(mesh, communicates):
    from tests.unit.test_transfer import local_state

    leaver, joiner = sharded_pair(mesh)
    opt, weight = leaver["optimizer"], leaver["model"].weight

    def ops_issued():  # the job groups' collectives so far: one per optimizer step when the step communicates
        return int(opt.state[weight]["step"]) if communicates else 0

    a, b = pair()

    def leave():
        dtensor_step(leaver, 0)
        pc = precopy.Precopy(a, 7, leaver, ops_issued=ops_issued)
        pc.start(1)
        for step in (1, 2):
            dtensor_step(leaver, step)
        pc.finish(3, torch.get_rng_state())
        pc.delivered(20)
        return pc

    with cf.ThreadPoolExecutor(2) as ex:
        left = ex.submit(leave)
        joined = ex.submit(precopy.follow, b, joiner)
        pc = left.result(timeout=50)
        joined.result(timeout=50)
    assert same(local_state(leaver), local_state(joiner))
    if communicates:
        assert "issued collectives" in pc.off["optimizer"] and pc.kept == 0
    else:  # the weight and AdamW's step, exp_avg, exp_avg_sq: no entry in the tail; the plain buffer is sent
        assert pc.off == {} and pc.replayed == {"optimizer": 2} and (pc.kept, pc.sent) == (4, 1)
        assert transfer.is_dtensor(joiner["optimizer"].state[joiner["model"].weight]["exp_avg"])


def test_a_dtensor_optimizer_without_a_count_of_collectives_is_not_replayed(mesh):
    leaver, _ = sharded_pair(mesh)
    a, _ = pair()
    assert "no count of collectives" in precopy.Precopy(a, 7, leaver).off["optimizer"]


def test_a_dtensor_gradient_of_another_layout_is_refused(mesh):
    from torch.distributed.tensor import Replicate

    leaver, joiner = sharded_pair(mesh)
    weight = joiner["model"].weight
    shard = transfer.ReceivedShard(torch.zeros(weight.to_local().shape), tuple(weight.shape), ("R",), (4,))
    with pytest.raises(transfer.TransferRefused):
        precopy._replay(joiner, "optimizer", {"grads": [shard], "groups": [
            {k: v for k, v in g.items() if k != "params"} for g in joiner["optimizer"].param_groups]})
    assert Replicate() not in weight.placements
    with pytest.raises(transfer.TransferRefused):  # a plain tensor for a DTensor parameter
        precopy._replay(joiner, "optimizer", {"grads": [torch.zeros(weight.shape)], "groups": [
            {k: v for k, v in g.items() if k != "params"} for g in joiner["optimizer"].param_groups]})
