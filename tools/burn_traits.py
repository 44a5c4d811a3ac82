"""Parse the op traits of burn-backend 0.21.0 into method signatures (used by gen_forward.py)."""
import re, pathlib, glob, os

TRAITS = [
    ("FloatTensorOps", "ops/tensor.rs"),
    ("IntTensorOps", "ops/int_tensor.rs"),
    ("BoolTensorOps", "ops/bool_tensor.rs"),
    ("ModuleOps", "ops/modules/base.rs"),
    ("ActivationOps", "ops/activation.rs"),
    ("QTensorOps", "ops/qtensor.rs"),
    ("TransactionOps", "ops/transaction.rs"),
]

def backend_src():
    home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
    hits = glob.glob(f"{home}/registry/src/*/burn-backend-0.21.0/src/backend")
    assert hits, "run `cargo fetch` first"
    return pathlib.Path(hits[0])

def strip(src):
    src = re.sub(r'"(\\.|[^"\\])*"', '""', src)
    src = re.sub(r"'(\\.|[^'\\])'", "' '", src)
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return src

def methods(trait, rel):
    src = strip((backend_src() / rel).read_text())
    start = re.search(r"pub trait %s<B: Backend>[^{]*\{" % trait, src).end()
    i, depth, out = start, 1, []
    while depth > 0:
        m = re.compile(r"\bfn\s+(\w+)|[{}]").search(src, i)
        tok = m.group(0)
        if tok == "{":
            depth += 1; i = m.end(); continue
        if tok == "}":
            depth -= 1; i = m.end(); continue
        # fn at depth 1: read signature up to '{' or ';' outside parens/angles
        j, par = m.end(), 0
        while True:
            c = src[j]
            if c in "([": par += 1
            elif c in ")]": par -= 1
            elif par == 0 and c in "{;": break
            j += 1
        sig = " ".join(src[m.start():j].split())
        has_default = src[j] == "{"
        if depth == 1:
            out.append((m.group(1), sig, has_default))
        i = j
    return out

def parse_sig(sig):
    m = re.match(r"fn (\w+)\s*(<.*?>)?\s*\(", sig)
    name, generics = m.groups()
    i, depth = m.end(), 1
    while depth:
        depth += {"(": 1, ")": -1}.get(sig[i], 0); i += 1
    args, rest = sig[m.end():i - 1], sig[i:]
    m2 = re.match(r"\s*(->\s*(.*?))?\s*(where .*)?$", rest)
    _, ret, where = m2.groups()
    # split args on top-level commas
    parts, depth, cur = [], 0, ""
    for c in args:
        if c in "<([": depth += 1
        if c in ">)]": depth -= 1
        if c == "," and depth == 0:
            parts.append(cur); cur = ""
        else:
            cur += c
    if cur.strip(): parts.append(cur)
    arglist = []
    for p in parts:
        p = p.strip()
        n, t = p.split(":", 1)
        arglist.append((n.strip().replace("mut ", ""), t.strip()))
    return name, generics or "", arglist, (ret or "").strip(), where or ""

if __name__ == "__main__":
    kinds = {}
    for trait, rel in TRAITS:
        for name, sig, d in methods(trait, rel):
            n, g, args, ret, w = parse_sig(sig)
            for _, t in args: kinds.setdefault(t, []).append(n)
            kinds.setdefault("RET " + ret, []).append(n)
        print(trait, len(methods(trait, rel)))
    for k, v in sorted(kinds.items()):
        print(f"{len(v):4} {k:60} {v[:4]}")
