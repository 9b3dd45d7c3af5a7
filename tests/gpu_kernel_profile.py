#!/usr/bin/env python3
"""Where a decode step's GPU time goes, kernel by kernel: the Nsight Compute CSV of tests/gpu_session.sh's step
`profile` (the synthetic model's decode steps) as one Markdown table.

    python3 tests/gpu_kernel_profile.py NCU_CSV      # gpu_session.sh writes it to OUT_DIR/profile.md

NCU_CSV: what `ncu --csv --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,...
--log-file NCU_CSV` wrote; its lines that are not CSV (ncu's ==PROF== notes) are skipped. ncu runs each kernel
alone, caches flushed before it: the times are the kernels' own, without the gaps between launches that the
graph step also pays, and a kernel's inputs come from DRAM even where a real step finds them in L2.

One row per kernel (template arguments kept, parameters dropped) and grid: launches, mean µs, MB read from DRAM
per launch, its rate (GB/s: bytes read over the kernel's own time, to set against the copy bandwidth the
benchmark measures), its share of the kernels' summed time, and where ncu measured them, registers per thread
and the warps active on a multiprocessor as a share of its most (achieved occupancy). Below it, per decode step (a step launches
embed_kernel once): the kernels' summed time and DRAM bytes, the step's floor without launch gaps.
Standard library only: the GPU machine has python3 and nothing to install.
"""
import csv
import re
import sys
from pathlib import Path

TIME, READ = "gpu__time_duration.sum", "dram__bytes_read.sum"
REGISTERS, OCCUPANCY = "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active"  # optional
# Nsight Compute 2025.3 on the H100 (2026-11-26) wrote "ns"; older versions "nsecond".
SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6,  # to µs
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}  # to bytes


def number(text, unit):
    if unit not in SCALE:
        raise ValueError(f"a unit this script does not know: {unit!r} (was ncu given --print-units base?)")
    return float(text.replace(",", "")) * SCALE[unit]


def optional_number(text):
    """A metric that may be missing or 'n/a': None then."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_launches(path: Path):
    """[(kernel, grid, µs, bytes read, registers per thread, achieved occupancy %)] in launch order (None for
    an optional metric ncu was not asked for)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header, rows = rows[0], rows[1:]
    for needed in ("Kernel Name", "Grid Size", TIME, READ):
        if needed not in header:
            raise ValueError(f"{path}: no column {needed!r} (was ncu given --csv --page raw and --metrics {TIME},{READ}?)")
    at = {name: header.index(name) for name in ("ID", "Kernel Name", "Grid Size", TIME, READ, REGISTERS, OCCUPANCY)
          if name in header}
    units = {}
    if rows and "ID" in at and rows[0][at["ID"]] == "":  # the units row
        units = {name: rows[0][i] for name, i in at.items()}
        rows = rows[1:]
    launches = []
    optional = lambda r, name: optional_number(r[at[name]]) if name in at else None
    for r in rows:
        launches.append((short_name(r[at["Kernel Name"]]), r[at["Grid Size"]].strip(),
                         number(r[at[TIME]], units.get(TIME, "nsecond")), number(r[at[READ]], units.get(READ, "byte")),
                         optional(r, REGISTERS), optional(r, OCCUPANCY)))
    return launches


def short_name(demangled):
    """'void kvs::(anonymous namespace)::gemv_kernel<1, 4, (kvs::...::GemvStore)0>(kvs::...::GemvArgs)' ->
    'gemv_kernel<1, 4, (GemvStore)0>': the return type, namespaces and parameter list dropped."""
    name = demangled.strip()
    if name.startswith("void "):
        name = name[len("void "):]
    if name.endswith(")"):  # the parameter list: from its matching parenthesis
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    # ncu 2025.3 (H100, 2026-11-26) writes the anonymous namespace as 'unnamed>::'
    return re.sub(r"(\w+::|\(anonymous namespace\)::|<?unnamed>::)", "", name)


def report(launches):
    if not launches:
        return ["no kernel was profiled (ncu's filter matched nothing, or the run failed: see profile_run.log)"]
    # (kernel, grid, bytes of its first launch) -> [µs, ...], [bytes, ...]. Launches of one kernel and grid that
    # read different amounts are different products (Wo's and W2's adds: 16.8 and 46.1 MB in the synthetic model).
    groups = {}
    for name, grid, us, read, registers, occupancy in launches:
        key = next((k for k in groups if k[:2] == (name, grid) and abs(read - k[2]) <= 0.1 * max(read, k[2])),
                   (name, grid, read))
        g = groups.setdefault(key, ([], [], [], []))
        g[0].append(us)
        g[1].append(read)
        if registers is not None:
            g[2].append(registers)
        if occupancy is not None:
            g[3].append(occupancy)
    total_us = sum(launch[2] for launch in launches)
    mean = lambda values, form: form.format(sum(values) / len(values)) if values else "-"
    lines = ["| kernel | grid | launches | µs each | MB read each | GB/s | share of time | registers | warps active |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, grid, _), (times, reads, registers, occupancy) in sorted(groups.items(), key=lambda kv: -sum(kv[1][0])):
        us, read = sum(times) / len(times), sum(reads) / len(reads)
        lines.append(f"| `{name}` | {grid} | {len(times)} | {us:.1f} | {read / 1e6:.2f} | "
                     f"{read / us / 1e3 if us > 0 else 0:.0f} | {100 * sum(times) / total_us if total_us > 0 else 0:.1f}% | "
                     f"{mean(registers, '{:.0f}')} | {mean(occupancy, '{:.0f}%')} |")
    steps = sum(1 for launch in launches if launch[0].startswith("embed_kernel"))
    total_read = sum(launch[3] for launch in launches)
    lines.append("")
    if steps:
        lines.append(f"Per decode step ({steps} profiled, {len(launches) / steps:.1f} launches each): kernels "
                     f"{total_us / steps / 1e3:.3f} ms summed, {total_read / steps / 1e6:.1f} MB read from DRAM, "
                     f"{total_read / total_us / 1e3 if total_us > 0 else 0:.0f} GB/s over the kernels' own time.")
    else:
        lines.append(f"{len(launches)} launches, no embed_kernel among them (not whole steps): kernels "
                     f"{total_us / 1e3:.3f} ms summed, {total_read / 1e6:.1f} MB read from DRAM.")
    return lines


def main(argv, doc=__doc__, script="gpu_kernel_profile.py", read=read_launches, make=report):
    """The command line of this script and of gpu_stall_table.py: NCU_CSV in, the table out (exit 1 on a bad file,
    2 on a bad command line)."""
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(doc.strip())
        return 0 if len(argv) == 2 else 2
    path = Path(argv[1])
    if not path.is_file():
        print(f"{script}: error: {path} is not a file; give the CSV ncu wrote (--log-file)", file=sys.stderr)
        return 1
    try:
        print("\n".join(make(read(path))))
    except ValueError as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
