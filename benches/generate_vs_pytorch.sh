#!/usr/bin/env bash
# Generation on CPU: Wildfire's GPT sample through its key/value cache (benches/generate.rs)
# beside transformers' `generate` (benches/pytorch/generate_gpt.py), each with and without its
# cache, GPT-2 124M's shape, f32, greedy, the same prompt and number of new tokens; rounds
# alternate which side runs first. Prints the medians and the ratios as one markdown table.
#
#   bash benches/generate_vs_pytorch.sh [--rounds 3] [--prompt 32] [--tokens 32]
#
# Env: WILDFIRE_TORCH_VENV (see benches/pytorch/setup.sh; transformers is added to it),
# BENCH_OUT (the JSON lines; default a new /tmp directory).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=3 PROMPT=32 TOKENS=32
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --prompt) PROMPT=$2; shift 2 ;;
        --tokens) TOKENS=$2; shift 2 ;;
        *) echo "usage: $0 [--rounds N] [--prompt N] [--tokens N]" >&2; exit 2 ;;
    esac
done
OUT=${BENCH_OUT:-$(mktemp -d /tmp/generate_vs_pytorch.XXXXXX)}
mkdir -p "$OUT"
PY=$(bash benches/pytorch/setup.sh | tail -n 1)
"$PY" -c 'import transformers' 2>/dev/null || "$PY" -m pip install --quiet transformers
# Build first: nothing is timed while a build runs.
cargo bench --bench generate --no-run >&2

ours() { cargo bench --quiet --bench generate -- --bench --prompt "$PROMPT" --tokens "$TOKENS"; }
theirs() { "$PY" benches/pytorch/generate_gpt.py --prompt "$PROMPT" --tokens "$TOKENS"; }
for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then ours; theirs; else theirs; ours; fi | grep '^{' | tee -a "$OUT/results.jsonl" >&2
done

python3 - "$OUT/results.jsonl" "$(nproc)" "$ROUNDS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
side = lambda r: r.get("backend", "transformers")
med = {}
for key in {(side(r), r["mode"]) for r in rows}:
    med[key] = statistics.median(r["tokens_per_s"] for r in rows if (side(r), r["mode"]) == key)
peer = next(r["framework"] for r in rows if side(r) == "transformers")
r0 = rows[0]
print(f"GPT-2 124M shape, f32, greedy, prompt {r0['prompt']}, {r0['tokens']} new tokens, "
      f"{sys.argv[2]} threads; peer: {peer}; medians of {sys.argv[3]} rounds")
print()
print("| tokens/s | Wildfire (`--sample-tokens`: one rank of the decorator) | Wildfire, plain `Gpt<Flex>` | transformers | ratio (decorator / transformers) |")
print("|---|---|---|---|---|")
for mode in ["cached", "uncached"]:
    a, f, b = (med.get((s, mode)) for s in ["decorator", "flex", "transformers"])
    if a and f and b:
        print(f"| {mode} | {a:.1f} | {f:.1f} | {b:.1f} | {a / b:.2f}x |")
a, b = med[("decorator", "cached")], med[("decorator", "uncached")]
print(f"\nWildfire's cache: {a / b:.1f}x its uncached generation")
EOF
