"""What tests/unit/test_warm_start.py has the warm starter fork: ``python -m tests.unit.warm_target MODE ARG``.

``exit N``: prints what it inherited (JSON: argv, the process name, whether torch was imported before it ran, the
thread count, the working directory, ``WARM_PROBE`` from its environment) and exits with N; ``hang``: prints
``hanging`` and sleeps until it is signalled; ``launch RUN_DIR``: starts a tmd.local.LocalLauncher of two ranks
(each ``exit 7``) in RUN_DIR, as tmd would, and prints whether its fork server was forked from this process
(``server_forked``) and the ranks' exit codes.
"""
import json
import os
import sys
import threading
import time

if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    with open("/proc/self/comm") as f:
        name = f.read().strip()
    print(json.dumps({"argv": sys.argv[1:], "name": name, "torch_loaded": "torch" in sys.modules,
                      "threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count(),
                      "cwd": os.getcwd(), "probe": os.environ.get("WARM_PROBE")}), flush=True)
    if mode == "launch":
        from tmd.local import Forked, LocalLauncher

        launcher = LocalLauncher([sys.executable, "-m", "tests.unit.warm_target", "exit", "7"], arg,
                                 "tcp://127.0.0.1:1", 2, echo=False)
        forked = launcher.fork_server is not None and isinstance(launcher.fork_server.proc, Forked)
        launcher.start_node("n1", standby=False)
        ranks_forked = all(isinstance(p.popen, Forked) for p in launcher.procs)
        codes = []
        while len(codes) < 2:
            codes += [p.returncode for p in launcher.poll()]
            time.sleep(0.05)
        launcher.terminate_all()
        print(json.dumps({"server_forked": forked, "ranks_forked": ranks_forked, "codes": codes}), flush=True)
        sys.exit(0)
    if mode == "hang":
        print("hanging", flush=True)
        time.sleep(600)
    sys.exit(int(arg))
