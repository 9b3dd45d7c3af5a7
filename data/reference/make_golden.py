"""Regenerate the golden files the C++ tests compare against (the tests themselves need no Python).

    /usr/bin/python3 data/reference/make_golden.py     # rewrites tests/golden/{mha,gqa,mqa}.{bin,logits}

Each shape gets a random-weight checkpoint and the reference logits for a fixed token sequence. Weights
are drawn large enough that activations and logits are O(1) to O(10) (init std 0.02 would give logits
near zero, where an absolute tolerance proves little). The sequences are 80 tokens long so that they cross
the CPU backend's 64-query attention block. The hidden sizes (172, 200, 344) and mqa's vocabulary (203) are not
multiples of 16, so the products with those outputs end in a partial AVX-512 register (172 and 203 also in a
partial 8-float AVX one); dim and kv_dim are multiples of 16, so the other products never do.

.logits format: int32 n_tokens, int32 vocab_size, int32 tokens[n_tokens], float32 logits[n_tokens][vocab_size]
"""
import struct
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model import Config, Transformer, read_checkpoint, write_checkpoint  # noqa: E402

OUT = HERE.parent.parent / "tests" / "golden"
N_TOKENS = 80

SHAPES = {
    # name: dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared classifier
    "mha": Config(64, 172, 2, 4, 4, 256, 96, shared_classifier=True),    # head_dim 16
    "gqa": Config(96, 200, 3, 6, 2, 256, 96, shared_classifier=False),   # head_dim 16, 3 queries per KV head
    "mqa": Config(128, 344, 2, 4, 1, 203, 96, shared_classifier=True),   # head_dim 32, one KV head
}


def randomize(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name == "tok_embeddings.weight" or name == "output.weight":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # (out, in): unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for i, (name, cfg) in enumerate(SHAPES.items()):
        gen = torch.Generator().manual_seed(1000 + i)
        model = Transformer(cfg)
        randomize(model, gen)
        write_checkpoint(model, OUT / f"{name}.bin")
        model = read_checkpoint(OUT / f"{name}.bin").eval()  # what the C++ code will read
        tokens = torch.randint(0, cfg.vocab_size, (N_TOKENS,), generator=gen)
        with torch.no_grad():
            logits = model(tokens[None])[0]
        with open(OUT / f"{name}.logits", "wb") as f:
            f.write(struct.pack("2i", N_TOKENS, cfg.vocab_size))
            f.write(tokens.to(torch.int32).numpy().tobytes())
            f.write(logits.to(torch.float32).numpy().tobytes())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, logits in "
              f"[{logits.min():.2f}, {logits.max():.2f}], std {logits.std():.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
