#!/usr/bin/env python3
"""The A/B of tests/gpu_session.sh as book 07's tables: one row per model, context and build, each round's
p50s side by side (run-to-run spread is part of the result), from the CSVs `03_benchmark --breakdown` wrote.

    python3 tests/gpu_ab_table.py OUT_DIR      # prints Markdown; gpu_session.sh writes it to OUT_DIR/ab_table.md

Files read: OUT_DIR/{shipped,synthetic}_{base,release,plain,chunks-S-R,gemv-warps-W}_{ROUND}.csv (plain: this
build with KVS_PROGRAMMATIC_LAUNCH=0; chunks-S-R: with KVS_DECODE_CHUNKS=S,R, and gemv-warps-W: with
KVS_GEMV_WARPS=W, the step chunks) and OUT_DIR/shipped_cpu1.csv
(one CPU core, the same contexts). A column an older
build's CSV lacks prints as "-". Standard library only: the GPU machine has python3 and nothing to install.

Columns: step p50 (a plain run, ms), graph p50 (the step recorded once and replayed, ms), attention (ms a step,
in the breakdown's run that times each operation apart, waiting after each), launches in the recorded step,
graph p50 / launches (µs, the kernels' work included: an upper bound on a launch's cost), and
the bytes a step must read (weights + the K/V rows it attends to) over the graph p50, as a share of the read
bandwidth the benchmark measured beside it (limit_gbs).
"""
import csv
import re
import sys
from pathlib import Path

VARIANTS = {"base": "base", "release": "this build", "plain": "this build, plain launch"}


def read_rounds(out: Path):
    """{(model, variant): {round: {context: row}}} from the files named as gpu_session.sh names them."""
    runs = {}
    for path in sorted(out.glob("*.csv")):
        match = re.fullmatch(r"(shipped|synthetic)_(base|release|plain|chunks-\d+-\d+|gemv-warps-\d+)_(\d+)\.csv", path.name)
        if not match:
            continue
        model, variant, round_ = match.group(1), match.group(2), int(match.group(3))
        with path.open(newline="") as f:
            rows = {int(r["prompt_tokens"]): r for r in csv.DictReader(f)}
        runs.setdefault((model, variant), {})[round_] = rows
    return runs


def number(row, column):
    value = row.get(column, "")
    try:
        return float(value)
    except ValueError:
        return None


def joined(values, form):
    """Each round's value, ' / ' between rounds; '-' where a CSV has no such column (or no such value)."""
    return " / ".join("-" if v is None else form.format(v) for v in values)


def label(variant):
    """A build's name in the table: VARIANTS', or the setting this build ran with."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    if variant.startswith("gemv-warps-"):
        return f"this build, KVS_GEMV_WARPS={variant.split('-')[2]}"
    splits, rows = variant.split("-")[1:]
    return f"this build, KVS_DECODE_CHUNKS={splits},{rows}"


def settings(model, runs, prefix):
    """The variants of one setting (its name's prefix) that ran for the model, in the order of their numbers."""
    return sorted((v for m, v in runs if m == model and v.startswith(prefix)),
                  key=lambda v: tuple(int(x) for x in v[len(prefix):].split("-")))


def table(model, runs, cpu_rows):
    variants = ([v for v in VARIANTS if (model, v) in runs] + settings(model, runs, "chunks-")
                + settings(model, runs, "gemv-warps-"))
    if not variants:
        return []
    contexts = sorted({c for v in variants for rows in runs[(model, v)].values() for c in rows})
    lines = [f"### {model}", "",
             "| context | build | step p50 (ms) | graph p50 (ms) | attention (ms) | launches | graph / launch (µs) "
             "| of the read limit |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for context in contexts:
        for variant in variants:
            rounds = [runs[(model, variant)][r].get(context, {}) for r in sorted(runs[(model, variant)])]
            step = [number(r, "step_ms_p50") for r in rounds]
            graph = [number(r, "graph_ms_p50") or None for r in rounds]  # 0: the backend cannot record a step
            attention = [number(r, "attention_ms") for r in rounds]
            launches = [number(r, "graph_launches") or None for r in rounds]
            per_launch = [g * 1000 / n if g and n else None for g, n in zip(graph, launches)]
            share = []
            for r, g in zip(rounds, graph):
                weights, kv, limit = number(r, "weight_bytes"), number(r, "kv_bytes"), number(r, "limit_gbs")
                share.append((weights + kv) / (g * 1e6) / limit * 100 if g and weights and kv is not None and limit else None)
            lines.append(f"| {context:,} | {label(variant)} | {joined(step, '{:.3f}')} | {joined(graph, '{:.3f}')} | "
                         f"{joined(attention, '{:.3f}')} | {joined(launches, '{:.0f}')} | {joined(per_launch, '{:.1f}')} | {joined(share, '{:.0f}%')} |")
        if context in cpu_rows:
            lines.append(f"| {context:,} | one CPU core | {joined([number(cpu_rows[context], 'step_ms_p50')], '{:.3f}')} "
                         "| | | | | |")
    return lines + [""]


def main():
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: gpu_ab_table.py OUT_DIR (the folder tests/gpu_session.sh wrote its CSVs to)")
    out = Path(sys.argv[1])
    runs = read_rounds(out)
    if not runs:
        sys.exit(f"gpu_ab_table.py: no {{shipped,synthetic}}_{{base,release,plain,chunks-S-R,gemv-warps-W}}_ROUND.csv in {out}; "
                 "run tests/gpu_session.sh with the step ab or chunks first")
    cpu_rows = {}
    if (out / "shipped_cpu1.csv").exists():
        with (out / "shipped_cpu1.csv").open(newline="") as f:
            cpu_rows = {int(r["prompt_tokens"]): r for r in csv.DictReader(f)}
    lines = []
    for model in ("shipped", "synthetic"):
        lines += table(model, runs, cpu_rows if model == "shipped" else {})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
