"""Record at job start, replay in a joiner's shadow iterations (TrainMover, arXiv 2412.12636, section 5).

Active ranks run their first ``record_steps`` steps with the mover in ``record`` mode: each collective's outputs are
kept in call order. At the boundary after those steps each group's recording is written to
``tmd.protocol.layout.recording_path(record_dir, r, group)`` (``<record_dir>/rank<r>.<group>.pt``, on a background
thread; the file appears atomically). A joiner that takes rank r loads that file and runs the same
script with the mover in ``replay`` mode: every collective is filled with the real recorded values (zeros could
produce NaNs), barriers and sends complete at once, and nothing touches the network. Those shadow iterations warm
up the allocator, DDP's buckets (DDP regroups them after the first step) and the optimizer state.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch

from tmd import protocol as p
from tmd.protocol.layout import recording_path

FORMAT_VERSION = 1


def save_recordings_async(movers: dict, record_dir: str, rank: int,
                          ranks: Optional[dict[str, list[int]]] = None) -> threading.Thread:
    """Stop recording on every group's mover (``{name: mover}``; mode becomes ``live``) and write what each
    recorded, on a background thread, with each group's global ``ranks`` (``{name: ranks}``) so that a joiner
    that creates its groups in another order is told so. The recorded tensors are freed once written: stayers
    keep no extra memory."""
    taken = {}
    for name, mover in movers.items():
        mover.set_mode(p.MoverMode.LIVE.value)
        taken[name] = mover.take_recording()

    def write() -> None:
        for name, entries in taken.items():
            path = recording_path(record_dir, rank, name)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({"version": FORMAT_VERSION, "rank": rank, "group": name, "entries": entries,
                        "ranks": list((ranks or {}).get(name, []))}, tmp)
            os.replace(tmp, path)
        taken.clear()

    t = threading.Thread(target=write, daemon=True, name="tm-record-writer")
    t.start()
    return t


def start_replay(mover, record_dir: str, rank: int, group: str = p.layout.WORLD_GROUP, wait_s: float = 60.0,
                 ranks: Optional[list[int]] = None) -> int:
    """Load rank ``rank``'s recording of ``group`` into ``mover`` and switch it to ``replay``. Returns the number
    of recorded ops. The recording is written by another process, so a missing file is awaited up to ``wait_s``
    seconds; raises FileNotFoundError after that, ValueError on a foreign format or when ``ranks`` (this
    process's group's global ranks) differ from the recorded group's (the script created its groups in another
    order than the job did)."""
    path = recording_path(record_dir, rank, group)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)  # written by another process: no event to wait on
    data = torch.load(path, weights_only=True)
    if data.get("version") != FORMAT_VERSION or data.get("rank") != rank or data.get("group") != group:
        raise ValueError(f"{path} is not a v{FORMAT_VERSION} recording of rank {rank}, group {group}")
    recorded = data.get("ranks") or []
    if ranks is not None and recorded and list(ranks) != list(recorded):
        raise ValueError(f"process group {group} was created over ranks {recorded} by the job but over {list(ranks)} "
                         "here: every process must create its groups in the same order")
    entries = [(op, list(tensors)) for op, tensors in data["entries"]]
    mover.load_recording(entries)
    mover.set_mode(p.MoverMode.REPLAY.value)
    return len(entries)
