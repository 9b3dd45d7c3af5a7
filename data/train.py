"""Train the tiny KJV GPT with the PyTorch reference model and export it as a llama2.c checkpoint.

    /usr/bin/python3 data/build_corpus.py
    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 data/train.py    # ~55 min on 2 cores; writes data/kjv-gpt.bin

Byte-level tokens (id = byte), AdamW with linear warm-up and cosine decay, fixed seeds. Most steps use a
context of 256 and 512 bytes; the last phase trains at 1024 and then 2048 so that every position the
chapters use (the header's seq_len is 2048) has been seen in training. Every step holds the same number
of tokens per process. With --processes 2 (the default) two processes of one thread each train data-parallel
(each its own batches, gradients averaged by an all-reduce): torch gains nothing from a second thread on a
model this small, but a second process doubles the tokens per second. Loss is logged in bits per byte (cross-entropy / ln 2) on train batches and on a fixed slice
of the held-out validation text.
"""
import argparse
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "reference"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from evaluate import bits_per_byte  # noqa: E402
from model import Config, Transformer, write_checkpoint  # noqa: E402

LN2 = math.log(2.0)
# (fraction of steps, context, batch per process): every step holds 4096 tokens per process
PHASES = [(0.60, 256, 16), (0.28, 512, 8), (0.08, 1024, 4), (0.04, 2048, 2)]


def main():
    args = parse_args()
    if args.processes == 1:
        train(0, args)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        mp.spawn(train, args=(args,), nprocs=args.processes, join=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2700)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden-dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048, help="header seq_len: the longest context")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-fraction", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--processes", type=int, default=2, help="data-parallel processes (one per core)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-bytes", type=int, default=32768, help="validation slice for periodic evals")
    ap.add_argument("--out", default=str(HERE / "kjv-gpt.bin"))
    return ap.parse_args()


def train(rank, args):
    lead = rank == 0  # logs, evaluates and writes the checkpoint
    if args.processes > 1:
        dist.init_process_group("gloo", rank=rank, world_size=args.processes)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed + rank)  # each process draws its own batches
    train_path, valid_path = HERE / "kjv" / "train.txt", HERE / "kjv" / "valid.txt"
    if not train_path.exists():
        sys.exit(f"error: {train_path} is missing; run /usr/bin/python3 data/build_corpus.py first")
    train = np.frombuffer(train_path.read_bytes(), dtype=np.uint8)
    valid = valid_path.read_bytes()

    cfg = Config(args.dim, args.hidden_dim, args.layers, args.heads, args.kv_heads, 256, args.seq_len)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    n_params = sum(p.numel() for p in model.parameters())
    if lead:
        print(f"model: dim {cfg.dim}, hidden {cfg.hidden_dim}, layers {cfg.n_layers}, heads {cfg.n_heads}, "
              f"kv heads {cfg.n_kv_heads}, {n_params} parameters; {args.steps} steps; {args.processes} processes "
              f"of {args.threads} thread(s)", flush=True)
    # Same initial weights everywhere (same seed); DDP averages gradients across processes.
    net = torch.nn.parallel.DistributedDataParallel(model) if args.processes > 1 else model

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        floor = args.lr * args.min_lr_fraction
        return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * progress))

    bounds, acc = [], 0.0
    for frac, ctx, batch in PHASES:
        acc += frac
        bounds.append((round(acc * args.steps), ctx, batch))

    start = time.time()
    model.train()
    for step in range(args.steps):
        ctx, batch = next((c, b) for end, c, b in bounds if step < end)
        offsets = rng.integers(0, len(train) - ctx - 1, size=batch)
        chunk = torch.from_numpy(np.stack([train[o:o + ctx + 1] for o in offsets]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = net(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if lead and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:5d}  ctx {ctx:4d}  lr {lr_at(step):.2e}  train {loss.item() / LN2:.3f} bits/byte"
                  f"  {time.time() - start:6.0f} s", flush=True)
        if lead and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            with torch.no_grad():
                bpb = bits_per_byte(model, valid[:args.eval_bytes], 512)
            model.train()
            print(f"step {step:5d}  valid {bpb:.3f} bits/byte (first {args.eval_bytes} bytes, context 512)",
                  flush=True)
            write_checkpoint(model, args.out)

    minutes = (time.time() - start) / 60
    if not lead:
        return
    model.eval()
    with torch.no_grad():
        for ctx in (512, 2048):
            print(f"final valid {bits_per_byte(model, valid, ctx):.4f} bits/byte "
                  f"(all {len(valid)} bytes, context {ctx})", flush=True)
    print(f"trained {args.steps} steps in {minutes:.1f} min; wrote {args.out}", flush=True)
    write_checkpoint(model, args.out)


if __name__ == "__main__":
    main()
