"""Independent PyTorch reference of the small GPT in common/ (a Llama-style decoder, llama2.c's run.c).

It computes the same function as the C++ forward pass, written the obvious way and without any cache:
every call recomputes the whole sequence. It reads and writes llama2.c's "version 0" checkpoint, so it
can create test checkpoints, produce golden logits, train the shipped model and cross-check the C++ code.
Run it with Debian's interpreter: /usr/bin/python3 (python3-torch).
"""
import math
import os
import struct
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

RMS_EPS = 1e-5
ROPE_THETA = 10000.0


@dataclass
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool = True

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    @property
    def kv_dim(self):
        return self.dim * self.n_kv_heads // self.n_heads


def rope_cos_sin(positions, head_dim):
    """cos/sin of angle pos * theta^(-2i/head_dim) for pairs i; angles in float64, like common/rope."""
    pos = positions.to(torch.float64)[:, None]
    i = torch.arange(0, head_dim // 2, dtype=torch.float64, device=positions.device)[None, :]
    angle = pos * torch.pow(torch.tensor(ROPE_THETA, dtype=torch.float64), -2.0 * i / head_dim)
    return torch.cos(angle).to(torch.float32), torch.sin(angle).to(torch.float32)  # (T, head_dim/2)


def apply_rope(x, cos, sin):
    """x: (B, T, heads, head_dim). Rotates consecutive pairs (2i, 2i+1) by the pair's angle."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)  # bf16 under autocast stays bf16
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.attention_norm = RMSNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x, cos, sin, mask):
        cfg = self.cfg
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.wk(h).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(h).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = cfg.n_heads // cfg.n_kv_heads  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if q.is_cuda:
            # Training on a GPU (train.py): the same causal softmax(q k^T / sqrt(head_dim)) v, through PyTorch's
            # fused kernel, which never writes the (T, T) scores to memory (torch >= 2.0). is_causal masks the
            # square (T, T) block, which is the CPU path's mask too: every call here starts at position 0.
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(mask, float("-inf"))
            att = F.softmax(scores, dim=-1) @ v
        x = x + self.wo(att.transpose(1, 2).reshape(B, T, cfg.dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.shared_classifier:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, generator=None, std=0.02):
        """GPT-2 style init; residual projections scaled by 1/sqrt(2 * n_layers)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                with torch.no_grad():
                    p.fill_(1.0)
                continue
            scale = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            with torch.no_grad():
                p.normal_(0.0, scale, generator=generator)

    def forward(self, tokens, start_pos=0):
        """tokens: (B, T) int64 -> logits (B, T, vocab). Positions start_pos .. start_pos+T-1."""
        T = tokens.shape[1]
        device = tokens.device
        cos, sin = rope_cos_sin(torch.arange(start_pos, start_pos + T, device=device), self.cfg.head_dim)
        mask = None if tokens.is_cuda else torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # True = hidden
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.output(self.norm(x))


# ---- llama2.c "version 0" checkpoint -------------------------------------------------------------

def _tensors_in_file_order(model):
    L = model.layers
    out = [model.tok_embeddings.weight]
    out += [l.attention_norm.weight for l in L]
    out += [l.wq.weight for l in L]
    out += [l.wk.weight for l in L]
    out += [l.wv.weight for l in L]
    out += [l.wo.weight for l in L]
    out += [l.ffn_norm.weight for l in L]
    out += [l.w1.weight for l in L]
    out += [l.w2.weight for l in L]
    out += [l.w3.weight for l in L]
    out += [model.norm.weight]
    return out


def write_checkpoint(model, path):
    """Writes a llama2.c version-0 file to a temporary file beside `path`, then renames it over `path`:
    a process that has the old file mapped keeps reading the old one (truncating it in place would kill
    that process with SIGBUS), and an interrupted write leaves the old file whole."""
    cfg = model.cfg
    vocab = cfg.vocab_size if cfg.shared_classifier else -cfg.vocab_size
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("7i", cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                vocab, cfg.seq_len))
            for t in _tensors_in_file_order(model):
                f.write(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
            # two legacy RoPE tables (freq_cis_real, freq_cis_imag), never read by the C++ loader
            cos, sin = rope_cos_sin(torch.arange(cfg.seq_len), cfg.head_dim)
            f.write(cos.numpy().tobytes())
            f.write(sin.numpy().tobytes())
            if not cfg.shared_classifier:
                f.write(model.output.weight.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(temp, 0o666 & ~mask)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def read_checkpoint(path):
    with open(path, "rb") as f:
        header = struct.unpack("7i", f.read(28))
        data = np.frombuffer(f.read(), dtype=np.float32)
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = header
    cfg = Config(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, shared_classifier=vocab > 0)
    model = Transformer(cfg)
    offset = 0

    def take(shape):
        nonlocal offset
        n = int(np.prod(shape))
        t = torch.from_numpy(data[offset:offset + n].copy()).view(*shape)
        offset += n
        return t

    with torch.no_grad():
        # per-layer tensors are stored grouped by kind, layer after layer, so read them in that order
        model.tok_embeddings.weight.copy_(take((cfg.vocab_size, dim)))
        for name, shape in [("attention_norm.weight", (dim,)), ("wq.weight", (dim, dim)),
                            ("wk.weight", (cfg.kv_dim, dim)), ("wv.weight", (cfg.kv_dim, dim)),
                            ("wo.weight", (dim, dim)), ("ffn_norm.weight", (dim,)),
                            ("w1.weight", (hidden, dim)), ("w2.weight", (dim, hidden)),
                            ("w3.weight", (hidden, dim))]:
            for layer in model.layers:
                layer.get_parameter(name).copy_(take(shape))
        model.norm.weight.copy_(take((dim,)))
        offset += 2 * seq_len * cfg.head_dim // 2
        if not cfg.shared_classifier:
            model.output.weight.copy_(take((cfg.vocab_size, dim)))
    if offset != data.size:
        raise ValueError(f"{path}: {data.size - offset} floats left over after reading the checkpoint")
    return model
