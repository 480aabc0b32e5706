"""Two processes on this host holding a 2-rank gloo group built like the job's (worker.backend.build_gloo, bound to
127.0.0.1) and the job's keys: what benchmarks.transfer and benchmarks.tail measure one data path over."""
from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def run(body: Callable[..., Any], *args: Any, name: str, timeout_s: float = 600.0) -> dict[int, Any]:
    """Run ``body(rank, pg, keys, *args)`` in two fresh processes (``torch.multiprocessing``, spawn; one intra-op
    thread each) for ranks 0 and 1 of a gloo group named ``name``, with a new set of job keys. ``body`` must be a
    module-level function. Returns what each rank's call returned, by rank. Raises queue.Empty when a rank gives no
    result within ``timeout_s`` seconds (it failed: its traceback is on stderr)."""
    from tmd.protocol.keys import JobKeys

    ctx = mp.get_context("spawn")
    store = dist.TCPStore(HOST, 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        keys_path = os.path.join(tmp, "keys")
        JobKeys.create(keys_path)
        procs = [ctx.Process(target=_child, args=(r, store.port, keys_path, name, queue, body, args)) for r in (0, 1)]
        for proc in procs:
            proc.start()
        try:
            return dict(queue.get(timeout=timeout_s) for _ in procs)
        finally:
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()


def _child(rank: int, port: int, keys_path: str, name: str, queue: Any, body: Callable[..., Any],
           args: tuple) -> None:
    from tmd.protocol.keys import JobKeys
    from worker import backend

    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, 2, False, timeout=datetime.timedelta(seconds=60))
    pg = backend.build_gloo(store, name, rank, 2, 60.0, HOST)
    queue.put((rank, body(rank, pg, JobKeys.load(keys_path), *args)))
