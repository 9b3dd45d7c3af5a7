"""Golden files of the *shipped* model, from the PyTorch reference (no cache), for the C++ tests.

    /usr/bin/python3 data/reference/make_shipped_golden.py     # after data/train.py; rewrites tests/golden/kjv-gpt.*
    /usr/bin/python3 data/reference/make_shipped_golden.py kjv-gpt-copy    # the copying model: tests/golden/kjv-gpt-copy.*

- NAME.logits (NAME: kjv-gpt unless given): reference logits for three prompts (14, 300 and 1100 bytes; the last crosses 1024),
  at positions that cross the C++ code's 64-query attention blocks. Format: int32 n_prompts, then per
  prompt: int32 n_tokens, int32 tokens[n_tokens], int32 n_rows, int32 positions[n_rows],
  float32 logits[n_rows][256].
- NAME.greedy.txt: the prompt "And God said, " and the 200 bytes greedy decoding (argmax, ties to the
  lowest id, no cache) appends to it.
- NAME.eval.txt: "<bytes> <context> <bits per byte>" of data/reference/evaluate.py on the start of the
  validation text.
"""
import struct
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
OUT = DATA.parent / "tests" / "golden"
sys.path.insert(0, str(HERE))
from evaluate import bits_per_byte  # noqa: E402
from model import read_checkpoint  # noqa: E402

GREEDY_PROMPT = b"And God said, "
GREEDY_TOKENS = 200
EVAL_BYTES, EVAL_CONTEXT = 8192, 512
ROW_POSITIONS = [0, 1, 63, 64, 127, 511, 1023, 1024, 1099]


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "kjv-gpt"
    torch.set_num_threads(2)
    model = read_checkpoint(DATA / f"{name}.bin").eval()
    valid = (DATA / "kjv" / "valid.txt").read_bytes()
    prompts = [GREEDY_PROMPT, valid[:300], valid[5000:6100]]
    with torch.no_grad(), open(OUT / f"{name}.logits", "wb") as f:
        f.write(struct.pack("i", len(prompts)))
        for p in prompts:
            tokens = torch.tensor(list(p), dtype=torch.int64)
            logits = model(tokens[None])[0]
            rows = sorted({r for r in ROW_POSITIONS if r < len(p)} | {len(p) - 1})
            f.write(struct.pack("i", len(p)) + tokens.to(torch.int32).numpy().tobytes())
            f.write(struct.pack("i", len(rows)) + torch.tensor(rows, dtype=torch.int32).numpy().tobytes())
            f.write(logits[rows].numpy().tobytes())

        tokens = list(GREEDY_PROMPT)
        for _ in range(GREEDY_TOKENS):
            logits = model(torch.tensor([tokens]))[0, -1]
            tokens.append(int(torch.argmax(logits)))  # first maximum: ties go to the lowest id
        (OUT / f"{name}.greedy.txt").write_bytes(bytes(tokens))

        bpb = bits_per_byte(model, valid[:EVAL_BYTES], EVAL_CONTEXT)
        (OUT / f"{name}.eval.txt").write_text(f"{EVAL_BYTES} {EVAL_CONTEXT} {bpb:.6f}\n")
    print(bytes(tokens).decode("utf-8", "replace"))
    print(f"bits/byte on the first {EVAL_BYTES} validation bytes at context {EVAL_CONTEXT}: {bpb:.6f}")


if __name__ == "__main__":
    main()
