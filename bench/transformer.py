"""A small word-level Transformer language model and a synthetic corpus for it.

The benchmark needs a model whose gradients are big enough that allreduce shows up in
the step time (a few MB to tens of MB), and data that needs no download. The corpus is
a seeded "language": every word has a handful of likely successors, so the model has
something real to learn and the loss falls from ln(vocab) towards ln(successors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 8192
    d_model: int = 256
    heads: int = 4
    layers: int = 2
    ff: int = 1024
    seq_len: int = 64


class TransformerLM(nn.Module):
    """Decoder-only LM built from nn.TransformerEncoder plus a causal mask."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model,
            cfg.heads,
            cfg.ff,
            dropout=0.0,  # no dropout: runs with different backends stay comparable
            batch_first=True,
            norm_first=True,
        )
        # Nested tensors only help with padding masks, which we never use.
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        # Untied head: a vocab x d_model gradient of its own is most of the bytes
        # allreduce has to move, as in real word-level LMs.
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(cfg.seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model) + self.pos(positions)
        x = self.encoder(x, mask=self.causal_mask[:seq, :seq], is_causal=True)
        return self.head(self.norm(x))


def build_model(cfg: ModelConfig, seed: int) -> TransformerLM:
    # Same seed on every rank and backend: DDP broadcasts rank 0's weights anyway,
    # but equal seeds make parameter dumps from different runs comparable.
    torch.manual_seed(seed)
    return TransformerLM(cfg)


def bucket_kwargs(bucket_cap_mb: float | None) -> dict[str, float]:
    """DDP's keyword for a bucket size; none at all when unset, as ``DDP(model)`` is run.

    Naming any bucket_cap_mb, even DDP's default 25, also sets DDP's first bucket to it
    (torch >= 2.x); left out, the first bucket is 1 MiB. Here that is the head's 8 MiB
    gradient alone, whose allreduce then overlaps the rest of the backward.
    """
    return {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class SyntheticCorpus:
    """Endless deterministic token stream from a seeded Markov chain.

    The successor table depends only on `seed`, so all ranks speak the same
    language; the sampling generator also depends on `rank`, so each rank sees
    different sentences, as with a sharded real corpus.
    """

    def __init__(self, vocab: int, seed: int, rank: int, successors: int = 4) -> None:
        table_gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, successors), generator=table_gen)
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
        self.vocab = vocab

    def batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (inputs, targets), each batch x seq_len; targets are inputs shifted by one."""
        width = self.successors.shape[1]
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=self.gen)
        choices = torch.randint(0, width, (batch, seq_len), generator=self.gen)
        for t in range(seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens[:, :-1], tokens[:, 1:]
