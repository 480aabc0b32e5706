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
