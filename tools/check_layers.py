#!/usr/bin/env python3
"""Check the module structure of every crate of the workspace: no import cycle between files in
any crate, and in parallel/src the layering written down in parallel/src/lib.rs.

Reads every `crate::…` and `super::…` path outside comments and test modules (`tests.rs`, inline
`mod tests { .. }`), maps it to the file that defines it (a name a `lib.rs` or `mod.rs`
re-exports, `crate::Error`, to its module), and fails (exit 1) on
- a cycle between files, apart from a `mod.rs` re-exporting its children, and
- in parallel/src, a file importing a module of a higher layer than its own (the order in
  LAYERS). Known exceptions are listed in EXCEPTIONS and reported.

    python3 tools/check_layers.py [SRC ...]    # SRC: every crate's src/ by default
"""
import collections, pathlib, re, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRATES = ["parallel/src", "kernels/src", "engine/src", "checkpoint/src", "models/src", "src"]
# The crate whose layering is checked (set per crate by `main`).
LAYERED = ROOT / "parallel/src"
SRC = LAYERED
LAYERS = [["error", "params"], ["mesh"], ["dims"], ["comm"], ["placement"], ["policy"], ["device"], ["collectives"],
          ["tensor"],
          ["backend"], ["data_parallel"], ["fsdp", "tensor_parallel", "context_parallel", "pipeline"], ["optim_state"], ["launch"], ["ranks"]]
LAYER = {m: i for i, group in enumerate(LAYERS) for m in group}
# (importing top-level module, imported top-level module): known upward imports (none left).
EXCEPTIONS = set()


def module_of(path):
    """`backend/rules/mod.rs` -> ["backend", "rules"]; `lib.rs` -> []."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return parts[:-1] if parts[-1] in ("mod", "lib") else parts


def file_of(mod):
    """The file defining module path `mod` (a list), or None."""
    base = SRC.joinpath(*mod) if mod else SRC / "lib"
    for f in (base.with_suffix(".rs"), base / "mod.rs"):
        if f.exists():
            return f
    return SRC / "lib.rs" if not mod else None


def code(path):
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def reexports(f):
    """Names `f` (a lib.rs or mod.rs) re-exports from a child (`pub use device::{DistDevice, ..}`)
    -> that child."""
    out = {}
    for m in re.finditer(r"pub(?:\([\w:]+\))? use (\w+)(?:::\w+)*::(?:\{([^}]*)\}|(\w+));", code(f)):
        for name in (m.group(2) or m.group(3)).replace("\n", " ").split(","):
            if name.strip():
                out[name.strip().split(" as ")[-1]] = m.group(1)
    return out


def resolve(mod, names):
    """The module defining `mod + names`: the longest prefix that is a module with a file, then
    through the re-exports of that module (`crate::Error` is `error`)."""
    path = list(mod)
    for n in names:
        if file_of(path + [n]) is not None:
            path.append(n)
            continue
        f = file_of(path)
        child = reexports(f).get(n) if f is not None and f.name in ("lib.rs", "mod.rs") else None
        if child is None or file_of(path + [child]) is None:
            break
        path.append(child)
    return path


def inline_mods(text):
    """The spans of inline `mod name { .. }` blocks: (start, end, name)."""
    out = []
    for m in re.finditer(r"\bmod (\w+)\s*\{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.append((m.start(), i, m.group(1)))
    return out


def paths(text):
    """Every `crate::a::b` / `super::a` path in `text`, a `use` list expanded: (root, names,
    the inline modules it sits in)."""
    spans = inline_mods(text)
    for m in re.finditer(r"\b(crate|super)((?:::\w+)*)(::\{)?", text):
        head = m.group(2).split("::")[1:]
        inner = [name for a, b, name in spans if a < m.start() < b]
        if not m.group(3):
            if head:
                yield m.group(1), head, inner
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        for item in split_top(text[m.end():i - 1]):
            yield (m.group(1), head + [n for n in re.findall(r"\w+", item.split("::{")[0])
                                       if n != "self"][:1], inner)


def split_top(s):
    parts, depth, cur = [], 0, ""
    for c in s:
        depth += {"{": 1, "}": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(cur); cur = ""
        else:
            cur += c
    return [p.strip() for p in parts + [cur] if p.strip()]


def edges():
    graph = collections.defaultdict(set)
    for f in sorted(SRC.rglob("*.rs")):
        if f.name == "tests.rs":
            continue
        mod = module_of(f)
        for root, names, inner in paths(code(f)):
            if not names or "tests" in inner:
                continue
            if root == "crate":
                base = []
            else:
                # `super` of a file `a/b.rs` (module a::b) is `a`; inside an inline `mod x { .. }`
                # of that file, `a::b`, the file itself.
                base = mod if inner else mod[:-1]
            target = resolve(base, names)
            src_file, dst_file = f, file_of(target)
            if dst_file is None or dst_file == src_file:
                continue
            # A mod.rs re-exporting (or declaring) its children is not a dependency on them.
            if f.name in ("mod.rs", "lib.rs") and target[:len(mod)] == mod:
                continue
            graph[src_file.relative_to(SRC)].add(dst_file.relative_to(SRC))
    return graph


def cycles(graph):
    """Strongly connected components with more than one file (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def top(path):
    return path.parts[0].removesuffix(".rs")


def check(src):
    """The errors and known exceptions of the crate at `src`."""
    global SRC
    SRC = src
    graph = edges()
    bad, known = [], []
    layered = src.resolve() == LAYERED.resolve()
    for src_file, dsts in sorted(graph.items()):
        for dst in sorted(dsts):
            a, b = top(src_file), top(dst)
            if not layered or a == b or a not in LAYER or b not in LAYER or LAYER[b] <= LAYER[a]:
                continue
            (known if (a, b) in EXCEPTIONS else bad).append(
                f"{src_file} imports {dst} (a higher layer)")
    # Cycles left without the known exceptions are errors; those they close are reported.
    strict = {s: {d for d in dsts if (top(s), top(d)) not in EXCEPTIONS}
              for s, dsts in graph.items()}
    strict_cycles = cycles(strict)
    for comp in cycles(graph):
        line = "cycle: " + " <-> ".join(str(p) for p in comp)
        if not any(set(c) <= set(comp) for c in strict_cycles):
            known.append(line + " (through the exceptions above)")
    for comp in strict_cycles:
        bad.append("cycle: " + " <-> ".join(str(p) for p in comp))
    return bad, known


def main():
    dirs = [pathlib.Path(a) for a in sys.argv[1:]] or [ROOT / c for c in CRATES]
    failed = False
    for src in dirs:
        bad, known = check(src)
        name = src.resolve().relative_to(ROOT) if src.resolve().is_relative_to(ROOT) else src
        for line in known:
            print(f"{name}: known: {line}")
        for line in bad:
            print(f"{name}: error: {line}")
        failed |= bool(bad)
        if not bad:
            what = "layering holds, no cycle" if src.resolve() == LAYERED.resolve() else "no cycle"
            print(f"{name}: {what}" + (" (known exceptions above)" if known else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
