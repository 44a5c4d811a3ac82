#!/usr/bin/env python3
"""Each thread's heaviest functions in a folded-stack profile (`gpt_pretrain --host-profile`).

    python3 tools/host_profile.py FILE [--top 12] [--threads 6]

Prints, as markdown, the samples per thread (threads of one pattern summed: a rank's body runs
on `rank-N-worker-N`, its rayon pool; CubeCL's device thread, which takes every launch and
allocation, is `DSD-N-N`; the communication thread `wildfire-comm-N`), then for the busiest threads the functions with the most samples of their own (the
innermost frame: where the CPU was) and the most samples under them (anywhere on the stack,
counted once per sample; frames on every one of the thread's stacks left out). Rust names lose their generic arguments (a trait impl keeps its
`<Type as Trait>` head) so that one function is one row.

Where `FILE.threads.tsv` is beside it (written with the profile), the thread table also has each
thread pattern's CPU time over the profile's window, read from the threads' own CPU clocks:
seconds, per step, how busy it kept the CPUs (CPU time over wall time, summed over the pattern's
threads: a pool of two busy workers shows 200%), and how many samples each CPU second left. Samples are not time: the kernel sends at most one per tick (≈ 250 a CPU second
here, whatever the 997 Hz asked), and a thread that blocks SIGPROF is never sampled (its own row).
A thread a library makes takes its maker's name: lavapipe's shader and queue threads, made by
CubeCL's Wgpu device thread, are named `DSD-N-N` too and block SIGPROF (Mesa's mask), so on
lavapipe the blocked `DSD-N-N` row is the emulated GPU's work and the open one CubeCL's device
thread. A thread with far fewer samples per CPU second than the others is under-represented in
the tables.
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


def read_threads(path):
    """The threads' CPU times written beside a profile: ({key: value}, [(thread, tid, seconds)]),
    or None where there is no such file."""
    try:
        f = open(path)
    except OSError:
        return None
    meta, rows = {}, []
    with f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("#"):
                parts = line[1:].split()
                if len(parts) == 2:
                    try:
                        meta[parts[0]] = float(parts[1])
                    except ValueError:
                        pass
            elif line and not line.startswith("thread\t"):
                name, tid, cpu, *rest = line.split("\t")
                # a thread that blocks SIGPROF is never sampled: its own row, so that its CPU
                # time is not read as its pattern's samples' time
                if rest and rest[0] == "blocked":
                    name += " (blocks SIGPROF: never sampled; a driver's threads carry their maker's name)"
                rows.append((name, int(tid), float(cpu)))
    return meta, rows


def report(stacks, top=12, threads=6, out=sys.stdout, clocks=None):
    total = sum(c for _, _, c in stacks)
    if total == 0:
        print("no samples", file=out)
        return
    per_thread = collections.Counter()
    for t, _, c in stacks:
        per_thread[pattern(t)] += c
    print(f"**{total} samples** (CPU time; sleeping and parked threads are not sampled)\n", file=out)
    if clocks is None:
        print("| threads | samples | share |", file=out)
        print("|---|---|---|", file=out)
        for t, c in per_thread.most_common():
            print(f"| `{t}` | {c} | {100 * c / total:.1f}% |", file=out)
    else:
        meta, rows = clocks
        wall, steps = meta.get("wall_seconds", 0.0), int(meta.get("steps", 0))
        cpu = collections.Counter()
        for name, _, seconds in rows:
            cpu[pattern(name)] += seconds
        print(
            f"Window: {steps} steps, {wall:.2f} s wall; {sum(cpu.values()):.2f} s of CPU in the "
            f"process's threads ({total / max(sum(cpu.values()), 1e-9):.0f} samples per CPU second)\n",
            file=out,
        )
        print("| threads | samples | share | CPU s | CPU ms per step | busy (CPU / wall) | samples per CPU s |", file=out)
        print("|---|---|---|---|---|---|---|", file=out)
        def clock_cols(s, samples):
            """CPU s | ms per step | busy | samples per CPU s, for `s` CPU seconds."""
            per_step = f"{1e3 * s / steps:.1f}" if steps else "–"
            busy = f"{100 * s / wall:.0f}%" if wall else "–"
            return f"{s:.2f} | {per_step} | {busy} | {samples / max(s, 1e-9):.0f}"

        # both name a thread by its comm (at most 15 bytes), so the patterns match
        for t, c in per_thread.most_common():
            cols = clock_cols(cpu[t], c) if t in cpu else "– | – | – | –"
            print(f"| `{t}` | {c} | {100 * c / total:.1f}% | {cols} |", file=out)
        for p, s in cpu.most_common():
            if p not in per_thread and s >= 0.01:
                print(f"| `{p}` (no samples) | 0 | 0.0% | {clock_cols(s, 0)} |", file=out)
    for t, c in per_thread.most_common(threads):
        own, under = collections.Counter(), collections.Counter()
        for th, frames, n in stacks:
            if pattern(th) != t or not frames:
                continue
            own[frames[-1]] += n
            for f in dict.fromkeys(frames):  # once per sample, in stack order (stable ties)
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
    report(read(a.file), a.top, a.threads, clocks=read_threads(a.file + ".threads.tsv"))


if __name__ == "__main__":
    main()
