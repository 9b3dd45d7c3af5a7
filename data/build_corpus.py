"""Build the King James Bible corpus for training, deterministically, from Debian's bible-kjv package.

    /usr/bin/python3 data/build_corpus.py          # writes data/kjv/train.txt and data/kjv/valid.txt

`bible "Gen1:1-Rev22:21"` prints each chapter as a heading ("Genesis 1") and numbered verses wrapped at
80 columns. We unwrap every verse onto one line ("1 In the beginning God created ...") so the model
learns the text, not the terminal width, and keep headings with a blank line around them.

Split: validation is the contiguous tail of the corpus, from the first chapter heading at or after 95%
of its bytes to the end (the last epistles and Revelation), so it is prose the model never trained on.
train.txt is rebuilt from the package and not committed; valid.txt is committed so that evaluation and
the default prompts work without the package. Both must be the texts the shipped model was trained and measured on
(SHA256 below): a bible-kjv that prints another text stops the script before valid.txt changes
(`--force` replaces it anyway), and a train.txt of other bytes is written with a warning.
"""
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALID_FRACTION = 0.05
# The texts of the shipped model (Debian 12's bible-kjv, 4.38): 4,026,137 and 209,895 bytes.
TRAIN_SHA256 = "08299bb8f85a137384d499356329732214e25d2afb4ae3ab2a6b1e558628d9da"
VALID_SHA256 = "00ed3c94a1e16a398c0322e79939caf6b5a7301db0e49ea41e677279e44e62b6"


def read_bible():
    try:
        raw = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        sys.exit("error: the 'bible' command is missing; install Debian's bible-kjv package "
                 "(sudo apt-get install bible-kjv)")
    return raw.splitlines()


def unwrap(lines):
    out, verse = [], None
    for i, line in enumerate(lines):
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            if verse:
                out.append(verse)
            verse = f"{m.group(1)} {m.group(2).strip()}"
        elif not line.strip():
            if verse:
                out.append(verse)
                verse = None
        elif verse is not None:
            verse += " " + line.strip()
        else:  # a chapter heading such as "Genesis 1"
            out.append("")
            out.append(line.strip())
            out.append("")
    if verse:
        out.append(verse)
    text = "\n".join(out).strip("\n") + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def replace_if_changed(path, text):
    """Leaves an identical file untouched; otherwise writes a temporary file and renames it over `path`, so
    a program reading the file meanwhile (a test, a chapter) sees the old text or the new, never a part."""
    data = text.encode()
    if path.exists() and path.read_bytes() == data:
        return
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def main():
    force = sys.argv[1:] == ["--force"]
    if sys.argv[1:] and not force:
        sys.exit("usage: build_corpus.py [--force]")
    text = unwrap(read_bible())
    cut = int(len(text) * (1 - VALID_FRACTION))
    cut = text.index("\n\n", cut) + 2  # start validation at a chapter heading
    train, valid = text[:cut], text[cut:]
    if sha256(valid) != VALID_SHA256 and not force:
        sys.exit(f"error: this bible-kjv gives another held-out text ({len(valid)} bytes, SHA256 {sha256(valid)[:12]}...) "
                 "than the one the shipped model and the book were measured on; data/kjv/valid.txt is left as it is "
                 "(pass --force to replace it)")
    if sha256(train) != TRAIN_SHA256:
        print(f"warning: this bible-kjv gives another training text ({len(train)} bytes) than the shipped model's "
              "(4,026,137): a model trained on it is not the shipped one", file=sys.stderr)
    (HERE / "kjv").mkdir(exist_ok=True)
    replace_if_changed(HERE / "kjv" / "train.txt", train)
    replace_if_changed(HERE / "kjv" / "valid.txt", valid)
    first = valid.splitlines()[0]
    print(f"corpus {len(text)} bytes: train {len(train)} bytes, valid {len(valid)} bytes "
          f"({100 * len(valid) / len(text):.1f}%, from '{first}' to the end)")


if __name__ == "__main__":
    main()
