"""worker.groups.trim_heap: freed C-heap memory goes back to the OS (what keeps a stayer's RSS flat after a switch).
In a fresh interpreter, so that the measurement sees only this test's heap."""
import subprocess
import sys

import pytest

SCRIPT = """
import psutil
from worker import groups
rss = lambda: psutil.Process().memory_info().rss
bufs = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MB on the malloc heap (under the mmap threshold)
keep = bufs[::16]  # still in use between the freed ones: glibc cannot just lower the heap's top
del bufs
before = rss()
trimmed = {trim}
print(trimmed, before - rss())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trim", [True, False])
def test_trim_heap_returns_the_freed_pages(trim):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(trim="groups.trim_heap()" if trim else "False")],
                         capture_output=True, text=True, timeout=50, check=True).stdout.split()
    trimmed, released = out[0] == "True", int(out[1])
    if trim and not trimmed:
        pytest.skip("no malloc_trim in this C library (not glibc)")
    if trim:
        assert released > 100e6, released  # most of the ~180 MB freed
    else:
        assert released < 20e6, released  # without the trim glibc keeps it: what the trim is for


def test_a_swap_trims_the_heap_only_after_the_next_step_committed(monkeypatch):
    """The trim and its page faults stay out of the step right after a swap (a recovery's redone step)."""
    from worker import groups

    started = []
    monkeypatch.setattr(groups, "trim_heap_when_released", lambda *a, **k: started.append(1))
    manager = groups.GroupManager(None, 0, 1, None)
    manager.step_committed()
    assert started == []  # nothing swapped yet
    manager.install({}, 1)  # a recovery's swap (nothing to stage here)
    assert started == []
    manager.step_committed()
    assert started == [1]
    manager.step_committed()
    assert started == [1]  # once per swap


def test_the_trim_waits_for_the_next_step_s_backward_pass_where_one_can_be_armed(monkeypatch):
    """Armed: the trim starts as the next step's backward pass begins (its activations allocated), once; a step
    that ran no backward pass trims at its commit; a swap while armed disarms (its own trim comes after it)."""
    from worker import groups

    started, armed = [], []
    monkeypatch.setattr(groups, "trim_heap_when_released", lambda *a, **k: started.append(1))
    manager = groups.GroupManager(None, 0, 1, None)
    manager.install({}, 1)
    manager.step_committed(lambda fn: armed.append(fn) or True)
    assert started == [] and len(armed) == 1
    armed[0]()  # the backward pass began
    assert started == [1]
    armed[0]()  # a second gradient, or a stale call: nothing more
    manager.step_committed(lambda fn: armed.append(fn) or True)
    assert started == [1] and len(armed) == 1

    manager.install({}, 1)
    manager.step_committed(lambda fn: armed.append(fn) or True)
    assert started == [1] and len(armed) == 2
    manager.step_committed(lambda fn: armed.append(fn) or True)  # that step ran no backward pass
    assert started == [1, 1]
    armed[1]()
    assert started == [1, 1]

    manager.install({}, 1)
    manager.step_committed(lambda fn: armed.append(fn) or True)
    manager.install({}, 1)  # a recovery in the armed step: its redone step must not trim
    armed[2]()
    assert started == [1, 1]
    manager.step_committed(lambda fn: False)  # nothing can be armed (no DDP gradient hooks): at once
    assert started == [1, 1, 1]


def test_the_world_generation_is_the_one_in_use_not_the_highest_built(monkeypatch):
    """A stayer's phase 1 builds generation g+1 while the leaver builds none: a collective of every active rank
    (the checkpoint saver's group) keys on the world generation in use, which moves at the switch or a recovery's
    install only."""
    import threading

    from tmd import protocol as p
    from worker import groups

    class Mover:
        generation = 0

        def stage(self, inner):
            pass

        def commit(self):
            self.generation += 1

        def discard_staged(self):
            pass

    monkeypatch.setattr(groups.mb, "build_inner", lambda *a, **k: object())
    monkeypatch.setattr(groups.mb, "setup_of", lambda inner: None)
    monkeypatch.setattr(groups, "trim_heap_when_released", lambda *a, **k: None)
    manager = groups.GroupManager(None, 0, 2, None)
    world = Mover()
    manager.world = world
    manager.groups[p.layout.WORLD_GROUP] = groups.Group(p.layout.WORLD_GROUP, [0, 1], world)
    manager.world_generation = manager.generation = 0
    done = threading.Event()
    manager.prepare(7, 1, p.MigrationRole.STAYER, [1], "tm/t", lambda ok, error, names: done.set())
    assert done.wait(10)
    assert (manager.generation, manager.world_generation) == (1, 0)  # built, not in use: the leaver is still at 0
    manager.commit(7)
    assert manager.world_generation == 1
    manager.install({p.layout.WORLD_GROUP: object()}, 5)  # a recovery's generation 5
    assert manager.world_generation == 5


def test_a_group_the_script_creates_live_is_passed_to_on_created(monkeypatch):
    """The session reports a group created after the recorded steps (worker.session ``_group_created``)."""
    from worker import backend as mb
    from worker import groups

    monkeypatch.setattr(groups.mb, "build_inner", lambda *a, **k: None)
    monkeypatch.setattr(groups.mb, "setup_of", lambda inner: None)
    manager = groups.GroupManager(None, 0, 2, None)
    manager.world = mb.MoverBackend(0, 2, None)
    created = []
    manager.on_created = lambda name, ranks: created.append((name, ranks))
    manager.create_group("2", [0, 1], 0, 2)
    assert created == [("pg2", [0, 1])] and "pg2" in manager.groups
