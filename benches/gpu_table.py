#!/usr/bin/env python3
"""The markdown table of `benches/gpu.sh run`, from the logs in its result folder.

    python3 benches/gpu_table.py RESULT_DIR

MFU has one formula for both sides: tokens/s × flops_per_token / 989e12 (H100 SXM dense bf16),
flops_per_token = 6·N + 12·L·T·d as PyTorch's script reports it for the same model (N without
the position table).
"""
import json, os, re, statistics, sys
from collections import defaultdict

R = sys.argv[1]
PEAK = 989e12


def read(name):
    try:
        return open(os.path.join(R, name), errors="replace").read()
    except OSError:
        return ""


def jsonl(name):
    out = []
    for line in read(name).splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


print("## GPU bench\n")
print("```\n" + read("env.txt").strip() + "\n```\n")
print("Steps: " + "; ".join(read("summary.txt").strip().splitlines()) + "\n")

# (a) correctness
print("### Correctness\n")
for log, what in (("attention_tests.log", "tensor-core attention against the f32 tiles"),
                  ("gemm_async_tests.log", "cuBLASLt GEMMs against host sums, WILDFIRE_CUBLAS_ASYNC=1"),
                  ("kernel_tests.log", "every kernel against Burn ops (f32)")):
    if not read(log):
        continue
    tests = re.findall(r"test result: .*", read(log))
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", read(log), re.M)
    print(f"- {what}: {tests[-1] if tests else 'no result'}"
          + (f" (failed: {', '.join(failed)})" if failed else ""))
flex = jsonl("flex_tiny.jsonl")
for log, how in (("cuda_tiny.jsonl", ""), ("cuda_tiny_async.jsonl", ", WILDFIRE_CUBLAS_ASYNC=1")):
    cuda = jsonl(log)
    if not read(log):
        continue
    if flex and cuda and len(flex) == len(cuda):
        dl = max(abs(a["loss"] - b["loss"]) for a, b in zip(flex, cuda))
        dg = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(flex, cuda))
        print(f"- tiny preset, {len(cuda)} steps f32, CUDA vs Flex{how}: max |Δloss| {dl:.2e}, "
              f"max |Δgrad_norm| {dg:.2e}")
    else:
        print(f"- tiny preset CUDA vs Flex{how}: incomplete ({len(flex)} vs {len(cuda)} steps)")

# (b) kernels
print("\n### Kernels at GPT-2 124M's shapes (bf16)\n")
ours = {k["kernel"]: k for k in jsonl("kernels_ours.log")}
torch = {k["kernel"]: k for k in jsonl("kernels_torch.log")}
print("| kernel | shape | Wildfire ms | PyTorch ms | ratio | Wildfire TFLOP/s (% of peak) or GB/s |")
print("|---|---|---|---|---|---|")
for name, k in ours.items():
    t = torch.get(name)
    ratio = f"{k['ms'] / t['ms']:.2f}×" if t and t["ms"] > 0 else "–"
    rate = (f"{k['gbps']} GB/s" if "gbps" in k
            else f"{k['tflops']} ({100 * k['tflops'] * 1e12 / PEAK:.0f}%)")
    print(f"| {name} | {k['shape']} | {k['ms']:.3f} | {t['ms'] if t else '–'} | {ratio} | {rate} |")

for log, how in (("kernels_ours_checked.log", "with bounds checks"),
                 ("kernels_ours_nocmma.log", "without tensor cores"),
                 ("kernels_ours_fragments.log", "`cmma` fragment kernels (`WILDFIRE_ATTENTION_MMA=0`)"),
                 ("kernels_ours_noldsm.log", "without `ldmatrix` (`WILDFIRE_ATTENTION_LDSM=0`)"),
                 ("kernels_ours_noprefetch.log",
                  "without the next block's reads ahead (`WILDFIRE_ATTENTION_PREFETCH=0`)"),
                 ("kernels_ours_twocubes.log",
                  "without the three-cube register ask (`WILDFIRE_ATTENTION_CUBES_PER_SM=0`)")):
    plain = {k["kernel"]: k for k in jsonl(log)}
    for name in ("attention_fwd", "attention_bwd"):
        if name in plain:
            k = plain[name]
            print(f"| {name} {how} | {k['shape']} | {k['ms']:.3f} | | | {k['tflops']} |")

# the attention at head dim 128 beside SDPA, and its dK/dV pass holding K and V in registers
ours128 = {k["kernel"]: k for k in jsonl("kernels_ours_d128.log")}
torch128 = {k["kernel"]: k for k in jsonl("kernels_torch_d128.log")}
held128 = {k["kernel"]: k for k in jsonl("kernels_ours_d128_held.log")}
for name, k in ours128.items():
    t = torch128.get(name)
    ratio = f"{k['ms'] / t['ms']:.2f}×" if t and t["ms"] > 0 else "–"
    print(f"| {name} | {k['shape']} | {k['ms']:.3f} | {t['ms'] if t else '–'} | {ratio} | {k['tflops']} |")
    if name in held128:
        h = held128[name]
        print(f"| {name}, K/V held (`WILDFIRE_ATTENTION_KV_REREAD=0`) | {h['shape']} | {h['ms']:.3f} | | | {h['tflops']} |")

# (b) whole step
print("\n### GPT-2 124M, bf16, batch 8 × 1024 (tokens/s after step 0)\n")
eager = jsonl("gpt2_eager.log")
compiled = jsonl("gpt2_compile.log")
fpt = (eager or compiled or [{}])[0].get("flops_per_token")
rows = []
for label, log in (("Wildfire (CUDA, cuBLASLt GEMMs)", "gpt2_ours.jsonl"),
                   ("Wildfire (CUDA, CubeCL GEMMs)", "gpt2_cubecl.jsonl"),
                   ("Wildfire (CUDA, cuBLASLt GEMMs, fragment attention)", "gpt2_fragments.jsonl"),
                   ("Wildfire (CUDA, attention without `ldmatrix`)", "gpt2_noldsm.jsonl"),
                   ("Wildfire (CUDA, attention without reads ahead)", "gpt2_noprefetch.jsonl"),
                   ("Wildfire (CUDA, attention without the three-cube ask)", "gpt2_twocubes.jsonl"),
                   ("Wildfire (CUDA, GEMMs not waited for: WILDFIRE_CUBLAS_ASYNC=1)", "gpt2_async.jsonl")):
    steps = jsonl(log)[1:]
    if steps:
        rows.append((label, statistics.median(s["tokens_per_s"] for s in steps)))
for label, res in (("PyTorch eager", eager), ("torch.compile", compiled)):
    if res:
        rows.append((label, res[0]["tokens_per_s"]))
print("| implementation | tokens/s | MFU |")
print("|---|---|---|")
for label, tps in rows:
    mfu = f"{100 * tps * fpt / PEAK:.1f}%" if fpt else "–"
    print(f"| {label} | {tps:,.0f} | {mfu} |")

# the host's time in each region of a step (`--trace`): forward and backward only queue work on
# the device, so where they fill the step the host is the limit, not the GPU
traces = []
for label, name in (("default", "gpt2_trace.json"), ("WILDFIRE_CUBLAS_ASYNC=1", "gpt2_async_trace.json")):
    try:
        events = json.loads(read(name) or "null")
    except ValueError:
        events = None
    if not events:
        continue
    events = events["traceEvents"] if isinstance(events, dict) else events
    regions = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            regions[e["name"]].append(e["dur"] / 1e3)
    traces.append((label, {k: statistics.median(v[2:] or v) for k, v in regions.items()}))
if traces:
    names = [n for n in ("forward", "backward", "sync and check", "optimizer", "step")
             if any(n in t for _, t in traces)]
    print("\n### The host's time per step region (median ms, steps 2 on; `--trace`)\n")
    print("| run | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, t in traces:
        print(f"| {label} | " + " | ".join(f"{t[n]:.1f}" if n in t else "–" for n in names) + " |")

# (c) the host's stacks (`--host-profile`, summed by host_profile.py): the thread table and
# the two busiest threads' heaviest functions
host = read("host_profile.md").strip()
if host:
    parts = host.split("\n### ")
    print("\n### Where the host's time goes (`--host-profile`, steps 2–11)\n")
    print(parts[0])
    for part in parts[1:3]:
        print("\n#### " + part)

# (c) profile
print("\n### CubeCL profile of one training step (the run's last step; top 15 kernels)\n")
per = defaultdict(lambda: [0.0, 0])
units = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}
launches = []
for line in read("profile.log").splitlines():
    m = re.match(r"\|\s*([\d.]+)(ns|µs|us|ms|s)\s*\|\s*(.+)$", line)
    if m:
        name = re.split(r"[\s<:(]", m.group(3).strip(), maxsplit=1)[0]
        launches.append((name, float(m.group(1)) * units[m.group(2)]))
# The last step alone: after the first step's optimizer launches (its first launches compile
# and tune). A step ends with one AdamW launch per parameter tensor.
adamw = [i for i, (n, _) in enumerate(launches) if n == "AdamwKernel"]
if adamw and len(adamw) % 2 == 0:
    launches = launches[adamw[len(adamw) // 2 - 1] + 1:]
for name, ms in launches:
    per[name][0] += ms
    per[name][1] += 1
total = sum(v[0] for v in per.values())
if total:
    print(f"Launches of the step: {sum(v[1] for v in per.values())}, {total:.1f} ms of kernel time "
          "(CubeCL's launches only: cuBLASLt's GEMMs are not in its profile).\n")
    print("| kernel | ms | launches | share |")
    print("|---|---|---|---|")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {name} | {ms:.1f} | {n} | {100 * ms / total:.1f}% |")
else:
    print("(no profile)")

# (d) memory (issue 35)
MEM = (("mem_adamw", "AdamW"), ("mem_bf16", "AdamW, bf16 moments"),
       ("mem_int8", "AdamW, 8-bit moments"), ("mem_adafactor", "Adafactor"), ("mem_muon", "Muon"),
       ("mem_offload_optimizer", "AdamW offloaded (`--offload optimizer`)"),
       ("mem_offload_params", "AdamW and parameters offloaded (`--offload params --fsdp full`)"),
       ("mem_plan_6g", "`--plan auto`, budget 6.0 GB"), ("mem_plan_4g5", "`--plan auto`, budget 4.5 GB"))
rows = []
for name, label in MEM:
    steps = [s for s in jsonl(name + ".jsonl") if "peak_bytes" in s]
    if not steps and not read(name + ".log"):
        continue
    smi = [int(x) for x in re.findall(r"^\s*(\d+)\s*$", read(name + ".smi"), re.M)]
    chosen = re.findall(r"`([^`]*)` \(chosen\)", read(name + ".log"))
    if not steps:
        rows.append(f"| {label} | failed or timed out (see {name}.log) | | | | | |")
        continue
    gb = lambda b: f"{b / 1e9:.2f} GB"
    later = steps[1:] or steps
    step_s = statistics.median(1024 / s["tokens_per_s"] for s in later if s.get("tokens_per_s"))
    rows.append(f"| {label} | {gb(max(s['peak_bytes'] for s in steps))} | "
                f"{gb(steps[-1]['optim_bytes'])} | {gb(steps[-1]['host_bytes'])} | "
                f"{(str(max(smi)) + ' MiB') if smi else '–'} | {step_s:.3f} s | "
                f"{'`' + chosen[-1] + '`' if chosen else ''} |")
if rows:
    print("\n### Memory: GPT-2 350M, one rank, batch 1 × 1024, f32, 3 steps (issue 35)\n")
    print("Peak: the accounting's largest step peak of live tensor bytes; device memory: the "
          "process's largest `nvidia-smi` reading (CUDA context and CubeCL's pools included); "
          "step: the median of the steps after the first.\n")
    print("| run | peak | optimizer state, device | host | device memory | step | plan |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
