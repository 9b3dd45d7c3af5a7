#!/usr/bin/env python3
"""What a kernel's warps wait on: the Nsight Compute CSV of tests/gpu_session.sh's stall profiles (step `profile`:
one decoding-kernel launch, five of a decode step's products) as one Markdown table, a row per launch.

    python3 tests/gpu_stall_table.py NCU_CSV      # gpu_session.sh writes it to OUT_DIR/stalls_*.md

NCU_CSV: what `ncu --csv --page raw --print-units base --section WarpStateStats ... --log-file NCU_CSV` wrote
(its lines that are not CSV skipped, as tests/gpu_kernel_profile.py does). WarpStateStats gives, per stall reason,
smsp__average_warps_issue_stalled_REASON_per_issue_active.ratio: how many warps wait for that reason, on average,
each cycle the scheduler issues an instruction. Their sum is the warps a scheduler holds per issue; a reason's
share of the sum says what a warp's time goes to (long_scoreboard: a load from memory or L2; short_scoreboard:
shared memory or a special function such as exp; barrier: __syncthreads; lg_throttle: too many loads queued;
wait: a fixed-latency dependency; math_pipe_throttle, not_selected, selected: the pipes or the scheduler busy).

Columns: kernel and grid, its own time (µs), warps active on a multiprocessor (share of its most), and the
largest stall reasons, each with its warps per issue and share. Standard library only.
"""
import csv
import re
import sys
from pathlib import Path

from gpu_kernel_profile import main, number, optional_number, short_name

TIME, OCCUPANCY = "gpu__time_duration.sum", "sm__warps_active.avg.pct_of_peak_sustained_active"
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
SHOWN = 6  # reasons a row shows, the largest first


def read_launches(path: Path):
    """[(kernel, grid, µs or None, warps active % or None, {reason: warps per issue})] in launch order."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header, rows = rows[0], rows[1:]
    for needed in ("Kernel Name", "Grid Size"):
        if needed not in header:
            raise ValueError(f"{path}: no column {needed!r} (was ncu given --csv --page raw?)")
    stalls = {i: m.group(1) for i, name in enumerate(header) if (m := STALL.fullmatch(name))}
    if not stalls:
        raise ValueError(f"{path}: no column smsp__average_warps_issue_stalled_*_per_issue_active.ratio (was ncu given "
                         "--section WarpStateStats --page raw?)")
    units = {}
    if rows and "ID" in header and rows[0][header.index("ID")] == "":  # the units row
        units, rows = dict(zip(header, rows[0])), rows[1:]
    at = {name: header.index(name) for name in ("Kernel Name", "Grid Size", TIME, OCCUPANCY) if name in header}
    launches = []
    for r in rows:
        us = number(r[at[TIME]], units.get(TIME, "ns")) if TIME in at and optional_number(r[at[TIME]]) is not None else None
        occupancy = optional_number(r[at[OCCUPANCY]]) if OCCUPANCY in at else None
        waits = {reason: value for i, reason in stalls.items() if (value := optional_number(r[i])) is not None}
        launches.append((short_name(r[at["Kernel Name"]]), r[at["Grid Size"]].strip(), us, occupancy, waits))
    return launches


def report(launches):
    if not launches:
        return ["no kernel was profiled (ncu's filter matched nothing, or the run failed: see its _run.log)"]
    lines = ["| kernel | grid | µs | warps active | warps waiting per issue, the largest reasons first (share) |",
             "|---|---|---:|---:|---|"]
    for name, grid, us, occupancy, waits in launches:
        total = sum(waits.values())
        largest = sorted(waits.items(), key=lambda kv: -kv[1])[:SHOWN]
        reasons = ", ".join(f"{reason} {value:.2f} ({100 * value / total:.0f}%)" for reason, value in largest) if total else "-"
        lines.append(f"| `{name}` | {grid} | {'-' if us is None else f'{us:.1f}'} | "
                     f"{'-' if occupancy is None else f'{occupancy:.0f}%'} | {total:.2f} in all: {reasons} |")
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv, __doc__, "gpu_stall_table.py", read_launches, report))
