"""Teacher-forced evaluation in bits per byte, defined exactly as common/perplexity does it in C++.

    /usr/bin/python3 data/reference/evaluate.py data/kjv-gpt.bin data/kjv/valid.txt --context 512

The text is cut into consecutive chunks of `context` bytes. Chunk c feeds bytes [c*context, (c+1)*context)
at positions 0..context-1 and scores each of them against the byte that follows it, so every byte of the
text after the first is predicted exactly once. bits/byte = mean(-log2 p(next byte)); perplexity = 2^bpb.
"""
import argparse
import math

import torch
import torch.nn.functional as F

LN2 = math.log(2.0)


def bits_per_byte(model, text: bytes, context: int, limit_chunks=None):
    data = torch.tensor(list(text), dtype=torch.int64, device=next(model.parameters()).device)
    total, count = 0.0, 0
    for c, start in enumerate(range(0, len(data) - 1, context)):
        if limit_chunks is not None and c >= limit_chunks:
            break
        chunk = data[start:start + context + 1]
        logits = model(chunk[None, :-1])[0]
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return total / count / LN2


if __name__ == "__main__":
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model import read_checkpoint
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("text")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--bytes", type=int, default=0, help="evaluate only the first N bytes (0 = all)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = read_checkpoint(args.checkpoint).eval()
    text = Path(args.text).read_bytes()
    if args.bytes:
        text = text[:args.bytes]
    with torch.no_grad():
        bpb = bits_per_byte(model, text, args.context)
    print(f"{bpb:.6f} bits/byte, perplexity {2 ** bpb:.4f} per byte ({len(text)} bytes, context {args.context})")
