"""worker.datapath's pure parts: a buffer's bytes read straight from its tensors, and the ring's copy steps."""
import numpy as np
import pytest
import torch

from worker import datapath


def tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g),  # float32
            torch.randn(7, generator=g).to(torch.bfloat16),  # no numpy dtype: through a tensor view
            torch.tensor(4.0),  # 0-dim (an optimizer's step)
            torch.randn(4, 6, generator=g).t(),  # not contiguous: a contiguous copy
            torch.empty(0),
            torch.arange(10, dtype=torch.int64),
            torch.tensor([True, False, True])]


def flat(ts):
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in ts)


@pytest.mark.parametrize("start,stop", [(0, 10_000), (0, 1), (3, 61), (60, 74), (59, 200), (100, 181), (181, 181)])
def test_arrays_yield_the_range_in_order(start, stop):
    ts = tensors()
    src = datapath.Source(ts)
    whole = flat(ts)
    assert src.nbytes == len(whole)
    got = b"".join(a.tobytes() for a in src.arrays(start, stop))
    assert got == whole[start:stop]
    assert got == b"".join(s.numpy().tobytes() for s in src.spans(start, stop))  # the wire path's view


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_fill_then_drain_moves_the_bytes_and_checksums_both_ends_alike(monkeypatch, piece):
    monkeypatch.setattr(datapath, "PIECE_BYTES", piece)
    ts = tensors()
    src = datapath.Source(ts)
    whole = flat(ts)
    slot = np.zeros(src.nbytes + 16, dtype=np.uint8)
    crc = datapath.fill_slot(src, slot, 0, src.nbytes, 0)
    assert slot[:src.nbytes].tobytes() == whole
    dest = np.zeros(src.nbytes, dtype=np.uint8)
    assert datapath.drain_slot(slot, dest, 0) == crc == datapath.crc32(torch.frombuffer(bytearray(whole),
                                                                                         dtype=torch.uint8))
    assert dest.tobytes() == whole
