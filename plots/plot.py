"""Redraw every figure of the book from the CSV files the binaries write (plots/data/).

    /usr/bin/python3 plots/plot.py     # Debian's python3-matplotlib; plots/regenerate.sh remeasures first

Figures: decode_time_vs_context.png (log-log, one line per method), speedup_vs_prompt.png (decode
speedup over naive), cache_bytes_vs_context.png (the formula's line and the bytes each cache held);
chapter 04: window_bits_per_byte.png (held-out bits per byte vs window, without and with sinks) and
window_memory_vs_length.png (cache bytes and time per token vs generated length, full cache vs window);
chapter 05: break_steps_to_divergence.png (median steps until the first different token, layer x position,
key and value), break_kl_over_steps.png (median KL per step after the corruption, per layer) and
break_contamination.png (how far each cache row moved, layer x position, one corruption);
chapter 06: off_by_one_probes.png (the share of probes that pass, vs probe length);
chapter 08: batch_throughput.png (decode tokens/s per batch size against batch 1's: the shipped model on 1 and 2
threads, a synthetic model too large for the caches) and paged_memory.png
(reserved vs live K/V per block size and for a max-length reservation, with the largest batch each fit);
chapter 09: prefix_sharing.png (N requests with one long document: K/V held at the peak and time to first token,
with and without sharing) and sampling_memory.png (N samples of one prompt: K/V held, shared vs separate);
chapter 10: kv_channels.png (each layer's cached keys and values, mean |x| per channel) and quantized_quality.png
(held-out bits per byte against bytes per cached position, per format, at contexts 512 and 2048);
decode_breakdown.png (where a decode step's time goes vs context, stacked, and the time reading the same bytes
at the measured bandwidth would take).
Chapter 07 (the GPU runs kept in plots/data/gpu/): gpu_decode_bandwidth.png (the synthetic model's graph-replayed
decode step, its bytes over its time as a share of the copy bandwidth measured in the same run, per version of
the kernels, against the 75% goal).
Chapter 04 on the copying model (data/kjv-gpt-copy.bin; drawn when its CSVs exist): copy_recall_vs_window.png
(recall against window over distance, W/d: every distance collapses at W = d), copy_what_fails_first.png
(recall, topic and local fluency against window) and copy_induction_heads.png (per layer and head, the
attention a repeated byte puts on the byte to copy).
"""
import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("error: matplotlib is missing; install Debian's python3-matplotlib (common/install-deps.sh plots)")

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
STYLE = {"naive": ("tab:red", "o"), "concatenate": ("tab:orange", "s"), "chunked": ("tab:green", "^"),
         "preallocated": ("tab:blue", "D")}


# The CSVs every run needs, checked before any figure is drawn: a missing one used to stop the script after it had
# redrawn the figures before it (the copying model's and the GPU's are drawn only where they exist).
REQUIRED = ["speedup.csv", "cache_memory.csv", "window_perplexity.csv", "window_memory.csv", "break_sweep.csv",
            "break_kl.csv", "break_contamination.csv", "decode_breakdown.csv", "off_by_one_probes.csv",
            "batch_throughput_1t.csv", "batch_throughput_2t.csv", "batch_throughput_synthetic_2t.csv",
            "paged_memory.csv", "prefix_sharing.csv", "sampling_memory.csv", "kv_channels.csv", "quantized_quality.csv"]


def check_data():
    missing = [name for name in REQUIRED if not (DATA / name).exists()]
    if missing:
        sys.exit(f"error: {DATA} lacks {', '.join(missing)}; run plots/regenerate.sh to measure "
                 f"{'it' if len(missing) == 1 else 'them'} (no figure was redrawn)")


def read(name):
    path = DATA / name
    if not path.exists():
        sys.exit(f"error: {path} is missing; run plots/regenerate.sh to measure it")
    with open(path) as f:
        return list(csv.DictReader(f))


def by_method(rows, x, y):
    series = defaultdict(list)
    for r in rows:
        series[r["method"]].append((float(r[x]), float(r[y])))
    return {m: sorted(v) for m, v in series.items()}


def finish(fig, ax, xlabel, ylabel, title, filename, log=True, legend="best"):
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if legend == "below":  # outside the axes, where no line runs
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="x-small")
    else:
        ax.legend(loc=legend, fontsize="small")
    fig.tight_layout()
    fig.savefig(HERE / filename, dpi=120)


def main():
    speed = read("speedup.csv")
    threads = speed[0]["threads"]
    decode = by_method(speed, "prompt_tokens", "decode_ms_median")

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method, points in decode.items():
        color, marker = STYLE.get(method, ("black", "x"))
        ax.plot(*zip(*points), marker=marker, color=color, label=method)
    finish(fig, ax, "context (prompt tokens)", "median decode time per token (ms)",
           f"Time per new token vs context ({threads} threads)", "decode_time_vs_context.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    naive = dict(decode["naive"])
    for method, points in decode.items():
        if method == "naive":
            continue
        color, marker = STYLE.get(method, ("black", "x"))
        ax.plot([x for x, _ in points], [naive[x] / y for x, y in points], marker=marker, color=color, label=method)
    finish(fig, ax, "prompt length (tokens)", "decode speedup over naive (x)",
           f"KV cache speedup per token ({threads} threads)", "speedup_vs_prompt.png")

    memory = read("cache_memory.csv")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    analytic = sorted({(int(r["positions"]), int(r["analytic_bytes"])) for r in memory})
    per_position = analytic[-1][1] / analytic[-1][0]
    xs = [0, max(x for x, _ in analytic)]
    ax.plot(xs, [x * per_position / 2**20 for x in xs], color="black", lw=1,
            label="2·layers·kv_heads·head_dim·positions·4 bytes")
    # Allocated (hollow) is the cache's own bookkeeping; resident (filled) is measured: the pages written.
    for column, fill in (("allocated_bytes", "none"), ("resident_bytes", None)):
        for method, points in by_method(memory, "positions", column).items():
            color, marker = STYLE.get(method, ("black", "x"))
            ax.plot([x for x, _ in points], [y / 2**20 for _, y in points], ls="none", marker=marker, color=color,
                    markerfacecolor=fill or color, label=f"{method} ({column.split('_')[0]})")
    finish(fig, ax, "positions in the cache", "KV cache bytes (MiB)", "Cache memory grows linearly with context",
           "cache_bytes_vs_context.png", log=False, legend="lower right")
    window_figures()
    if (DATA / "copy_window_recall.csv").exists():
        copy_figures()
    break_figures()
    breakdown_figure()
    if (DATA / "gpu").exists():
        gpu_figure()


def window_figures():
    rows = read("window_perplexity.csv")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    full = [float(r["bits_per_byte"]) for r in rows if r["window"] == "full"]
    for sinks, color in (("0", "tab:blue"), ("4", "tab:orange")):
        points = sorted((int(r["window"]), float(r["bits_per_byte"])) for r in rows
                        if r["window"] != "full" and r["sinks"] == sinks)
        ax.plot(*zip(*points), marker="o", color=color, label=f"window, {sinks} sinks")
    if full:
        ax.axhline(full[0], color="black", ls="--", lw=1, label=f"full cache ({full[0]:.3f})")
    ax.set_xscale("log", base=2)
    finish(fig, ax, "window (keys each query sees)", "held-out bits per byte (lower is better)",
           f"What a window costs (sequences of {rows[0]['context']} bytes)", "window_bits_per_byte.png", log=False)

    rows = read("window_memory.csv")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
    for cache, color in ((r, c) for r, c in zip(sorted({r["cache"] for r in rows}), ("tab:blue", "tab:green"))):
        mine = [r for r in rows if r["cache"] == cache]
        xs = [int(r["generated"]) for r in mine]
        top.plot(xs, [int(r["allocated_bytes"]) / 2**20 for r in mine], color=color, ls="--", label=f"{cache} (allocated)")
        resident = [int(r["resident_bytes"]) for r in mine]
        if min(resident) >= 0:
            top.plot(xs, [b / 2**20 for b in resident], color=color, marker="o", ms=3, label=f"{cache} (resident)")
        bottom.plot(xs, [float(r["ms_p50"]) for r in mine], color=color, marker="o", ms=3, label=f"{cache} p50")
        bottom.plot(xs, [float(r["ms_p99"]) for r in mine], color=color, ls=":", label=f"{cache} p99")
    top.set_ylabel("KV cache (MiB)")
    top.grid(True, alpha=0.3)
    top.legend(fontsize="small")
    top.set_title("A window keeps memory and time per token flat")
    finish(fig, bottom, "tokens generated", "ms per token", "", "window_memory_vs_length.png", log=False)


def copy_figures():
    """Chapter 04's question on the model that copies (data/kjv-gpt-copy.bin)."""
    rows = read("copy_window_recall.csv")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, kind in zip(axes, ("word salad", "verses")):
        mine = [r for r in rows if r["passage_kind"] == kind]
        for d, color in zip(sorted({int(r["distance"]) for r in mine}), plt.cm.viridis([0.0, 0.3, 0.6, 0.85, 0.95])):
            at_d = [r for r in mine if int(r["distance"]) == d]
            points = sorted((int(r["window"]) / d, float(r["recalled_share"])) for r in at_d
                            if r["window"] not in ("full", "not seen"))
            ax.plot(*zip(*points), marker="o", color=color, label=f"d = {d}")
            unseen = [float(r["recalled_share"]) for r in at_d if r["window"] == "not seen"]
            ax.axhline(unseen[0], color=color, ls=":", lw=1)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("window / distance  (W / d)")
        ax.set_title(f"{kind}: recall collapses at W = d")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("share of the repeat's bytes predicted exactly")
    axes[0].legend(fontsize="small", title="dotted: not seen", title_fontsize="small")
    fig.tight_layout()
    fig.savefig(HERE / "copy_recall_vs_window.png", dpi=120)

    # What fails first: every probe with the same 4 sinks (without them this model loses its attention sink
    # and everything fails at once, chapter 04's section 6).
    rows = read("copy_window_recall_sinks.csv")
    fluency = read("copy_window_fluency.csv")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    full_x = 2 * max(int(r["window"]) for r in rows if r["window"] not in ("full", "not seen"))  # "full", drawn right

    def x_of(window):
        return full_x if window == "full" else int(window)
    for d, color in ((128, "tab:blue"), (1024, "tab:purple")):
        points = sorted((x_of(r["window"]), float(r["recalled_share"])) for r in rows if r["passage_kind"] == "word salad"
                        and int(r["distance"]) == d and r["window"] != "not seen")
        ax.plot(*zip(*points), marker="o", color=color, label=f"recall, word salad at d = {d}")
    for column, color, label in (("names_from_prompt_share", "tab:orange", "topic: names from the prompt"),
                                 ("known_word_share", "tab:green", "local fluency: known words")):
        points = sorted((x_of(r["window"]), float(r[column])) for r in fluency)
        ax.plot(*zip(*points), marker="s", color=color, label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({x_of(r["window"]) for r in fluency} | {x_of(r["window"]) for r in rows if r["window"] != "not seen"})
    ax.set_xticks(ticks, ["full" if t == full_x else str(t) for t in ticks], fontsize="small")
    ax.set_ylim(0, 1.02)
    finish(fig, ax, "window (keys each query sees, 4 of them sinks)", "share",
           "What fails first as the window shrinks (copying model)",
           "copy_what_fails_first.png", log=False, legend="lower right")

    heads = read("copy_induction.csv")
    layers, n_heads = 1 + max(int(r["layer"]) for r in heads), 1 + max(int(r["head"]) for r in heads)
    grid = [[0.0] * n_heads for _ in range(layers)]
    for r in heads:
        grid[int(r["layer"])][int(r["head"])] = float(r["next_byte_weight"])
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    image = ax.imshow(grid, cmap="magma", vmin=0, vmax=1)
    for layer in range(layers):
        for head in range(n_heads):
            ax.text(head, layer, f"{grid[layer][head]:.2f}", ha="center", va="center",
                    color="white" if grid[layer][head] < 0.5 else "black", fontsize="small")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"Attention on the byte to copy (d = {heads[0]['distance']})", fontsize="medium")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(HERE / "copy_induction_heads.png", dpi=120)


def breakdown_figure():
    rows = read("decode_breakdown.csv")
    xs = [int(r["prompt_tokens"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    parts = [("matmul_ms", "weight matrix products", "tab:blue"), ("attention_ms", "attention over the cache", "tab:orange"),
             ("other_ms", "everything else", "tab:gray")]
    ax.stackplot(xs, *[[float(r[key]) for r in rows] for key, _, _ in parts], labels=[n for _, n, _ in parts],
                 colors=[c for _, _, c in parts], alpha=0.8)
    ax.plot(xs, [float(r["step_ms_mean"]) for r in rows], color="black", marker="o", ms=3, label="whole step (mean)")
    limit = [(int(r["weight_bytes"]) + int(r["kv_bytes"])) / (float(r["limit_gbs"]) * 1e9) * 1e3 for r in rows]
    ax.plot(xs, limit, color="tab:green", ls="--", label="reading the step's bytes at the measured bandwidth")
    if len(rows) > 1:  # K/V bytes grow linearly with the prompt: the prompt at which they equal the weights' bytes
        # (a step at prompt p reads the K/V of p + steps / 2 positions, the breakdown's middle step: kv_bytes says so)
        (x0, k0), (x1, k1) = [(int(r["prompt_tokens"]), int(r["kv_bytes"])) for r in (rows[0], rows[-1])]
        per_position = (k1 - k0) / (x1 - x0)
        weights = int(rows[0]["weight_bytes"])
        cross = x0 + (weights - k0) / per_position
        ax.axvline(cross, color="tab:red", lw=1, ls=":",
                   label=f"K/V bytes = weight bytes (a prompt of {cross:.0f}: {weights / per_position:.0f} positions read)")
    finish(fig, ax, "prompt (positions)", "ms per decode step",
           f"Where a decode step's time goes ({rows[0]['threads']} thread(s))", "decode_breakdown.png", log=False,
           legend="upper left")


# Chapter 07's versions of the CUDA decode step, by the file its run wrote (plots/data/gpu/): a run kept under a
# new name is drawn under its file name until it gets a line here. breakdown_h100_synthetic_cuda.csv is book 07's
# transcript, rewritten whenever a GPU reruns it: drawn as the latest run unless it is one of the kept ones.
GPU_VERSIONS = [
    ("breakdown_h100_synthetic_cuda_unsplit.csv", "version 1: a block per query head"),
    ("breakdown_h100_synthetic_cuda_split_v1.csv", "version 2: chunks of rows (flash-decoding)"),
    ("breakdown_h100_synthetic_cuda_v3.csv", "version 3: each row read once, 4 in flight"),
    ("breakdown_h100_synthetic_cuda_v5.csv", "version 5, first run: K/V via KvView::key"),
    ("breakdown_h100_synthetic_cuda_v6.csv", "version 6: float rows, plain loads"),
    ("breakdown_h100_synthetic_cuda_v7.csv", "version 7: chunks of the visited rows"),
]
GPU_TRANSCRIPT = "breakdown_h100_synthetic_cuda.csv"


def fused_ab_points(path):
    """Version 4's synthetic rows from the A/B summary (plots/data/gpu/fused_decode_ab_h100.txt; its CSVs did not
    come back): (context, share of the limit) of the graph step, for each round of the newer build."""
    points, newer = [], False
    for line in path.read_text().splitlines():
        if line.startswith("== "):
            newer = line.rstrip().endswith("release")
            continue
        cols = line.split()
        # context, mean, p50, p99, matmul, attention, other, ops, MB read, GB/s, limit, of limit, graph p50, ...
        if newer and len(cols) >= 13 and not line.startswith("#") and int(cols[7]) > 100:  # the synthetic model's
            mb, limit, graph_ms = float(cols[8]), float(cols[10]), float(cols[12])
            points.append((int(cols[0]), 100 * mb / graph_ms / limit))  # MB / ms = GB/s
    return points


def gpu_figure():
    gpu = DATA / "gpu"
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    known = {name for name, _ in GPU_VERSIONS} | {GPU_TRANSCRIPT}
    runs = GPU_VERSIONS + [(p.name, p.stem) for p in sorted(gpu.glob("breakdown_*_synthetic_cuda*.csv")) if p.name not in known]
    kept = [(gpu / name).read_bytes() for name, _ in runs if (gpu / name).exists()]
    if (gpu / GPU_TRANSCRIPT).exists() and (gpu / GPU_TRANSCRIPT).read_bytes() not in kept:
        runs.append((GPU_TRANSCRIPT, "book 07's transcript, a 16,416-row cache"))
    for name, label in runs:
        if not (gpu / name).exists():
            continue
        rows = read(f"gpu/{name}")
        share = [100 * (int(r["weight_bytes"]) + int(r["kv_bytes"])) / (float(r["graph_ms_p50"]) * 1e6) /
                 float(r["limit_gbs"]) for r in rows]
        ax.plot([int(r["prompt_tokens"]) for r in rows], share, marker="o", label=label)
    ab = gpu / "fused_decode_ab_h100.txt"
    if ab.exists():
        points = fused_ab_points(ab)
        ax.plot([x for x, _ in points], [y for _, y in points], ls="none", marker="D", color="black",
                label="version 4: fused products (two rounds)")
    ax.axhline(75, color="gray", ls="--", lw=1, label="goal: 75% of the copy bandwidth")
    ax.set_ylim(0, 100)
    ax.set_xscale("log", base=2)
    finish(fig, ax, "context (positions)", "bytes read / graph step time, % of copy bandwidth",
           "H100, synthetic 2048/16/16/4: a decode step against the memory", "gpu_decode_bandwidth.png", log=False,
           legend="below")


def break_figures():
    rows = read("break_sweep.csv")
    kl = read("break_kl.csv")
    steps = max(int(r["steps_after"]) for r in kl) + 1  # generated tokens per run
    layers = sorted({int(r["layer"]) for r in rows})
    positions = sorted({int(r["position"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, part in zip(axes, ("key", "value")):
        grid = []
        for layer in layers:
            line = []
            for p in positions:
                values = sorted(steps if int(r["steps_to_mismatch"]) < 0 else int(r["steps_to_mismatch"])
                                for r in rows if r["part"] == part and int(r["layer"]) == layer and int(r["position"]) == p)
                line.append(values[(len(values) - 1) // 2])  # the lower median
            grid.append(line)
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis_r", vmin=0, vmax=steps)
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, "∞" if v >= steps else str(v), ha="center", va="center", fontsize=8,
                        color="black" if v < steps / 2 else "white")
        ax.set_xticks(range(len(positions)), [str(p) for p in positions], fontsize=8)
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_xlabel("corrupted position")
        ax.set_title(f"{part} corrupted")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="median steps to the first different token")
    fig.suptitle(f"How long one corrupted cache vector goes unnoticed (∞: no different token in {steps - 1} steps)")
    fig.savefig(HERE / "break_steps_to_divergence.png", dpi=120)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, part in zip(axes, ("key", "value")):
        for layer in layers:
            points = sorted((int(r["steps_after"]), float(r["kl_median"])) for r in kl
                            if r["part"] == part and int(r["layer"]) == layer)
            ax.plot(*zip(*points), lw=1, label=f"layer {layer}")
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(f"{part} corrupted")
        ax.set_xlabel("steps after the corruption")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("median KL(clean || corrupted), nats")
    axes[1].legend(fontsize="small")
    fig.suptitle("Teacher-forced: the damaged cache alone, step by step")
    fig.tight_layout()
    fig.savefig(HERE / "break_kl_over_steps.png", dpi=120)

    rows = read("break_contamination.csv")
    layers = sorted({int(r["layer"]) for r in rows})
    first = min(int(r["position"]) for r in rows)
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True)
    for ax, column, name in zip(axes, ("max_abs_dkey", "max_abs_dvalue"), ("keys", "values")):
        grid = [[float(r[column]) for r in rows if int(r["layer"]) == layer] for layer in layers]
        top = max(max(line) for line in grid) or 1.0
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="magma_r", interpolation="nearest",
                          norm=matplotlib.colors.SymLogNorm(linthresh=1e-3, vmin=0, vmax=top),
                          extent=(first - 0.5, first + len(grid[0]) - 0.5, -0.5, len(layers) - 0.5))
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_ylabel(f"layer ({name})")
        fig.colorbar(image, ax=ax, label="max |difference|")
    axes[1].set_xlabel("cached position")
    axes[0].set_title("Contamination: each cache row vs the clean run's (teacher-forced)")
    fig.savefig(HERE / "break_contamination.png", dpi=120)

    rows = read("off_by_one_probes.csv")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for shift, color in (("1", "tab:blue"), ("-1", "tab:orange")):
        mine = sorted((int(r["probe_tokens"]), int(r["passed_tokens_only"]) / int(r["prompts"]),
                       int(r["passed_tokens_and_logits"]) / int(r["prompts"])) for r in rows if r["shift"] == shift)
        if not mine:
            continue
        label = "+1" if shift == "1" else "-1"
        ax.plot([m[0] for m in mine], [m[1] for m in mine], marker="o", color=color, label=f"slot p{label}, tokens only")
        ax.plot([m[0] for m in mine], [m[2] for m in mine], marker="x", ls="--", color=color,
                label=f"slot p{label}, tokens + logits")
    ax.set_xscale("log")
    finish(fig, ax, "probe length (generated tokens)", "share of prompts whose probe passes",
           "Short probes miss the off-by-one bug; the logits never do", "off_by_one_probes.png", log=False)


def batching_figures():
    """Chapter 08: tokens/s per batch size against batch 1's (the shipped model on 1 and 2 threads, a synthetic
    model too large for the caches on 2), and reserved vs live K/V per block size."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, label, color in (("batch_throughput_1t.csv", "shipped model (4 MiB), 1 thread", "tab:blue"),
                               ("batch_throughput_2t.csv", "shipped model (4 MiB), 2 threads", "tab:orange"),
                               ("batch_throughput_synthetic_2t.csv", "synthetic 1024,8,8,2 (346 MiB), 2 threads",
                                "tab:green")):
        rows = read(name)
        ax.plot([int(r["batch"]) for r in rows], [float(r["speedup_vs_batch1"]) for r in rows], marker="o",
                color=color, label=label)
    ax.set_xscale("log", base=2)
    finish(fig, ax, "sequences decoded together (batch)", "tokens/s (decode steps, p50) / batch 1's",
           "Batching pays where a step waits on the weights", "batch_throughput.png", log=False, legend="upper left")

    rows = read("paged_memory.csv")
    labels = ["max-length" if r is rows[-1] else r["block_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = range(len(rows))
    mib = 1 << 20
    ax.bar([x - 0.2 for x in xs], [float(r["reserved_bytes_mean"]) / mib for r in rows], width=0.4,
           label="reserved (blocks handed out)", color="tab:gray")
    ax.bar([x + 0.2 for x in xs], [float(r["live_bytes_mean"]) / mib for r in rows], width=0.4,
           label="live (holding K/V)", color="tab:blue")
    for x, r in zip(xs, rows):
        ax.annotate(f"batch {r['largest_batch']}", (x, float(r["reserved_bytes_mean"]) / mib), ha="center",
                    va="bottom", fontsize="small")
    ax.set_xticks(list(xs), labels)
    finish(fig, ax, "positions per block", "MiB, averaged over the steps",
           "One KV budget, one trace: what blocks reserve and what they hold", "paged_memory.png", log=False)


def sharing_figures():
    """Chapter 09: N requests sharing a document (memory, time to first token), and N samples of one prompt."""
    rows = read("prefix_sharing.csv")
    mib = 1 << 20
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    ns = [int(r["requests"]) for r in rows]
    for column, running, label, color in (("kv_bytes_unshared", "running_unshared", "not shared (chapter 08)", "tab:gray"),
                                          ("kv_bytes_shared", "running_shared", "prefix cache", "tab:blue")):
        ys = [float(r[column]) / mib for r in rows]
        left.plot(ns, ys, marker="o", color=color, label=label)
        for n, y, r in zip(ns, ys, rows):
            left.annotate(r[running], (n, y), textcoords="offset points", xytext=(0, 5), ha="center", fontsize="x-small",
                          color=color)
    left.set_xscale("log", base=2)
    left.set_xlabel("requests sharing the document (N)")
    left.set_ylabel("K/V held at the peak, MiB (label: requests running)")
    left.legend()
    left.grid(True, alpha=0.3)
    for column, label, color in (("ttft_ms_p50_unshared", "not shared", "tab:gray"), ("ttft_ms_p50_shared", "prefix cache", "tab:blue")):
        right.plot(ns, [float(r[column]) for r in rows], marker="o", color=color, label=label)
    finish(fig, right, "requests sharing the document (N)", "time to first token, p50 (ms)",
           "One 1 KiB document, N questions: what sharing saves", "prefix_sharing.png")

    rows = read("sampling_memory.csv")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = [int(r["samples"]) for r in rows]
    ax.plot(ns, [float(r["kv_bytes_unshared"]) / mib for r in rows], marker="o", color="tab:gray", label="separate requests")
    ax.plot(ns, [float(r["kv_bytes_shared"]) / mib for r in rows], marker="o", color="tab:blue", label="shared prompt")
    ax.plot(ns, [float(r["cow_bytes"]) / mib for r in rows], marker="x", ls="--", color="tab:orange",
            label="of which copied on write")
    finish(fig, ax, "samples of one prompt (N)", "K/V held at the peak, MiB",
           "Parallel sampling: the prompt's blocks held once", "sampling_memory.png", log=False)


def quantized_figures():
    """Chapter 10: the cached keys and values channel by channel; bits per byte against bytes per position."""
    rows = read("kv_channels.csv")
    layers = sorted({int(r["layer"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, kind in zip(axes, ("key", "value")):
        for layer in layers:
            points = [(int(r["channel"]), float(r["mean_abs"])) for r in rows if r["kind"] == kind and int(r["layer"]) == layer]
            ax.plot(*zip(*sorted(points)), lw=1, label=f"layer {layer}")
        ax.set_xlabel(f"channel of the cached {kind}s (2 heads of 32)")
        ax.set_title(f"{kind}s")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("mean |x| over 2,048 positions")
    finish(fig, axes[1], f"channel of the cached values (2 heads of 32)", "mean |x| over 2,048 positions",
           "Keys have outlier channels, values hardly", "kv_channels.png", log=False)

    points = {}
    for name in ("quantized_quality.csv", "quantized_quality_g8.csv", "quantized_quality_g16.csv"):
        if (DATA / name).exists():
            for r in read(name):
                points[(r["format"], int(r["context"]))] = (int(r["bytes_per_position"]), float(r["bits_per_byte"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for context, marker in ((512, "o"), (2048, "s")):
        chosen = sorted((v[0], v[1], f) for (f, c), v in points.items() if c == context)
        ax.plot([x for x, _, _ in chosen], [y for _, y, _ in chosen], marker=marker, ls="none", label=f"context {context}")
        labels = defaultdict(list)  # formats at the same point (fp16 and bf16) share one label
        for x, y, f in chosen:
            labels[(x, round(y, 3))].append(f)
        for (x, y), names in labels.items():
            ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    finish(fig, ax, "bytes per cached position (5 layers, K and V, scales included)", "held-out bits per byte",
           "What each format saves and what it costs", "quantized_quality.png", log=False)


if __name__ == "__main__":
    argparse.ArgumentParser(description="Redraws every figure of the book (plots/*.png, beside this script) from "
                            "the CSVs in plots/data/; plots/regenerate.sh measures them first. Takes no arguments.",
                            epilog="Run: /usr/bin/python3 plots/plot.py (Debian's python3-matplotlib)").parse_args()
    check_data()
    main()
    batching_figures()
    sharing_figures()
    quantized_figures()
    print("drew every figure: plots/*.png")  # only now: a figure that failed would have stopped the script
