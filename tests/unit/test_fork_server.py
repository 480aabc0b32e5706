"""The fork server (worker/fork_server.py) and the launcher's use of it (tmd.local): which commands it serves, and
that a forked rank runs as a fresh interpreter would: its own argv, environment, sys.path[0], working directory
and log; its exit code, uncaught exception and killing signal reach the launcher."""
import os
import signal
import sys
import time

import pytest

from tmd.local import Forked, LocalLauncher
from worker import fork_server

pytestmark = pytest.mark.timeout(60)
PY = sys.executable


@pytest.mark.parametrize("argv, parsed", [
    ([PY, "train.py", "--lr", "1"], ("script", "train.py", ["--lr", "1"])),
    ([PY, "-u", "train.py"], ("script", "train.py", [])),
    ([PY, "-m", "examples.demo", "-x"], ("module", "examples.demo", ["-x"])),
    ([PY, "-c", "pass"], None),
    ([PY, "-X", "importtime", "t.py"], None),
    ([PY, "-m"], None),
    ([PY], None),
])
def test_only_commands_a_fork_reproduces_are_parsed(argv, parsed):
    assert fork_server.parse(argv) == parsed


def test_eligibility_needs_a_python_interpreter_and_can_be_switched_off():
    env = dict(os.environ)
    assert fork_server.eligible([PY, "t.py"], env)
    assert not fork_server.eligible(["bash", "t.py"], env)
    assert not fork_server.eligible(["/no/such/python", "t.py"], env)
    assert not fork_server.eligible([PY, "t.py"], {**env, "TM_FORK_SERVER": "0"})


SCRIPT = """
import json, os, sys, threading, time
if sys.argv[1] == "raise":
    raise RuntimeError("boom in the script")
if sys.argv[1] == "hang":
    print("hanging", open("/proc/self/comm").read().strip(), flush=True)
    time.sleep(60)
done = threading.Event()
threading.Thread(target=lambda: (time.sleep(0.2), done.set())).start()  # a non-daemon thread is joined at exit
print(json.dumps({"argv": sys.argv, "node": os.environ["TM_NODE"], "rank": os.environ["TM_LOCAL_RANK"],
                  "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
                  "torch_loaded": "torch" in sys.modules}), flush=True)
import atexit
atexit.register(lambda: print("atexit ran", flush=True))
sys.exit(int(sys.argv[2]))
"""


def _wait_exits(launcher, n, timeout_s=30):
    exited, deadline = [], time.monotonic() + timeout_s
    while len(exited) < n and time.monotonic() < deadline:
        exited += launcher.poll()
        time.sleep(0.05)
    return exited


def test_forked_ranks_run_as_fresh_processes_and_report_their_exit(tmp_path, monkeypatch):
    script = tmp_path / "scripts" / "job.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TM_FORK_SERVER", "1")
    launcher = LocalLauncher([PY, str(script), "ok", "7"], str(tmp_path / "run"), "tcp://127.0.0.1:1", 2,
                             echo=False)
    try:
        assert launcher.fork_server is not None
        launcher.start_node("n1", standby=False)
        procs = list(launcher.procs)
        assert all(isinstance(p.popen, Forked) for p in procs)
        exited = _wait_exits(launcher, 2)
        # their exit codes came from waitpid: they were re-parented to this process (a child subreaper)
        assert sorted(p.returncode for p in exited) == [7, 7]
        for proc in procs:
            with open(os.path.join(tmp_path, "run", "logs", f"n1.{proc.local_rank}.log")) as f:
                lines = f.read().splitlines()
            import json
            seen = json.loads(lines[0])
            assert seen["argv"] == [str(script), "ok", "7"] and seen["main"] == "__main__"
            assert (seen["node"], seen["rank"]) == ("n1", str(proc.local_rank))
            assert seen["path0"] == str(script.parent) and seen["cwd"] == str(work)
            assert seen["torch_loaded"]  # forked from the warm image
            assert lines[-1] == "atexit ran"

        # an uncaught exception: traceback in the log, exit code 1; a SIGKILL: -9
        launcher.command = [PY, str(script), "raise", "0"]
        launcher.start_node("n2", standby=False)
        launcher.command = [PY, str(script), "hang", "0"]
        launcher.start_node("n3", standby=True)
        hang = [p for p in launcher.procs if p.node == "n3"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                "hanging" in open(launcher._log_path("n3", p.local_rank)).read() for p in hang):
            time.sleep(0.05)
        assert f"hanging tm-n3.{hang[0].local_rank}" in open(launcher._log_path("n3", hang[0].local_rank)).read()
        for p in hang:
            os.kill(p.popen.pid, signal.SIGKILL)
        exited = _wait_exits(launcher, 4)
        codes = {(p.node, p.local_rank): p.returncode for p in exited}
        assert codes == {("n2", 0): 1, ("n2", 1): 1, ("n3", 0): -9, ("n3", 1): -9}, codes
        assert "RuntimeError: boom in the script" in open(launcher._log_path("n2", 0)).read()
    finally:
        launcher.terminate_all(grace_s=2)
    assert launcher.fork_server.proc.returncode is not None  # the server ended with the launcher


PROBE = "import os\nwith open(os.environ['PROBE_LOG'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"
THREADED = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
SEES = "import json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('tm_probe'))), flush=True)\n"


def test_preloaded_modules_are_imported_once_by_the_server_and_one_that_starts_a_thread_is_refused(
        tmp_path, monkeypatch):
    """TM_FORK_PRELOAD: the server imports the named modules once, and every forked rank has them without importing
    them; a module that leaves a thread running makes the server refuse, and the ranks start as fresh processes."""
    (tmp_path / "tm_probe.py").write_text(PROBE)
    (tmp_path / "tm_probe_threaded.py").write_text(THREADED)
    script = tmp_path / "sees.py"
    script.write_text(SEES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PROBE_LOG", str(tmp_path / "imported-by"))
    monkeypatch.setenv("TM_FORK_SERVER", "1")
    monkeypatch.setenv("TM_FORK_PRELOAD", "tm_probe, json")
    launcher = LocalLauncher([PY, str(script)], str(tmp_path / "run"), "tcp://127.0.0.1:1", 2, echo=False)
    try:
        launcher.start_node("n1", standby=False)
        assert all(isinstance(p.popen, Forked) for p in launcher.procs)
        assert sorted(p.returncode for p in _wait_exits(launcher, 2)) == [0, 0]
        for proc in launcher.procs:
            assert open(launcher._log_path("n1", proc.local_rank)).read().split() == ['["tm_probe"]']
        assert open(tmp_path / "imported-by").read().split() == [str(launcher.fork_server.proc.pid)]
    finally:
        launcher.terminate_all(grace_s=2)

    monkeypatch.setenv("TM_FORK_PRELOAD", "tm_probe_threaded")
    launcher = LocalLauncher([PY, str(script)], str(tmp_path / "run2"), "tcp://127.0.0.1:1", 1, echo=False)
    try:
        launcher.start_node("n1", standby=False)
        assert not any(isinstance(p.popen, Forked) for p in launcher.procs)
        assert "importing tm_probe_threaded started a thread" in launcher.fork_server.broken
        assert sorted(p.returncode for p in _wait_exits(launcher, 1)) == [0]
        assert open(launcher._log_path("n1", 0)).read().split() == ["[]"]  # a fresh interpreter
    finally:
        launcher.terminate_all(grace_s=2)


def test_other_commands_and_a_disabled_server_start_processes_directly(tmp_path, monkeypatch):
    launcher = LocalLauncher([PY, "-c", "import sys; sys.exit(3)"], str(tmp_path), "tcp://127.0.0.1:1", 1,
                             echo=False)
    assert launcher.fork_server is None
    monkeypatch.setenv("TM_FORK_SERVER", "0")
    off = LocalLauncher([PY, "job.py"], str(tmp_path / "off"), "tcp://127.0.0.1:1", 1, echo=False)
    assert off.fork_server is None
    launcher.start_node("n1", standby=False)
    assert [p.returncode for p in _wait_exits(launcher, 1)] == [3]


THREADS = "import torch\nprint(torch.get_num_threads(), flush=True)\n"
FORKS = """
import json, os, sys, torch
from worker import fork_server
script, log = sys.argv[1:3]
torch.set_num_threads(3)  # the image's count (a fork keeps it)
assert torch.get_num_threads() == 3
pid = os.fork()
if pid == 0:
    fork_server.become({"log": log, "env": {**os.environ, "OMP_NUM_THREADS": "1"}, "cwd": os.getcwd(),
                        "argv": [sys.executable, script]}, {})
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_rank_gets_the_thread_count_its_own_environment_names(tmp_path):
    """A rank forked from an image that imported torch with 3 threads runs with the 1 its OMP_NUM_THREADS names, as
    a fresh interpreter would (a different count changed torchtitan's final hashes on an AVX-512 machine)."""
    import subprocess

    (tmp_path / "threads.py").write_text(THREADS)
    (tmp_path / "forks.py").write_text(FORKS)
    log = tmp_path / "rank.log"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(fork_server.__file__))}
    done = subprocess.run([PY, str(tmp_path / "forks.py"), str(tmp_path / "threads.py"), str(log)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().split() == ["1"]
