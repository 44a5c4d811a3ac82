#!/usr/bin/env bash
# Multi-process tests of the MPI communicator on loopback (`mpirun --oversubscribe`), installing
# Open MPI and libclang (rsmpi's bindgen) first where they are missing. Run by `.ci/run`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mpirun >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
    echo "mpi_test.sh: installing Open MPI and libclang (openmpi-bin libopenmpi-dev libclang-dev)"
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev libclang-dev >/dev/null) || {
            echo "mpi_test.sh: could not install Open MPI; install openmpi-bin libopenmpi-dev libclang-dev and rerun" >&2
            exit 1
        }
    else
        echo "mpi_test.sh: Open MPI or libclang is missing; install openmpi-bin libopenmpi-dev libclang-dev and rerun" >&2
        exit 1
    fi
fi

# Containers: mpirun refuses root without these, and the shared-memory transport's single-copy
# mechanism (CMA) needs ptrace rights containers seldom grant.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

cargo build --example mpi_check --example gpt_pretrain --example learner_fsdp --features mpi,learner
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
check="$target_dir/debug/examples/mpi_check"
pretrain="$target_dir/debug/examples/gpt_pretrain"
learner="$target_dir/debug/examples/learner_fsdp"
mpi() { timeout 300 mpirun --oversubscribe "$@"; }
fail() { echo "mpi_test.sh: FAILED: $*" >&2; exit 1; }

for np in 2 4; do
    echo "--- collectives, $np processes: bitwise equal to ranks-as-threads"
    mpi -np "$np" "$check" collectives
    echo "--- FullShard training, $np processes: parity with ranks-as-threads and one device"
    mpi -np "$np" "$check" fsdp
    echo "--- hybrid: 2 ranks as threads in each of $np processes, one mesh"
    mpi -np "$np" "$check" hybrid
done

echo "--- a mismatched collective is detected on every rank"
out=$(mpi -np 2 "$check" mismatch 2>&1) || fail "mismatch: $out"
printf '%s\n' "$out"
[ "$(grep -c 'detected: mismatched.*made different calls' <<<"$out")" = 2 ] || fail "mismatch not reported by both ranks"
[ "$(grep -c "detected: mismatched all_to_all.*splits disagree" <<<"$out")" = 2 ] || fail "the all-to-all's disagreeing splits not reported by both ranks"

echo "--- a rank that never arrives: the watchdog aborts the job within the timeout"
start=$(date +%s)
if out=$(mpi -np 2 "$check" hang 2>&1); then fail "hang: the job did not fail"; fi
printf '%s\n' "$out" | head -3
grep -q "timed out after" <<<"$out" || fail "hang: no timeout message"
[ $(( $(date +%s) - start )) -lt 30 ] || fail "hang: took longer than 30 s"

echo "--- a rank that dies mid-training: mpirun stops the others"
start=$(date +%s)
if out=$(mpi -np 2 "$check" kill 2>&1); then fail "kill: the job did not fail"; fi
printf '%s\n' "$out" | grep -E "dying|exited on signal|noticed" || true
grep -q "exited on signal" <<<"$out" || fail "kill: mpirun did not report the dead rank"
[ $(( $(date +%s) - start )) -lt 60 ] || fail "kill: took longer than 60 s"

echo "--- gpt_pretrain unchanged under mpirun: the same losses as ranks-as-threads"
tmp=$(mktemp -d)
run_args=(--steps 4 --batch-size 4 --n-layer 2 --block-size 32 --tokenizer bytes --sample-tokens 0 --eval-every 2)
# Overlap is on by default (prefetched gathers, reductions issued where gradients are born, DDP
# buckets: over MPI the rank's communication thread makes the calls); the third run blocks on
# every collective, the fourth all-reduces DDP's gradients in 1 MiB buckets.
# Pipelines: activations and gradients over MPI's point-to-point messages (sends started
# without waiting for their receives), ZB-H1 on pp 2, 1F1B on dp 2 × pp 2 with FSDP in stages.
# Expert parallelism: the routed rows over MPI_Alltoallv, the experts FSDP-sharded inside ep 2.
for mesh in "2:--dp 2 --fsdp full" "4:--dp 2 --tp 2 --fsdp full" \
    "2:--dp 2 --fsdp full --prefetch 0 --reduce-in-flight 0" "2:--dp 2 --bucket-mb 1" \
    "2:--pp 2 --microbatches 2 --pp-schedule zb" "4:--dp 2 --pp 2 --microbatches 2 --fsdp full" \
    "4:--preset llama-moe-tiny --dp 4 --ep 2 --fsdp full"; do
    np=${mesh%%:*}
    read -r -a flags <<<"${mesh#*:}"
    mpi -np "$np" "$pretrain" "${run_args[@]}" "${flags[@]}" --metrics "$tmp/mpi.jsonl" --plot "$tmp/mpi.png" 2>/dev/null
    "$pretrain" "${run_args[@]}" "${flags[@]}" --metrics "$tmp/threads.jsonl" --plot "$tmp/threads.png" 2>/dev/null
    python3 - "$tmp/mpi.jsonl" "$tmp/threads.jsonl" "${flags[*]}" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
key = lambda rows: [(r["step"], r["loss"], r.get("val_loss")) for r in rows]
assert len(a) == 4 and key(a) == key(b), (key(a), key(b))
print(f"{sys.argv[3]}: {len(a)} steps, losses identical under mpirun and ranks-as-threads: {[r['loss'] for r in a]}")
PY
done
echo "--- context and expert parallelism inside pipeline stages (one process per rank; the same as threads in cargo test)"
# cp 2 × pp 2 against pp 2 alone, ep 2 × pp 2 (dp 2 FullShard, a mixture of experts) against dp 2 × pp
# 2: the same losses within 1e-5 (the arithmetic differs: not bitwise).
stage_args=(--steps 4 --n-layer 2 --block-size 32 --tokenizer bytes --sample-tokens 0 --eval-every 2 --pp 2 --microbatches 2)
for pair in "4:2:--batch-size 4:--cp 2" "4:4:--batch-size 8 --preset llama-moe-tiny --dp 2 --fsdp full:--ep 2"; do
    IFS=: read -r np_with np_without common extra <<<"$pair"
    read -r -a common_flags <<<"$common"
    read -r -a extra_flags <<<"$extra"
    mpi -np "$np_with" "$pretrain" "${stage_args[@]}" "${common_flags[@]}" "${extra_flags[@]}" \
        --metrics "$tmp/with.jsonl" --plot "$tmp/with.png" 2>/dev/null
    mpi -np "$np_without" "$pretrain" "${stage_args[@]}" "${common_flags[@]}" \
        --metrics "$tmp/without.jsonl" --plot "$tmp/without.png" 2>/dev/null
    python3 - "$tmp/with.jsonl" "$tmp/without.jsonl" "$extra" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert len(a) == 4 and all(abs(x - y) <= 1e-5 * y for x, y in zip(a, b)), (a, b)
print(f"{sys.argv[3]} inside pp 2 stages under mpirun: losses {a} within 1e-5 of {b}")
PY
done
echo "--- gpt_pretrain under mpirun: save at step 2, resume to 4 == a straight run (FullShard)"
ck=(--batch-size 4 --n-layer 2 --block-size 32 --tokenizer bytes --sample-tokens 0 --eval-every 100 --fsdp full --dp 2 --decay-steps 4 --plot "$tmp/ck.png")
mpi -np 2 "$pretrain" "${ck[@]}" --steps 2 --save "$tmp/ck" --save-every 2 2>/dev/null
mpi -np 2 "$pretrain" "${ck[@]}" --steps 4 --resume "$tmp/ck" --metrics "$tmp/resumed.jsonl" 2>/dev/null
"$pretrain" "${ck[@]}" --steps 4 --metrics "$tmp/straight.jsonl" 2>/dev/null
python3 - "$tmp/resumed.jsonl" "$tmp/straight.jsonl" <<'PY'
import json, sys
r, s = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert len(r) == 2 and r == s[-2:], (r, s)
print(f"resumed losses {r} == straight run's last two, bitwise")
PY
echo "--- elastic restart under mpirun (scripts/elastic_mpirun.sh): rank 1 of 2 dies at step 3, the job goes on as 1 process"
el=(--batch-size 4 --n-layer 2 --block-size 32 --tokenizer bytes --sample-tokens 0 --eval-every 100 --fsdp full --decay-steps 6 --plot "$tmp/el.png" --steps 6)
out=$(scripts/elastic_mpirun.sh --max-restarts 1 -np 2 --oversubscribe -- "$pretrain" "${el[@]}" --dp 2 \
    --save "$tmp/el" --save-every 2 --fail-at 3:1 --metrics "$tmp/el.jsonl" 2>&1) || fail "elastic: $out"
restart=$(grep '^elastic_mpirun.sh: restart 1:' <<<"$out") || fail "elastic: no restart reported: $out"
echo "$restart"
from=$(sed -n 's/.*relaunching on 1 from step \([0-9]*\).*/\1/p' <<<"$restart")
[ -n "$from" ] || fail "elastic: the restart did not shrink to 1 process: $restart"
# The restarted curve is a --resume of that checkpoint on 1 rank, bit for bit.
"$pretrain" "${el[@]}" --dp 1 --resume "$tmp/el/$(printf 'step-%08d' "$from")" --metrics "$tmp/el-ref.jsonl" >/dev/null 2>&1
python3 - "$tmp/el.jsonl" "$tmp/el-ref.jsonl" "$from" <<'PY'
import json, sys
got, ref = ([(r["step"], r["loss"]) for r in map(json.loads, open(p))] for p in sys.argv[1:3])
start = int(sys.argv[3])
assert [s for s, _ in got] == list(range(3)) + list(range(start, 6)), got
assert got[-len(ref):] == ref and len(ref) == 6 - start, (got, ref)
print(f"restarted from step {start} on 1 process: losses {[l for _, l in ref]} == a --resume at --dp 1, bitwise")
PY
echo "--- elastic restart with a replacement: the hostfile has both slots again within the grace period"
echo "localhost slots=2" >"$tmp/hosts"
out=$(scripts/elastic_mpirun.sh --max-restarts 1 --restart-grace 5 --hostfile "$tmp/hosts" -np 2 --oversubscribe -- \
    "$pretrain" "${el[@]}" --dp 2 --save "$tmp/el2" --save-every 2 --fail-at 3:1 --metrics "$tmp/el2.jsonl" 2>&1) || fail "replacement: $out"
grep '^elastic_mpirun.sh: restart 1:.*relaunching on 2 ' <<<"$out" || fail "replacement: not relaunched on 2: $out"
"$pretrain" "${el[@]}" --dp 2 --metrics "$tmp/el2-straight.jsonl" >/dev/null 2>&1
python3 - "$tmp/el2.jsonl" "$tmp/el2-straight.jsonl" <<'PY'
import json, sys
got, straight = ([(r["step"], r["loss"]) for r in map(json.loads, open(p))] for p in sys.argv[1:3])
assert got[-4:] == straight[-4:], (got, straight)
print(f"relaunched on 2 processes: the last steps {got[-4:]} are the uninterrupted run's, bitwise")
PY
echo "--- the memory planner under mpirun: the processes probe together in the run's one launch and plan the same"
est=(--estimate --plan auto --memory-budget 20000000 --dp 2)
mpi_plan=$(mpi -np 2 "$pretrain" "${est[@]}" 2>/dev/null) || fail "plan estimate: $mpi_plan"
[ "$(grep -c '^chosen: --fsdp' <<<"$mpi_plan")" = 1 ] || fail "plan estimate: not one report: $mpi_plan"
threads_plan=$("$pretrain" "${est[@]}" 2>/dev/null)
# The predicted peaks and host bytes (not the step times, nor the choice they decide) are the
# ranks-as-threads plan's.
peaks() { grep '^| `' | sed 's/ (chosen)//' | awk -F'|' '{print $2, $3, $4, $6}'; }
[ "$(peaks <<<"$mpi_plan")" = "$(peaks <<<"$threads_plan")" ] || fail "plan: peaks differ: $mpi_plan vs $threads_plan"
out=$(mpi -np 2 "$pretrain" --plan auto --memory-budget 12000000 --dp 2 --steps 3 --sample-tokens 0 \
    --eval-every 0 --plot "$tmp/plan.png" --metrics "$tmp/plan.jsonl" 2>&1) || fail "planned run: $out"
grep -q -- '--plan auto: --fsdp' <<<"$out" || fail "planned run: no plan logged: $out"
python3 - "$tmp/plan.jsonl" <<'PY'
import json, sys
peaks = [r["peak_bytes"] for r in map(json.loads, open(sys.argv[1]))]
assert len(peaks) == 3 and max(peaks) <= 12000000, peaks
print(f"planned under mpirun: 3 steps within the 12 MB budget (peaks {peaks})")
PY
echo "--- burn-train's Learner under mpirun (FSDP, one process per rank): the curve of ranks-as-threads"
lf=(--dp 2 --epochs 2 --rows 256)
mpi_curve=$(mpi -np 2 "$learner" "${lf[@]}" --dir "$tmp/lf-mpi" 2>/dev/null | grep '^curve:')
threads_curve=$("$learner" "${lf[@]}" --dir "$tmp/lf-threads" 2>/dev/null | grep '^curve:')
[ -n "$mpi_curve" ] && [ "$mpi_curve" = "$threads_curve" ] || fail "learner_fsdp: $mpi_curve vs $threads_curve"
echo "learner_fsdp: the same losses under mpirun and ranks-as-threads"
if out=$(mpi -np 2 "$pretrain" --steps 1 --dp 1 2>&1); then fail "a world that does not match the mesh was accepted"; fi
grep -q "one process per rank" <<<"$out" || fail "no clear error for -np 2 --dp 1: $out"
rm -rf "$tmp"

echo "mpi_test.sh: all multi-process checks passed"
