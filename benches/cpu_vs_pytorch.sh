#!/usr/bin/env bash
# Wildfire's gpt_pretrain against PyTorch eager (f32, CPU, no torch.compile) on the same GPT, the
# same data and the same hyper-parameters, run alternately (wildfire, pytorch, wildfire, ...):
#
#   bash benches/cpu_vs_pytorch.sh [--rounds 3] [--quick] [--threads N]
#
# (a) nanoGPT's shakespeare-char CPU recipe: 4 layers, 4 heads, d 128, block 64, batch 12, byte
#     tokenizer, 2000 steps, lr 1e-3 -> 1e-4 (cosine to step 2000), warmup 100, dropout 0, val loss
#     over 20 batches every 250 steps. Not flags of ours, so both sides use our values: AdamW
#     beta2 0.95 (nanoGPT's recipe: 0.99), eps 1e-5, weight decay 0.1 on every parameter (nanoGPT:
#     matrices only), min lr = lr/10 (= nanoGPT's 1e-4 here), 256 byte ids (nanoGPT: 65 chars).
# (b) 4 layers, 4 heads, d 256, seq 256, GPT-2 vocabulary padded to 50304, batch 4: 21 steps
#     (20 timed), no evaluation. Both sides read the same GPT-2 ids (train_gpt.py reads our cache).
#
# Measured, both sides: tokens/s = batch*block*(steps-1) / the summed time of steps 1.. (step 0,
# the warm-up, is excluded; so are evaluation, sampling and startup). A step is timed from batch
# sampling through forward, backward, clipping and the AdamW update to the loss on the host: ours
# from gpt_pretrain's per-step `tokens_per_s` (--metrics JSON lines: batch*block / that step's
# seconds), PyTorch's from perf_counter in benches/pytorch/train_gpt.py. Val loss of (a): the
# last evaluation (after step 2000), mean over 20 validation batches, same batches both sides.
# Threads: all cores on both sides (RAYON_NUM_THREADS / torch.set_num_threads).
#
# Env: WILDFIRE_BIN (default ${CARGO_TARGET_DIR:-target}/release/examples/gpt_pretrain, built by
# `cargo build --release --example gpt_pretrain`), WILDFIRE_CORPUS (default
# ../shared/data/tinyshakespeare.txt), WILDFIRE_TORCH_VENV (see benches/pytorch/setup.sh),
# BENCH_OUT (logs and results; default a new /tmp directory).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="" QUICK=0 THREADS=$(nproc)
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --threads) THREADS=$2; shift 2 ;;
        *) echo "usage: $0 [--rounds N] [--quick] [--threads N]" >&2; exit 2 ;;
    esac
done
BIN=${WILDFIRE_BIN:-${CARGO_TARGET_DIR:-target}/release/examples/gpt_pretrain}
DATA=${WILDFIRE_CORPUS:-../shared/data/tinyshakespeare.txt}
OUT=${BENCH_OUT:-$(mktemp -d /tmp/cpu_vs_pytorch.XXXXXX)}
mkdir -p "$OUT"
[[ -x $BIN ]] || { echo "no $BIN: cargo build --release --example gpt_pretrain (or set WILDFIRE_BIN)" >&2; exit 1; }
[[ -f $DATA ]] || { echo "no corpus at $DATA (set WILDFIRE_CORPUS)" >&2; exit 1; }
PY=$(bash benches/pytorch/setup.sh | tail -n 1)

# Flags both binaries take under the same names; each workload: name, tokenizer, tokens/step, flags.
if [[ $QUICK == 1 ]]; then
    ROUNDS=${ROUNDS:-1}
    A_STEPS="--steps 50 --warmup 10 --eval-every 25 --eval-iters 5" B_STEPS="--steps 4 --warmup 1"
else
    ROUNDS=${ROUNDS:-3}
    A_STEPS="--steps 2000 --warmup 100 --eval-every 250 --eval-iters 20" B_STEPS="--steps 21 --warmup 2"
fi
A="--n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 12 --lr 1e-3 --seed 1337 $A_STEPS"
B="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256 --batch-size 4 --lr 1e-3 --seed 1337 --eval-every 0 --eval-iters 0 $B_STEPS"

run_wildfire() { # workload tokenizer tokens_per_step flags round
    local tag="$OUT/$1-wildfire-$5"
    echo "+ $BIN $4 --data $DATA --tokenizer $2 --metrics $tag.jsonl --sample-tokens 0 --plot $tag.png --log-every 100" >"$tag.log"
    # shellcheck disable=SC2086
    RAYON_NUM_THREADS=$THREADS "$BIN" $4 --data "$DATA" --tokenizer "$2" --metrics "$tag.jsonl" \
        --sample-tokens 0 --plot "$tag.png" --log-every 100 >>"$tag.log" 2>&1 \
        || { tail -n 20 "$tag.log" >&2; exit 1; }
    python3 - "$tag.jsonl" "$tag.log" "$3" <<'EOF'
import json, re, sys
metrics, log, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(metrics) if l.strip()]
timed = rows[1:]  # step 0 is the warm-up
secs = sum(tokens / r["tokens_per_s"] for r in timed)
vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
if not vals:  # the binary's last stdout line: "final: step N loss X val_loss Y|-"
    m = re.findall(r"^final: step \d+ loss \S+ val_loss ([0-9.]+)", open(log).read(), re.M)
    vals = [float(v) for v in m]
print(json.dumps({"framework": "wildfire", "tokens_per_s": tokens * len(timed) / secs if secs else None,
                  "train_seconds": secs, "steps": len(rows), "val_loss": vals[-1] if vals else None}))
EOF
}

run_pytorch() { # workload tokenizer tokens_per_step flags round
    local tag="$OUT/$1-pytorch-$5"
    # shellcheck disable=SC2086
    "$PY" benches/pytorch/train_gpt.py $4 --data "$DATA" --vocab "$2" --threads "$THREADS" \
        >"$tag.json" 2>"$tag.log" || { tail -n 20 "$tag.log" >&2; exit 1; }
    tail -n 1 "$tag.json"
}

RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
for r in $(seq 1 "$ROUNDS"); do
    for w in a b; do
        if [[ $w == a ]]; then set -- bytes $((12 * 64)) "$A"; else set -- gpt2 $((4 * 256)) "$B"; fi
        for fw in wildfire pytorch; do
            echo "round $r/$ROUNDS: workload ($w) $fw" >&2
            line=$("run_$fw" "$w" "$1" "$2" "$3" "$r")
            python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(workload=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(d))' \
                "$line" "$w" "$r" >>"$RESULTS"
        done
    done
done

python3 - "$RESULTS" "$THREADS" <<'EOF' | tee "$OUT/table.md"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = {"a": "(a) shakespeare-char, bytes", "b": "(b) d256 seq256, gpt2 vocab"}
f = lambda v, fmt: "-" if v is None else format(v, fmt)
print(f"\nGPT training on CPU, f32, {sys.argv[2]} threads: tokens/s excluding step 0 and evaluation\n")
print("| workload | round | wildfire tok/s | pytorch tok/s | wildfire/pytorch | wildfire val loss | pytorch val loss |")
print("|---|---|---|---|---|---|---|")
for w in "ab":
    by = {(r["round"], r["framework"]): r for r in rows if r["workload"] == w}
    rounds = sorted({k[0] for k in by})
    ratios = []
    for n in rounds:
        wf, pt = by[(n, "wildfire")], by[(n, "pytorch")]
        ratios.append(wf["tokens_per_s"] / pt["tokens_per_s"])
        print(f"| {names[w]} | {n} | {wf['tokens_per_s']:.0f} | {pt['tokens_per_s']:.0f} | {ratios[-1]:.2f} | "
              f"{f(wf['val_loss'] if w == 'a' else None, '.4f')} | {f(pt['val_loss'] if w == 'a' else None, '.4f')} |")
    med = lambda fw: statistics.median(by[(n, fw)]["tokens_per_s"] for n in rounds)
    print(f"| **{names[w]}** | **median** | **{med('wildfire'):.0f}** | **{med('pytorch'):.0f}** | "
          f"**{statistics.median(ratios):.2f}** | | |")
EOF

# Per-op cost: one elementwise op on a 64-element tensor, ours (benches/overhead.rs: Flex and the
# decorator, with and without autodiff) beside PyTorch's (one thread: a 64-element op is serial).
cargo bench -q --bench overhead -- --rounds 3 2>/dev/null | tee -a "$OUT/table.md"
"$PY" - <<'EOF' | tee -a "$OUT/table.md"
import time, torch
torch.set_num_threads(1)
def per_op(x, n=200_000):
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            x * x
        runs.append((time.perf_counter() - t) * 1e9 / n)
    return sorted(runs)[2]
x = torch.ones(64)
print(f"PyTorch {torch.__version__:<21}{per_op(x):8.0f} ns/op")
print(f"PyTorch, requires_grad       {per_op(x.clone().requires_grad_()):8.0f} ns/op (tracked)")
EOF
echo "logs and per-run JSON: $OUT" >&2
