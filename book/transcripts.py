#!/usr/bin/env python3
"""Re-runs every command the book shows and writes its real output into the book.

A transcript in book/*.md is a ```text block right after a line `<!-- transcript -->`. Its lines that
start with "$ " are commands; everything else in the block is their output, replaced on every run by what
the commands print now (stdout and stderr together, in the order a terminal shows them). Under each block
the script writes the machine, CPU and date it ran on, so every timing says where it was measured.

A block after `<!-- transcript gpu -->` needs an NVIDIA GPU (its commands run `--backend cuda`): where
`nvidia-smi` finds none, it is left as it is and the script says so (it was captured where one was, and
its machine line names the GPU); --gpu-only re-runs those blocks alone.

    /usr/bin/python3 book/transcripts.py            # regenerate every transcript (minutes; a quiet machine)
    /usr/bin/python3 book/transcripts.py --check    # run every command with tiny settings; exit 1 if one fails
    python3 book/transcripts.py --gpu-only book/07_the_same_cache_on_a_gpu.md   # on a machine with a GPU
    /usr/bin/python3 book/transcripts.py --only kvs_tests book/03_preallocated_cache.md  # only the blocks that match

Commands run in order, chapter by chapter, with bash, in a scratch folder that looks like the repository
(build/, data/ and plots/ lead to the real ones), so files a command writes (naive.csv, long_prompt.txt)
stay out of the repository; with --check, plots/ is a scratch folder too, so the tiny runs overwrite no
plot data. (Chapter 00's corpus command rebuilds data/kjv/train.txt in place, and leaves the committed
valid.txt untouched when it is unchanged: data/build_corpus.py replaces a file only when its text differs.) --check shrinks what makes a run long (new tokens, sweep lengths, repeats, evaluated bytes, distances) and
lists test cases instead of running them: it checks that every command still runs and exits 0.
"""
import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
# The build whose binaries the book's `build/release/bin/...` commands run: build/release, or the folder CTest's entry
# names (KVS_BUILD_DIR), so that a build configured elsewhere tests its own binaries, not build/release's.
BUILD = Path(os.environ.get("KVS_BUILD_DIR") or ROOT / "build" / "release").resolve()
MARK = "<!-- transcript -->"
GPU_MARK = "<!-- transcript gpu -->"
MACHINE_PREFIX = "<sub>Captured by `book/transcripts.py`"


# A progress update (common/progress.h): "  <label>: <done> of <total> <unit>, <seconds> s".
PROGRESS = re.compile(r"^  (.+?): \d+ of \d+ .*, \d+ s$")

def gpu_name():
    """The first GPU nvidia-smi lists, or None where there is none."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.decode().strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else None


def machine_line(gpu=None):
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0))
    day = datetime.date.today().isoformat()
    where = f"{gpu} (GPU: name, memory, driver) with {cpu}, {cores} cores" if gpu else f"{cpu}, {cores} cores"
    return (f"{MACHINE_PREFIX} on {where}, {day}; threads as printed (default: every core). "
            f"Timings, page faults and resident memory differ on your machine; the text, counts and sizes do not.</sub>")


# What --check adds to one experiment of one binary to make it quick.
EXPERIMENT_SHRINK = {
    ("05_break_corrupt_key", "sweep"): " --prompts 1 --seeds 1 --max-new-tokens 8",
    ("06_break_off_by_one", "probes"): " --prompts 2 --probe-tokens 5,20",
    ("09_prefix_sharing", "prefix"): " --counts 1,2 --prefix-length 256",
    ("09_prefix_sharing", "sampling"): " --counts 1,2",
    ("09_prefix_sharing", "mixed"): " --requests 8",
    ("10_quantized_cache", "quality"): " --text-bytes 4096 --contexts 512",
    ("10_quantized_cache", "speed"): " --contexts 64 --steps 5",
    ("10_quantized_cache", "recall"): " --distances 200",
    ("10_quantized_cache", "channels"): " --text-bytes 256",
}


def shrink(command):
    """The same command with settings that make it quick (--check)."""
    command = re.sub(r"--max-new-tokens \d+", lambda m: "--max-new-tokens 8", command)
    command = re.sub(r"--lengths [\d,]+", "--lengths 32,64", command)
    command = re.sub(r"--repeats \d+", "--repeats 1", command)
    if "00_perplexity" in command and "--max-bytes" not in command:
        command = command.replace("00_perplexity", "00_perplexity --max-bytes 4096", 1)
    if "04_sliding_window" in command:
        command = re.sub(r"--windows \S+", "--windows full,8", command)
        if "--experiment perplexity" in command:
            command += " --windows full,8 --max-bytes 2048" if "--windows" not in command else " --max-bytes 2048"
        if "--experiment recall" in command and "--windows" not in command:
            command += " --windows full,8"
        if "--experiment recall" in command and "--distances" not in command:
            command += " --distances 128"
        if "--experiment stream" in command:
            command += " --stream-bytes 2100"
    for (binary, experiment), extra in EXPERIMENT_SHRINK.items():
        if binary in command and f"--experiment {experiment}" in command:
            command += extra
    if "busy_machine.sh" in command:
        command = re.sub(r"--runs \d+", "--runs 1", command) + " --tokens 20"
    if "08_paged_batching" in command:
        command = re.sub(r"--requests \d+", "--requests 6", command)
        command = re.sub(r"--batch-sizes [\d,]+", "--batch-sizes 1,2", command)
        command = re.sub(r"--block-sizes [\d,]+", "--block-sizes 16", command)
        command = re.sub(r"--synthetic [\d,]+", "--synthetic 256,2,4,2", command)
        if "--experiment throughput" in command and "--batch-sizes" not in command:
            command += " --batch-sizes 1,2"
        if "--experiment memory" in command and "--block-sizes" not in command:
            command += " --block-sizes 16"
        command = re.sub(r"--tokens [\d,]+", "--tokens 1,9", command)
        if "--experiment products" in command and "--tokens" not in command:
            command += " --tokens 1,9"
        if "--experiment products" in command and "--rounds" not in command:
            command += " --rounds 1"
    if "kvs_tests" in command:
        command += " --list-test-cases"
    return command


def scratch_folder(check):
    folder = Path(tempfile.mkdtemp(prefix="kvs-book-"))
    for name in ("data", "tests", "common", "chapters"):
        (folder / name).symlink_to(ROOT / name)
    (folder / "build").mkdir()
    (folder / "build" / "release").symlink_to(BUILD)
    if check:
        (folder / "plots" / "data" / "gpu").mkdir(parents=True)  # book 07's GPU blocks write there
    else:
        (folder / "plots").symlink_to(ROOT / "plots")
    return folder


def run(command, cwd):
    result = subprocess.run(["bash", "-c", "set -o pipefail; " + command], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    # A progress line rewritten in place shows only its last state on a terminal. The binaries write progress
    # to a pipe as a line per update (common/progress.h: "  sweep: 24 of 1200 corruptions, 1 s"): a run of
    # such lines with the same label is kept as its last, what a reader's terminal shows.
    text = result.stdout.decode("utf-8", errors="replace")
    lines = []
    for line in (line.rsplit("\r", 1)[-1] for line in text.split("\n")):
        match = PROGRESS.match(line)
        if match and lines and PROGRESS.match(lines[-1]) and PROGRESS.match(lines[-1]).group(1) == match.group(1):
            lines[-1] = line
        else:
            lines.append(line)
    return result.returncode, "\n".join(lines)


def blocks(text, path):
    """(start, end, needs_gpu) for each transcript block: the line indices of its body, between its fences."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() in (MARK, GPU_MARK):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
                raise SystemExit(f"{path}:{i + 1}: a {line.strip()} line must be followed by a ``` block")
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise SystemExit(f"{path}:{i + 1}: a {line.strip()} block is never closed with ```")
            yield i + 2, end, line.strip() == GPU_MARK


def process(path, cwd, check, gpu, gpu_only, only=None):
    """Runs the blocks of one chapter; returns (commands failed, commands run)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); give a book chapter")
    lines = text.split("\n")
    failures = ran = 0
    out = []
    cursor = 0
    for start, end, needs_gpu in list(blocks(text, path)):
        commands = [line[2:] for line in lines[start:end] if line.startswith("$ ")]
        if only and not any(re.search(only, command) for command in commands):
            continue  # --only: a block none of whose commands match stays as captured
        if (needs_gpu and not gpu) or (gpu_only and not needs_gpu):
            if needs_gpu and not gpu:
                print(f"[{path.name}] a GPU transcript left as captured: no GPU here (nvidia-smi), or no CUDA build",
                      file=sys.stderr)
            continue  # the block and its machine line stay as they are
        out.extend(lines[cursor:start])
        body = []
        printed = False
        for command in commands:
            actual = shrink(command) if check else command
            print(f"[{path.name}] $ {actual}", file=sys.stderr, flush=True)
            code, output = run(actual, cwd)
            ran += 1
            printed = printed or output.strip() != ""
            if code != 0:
                failures += 1
                print(f"  FAILED with exit code {code}:\n{output[-2000:]}", file=sys.stderr)
            elif check and "kvs_tests" in command and "passing the current filters: 0" in output:
                # doctest's listing exits 0 whatever it lists; the real run would fail on a filter that matches nothing
                failures += 1
                print("  FAILED: its --test-case filter matches no test case", file=sys.stderr)
            body.append("$ " + command)
            for line in output.rstrip("\n").split("\n") if output else []:
                # output that would read as a command or close the block on the next run is indented
                body.append(" " + line if line.startswith(("$ ", "```")) else line)
        if not printed:  # a filter (sed, grep) that matched nothing would leave an empty transcript and exit 0
            failures += 1
            print("  FAILED: the block's commands printed nothing", file=sys.stderr)
        out.extend(body)
        out.append(lines[end])  # the closing fence
        cursor = end + 1
        # the machine line right after the block: replaced, or inserted
        if cursor < len(lines) and lines[cursor].startswith(MACHINE_PREFIX):
            cursor += 1
        out.append(machine_line(gpu if needs_gpu else None))
    out.extend(lines[cursor:])
    if not check and failures == 0:  # a failed command's output never lands in the book
        path.write_text("\n".join(out))
    return failures, ran


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="run every command with tiny settings, change nothing")
    parser.add_argument("--gpu-only", action="store_true", help="re-run only the blocks that need a GPU")
    parser.add_argument("--only", metavar="REGEX",
                        help="re-run only the blocks with a command matching REGEX (e.g. a test run whose line numbers "
                             "moved), leaving the timed ones as captured")
    parser.add_argument("chapters", nargs="*", help="book files to process (default: every chapter, in order)")
    args = parser.parse_args()
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as e:
            parser.error(f"--only {args.only!r} is not a regular expression: {e}")
    if not (BUILD / "bin").is_dir():  # else every command fails alike, each naming build/release
        where = f"KVS_BUILD_DIR={os.environ['KVS_BUILD_DIR']}" if os.environ.get("KVS_BUILD_DIR") else str(BUILD)
        print(f"transcripts.py: {where} has no bin/ folder of built binaries; build first (cmake --workflow --preset "
              "release) or point KVS_BUILD_DIR at a build", file=sys.stderr)
        return 2
    paths = [Path(p).resolve() for p in args.chapters] or sorted(BOOK.glob("[0-9][0-9]_*.md"))
    for path in paths:
        if not path.is_file():
            print(f"transcripts.py: {path} is not a file; give chapters such as book/03_preallocated_cache.md",
                  file=sys.stderr)
            return 2
    cwd = scratch_folder(args.check)
    try:
        gpu = gpu_name()
        if gpu and not (BUILD / "bin" / "libkvs_cuda.so").exists():
            print(f"a GPU is here ({gpu}) but this build has no CUDA backend (nvcc was not found at configure): "
                  "the GPU transcripts stay as captured", file=sys.stderr)
            gpu = None
        results = [process(path, cwd, args.check, gpu, args.gpu_only, args.only) for path in paths]
    finally:
        shutil.rmtree(cwd)
    failures, ran = sum(r[0] for r in results), sum(r[1] for r in results)
    if ran == 0:  # --only or --gpu-only that matched nothing, or GPU blocks alone with no GPU: nothing was captured
        print("no command ran: nothing matched --only, or every block needs a GPU this machine or build lacks",
              file=sys.stderr)
        return 1
    redraw = not args.check and not args.gpu_only and not args.only
    if failures:  # the figures are not redrawn: the CSVs may hold a failed run's part
        print(f"{failures} command(s) failed" + ("; the figures were not redrawn" if redraw else ""), file=sys.stderr)
        return 1
    if redraw:
        code, output = run(f"/usr/bin/python3 '{ROOT}/plots/plot.py'", ROOT)
        print(output, file=sys.stderr)
        if code != 0:
            print("plots/plot.py failed", file=sys.stderr)
            return 1
    print("every command the book shows ran and exited 0", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
