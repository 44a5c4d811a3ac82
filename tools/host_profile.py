#!/usr/bin/env python3
"""Each thread's heaviest functions in a folded-stack profile (`gpt_pretrain --host-profile`).

    python3 tools/host_profile.py FILE [--top 12] [--threads 6]

Prints, as markdown, the samples per thread (threads of one pattern summed: a rank's body runs
on `rank-N-worker-N`, its rayon pool; CubeCL's device thread, which takes every launch and
allocation, is `DSD-N-N`; the communication thread `wildfire-comm-N`), then for the busiest threads the functions with the most samples of their own (the
innermost frame: where the CPU was) and the most samples under them (anywhere on the stack,
counted once per sample; frames on every one of the thread's stacks left out). Rust names lose their generic arguments (a trait impl keeps its
`<Type as Trait>` head) so that one function is one row.
"""
import argparse
import collections
import re
import sys


def short(name: str) -> str:
    """A Rust symbol without generic arguments or hash: `a::B<T>::f` is `a::B::f`, and a
    qualified head keeps its types (`<a::B<T> as c::D<U>>::f` is `<a::B as c::D>::f`)."""
    name = re.sub(r"::h[0-9a-f]{16}$", "", name)

    def strip(s: str) -> str:
        out, i = [], 0
        while i < len(s):
            c = s[i]
            if c != "<":
                out.append(c)
                i += 1
                continue
            depth, j = 0, i
            while j < len(s):
                if s[j] == "<":
                    depth += 1
                elif s[j] == ">" and s[j - 1] != "-":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            inner = s[i + 1 : j]
            if out and (out[-1].isalnum() or out[-1] in "_}"):
                pass  # generic arguments: dropped
            else:
                out.append("<" + strip(inner) + ">")  # a qualified path's head
            i = j + 1
        return "".join(out)

    return strip(name)


def pattern(thread: str) -> str:
    return re.sub(r"\d+", "N", thread)


def read(path):
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            head, _, count = line.rpartition(" ")
            frames = head.split(";")
            stacks.append((frames[0], [short(x) for x in frames[1:]], int(count)))
    return stacks


def report(stacks, top=12, threads=6, out=sys.stdout):
    total = sum(c for _, _, c in stacks)
    if total == 0:
        print("no samples", file=out)
        return
    per_thread = collections.Counter()
    for t, _, c in stacks:
        per_thread[pattern(t)] += c
    print(f"**{total} samples** (CPU time; sleeping and parked threads are not sampled)\n", file=out)
    print("| threads | samples | share |", file=out)
    print("|---|---|---|", file=out)
    for t, c in per_thread.most_common():
        print(f"| `{t}` | {c} | {100 * c / total:.1f}% |", file=out)
    for t, c in per_thread.most_common(threads):
        own, under = collections.Counter(), collections.Counter()
        for th, frames, n in stacks:
            if pattern(th) != t or not frames:
                continue
            own[frames[-1]] += n
            for f in set(frames):
                under[f] += n
        print(f"\n### `{t}`: {c} samples\n", file=out)
        print("| own samples | function |", file=out)
        print("|---|---|", file=out)
        for f, n in own.most_common(top):
            print(f"| {100 * n / c:.1f}% | `{f}` |", file=out)
        print("\n| under (inclusive) | function |", file=out)
        print("|---|---|", file=out)
        # frames on every stack of the thread (its start, the pool's loop) say nothing
        rows = [(f, n) for f, n in under.most_common() if n < c][: top * 2]
        for f, n in rows:
            print(f"| {100 * n / c:.1f}% | `{f}` |", file=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--threads", type=int, default=6)
    a = ap.parse_args()
    report(read(a.file), a.top, a.threads)


if __name__ == "__main__":
    main()
