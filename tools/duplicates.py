#!/usr/bin/env python3
"""Find blocks of Rust code written twice: runs of 6 or more consecutive code lines (whitespace
and comments aside) that stand again elsewhere in the workspace, in the same or another file.

A run counts only when most of its lines carry some code (at least 4 of any 6 lines with 12 or
more characters), so closing braces and short `use` lines do not make duplicates by themselves.
Generated files (`parallel/src/backend/forward/`) and vendored crates (`vendor/`: upstream code,
patched, not ours to factor) are left out.

    python3 tools/duplicates.py              # list the duplicated runs, longest first
    python3 tools/duplicates.py --max N      # also fail (exit 1) when there are more than N

CI runs it with `--max` at the count of the day it was added, so the count can only go down.
"""
import argparse
import collections
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
WINDOW = 6
SKIP = ("parallel/src/backend/forward/", "vendor/")


def files():
    out = subprocess.run(["git", "ls-files", "*.rs"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [f for f in out if not f.startswith(SKIP)]


def code_lines(path):
    """(line number, normalised text) of the lines that hold code."""
    text = (ROOT / path).read_text()
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        line = re.sub(r"//.*", "", line).strip()
        if line:
            out.append((n, re.sub(r"\s+", " ", line)))
    return out


def substantial(lines):
    return sum(len(t) >= 12 for t in lines) >= 4


def runs():
    """Maximal duplicated runs: (lines, (file, first, last), (file, first, last))."""
    seen = collections.defaultdict(list)
    content = {}
    for f in files():
        lines = code_lines(f)
        content[f] = lines
        for i in range(len(lines) - WINDOW + 1):
            window = tuple(t for _, t in lines[i:i + WINDOW])
            if substantial(window):
                seen[window].append((f, i))
    # Pairs of window starts sharing a window, grown into maximal runs along both files.
    pairs = set()
    for places in seen.values():
        if len(places) < 2 or len(places) > 8:  # more than 8: a pattern, not a copy
            continue
        for a in range(len(places)):
            for b in range(a + 1, len(places)):
                pairs.add((places[a], places[b]))
    found, covered = [], set()
    for (fa, ia), (fb, ib) in sorted(pairs):
        if ((fa, ia), (fb, ib)) in covered:
            continue
        la, lb = content[fa], content[fb]
        # walk back to the run's start, then forward to its end
        while ia > 0 and ib > 0 and la[ia - 1][1] == lb[ib - 1][1] and (fa, ia - 1) != (fb, ib):
            ia, ib = ia - 1, ib - 1
        length = 0
        while (ia + length < len(la) and ib + length < len(lb)
               and la[ia + length][1] == lb[ib + length][1]
               and (fa != fb or ia + length < ib)):
            covered.add(((fa, ia + length), (fb, ib + length)))
            length += 1
        if length >= WINDOW:
            found.append((length, (fa, la[ia][0], la[ia + length - 1][0]),
                          (fb, lb[ib][0], lb[ib + length - 1][0])))
    return sorted(found, key=lambda r: (-r[0], r[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max", type=int, help="fail when there are more duplicated runs")
    args = parser.parse_args()
    found = runs()
    for length, (fa, a0, a1), (fb, b0, b1) in found:
        print(f"{length:3} lines  {fa}:{a0}-{a1}  ~  {fb}:{b0}-{b1}")
    print(f"{len(found)} duplicated runs of {WINDOW}+ code lines")
    if args.max is not None and len(found) > args.max:
        print(f"error: more than the ceiling of {args.max}: factor the new copy out",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
