"""State transfer throughput against this host's bound, measured in the same run. Prints one JSON object.

    python -m benchmarks.transfer [--reps 7] [--sizes demo,large] [--no-save]

Two processes on this host (``torch.multiprocessing``, spawn) hold a 2-rank gloo group built like the job's
(worker.backend.build_gloo, bound to 127.0.0.1). For each state size, rank 0 holds a trained GPT's model and AdamW
state (``demo``: the demo GPT, examples.gpt.GPTConfig(); ``large``: d_model 512, 11 layers, ~35 M parameters) and
rank 1 an identical-shaped one. Per repetition, interleaved so that all three see the same noise:

- ``ours``: worker.transfer.send_state on rank 0 / recv_state on rank 1 (the real code path: job keys, MAC'd
  header, checksums, packing, pre-touched receive buffers as worker.migration passes them);
- ``bound``: the same bytes through a shared-memory segment (/dev/shm, created and touched before timing): rank 0
  copies each state tensor into the segment (one memcpy in), signals rank 1 with an 8-byte gloo message, rank 1
  copies the whole segment into one pre-touched buffer (one memcpy out);
- ``gloo``: the same bytes, pre-packed into one flat uint8 tensor before timing, with one raw gloo send/recv into a
  pre-touched buffer.

A repetition's time runs from rank 0's start (after a handshake in which rank 1 says it is waiting) to rank 1
holding the bytes (``time.perf_counter``: CLOCK_MONOTONIC, one clock for both processes). Throughput = tensor
payload bytes (the same count for all three; our header and framing are not counted) / median seconds, in GB/s
(1e9 bytes/s). ``ratio`` = ours / bound (issue 12, target 6: >= 0.8) and ours / gloo.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from typing import Any

import torch

SIZES = {"demo": {}, "large": {"d_model": 512, "n_layer": 11, "n_head": 8}}
TARGET = 0.8


def build_state(size: str, seed: int) -> dict[str, Any]:
    """The managed objects of a rank: a GPT of ``size`` (see SIZES) and its AdamW after one step."""
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**SIZES[size]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for q in model.parameters():
        q.grad = torch.full_like(q, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": opt}


def tensors_of(objects: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x.detach())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for obj in objects.values():
        walk(obj.state_dict())
    return out


def payload_bytes(objects: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(objects))


def gbps(nbytes: int, seconds: list[float]) -> float:
    """``nbytes`` over the median of ``seconds``, in GB/s (1e9 bytes per second)."""
    return nbytes / statistics.median(seconds) / 1e9


def summarize(nbytes: int, times: dict[str, list[float]]) -> dict:
    """Per method: median seconds and GB/s; ratios ours/bound and ours/gloo, and whether target 6 is met."""
    out: dict[str, Any] = {"payload_bytes": nbytes}
    for name, ts in times.items():
        out[name] = {"median_s": statistics.median(ts), "gb_per_s": gbps(nbytes, ts), "seconds": ts}
    out["ours_over_bound"] = out["ours"]["gb_per_s"] / out["bound"]["gb_per_s"]
    out["ours_over_gloo"] = out["ours"]["gb_per_s"] / out["gloo"]["gb_per_s"]
    out["met"] = out["ours_over_bound"] >= TARGET
    return out


def _flag(pg, rank: int, peer: int, value: float = 0.0) -> float:
    """Send (rank 0 -> 1 when ``rank`` is the sender of this flag) or receive an 8-byte float64 message."""
    t = torch.tensor([value], dtype=torch.float64)
    if rank == 0:
        pg.send([t], peer, 999).wait()
    else:
        pg.recv([t], peer, 999).wait()
    return float(t.item())


def _ready(pg, rank: int) -> None:
    """Rank 1 tells rank 0 it is about to wait: rank 0 starts its clock after this."""
    t = torch.zeros(1, dtype=torch.int64)
    if rank == 1:
        pg.send([t], 0, 998).wait()
    else:
        pg.recv([t], 1, 998).wait()


def _measure(rank: int, pg: Any, keys: Any, sizes: list[str], reps: int) -> dict:
    from worker import transfer

    result: dict[str, Any] = {}
    for size in sizes:
        objects = build_state(size, seed=rank)
        tensors = tensors_of(objects)
        nbytes = payload_bytes(objects)
        path = f"/dev/shm/tm-bench-transfer-{size}-{os.getppid()}"
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        _ready(pg, rank)
        fd = os.open(path, os.O_RDWR)
        seg_map = mmap.mmap(fd, nbytes)
        os.close(fd)
        seg = torch.frombuffer(seg_map, dtype=torch.uint8)
        seg.fill_(rank)  # touch the segment's pages before timing
        _ready(pg, rank)
        if rank == 1:
            os.unlink(path)
        prealloc = transfer.pretouch(transfer.plan_buffers(objects)) if rank == 1 else None
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if rank == 0 else \
            torch.ones(nbytes, dtype=torch.uint8)
        sink = torch.ones(nbytes, dtype=torch.uint8)
        times: dict[str, list[float]] = {"ours": [], "bound": [], "gloo": []}
        for rep in range(reps + 1):  # the first repetition warms up and is dropped
            # ours
            _ready(pg, rank)
            if rank == 0:
                t0 = time.perf_counter()
                transfer.send_state(pg, objects, {"step": rep}, 1, keys)
                _flag(pg, rank, 1, t0)
            else:
                states, extra, _, _ = transfer.recv_state(pg, 0, prealloc, keys)
                t1 = time.perf_counter()
                t0 = _flag(pg, rank, 0)
                assert extra == {"step": rep}
                if rep == 0:
                    got = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors_of(
                        {"o": _Holder(states)})])
                    assert got.numel() == nbytes
                del states
                if rep:
                    times["ours"].append(t1 - t0)
            # bound: one memcpy in, an 8-byte signal, one memcpy out
            _ready(pg, rank)
            if rank == 0:
                t0 = time.perf_counter()
                off = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    seg[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
                    off += n
                _flag(pg, rank, 1, t0)
            else:
                t0 = _flag(pg, rank, 0)
                sink.copy_(seg)
                t1 = time.perf_counter()
                if rep:
                    times["bound"].append(t1 - t0)
                if rep == 0:
                    assert torch.equal(sink, got), "the bound moved other bytes than ours"
            # raw gloo, one pre-packed flat buffer
            _ready(pg, rank)
            if rank == 0:
                t0 = time.perf_counter()
                pg.send([flat], 1, 7).wait()
                _flag(pg, rank, 1, t0)
            else:
                pg.recv([sink], 0, 7).wait()
                t1 = time.perf_counter()
                t0 = _flag(pg, rank, 0)
                if rep:
                    times["gloo"].append(t1 - t0)
        del seg
        seg_map.close()
        if rank == 1:
            result[size] = summarize(nbytes, times)
    return result


class _Holder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def run(sizes: list[str], reps: int) -> dict:
    """Measure every size in ``sizes`` with ``reps`` timed repetitions per method. Returns the result object."""
    from benchmarks import pair
    from worker import datapath

    results = pair.run(_measure, sizes, reps, name="bench-transfer")

    return {"benchmark": "transfer", "reps": reps, "target_ours_over_bound": TARGET,
            "checksum": datapath.CRC_IMPL, "chunk_bytes": datapath.CHUNK_BYTES, "ring_slots": datapath.RING_SLOTS,
            "sizes": results[1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per method (median)")
    ap.add_argument("--sizes", default="demo,large", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write benchmarks/results")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        ap.error(f"unknown sizes {sorted(unknown)}")
    result = run(sizes, args.reps)
    print(json.dumps(result, indent=1))
    if not args.no_save:
        from benchmarks import report

        report.save("transfer", result, [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
