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

Fine-tuning: --init starts from a checkpoint instead of random weights; --phases replaces the default
schedule (fraction:context:batch per phase); --copy-fraction is the share of training sequences into which
passages of word salad are written twice, far apart (with_repeated_passages). Chapter 04 needs a model that
looks a passage up in its context to show a window taking that away, and the Bible text rarely repeats a
passage verbatim far apart. --copy-kind chooses what is written (letters, random characters, stretches of
the text, or a mix); the log shows the loss on the second copies' bytes alone ("repeats") and, at every
eval, a quick version of chapter 04's recall probe. data/kjv-gpt-copy.bin was made on a GPU (--device cuda:
one process, bf16 autocast, fused attention; about 5 minutes on an H100) with the command below; what made
it work is the short contexts first (128, then 512, then 2048), and what did not is in data/README.md:

    python3 data/train.py --device cuda --compile --loader-workers 5 --init data/kjv-gpt.bin --steps 4000 \
        --warmup 100 --lr 2e-3 --phases 0.3:128:1024,0.3:512:256,0.4:2048:64 --copy-fraction 1.0 \
        --copy-kind mix --copy-distance log --copy-spacing 128 --eval-every 500 --out data/kjv-gpt-copy.bin
"""
import argparse
import contextlib
import ctypes
import math
import os
import re
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
from model import Config, Transformer, read_checkpoint, write_checkpoint  # noqa: E402

LN2 = math.log(2.0)

# Keep freed memory in the process: by default glibc hands every block over 32 MiB (a batch's attention
# scores) back to the kernel and faults it in again on the next step; on a VM where page faults are
# costly that made a step 4-5x slower (measured on a 2-core AMD EPYC VM: forward and backward pass at context
# 512, batch 8, 4.7 s -> 0.7-1.2 s).
_libc = ctypes.CDLL("libc.so.6")
_libc.mallopt(-4, 0)          # M_MMAP_MAX: serve large blocks from the heap, not from fresh mappings
_libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD: do not give the heap's free top back below 1 GiB

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
    ap.add_argument("--init", help="start from this checkpoint (fine-tuning) instead of random weights")
    ap.add_argument("--copy-fraction", type=float, default=0.0,
                    help="share of sequences with a passage repeated later in them (default 0)")
    ap.add_argument("--copy-kind", choices=COPY_KINDS + ("mix",), default="salad",
                    help="what the repeated passages are: word salad (random corpus words), random lowercase "
                         "letters in words of 2-8 (nothing but the first copy predicts a byte of the second), a "
                         "stretch of the training text (text), random printable characters (chars), or each pair one of the four "
                         "at random (mix)")
    ap.add_argument("--copy-distance", choices=("uniform", "log"), default="uniform",
                    help="how a pair's distance is drawn between 40 bytes and the sequence's length: uniformly, or "
                         "log-uniformly (as many pairs 40-80 bytes apart as 1000-2000)")
    ap.add_argument("--copy-spacing", type=int, default=128,
                    help="one repeated pair per this many bytes of a sequence that gets pairs (default 128)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu (data-parallel processes) or cuda (one process, bf16 autocast); default: cuda if present")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (cuda; falls back to eager)")
    ap.add_argument("--loader-workers", type=int, default=6,
                    help="cuda: processes that build batches ahead of the GPU (each step's batch from its own seed)")
    ap.add_argument("--state", help="save the whole training state (weights, optimizer, step) here at every eval")
    ap.add_argument("--resume", help="continue from a --state file written by an earlier segment of the same run")
    ap.add_argument("--stop-after-minutes", type=float, default=0,
                    help="stop (after saving --state and --out) once this much wall time has passed; resume later")
    ap.add_argument("--phases", help="fraction:context:batch,... (default " +
                    ",".join(f"{f}:{c}:{b}" for f, c, b in PHASES) + ")")
    args = ap.parse_args()
    if not 0.0 <= args.copy_fraction <= 1.0:
        ap.error("--copy-fraction must be between 0 and 1")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: this PyTorch sees no CUDA device")
        args.processes = 1  # one GPU, one process
    if args.copy_spacing < 64:
        ap.error("--copy-spacing must be at least 64 bytes")
    try:
        args.phases = ([(float(f), int(c), int(b)) for f, c, b in (p.split(":") for p in args.phases.split(","))]
                       if args.phases else PHASES)
    except ValueError:
        ap.error("--phases: give fraction:context:batch triples separated by commas, e.g. 0.5:512:8,0.5:1024:4")
    if abs(sum(f for f, _, _ in args.phases) - 1.0) > 1e-6 or any(c < 2 or b < 1 for _, c, b in args.phases):
        ap.error("--phases: fractions must add up to 1, contexts be at least 2 and batches at least 1")
    return args


def letter_salad(length, rng):
    """`length` bytes of random lowercase words of 2-8 letters: each letter of a repeat costs log2(26) = 4.7
    bits to a model that does not look the first copy up, and ~0 to one that does."""
    out = bytearray()
    while len(out) < length:
        out += bytes(rng.integers(97, 123, size=int(rng.integers(2, 9))).astype(np.uint8)) + b" "
    return bytes(out[:length])


COPY_KINDS = ("salad", "letters", "text", "chars")


def passage(length, kind, words, corpus, rng):
    """`length` bytes of one kind of passage (see --copy-kind)."""
    if kind == "letters":
        return letter_salad(length, rng)
    if kind == "chars":  # printable ASCII at random: 6.6 bits a byte, and a byte's earlier occurrences are rare
        return bytes(rng.integers(32, 127, size=length).astype(np.uint8))
    if kind == "text":  # a verbatim stretch of the training text: copying beats the language prior
        start = int(rng.integers(0, len(corpus) - length))
        return corpus[start:start + length].tobytes()
    return b" ".join(words[i] for i in rng.integers(0, len(words), size=length // 2))[:length].ljust(length)


def with_repeated_passages(sequence, words, rng, kind="salad", repeats=None, corpus=None, spacing=128,
                           log_distance=False):
    """Writes passages of 32-128 bytes (at most a third of the sequence) of word salad (random words of the corpus)
    into `sequence`, each twice, the second copy 40 bytes or more after the first (up to the sequence's length),
    one pair per `spacing` bytes of sequence. Nothing but the
    first occurrence predicts a salad's second one, so it rewards looking that up in the context (induction);
    a verse repeated verbatim would be half predictable from the language alone. A later pair may land on an
    earlier one: a little noise, no harm. Other kinds: see passage(); "mix" draws one for each pair.
    `repeats`, when given (a bool array of the sequence's length), marks the bytes of every second copy."""
    n = len(sequence)
    for _ in range(max(1, n // spacing)):
        length = int(rng.integers(32, min(128, n // 3) + 1))
        shortest = min(40, n - length - 1)
        if log_distance:  # as many copies 40-80 bytes apart as 1000-2000: see --copy-distance
            distance = min(n - length - 1, int(math.exp(rng.uniform(math.log(shortest), math.log(n - length)))))
        else:
            distance = int(rng.integers(shortest, n - length))
        first = int(rng.integers(0, n - length - distance + 1))
        this_kind = COPY_KINDS[int(rng.integers(0, len(COPY_KINDS)))] if kind == "mix" else kind
        copy = np.frombuffer(passage(length, this_kind, words, corpus, rng), dtype=np.uint8)
        sequence[first:first + length] = copy
        sequence[first + distance:first + distance + length] = copy
        if repeats is not None:
            repeats[first:first + length] = False  # an earlier pair's repeat overwritten by this first copy
            repeats[first + distance + 1:first + distance + length] = True  # its first byte is not predictable
    return sequence


def make_batch(train, words, rng, ctx, batch, args):
    """`batch` sequences of ctx + 1 bytes from random offsets of the training text, a share of them with
    repeated passages (--copy-fraction); also which bytes are second copies (their loss is logged apart)."""
    offsets = rng.integers(0, len(train) - ctx - 1, size=batch)
    rows = [train[o:o + ctx + 1].copy() for o in offsets]
    repeats = np.zeros((batch, ctx + 1), dtype=bool)
    rows = [with_repeated_passages(r, words, rng, args.copy_kind, repeats[i], train, args.copy_spacing,
                                   args.copy_distance == "log")
            if args.copy_fraction and rng.random() < args.copy_fraction else r
            for i, r in enumerate(rows)]  # no draw when 0: the default run stays the shipped one
    return torch.from_numpy(np.stack(rows).astype(np.int64)), torch.from_numpy(repeats)


class Batches(torch.utils.data.IterableDataset):
    """The GPU run's batches, built by --loader-workers processes ahead of the GPU. Step s's batch comes from a
    generator seeded with (seed, s), so a run resumed at any step draws the same data as one never stopped."""

    def __init__(self, train, words, args, phase_of, first_step):
        self.train, self.words, self.args, self.phase_of, self.first_step = train, words, args, phase_of, first_step

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.first_step + worker  # the loader takes one batch from each worker in turn: steps in order
        while True:
            ctx, batch = self.phase_of(step)
            rng = np.random.default_rng([self.args.seed, step])
            yield make_batch(self.train, self.words, rng, ctx, batch, self.args)
            step += workers


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
    words = sorted(set(train.tobytes().split())) if args.copy_fraction else []  # --copy-fraction's word salad
    cuda = args.device == "cuda"

    cfg = Config(args.dim, args.hidden_dim, args.layers, args.heads, args.kv_heads, 256, args.seq_len)
    if args.init:
        model = read_checkpoint(args.init)
        cfg = model.cfg
    else:
        model = Transformer(cfg)
        model.init_weights(torch.Generator().manual_seed(args.seed))
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    if lead:
        print(f"model: dim {cfg.dim}, hidden {cfg.hidden_dim}, layers {cfg.n_layers}, heads {cfg.n_heads}, "
              f"kv heads {cfg.n_kv_heads}, {n_params} parameters; {args.steps} steps; " +
              (f"{torch.cuda.get_device_name()}, bf16 autocast, torch {torch.__version__}" if cuda else
               f"{args.processes} processes of {args.threads} thread(s)") +
              (f"; from {args.init}" if args.init else "") +
              (f"; {args.copy_fraction:.0%} of sequences with repeated passages ({args.copy_kind}, one pair per "
               f"{args.copy_spacing} bytes)" if args.copy_fraction else ""), flush=True)
    # Same initial weights everywhere (same seed); DDP averages gradients across processes.
    net = torch.nn.parallel.DistributedDataParallel(model) if args.processes > 1 else model

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if cuda else {}))
    first_step = 0
    if args.resume:
        state = torch.load(args.resume, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first_step, args.steps = state["step"], state["steps"]
        if lead:
            print(f"resumed from {args.resume} at step {first_step}", flush=True)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        floor = args.lr * args.min_lr_fraction
        return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * progress))

    bounds, acc = [], 0.0
    for frac, ctx, batch in args.phases:
        acc += frac
        bounds.append((round(acc * args.steps), ctx, batch))
    bounds[-1] = (args.steps, *bounds[-1][1:])  # fractions summing to 0.9999... still cover the last step

    def phase_of(step):
        return next(((c, b) for end, c, b in bounds if step < end), bounds[-1][1:])

    if cuda:
        loader = iter(torch.utils.data.DataLoader(Batches(train, words, args, phase_of, first_step), batch_size=None,
                                                  num_workers=args.loader_workers, pin_memory=True, prefetch_factor=4))
        next_batch = lambda step: next(loader)  # noqa: E731
    else:
        next_batch = lambda step: make_batch(train, words, rng, *phase_of(step), args)  # noqa: E731
    forward = net
    if args.compile:
        try:
            forward = torch.compile(net)
        except Exception as e:  # noqa: BLE001
            print(f"torch.compile unavailable ({e}); eager", flush=True)

    def save(step_done):
        write_checkpoint(model, args.out)
        if args.state:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step_done,
                        "steps": args.steps}, args.state)

    start = time.time()
    model.train()
    for step in range(first_step, args.steps):
        ctx, _ = phase_of(step)
        chunk, repeats = next_batch(step)
        chunk = chunk.to(args.device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            try:
                logits = forward(chunk[:, :-1])
            except Exception as e:  # noqa: BLE001  (a compiler that fails on this machine: go on without it)
                if forward is net:
                    raise
                print(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); eager", flush=True)
                forward = net
                logits = forward(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if lead and (step % 50 == 0 or step == args.steps - 1):
            copied = ""
            if repeats.any():  # the loss on second copies alone: below the letters' prior only if the model copies
                with torch.no_grad():
                    repeat = repeats[:, 1:].reshape(-1).to(args.device)
                    losses = F.cross_entropy(logits.reshape(-1, cfg.vocab_size)[repeat].float(),
                                             chunk[:, 1:].reshape(-1)[repeat])
                copied = f"  repeats {losses.item() / LN2:.3f} bits/byte"
            print(f"step {step:5d}  ctx {ctx:4d}  lr {lr_at(step):.2e}  train {loss.item() / LN2:.3f} bits/byte"
                  f"{copied}  {time.time() - start:6.0f} s", flush=True)
        out_of_time = args.stop_after_minutes and time.time() - start > 60 * args.stop_after_minutes
        if lead and ((step + 1) % args.eval_every == 0 or step == args.steps - 1 or out_of_time):
            model.eval()
            with torch.no_grad():
                bpb = bits_per_byte(model, valid[:args.eval_bytes], 512)
                recall = "  ".join(f"d={d} {salad_recall(model, valid, d):.2f}" for d in (128, 512, 1024, 1900)
                                   if d < cfg.seq_len)
            model.train()
            print(f"step {step:5d}  valid {bpb:.3f} bits/byte (first {args.eval_bytes} bytes, context 512);  "
                  f"word-salad recall {recall}", flush=True)
            save(step + 1)
        if out_of_time:
            if lead:
                print(f"stopped after step {step} ({args.stop_after_minutes} min); resume with --resume {args.state}",
                      flush=True)
            return

    minutes = (time.time() - start) / 60
    if not lead:
        return
    model.eval()
    with torch.no_grad():
        for ctx in (512, 2048):
            print(f"final valid {bits_per_byte(model, valid, ctx):.4f} bits/byte "
                  f"(all {len(valid)} bytes, context {ctx})", flush=True)
    print(f"trained {args.steps - first_step} steps in {minutes:.1f} min; wrote {args.out}", flush=True)
    save(args.steps)


def salad_recall(model, valid, distance, passages=8, passage_bytes=96, cue=32):
    """A quick version of chapter 04's recall probe, for the training log: word salad of held-out words, seen
    `distance` bytes earlier; the share of its last passage_bytes - cue bytes the model predicts exactly."""
    words = sorted({w for w in re.findall(rb"[A-Za-z]+", valid)})
    rng = np.random.default_rng(2023)
    correct = total = 0
    for k in range(passages):
        salad = b" ".join(words[i] for i in rng.integers(0, len(words), size=passage_bytes))[:passage_bytes]
        start = (len(valid) // 2 + k * 9973) % len(valid)
        filler = valid[start:start + distance - passage_bytes - 2]
        text = torch.tensor(list(salad + b"\n" + filler + b"\n" + salad), device=next(model.parameters()).device)
        logits = model(text[None, :-1])[0, -(passage_bytes - cue):]
        correct += (logits.argmax(-1) == text[-(passage_bytes - cue):]).sum().item()
        total += passage_bytes - cue
    return correct / total


if __name__ == "__main__":
    main()
