"""A small byte-level Llama-style decoder, written the way torchtitan's ``llama3`` model is, for
``examples/train_llama.py``.

Building blocks: RMSNorm (pre-norm), rotary position embeddings (RoPE, real cos/sin tables), grouped-query
attention (``n_heads`` query heads share ``n_kv_heads`` key/value heads), a SwiGLU feed-forward
(``w2(silu(w1 x) * w3 x)``), optionally tied input embedding and output head.

Parallelization-friendly layout, as in torchtitan:

* the blocks live in ``layers``, an ``nn.ModuleDict`` keyed ``"0" .. "n-1"``, so a pipeline stage can delete the
  blocks it does not run and keep the others' fully qualified names;
* ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` (pipeline stages other than the first / last) and
  ``forward`` then skips them: stage 0 maps tokens int64 [B, T] -> hidden float32 [B, T, dim], the last stage
  maps hidden [B, T, dim] -> logits [B, T, vocab_size], a middle stage hidden -> hidden;
* attention reshapes with ``-1`` heads, so after tensor parallelism (column-wise ``wq/wk/wv``, row-wise ``wo``)
  each rank runs its ``n_heads / tp`` local heads unchanged;
* no dropout and no other randomness: a step is a pure function of (parameters, optimizer state, batch);
* the RoPE tables are non-persistent buffers (recomputed, never in ``state_dict()``), so the training state is the
  parameters and the optimizer state only.

All floating tensors are float32, token tensors int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "RMSNorm", "Attention", "FeedForward", "TransformerBlock", "Transformer", "loss",
           "rope_tables", "apply_rope"]


@dataclass
class LlamaConfig:
    """Model hyper-parameters. Defaults are the demo size (~0.8 M parameters)."""

    vocab_size: int = 256  # byte-level: one token per byte value
    dim: int = 128  # hidden width
    n_layers: int = 4
    n_heads: int = 8  # query heads; dim must divide by n_heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention); n_heads must divide by n_kv_heads
    ffn_hidden: int = 352  # SwiGLU hidden width (about 8/3 * dim, rounded)
    max_seq_len: int = 128  # the longest sequence T the RoPE tables cover
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # output head shares tok_embeddings.weight

    @classmethod
    def tiny(cls) -> "LlamaConfig":
        """The ``--tiny`` configuration for tests (~35 k parameters): dim 32, 2 layers, 4 heads, 2 kv heads,
        sequence 32."""
        return cls(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        """Raises ValueError when the head counts do not fit ``dim`` or each other."""
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension: [..., dim] -> [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ``(cos, sin)``, float32 [max_seq_len, head_dim // 2] each."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` [B, T, H, head_dim] by the position angles; cos/sin [T, head_dim // 2]."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, T, H, head_dim/2] each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE: [B, T, dim] -> [B, T, dim].

    Head counts come from the projections' local widths (``-1`` in the reshapes), so a tensor-parallel rank holding
    ``1/tp`` of ``wq/wk/wv``'s output columns runs its local heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)  # [B, T, Hq_local, hd]
        k = self.wk(x).view(B, T, -1, self.head_dim)  # [B, T, Hkv_local, hd]
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        if self.n_rep > 1:  # each kv head serves n_rep query heads
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, Hq_local, T, hd]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, [B, T, dim] -> [B, T, hidden] -> [B, T, dim]."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``; [B, T, dim]."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: tokens int64 [B, T] -> logits float32 [B, T, vocab_size] (T <= ``max_seq_len``).

    A pipeline stage sets ``tok_embeddings`` / ``norm`` / ``output`` to None and deletes entries of ``layers``;
    see the module docstring for what each stage's forward takes and returns."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deterministic init from the global RNG (call ``torch.manual_seed`` first for identical ranks):
        normal(0, 0.02) for embeddings and projections, depth-scaled for ``wo``/``w2``, ones for the norms."""
        std = 0.02
        for name, param in self.named_parameters():
            if param.dim() < 2:
                continue  # RMSNorm weights stay 1
            scale = std / (2 * self.cfg.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else std
            nn.init.normal_(param, 0.0, scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        T = h.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy: logits [B, T, V] float32, targets [B, T] int64 -> scalar float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
