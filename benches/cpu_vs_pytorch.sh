#!/usr/bin/env bash
# Wildfire's gpt_pretrain against PyTorch eager (f32, CPU, no torch.compile) on the same GPT, the
# same data and the same hyper-parameters, run alternately (round 1 wildfire first, round 2
# pytorch first, ...):
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
# Threads: all cores on both sides (RAYON_NUM_THREADS / torch.set_num_threads). PyTorch's AdamW
# is its fused CPU kernel (fused=True). Also measured: each process's wall clock from launch to
# exit (what a user waits for: start-up, data, evaluation included), and Wildfire's own split of it
# (the binary's `wall clock` line). The table's header names the CPU, the torch version and where
# each side's tokens came from.
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
    local start end
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    RAYON_NUM_THREADS=$THREADS "$BIN" $4 --data "$DATA" --tokenizer "$2" --metrics "$tag.jsonl" \
        --sample-tokens 0 --plot "$tag.png" --log-every 100 >>"$tag.log" 2>&1 \
        || { tail -n 20 "$tag.log" >&2; exit 1; }
    end=$(date +%s.%N)
    python3 - "$tag.jsonl" "$tag.log" "$3" "$start" "$end" <<'EOF'
import json, re, sys
metrics, log, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
wall = float(sys.argv[5]) - float(sys.argv[4])
text = open(log).read()
parts = re.findall(r"^wall clock [0-9.]+ s: (.*)$", text, re.M)  # the binary's own split
source = re.findall(r"data=(\S+)", text)
rows = [json.loads(l) for l in open(metrics) if l.strip()]
timed = rows[1:]  # step 0 is the warm-up
secs = sum(tokens / r["tokens_per_s"] for r in timed)
vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
if not vals:  # the binary's last stdout line: "final: step N loss X val_loss Y|-"
    m = re.findall(r"^final: step \d+ loss \S+ val_loss ([0-9.]+)", text, re.M)
    vals = [float(v) for v in m]
print(json.dumps({"framework": "wildfire", "tokens_per_s": tokens * len(timed) / secs if secs else None,
                  "train_seconds": secs, "wall_seconds": wall, "wall_parts": parts[-1] if parts else None,
                  "tokens": source[-1] if source else None,
                  "steps": len(rows), "val_loss": vals[-1] if vals else None}))
EOF
}

run_pytorch() { # workload tokenizer tokens_per_step flags round
    local tag="$OUT/$1-pytorch-$5" start end
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$PY" benches/pytorch/train_gpt.py $4 --data "$DATA" --vocab "$2" --threads "$THREADS" \
        >"$tag.json" 2>"$tag.log" || { tail -n 20 "$tag.log" >&2; exit 1; }
    end=$(date +%s.%N)
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["wall_seconds"]=float(sys.argv[3])-float(sys.argv[2]); print(json.dumps(d))' \
        "$(tail -n 1 "$tag.json")" "$start" "$end"
}

RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
for r in $(seq 1 "$ROUNDS"); do
    for w in a b; do
        if [[ $w == a ]]; then set -- bytes $((12 * 64)) "$A"; else set -- gpt2 $((4 * 256)) "$B"; fi
        # The side that runs first alternates from round to round (a warm cache or a cooler CPU
        # favours neither).
        if (( r % 2 == 1 )); then order="wildfire pytorch"; else order="pytorch wildfire"; fi
        for fw in $order; do
            echo "round $r/$ROUNDS: workload ($w) $fw" >&2
            line=$("run_$fw" "$w" "$1" "$2" "$3" "$r")
            python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(workload=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(d))' \
                "$line" "$w" "$r" >>"$RESULTS"
        done
    done
done

CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
python3 - "$RESULTS" "$THREADS" "$CPU" <<'EOF' | tee "$OUT/table.md"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = {"a": "(a) shakespeare-char, bytes", "b": "(b) d256 seq256, gpt2 vocab"}
f = lambda v, fmt: "-" if v is None else format(v, fmt)
torch_row = next(r for r in rows if r["framework"] == "pytorch")
print(f"\nGPT training on CPU, f32, {sys.argv[2]} threads, {sys.argv[3] or 'CPU model unknown'}; "
      f"torch {torch_row.get('torch')} (AdamW {torch_row.get('adamw', 'foreach')})")
for w in "ab":
    src = {r["framework"]: r.get("tokens") for r in rows if r["workload"] == w}
    print(f"tokens of {names[w]}: wildfire {src.get('wildfire')}, pytorch {src.get('pytorch')}")
print("\ntok/s exclude step 0 and evaluation; train s = the timed steps; wall s = the process, launch to exit\n")
print("| workload | round | first | wildfire tok/s | pytorch tok/s | tok/s ratio | wildfire train s | pytorch train s "
      "| wildfire wall s | pytorch wall s | wall ratio | wildfire val loss | pytorch val loss |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for w in "ab":
    by = {(r["round"], r["framework"]): r for r in rows if r["workload"] == w}
    rounds = sorted({k[0] for k in by})
    val = lambda r: f(r["val_loss"] if w == "a" else None, ".4f")
    for n in rounds:
        wf, pt = by[(n, "wildfire")], by[(n, "pytorch")]
        print(f"| {names[w]} | {n} | {'wildfire' if n % 2 else 'pytorch'} | {wf['tokens_per_s']:.0f} | "
              f"{pt['tokens_per_s']:.0f} | {wf['tokens_per_s'] / pt['tokens_per_s']:.2f} | "
              f"{wf['train_seconds']:.1f} | {pt['train_seconds']:.1f} | {wf['wall_seconds']:.1f} | "
              f"{pt['wall_seconds']:.1f} | {wf['wall_seconds'] / pt['wall_seconds']:.2f} | {val(wf)} | {val(pt)} |")
    med = lambda fw, k: statistics.median(by[(n, fw)][k] for n in rounds)
    vm = lambda fw: f(med(fw, "val_loss") if w == "a" else None, ".4f")
    print(f"| **{names[w]}** | **median** | | **{med('wildfire', 'tokens_per_s'):.0f}** | "
          f"**{med('pytorch', 'tokens_per_s'):.0f}** | "
          f"**{med('wildfire', 'tokens_per_s') / med('pytorch', 'tokens_per_s'):.2f}** | "
          f"**{med('wildfire', 'train_seconds'):.1f}** | **{med('pytorch', 'train_seconds'):.1f}** | "
          f"**{med('wildfire', 'wall_seconds'):.1f}** | **{med('pytorch', 'wall_seconds'):.1f}** | "
          f"**{med('wildfire', 'wall_seconds') / med('pytorch', 'wall_seconds'):.2f}** | {vm('wildfire')} | {vm('pytorch')} |")
print("\nWildfire's split of its wall clock (last round):")
for w in "ab":
    last = max(r["round"] for r in rows if r["workload"] == w)
    wf = next(r for r in rows if r["workload"] == w and r["round"] == last and r["framework"] == "wildfire")
    print(f"- {names[w]}: {wf.get('wall_parts')} (process {wf['wall_seconds']:.2f} s)")
EOF

# Per-op cost: one elementwise op on a 64-element tensor, ours (benches/overhead.rs: Flex and the
# decorator, with and without autodiff) beside PyTorch's (one thread: a 64-element op is serial);
# tracked ops as a step pays them: chains of 32 products summed and taken backward.
cargo bench -q --bench overhead -- --rounds 3 2>/dev/null | tee -a "$OUT/table.md"
"$PY" - <<'EOF' | tee -a "$OUT/table.md"
import time, torch
torch.set_num_threads(1)
CHAIN = 32  # benches/overhead.rs's CHAIN
def median_ns(ops, run):
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        run()
        runs.append((time.perf_counter() - t) * 1e9 / ops)
    return sorted(runs)[2]
def plain(n=200_000):
    x = torch.ones(64)
    def run():
        for _ in range(n):
            x * x
    return median_ns(n, run)
def tracked(n=200_000):  # chains of CHAIN products, summed and taken backward, graph freed
    x = torch.ones(64, requires_grad=True)
    chains = -(-n // (CHAIN + 1))
    def run():
        for _ in range(chains):
            y = x
            for _ in range(CHAIN):
                y = y * x
            y.sum().backward()
            x.grad = None
    return median_ns(chains * (CHAIN + 1), run)
print(f"PyTorch {torch.__version__:<21}{plain():8.0f} ns/op")
print(f"PyTorch, requires_grad       {tracked():8.0f} ns/op (forward + backward)")
EOF
echo "logs and per-run JSON: $OUT" >&2
