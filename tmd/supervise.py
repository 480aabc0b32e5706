"""Restarting a crashed tmd in the same process, as ``tmd resume`` would: the ranks never notice more than a pause.

tmd's loop survives bad input and a failing handler (tmd.daemon); what is left, a bug that keeps failing its ticks,
ends :meth:`tmd.daemon.Daemon.run` with :class:`tmd.daemon.TmdCrashed` (journalled as ``tmd_crashed``) and leaves
the ranks training. :func:`supervise` then builds a resumed daemon from the run directory's journal
(tmd.resume.load: the same address, a new store, the workers re-register), hands it the crashed one's process
launcher (the handles of the processes it started, so their exits are still seen with their codes: local
processes, or srun steps) and SLURM cluster (its poller, standby jobs and standby pool), and runs it; the resumed
daemon journals ``tmd_restarted``. ``tmd local`` and ``tmd slurm`` both run under it. After ``max_crashes``
crashes within ``window_s`` seconds it gives up and returns, leaving the ranks running: ``tmd resume --run-dir
DIR`` restarts a local job's tmd by hand then. A job that ended, or a tmd the user stopped (SIGTERM/SIGINT), is never restarted.
"""
from __future__ import annotations

import collections
import sys
import time
from typing import Callable, Optional

from tmd.daemon import Daemon, TmdCrashed
from tmd.protocol.vocab import ExitCode, NodeRole
from tmd.resume import JobState, ResumeError, load

MAX_CRASHES = 3  # crashes within WINDOW_S after which supervise gives up
WINDOW_S = 600.0  # seconds
GAVE_UP = ExitCode.FAILED  # supervise's return value when it gives up (tmd is down, the ranks train on)


def supervise(build: Callable[[Optional[JobState]], Daemon], *, max_crashes: int = MAX_CRASHES,
              window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic,
              say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> int:
    """Run the job's tmd until the job ends; restart it after each crash. Returns the job's exit code (that of
    :meth:`Daemon.run`), or GAVE_UP after ``max_crashes`` crashes within ``window_s`` seconds, or when the
    journal cannot be resumed (``say`` tells why and how to restart tmd by hand).

    ``build(None)`` makes the job's first daemon, with its launcher (and SLURM cluster) set and its processes
    started; ``build(state)`` makes a resumed one from tmd.resume.JobState with the same config (pass
    ``resume=state``: it binds ``state.address``; the same ``keys_dir``) and no launcher: supervise hands the
    crashed daemon's launcher and cluster over. ``clock``: monotonic seconds (tests pass their own)."""
    daemon = build(None)
    crashes: collections.deque[float] = collections.deque()
    while True:
        try:
            return daemon.run()
        except TmdCrashed as e:
            now = clock()
            crashes.append(now)
            while crashes and now - crashes[0] > window_s:
                crashes.popleft()
            hint = f"the ranks train on; `tmd resume --run-dir {daemon.run_dir}` restarts tmd"
            if len(crashes) >= max_crashes:
                say(f"tmd: {e}; it crashed {len(crashes)} times in {window_s:g} s: not restarted again ({hint})")
                return GAVE_UP
            say(f"tmd: {e}; restarting it from its journal (crash {len(crashes)} of at most {max_crashes} "
                f"in {window_s:g} s)")
            try:
                state = load(daemon.run_dir)
                resumed = build(state)
            except (ResumeError, OSError, ValueError, RuntimeError) as err:  # e.g. the address is taken
                say(f"tmd: cannot restart tmd of job {daemon.job}: {err} ({hint})")
                return GAVE_UP
            hand_over(daemon, resumed)
            daemon = resumed


def hand_over(crashed: Daemon, resumed: Daemon) -> None:
    """Give ``resumed`` what ``crashed`` drove: its process launcher (the resumed daemon keeps watching the
    processes it started, with their exit codes) and its SLURM cluster (re-pointed at ``resumed``; the nodes of
    its standby jobs stay standbys of the job; failed and left nodes the journal since the last ``tmd_started``
    does not name, those of the world before a rebuild inside the allocation, stay known, so that SLURM still
    drains the failed ones and they are handed back)."""
    if crashed.launcher is not None:
        resumed.launcher = crashed.launcher
    cluster = crashed.cluster
    if cluster is not None:
        cluster.attach(resumed)
        for name, node in crashed.registry.nodes.items():
            if name not in resumed.registry.nodes and node.role in (NodeRole.FAILED, NodeRole.LEFT):
                resumed.registry.restore(resumed.registry.add_node(name), node.role, [], node.reason)
        for nodes in cluster.adopted.values():
            for name in nodes:
                if name not in resumed.registry.nodes:
                    resumed.registry.add_node(name)
        resumed.cluster = cluster
