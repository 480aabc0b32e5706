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
    manager.install({})  # a recovery's swap (nothing to stage here)
    assert started == []
    manager.step_committed()
    assert started == [1]
    manager.step_committed()
    assert started == [1]  # once per swap
