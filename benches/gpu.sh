#!/usr/bin/env bash
# The GPU bench, in two halves.
#
#   bash benches/gpu.sh build            # any machine with Rust: CUDA binaries → .gpu/ (stripped, xz)
#   bash benches/gpu.sh run              # a machine with an NVIDIA GPU, Python and PyTorch, no Rust needed
#
# `build` compiles gpt_pretrain, the kernel bench (benches/gpu_kernels.rs) and the test binary
# with `--features cuda` (FEATURES overrides, e.g. FEATURES=cuda,wgpu to share a build with the
# lavapipe tests), and packs them with the corpus and the PyTorch scripts into `.gpu/` (git
# ignores it; ≈ 25 MB). `run` (from the repository root, or any folder holding `.gpu/`) does, in
# order of priority, each step with its own timeout and the whole under DEADLINE seconds (480):
#   (a) correctness: the tensor-core attention (bf16, f16; the cmma-fragment kernels, then the
#       fragment kernels of WILDFIRE_ATTENTION_MMA=0, then the default register kernels) against
#       the f32 tiles on CUDA, the 8-bit
#       optimizer state's kernels against Flex's host loops, NCCL's collectives (the experts'
#       all-to-all included) on a world of one, CUDA
#       against Flex for 30 steps of the tiny preset, and (last: its Burn-op references are
#       autotuned) every kernel against Burn ops in f32;
#   (b) speed: attention and GEMMs (cuBLASLt, and CubeCL's for comparison) at GPT-2 124M's
#       shapes beside SDPA and torch.matmul (the fragment attention too), the step with the
#       fragment attention and on CubeCL's matmuls (WILDFIRE_CUBLAS=0), then
#       GPT-2 124M bf16 at 8 × 1024 beside PyTorch eager (and torch.compile if time is left), the
#       same model, batches and optimizer; tokens/s and MFU with one formula for both;
#   (c) where the host's time goes in the step (`--host-profile`: every thread's stacks,
#       summed per function by tools/host_profile.py), CubeCL's per-kernel time table of one
#       training step (its profiler), and Nsight Compute's
#       report on the flash-attention kernels where `ncu` is installed (both with the default
#       register attention);
#   (d) memory (issue 35): GPT-2 350M on one rank for each optimizer, optimizer state dtype and
#       offload, and the planner for two budgets: peaks, the process's device memory, step times.
# It prints one markdown table and leaves every log in $OUT/gpu-bench.tgz, and CubeCL's tuning
# cache in $OUT/cubecl-cache.tgz (put it in .gpu/ to skip the tuning next time — `build` packs
# benches/cubecl-cache-h100.tgz, an H100's, when .gpu/ has none; OUT defaults to a temporary
# folder). CUBECL_AUTOTUNE_LEVEL (here `minimal` unless set: the first run's tuning
# fits the deadline; `balanced` is CubeCL's default) sets the matmul tuning effort. ONLY="step …"
# runs only the named steps (their names are the logs' names).
set -uo pipefail
mode=${1:-}
root=$(cd "$(dirname "$0")/.." && pwd)

build() {
    cd "$root"
    # host-profile: gpt_pretrain's `--host-profile` (pprof; the root crate only)
    local features=${FEATURES:-cuda},host-profile dir=.gpu
    mkdir -p "$dir"
    cargo build --release --features "$features" --example gpt_pretrain
    cargo bench --no-run --features "$features" --bench gpu_kernels
    local bench tests
    bench=$(cargo bench --no-run --features "$features" --bench gpu_kernels --message-format json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m["target"]["name"] == "gpu_kernels": print(m["executable"])')
    tests=$(cargo test --release --no-run --features "$features" --test main --message-format json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m["target"]["name"] == "main": print(m["executable"])')
    # the communicators' unit tests (NCCL's world of one: every collective, the experts'
    # all-to-all, through NCCL on the one GPU)
    local comm_tests
    comm_tests=$(cargo test --release --no-run -p wildfire-parallel --features cuda --lib --message-format json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m["target"]["name"] == "wildfire_parallel": print(m["executable"])')
    local target=${CARGO_TARGET_DIR:-target}
    for pair in "$target/release/examples/gpt_pretrain:gpt_pretrain" "$bench:gpu_kernels" "$tests:kernel_tests" "$comm_tests:comm_tests"; do
        local src=${pair%%:*} name=${pair##*:}
        rm -f "$dir/$name.gz"
        # gpt_pretrain keeps its symbol table (not its debug info): `--host-profile` names
        # functions from it
        if [ "$name" = gpt_pretrain ]; then
            objcopy --strip-debug "$src" "$dir/$name"
        else
            strip -o "$dir/$name" "$src"
        fi && xz -9e -T0 -f "$dir/$name"
    done
    cp benches/pytorch/gpt_gpu.py benches/pytorch/gpu_kernels.py benches/gpu_table.py tools/host_profile.py "$dir/"
    cp benches/gpu.sh "$dir/gpu.sh"
    # CubeCL's tuning results from the last H100 run (keyed by device index, not model: on another
    # GPU they only pick kernels, never change results); a newer run's cache replaces it.
    [ -f "$dir/cubecl-cache.tgz" ] || cp benches/cubecl-cache-h100.tgz "$dir/cubecl-cache.tgz"
    gzip -9c "$root/../shared/data/tinyshakespeare.txt" > "$dir/tinyshakespeare.txt.gz" 2>/dev/null ||
        echo "gpu.sh: no ../shared corpus; the run half will use the binary's embedded one"
    du -sh "$dir"
}

run() {
    local here dir
    here=$(pwd)
    dir=$([ -d "$here/.gpu" ] && echo "$here/.gpu" || echo "$root/.gpu")
    local T; T=$(mktemp -d)
    local START; START=$(date +%s)
    local DEADLINE=${DEADLINE:-480}
    local O=${OUT:-$T/out} R=$T/r
    mkdir -p "$O" "$R" "$T/b"
    for f in "$dir"/*.gz; do gunzip -c "$f" > "$T/b/$(basename "$f" .gz)"; done
    # The binaries are xz (a third smaller than gzip); Python's lzma where xz is not installed.
    for f in "$dir"/*.xz; do
        xz -dc "$f" > "$T/b/$(basename "$f" .xz)" 2>/dev/null ||
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$T/b/$(basename "$f" .xz)"
    done
    chmod +x "$T/b/gpt_pretrain" "$T/b/gpu_kernels" "$T/b/kernel_tests" "$T/b/comm_tests"
    cp "$dir"/*.py "$T/b/"
    export NO_COLOR=1 RUST_LOG=${RUST_LOG:-info}
    # cuBLASLt (the GEMMs) is loaded at run time by name; the CUDA toolkit's folder where the
    # loader's cache lacks it
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
    export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
    # A previous run's tuning results (CubeCL keys them by device): on a fresh machine each GEMM
    # shape costs 20–30 s of tuning even at `minimal`, ≈ 17 shapes for GPT-2 124M's step.
    [ -f "$dir/cubecl-cache.tgz" ] && mkdir -p "$HOME/.cache" && tar xzf "$dir/cubecl-cache.tgz" -C "$HOME/.cache"
    { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } > "$R/env.txt" 2>&1
    local corpus=()
    [ -f "$T/b/tinyshakespeare.txt" ] && corpus=(--data "$T/b/tinyshakespeare.txt")
    left() { echo $((DEADLINE - ($(date +%s) - START))); }
    step() { # name timeout cmd...
        local name=$1 t=$2; shift 2
        # ONLY="a b c" runs just those steps (a short device lease)
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
        local l; l=$(left)
        if [ "$l" -lt 15 ]; then echo "$name skipped (deadline)" >> "$R/summary.txt"; return; fi
        [ "$t" -gt "$l" ] && t=$l
        local s; s=$(date +%s)
        (cd "$T" && timeout "$t" "$@") > "$R/$name.log" 2>&1
        echo "$name rc=$? $(( $(date +%s) - s ))s" >> "$R/summary.txt"
        tar czf "$O/gpu-bench.tgz" -C "$T" r 2>/dev/null
    }
    local G=$T/b/gpt_pretrain
    local SMALL=(--tokenizer bytes "${corpus[@]}" --steps 30 --warmup 5 --eval-every 0 --eval-iters 0
        --sample-tokens 0 --log-every 1 --plot "$T/p.png")
    local BIG=(--preset gpt2-124m --tokenizer gpt2 "${corpus[@]}" --batch-size 8 --precision bf16
        --eval-every 0 --eval-iters 0 --sample-tokens 0 --log-every 1 --peak-flops 9.89e14 --plot "$T/p.png")
    # (a) the kernels' correctness first (tensor-core tiles included), (b) the whole step beside
    # PyTorch eager, then the kernels beside SDPA and torch.matmul, (c) the profile, then the
    # tiny run against Flex and torch.compile while time is left.
    step attention_tests 120 "$T/b/kernel_tests" cuda_tensor_core --test-threads 1
    # the 8-bit optimizer state's kernels (`u8` codes) against Flex's host loops, bit for bit
    step quant_tests 60 "$T/b/kernel_tests" cuda_blockwise --test-threads 1
    # NCCL on a world of one (the machine's one GPU: NCCL refuses two ranks on one device):
    # every collective and the experts' all-to-all, through the library
    step nccl_tests 60 "$T/b/comm_tests" nccl --test-threads 1
    # (--trace: the host's time in each region of a step — forward and backward are only queued
    # on the device, so where they take as long as the step the host, not the GPU, is the limit)
    step gpt2_ours 200 "$G" --backend cuda "${BIG[@]}" --steps 24 --warmup 2 --metrics "$R/gpt2_ours.jsonl" \
        --trace "$R/gpt2_trace.json"
    step gpt2_eager 60 python3 "$T/b/gpt_gpu.py" --mode eager --batch 8 --seq 1024 --dtype bf16 --steps 24 --warmup 3
    # where the host's time goes: every thread's stacks sampled (pprof, 997 Hz of CPU time) from
    # step 2 to 12 — the rank's thread preparing launches, CubeCL's device thread taking them
    step gpt2_hostprof 120 "$G" --backend cuda "${BIG[@]}" --steps 12 --warmup 2 --host-profile "$R/host.folded"
    [ -f "$R/host.folded" ] && python3 "$T/b/host_profile.py" "$R/host.folded" > "$R/host_profile.md" 2>&1
    # the GEMMs handed to CubeCL's device thread without waiting (WILDFIRE_CUBLAS_ASYNC=1): their
    # products against host sums, the tiny run against Flex (below), and the step with its trace
    WILDFIRE_CUBLAS_ASYNC=1 step gemm_async_tests 60 "$T/b/kernel_tests" cuda_tensor_core_gemm --test-threads 1
    WILDFIRE_CUBLAS_ASYNC=1 step gpt2_async 120 "$G" --backend cuda "${BIG[@]}" --steps 24 --warmup 2 \
        --metrics "$R/gpt2_async.jsonl" --trace "$R/gpt2_async_trace.json"
    step kernels_ours 120 "$T/b/gpu_kernels"
    step kernels_torch 60 python3 "$T/b/gpu_kernels.py"
    # the attention on the `cmma` fragment kernels instead of the default register kernels
    # (WILDFIRE_ATTENTION_MMA=0): its kernels and the step with it
    WILDFIRE_ATTENTION_MMA=0 step kernels_ours_fragments 60 "$T/b/gpu_kernels" --iters 5
    WILDFIRE_ATTENTION_MMA=0 step gpt2_fragments 120 "$G" --backend cuda "${BIG[@]}" --steps 24 --warmup 2 --metrics "$R/gpt2_fragments.jsonl"
    # the register attention without its `ldmatrix` operand loads (WILDFIRE_ATTENTION_LDSM=0):
    # its kernels and the step with it
    WILDFIRE_ATTENTION_LDSM=0 step kernels_ours_noldsm 60 "$T/b/gpu_kernels" --iters 5
    WILDFIRE_ATTENTION_LDSM=0 step gpt2_noldsm 120 "$G" --backend cuda "${BIG[@]}" --steps 24 --warmup 2 --metrics "$R/gpt2_noldsm.jsonl"
    # the register attention loading each key block at its step, not during the block before
    # (WILDFIRE_ATTENTION_PREFETCH=0): its kernels and the step with it
    WILDFIRE_ATTENTION_PREFETCH=0 step kernels_ours_noprefetch 60 "$T/b/gpu_kernels" --iters 5
    WILDFIRE_ATTENTION_PREFETCH=0 step gpt2_noprefetch 120 "$G" --backend cuda "${BIG[@]}" --steps 24 --warmup 2 --metrics "$R/gpt2_noprefetch.jsonl"
    # the register attention compiled without asking ptxas for three cubes per multiprocessor
    # (WILDFIRE_ATTENTION_CUBES_PER_SM=0: two cubes at 172-174 registers, no spill; the default
    # asks three, 164-168 registers): its kernels and the step with it
    WILDFIRE_ATTENTION_CUBES_PER_SM=0 step kernels_ours_twocubes 60 "$T/b/gpu_kernels" --iters 5
    WILDFIRE_ATTENTION_CUBES_PER_SM=0 step gpt2_twocubes 120 "$G" --backend cuda "${BIG[@]}" --steps 24 --warmup 2 --metrics "$R/gpt2_twocubes.jsonl"
    # the attention at head dim 128 (the Llama family's; 6 heads of GPT-2's width) beside SDPA,
    # and its dK/dV pass holding K and V in registers instead of rereading them
    # (WILDFIRE_ATTENTION_KV_REREAD=0: 658 bytes of spill in ptxas)
    step kernels_ours_d128 60 "$T/b/gpu_kernels" --iters 5 --head-dim 128 --attention-only
    step kernels_torch_d128 60 python3 "$T/b/gpu_kernels.py" --iters 5 --head-dim 128 --attention-only
    WILDFIRE_ATTENTION_KV_REREAD=0 step kernels_ours_d128_held 60 "$T/b/gpu_kernels" --iters 5 --head-dim 128 --attention-only
    # the same step with Burn's CubeCL matmuls instead of cuBLASLt (the GEMMs' share of the step)
    WILDFIRE_CUBLAS=0 step gpt2_cubecl 120 "$G" --backend cuda "${BIG[@]}" --steps 8 --warmup 2 --metrics "$R/gpt2_cubecl.jsonl"
    # the flash kernels with CubeCL's bounds checks on every index (the default launches skip them)
    WILDFIRE_KERNELS_CHECKED=1 step kernels_ours_checked 60 "$T/b/gpu_kernels" --iters 5
    WILDFIRE_ATTENTION_MMA=0 WILDFIRE_ATTENTION_CMMA=0 step kernels_ours_nocmma 60 "$T/b/gpu_kernels" --iters 5
    # CubeCL's generated CUDA of the kernel bench's kernels (attention, norms, optimizer tail…),
    # gzipped beside the results (a file of its own: too large, only it is lost):
    # `tools/cuda_sass.py --split` and its NVRTC/ptxas compile read registers, spills and SASS
    # from it on a machine without a GPU (docs/architecture.md §15)
    printf '[compilation.logger]\nlevel = "full"\nfile = "%s"\n' "$T/compilation.log" > "$T/cubecl.toml"
    step kernel_sources 90 "$T/b/gpu_kernels" --iters 1
    rm -f "$T/cubecl.toml"
    [ -f "$T/compilation.log" ] && gzip -c "$T/compilation.log" > "$O/compilation.log.gz"
    printf '[profiling.logger]\nlevel = "basic"\nfile = "%s"\n' "$R/profile.log" > "$T/cubecl.toml"
    step gpt2_profile 90 "$G" --backend cuda "${BIG[@]}" --steps 2 --warmup 1
    rm -f "$T/cubecl.toml"
    # Nsight Systems, where installed: every kernel's device time without the profiler's
    # synchronisation, and the gaps between kernels (the device waiting for the host)
    local nsys; nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    [ -n "$nsys" ] && step nsys_step 120 bash -c "'$nsys' profile --trace=cuda --sample=none --cpuctxsw=none \
        --force-overwrite=true -o '$T/nsys' '$G' --backend cuda ${BIG[*]} --steps 6 --warmup 1 &&
        '$nsys' stats --force-export=true --report cuda_gpu_kern_sum --report cuda_api_sum --report cuda_gpu_trace \
        --format csv --output '$R/nsys' '$T/nsys.nsys-rep'"
    # (f32 GEMMs of the tiny shapes: ≈ 25 s of tuning each on a fresh machine, ≈ 8 shapes)
    step flex_tiny 90 "$G" --backend flex "${SMALL[@]}" --metrics "$R/flex_tiny.jsonl" &
    step cuda_tiny 240 "$G" --backend cuda "${SMALL[@]}" --metrics "$R/cuda_tiny.jsonl"
    wait
    WILDFIRE_CUBLAS_ASYNC=1 step cuda_tiny_async 120 "$G" --backend cuda "${SMALL[@]}" --metrics "$R/cuda_tiny_async.jsonl"
    step gpt2_compile 150 python3 "$T/b/gpt_gpu.py" --mode compile --batch 8 --seq 1024 --dtype bf16 --steps 10 --warmup 3
    # every kernel against Burn ops in f32 (each reference matmul shape is tuned once: slow on a
    # fresh machine, last)
    step kernel_tests 150 "$T/b/kernel_tests" cuda_kernels_match_burn_ops --test-threads 1
    # Nsight Compute on the first six flash-attention launches (four forward, then dQ and dK/dV:
    # the bench calls each twice to warm up, then once timed, at GPT-2's shape),
    # where the toolkit has it: occupancy, throughput, stall reasons — what to fix next
    local ncu; ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
    [ -n "$ncu" ] && step ncu_attention 150 "$ncu" -k regex:flash -c 6 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis "$T/b/gpu_kernels" --iters 1
    # (d) issue 35's memory table: GPT-2 350M, one rank, batch 1 × 1024, f32, 3 steps (the CPU
    # table's settings, `cargo bench --bench optimizers`), per optimizer and offload, then the
    # planner for the CPU table's two budgets: the accounting's peak (metrics) beside the
    # process's device memory (nvidia-smi, sampled every 100 ms: the CUDA context and CubeCL's
    # pools included) and the step time — what the offloads' transfers cost on a GPU
    local MEM=(--preset gpt2-350m --tokenizer gpt2 "${corpus[@]}" --batch-size 1 --block-size 1024
        --steps 3 --warmup 0 --eval-every 0 --eval-iters 0 --sample-tokens 0 --log-every 1 --plot "$T/p.png")
    memstep() { # name timeout gpt_pretrain-flags...
        local name=$1 t=$2; shift 2
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
        nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits -lms 100 > "$R/$name.smi" 2>&1 &
        local smi=$!
        step "$name" "$t" "$G" --backend cuda "${MEM[@]}" --metrics "$R/$name.jsonl" "$@"
        kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    }
    memstep mem_adamw 90
    memstep mem_bf16 90 --optim-state bf16
    memstep mem_int8 90 --optim-state int8
    memstep mem_adafactor 90 --optimizer adafactor
    memstep mem_muon 90 --optimizer muon
    memstep mem_offload_optimizer 90 --offload optimizer
    memstep mem_offload_params 90 --offload params --fsdp full
    memstep mem_plan_6g 150 --plan auto --memory-budget 6000000000
    memstep mem_plan_4g5 150 --plan auto --memory-budget 4500000000
    # the tuning results, for the next run on this kind of GPU (`.gpu/cubecl-cache.tgz`)
    tar czf "$O/cubecl-cache.tgz" -C "$HOME/.cache" cubecl 2>/dev/null
    python3 "$T/b/gpu_table.py" "$R" > "$R/table.md" 2>&1
    tar czf "$O/gpu-bench.tgz" -C "$T" r
    cat "$R/table.md"
}

case "$mode" in
    build) build ;;
    run) run ;;
    *) echo "usage: bash benches/gpu.sh build|run" >&2; exit 2 ;;
esac
