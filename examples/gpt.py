"""A small byte-level GPT used by the TrainMover examples and benchmarks.

Design choices that matter for bit-exact live migration:

* no dropout and no other randomness in forward/backward, so a step is a pure
  function of (parameters, optimizer state, batch);
* no buffers (DDP would broadcast them every step), so the full training
  state is ``model.state_dict()`` + ``optimizer.state_dict()`` + the data
  position;
* untied input embedding and output head, so every parameter is a separate
  leaf tensor with a fixed registration order.

Shapes use B = batch size, T = sequence length (<= ``config.context``),
C = ``config.d_model``, V = ``config.vocab_size``. All floating tensors are
float32; token tensors are int64 (``torch.long``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "MLP", "Block", "loss"]


@dataclass
class GPTConfig:
    """Model hyper-parameters. Defaults are the demo size (~3.3 M parameters)."""

    vocab_size: int = 256  # byte-level: one token per byte value
    context: int = 128  # maximum sequence length T
    d_model: int = 256  # embedding width C
    n_layer: int = 4
    n_head: int = 4  # d_model must be divisible by n_head
    mlp_ratio: int = 4  # hidden width of the MLP = mlp_ratio * d_model

    @classmethod
    def tiny(cls) -> "GPTConfig":
        """The configuration used by ``--tiny`` runs and tests (~40 k parameters)."""
        return cls(context=32, d_model=32, n_layer=1, n_head=2)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: [B, T, C] float32 -> [B, T, C] float32."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head != 0:
            raise ValueError(f"d_model={config.d_model} is not divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        # [B, T, 3C] -> three [B, H, T, C/H]
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, C/H]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward: [B, T, C] -> [B, T, mlp_ratio*C] (GELU) -> [B, T, C]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). [B, T, C] -> [B, T, C]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Byte-level decoder-only transformer.

    ``forward(idx)`` maps token ids ``idx`` (int64, [B, T], values in [0, vocab_size),
    T <= context) to next-token logits (float32, [B, T, vocab_size]).

    Initialisation uses the global torch RNG: call ``torch.manual_seed(seed)``
    right before ``GPT(config)`` so that every rank builds identical weights.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual output projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Total number of parameter elements."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: int64 [B, T] -> logits: float32 [B, T, vocab_size]."""
        B, T = idx.shape
        if T > self.config.context:
            raise ValueError(f"sequence length {T} exceeds context {self.config.context}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # [T]
        x = self.tok_emb(idx) + self.pos_emb(pos)  # [B, T, C] (+ broadcast [T, C])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [B, T, V]

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """See module-level :func:`loss`."""
        return loss(logits, targets)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    logits: float32 [B, T, V]; targets: int64 [B, T]. Returns a float32 scalar (0-dim) in nats/token.
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
