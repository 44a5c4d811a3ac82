#!/usr/bin/env python3
"""PyTorch's side of benches/gpu_kernels.rs: SDPA (causal, bf16) forward and forward+backward,
the embedding gradient and the cross-entropy backward, and torch.matmul on each bf16 GEMM of a GPT-2 124M training step, timed the same way (mean over
the timed calls after two warm-up calls). One JSON line per kernel, the same keys as the Rust
bench: {"kernel", "shape", "ms", "tflops"}.

    python3 benches/pytorch/gpu_kernels.py [--batch 8 --seq 1024] [--head-dim 128 --attention-only]
"""
import argparse, json, math, time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=1024)
p.add_argument("--iters", type=int, default=20)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--attention-only", action="store_true")
args = p.parse_args()
d, v = 768, 50304
hd = args.head_dim
assert d % hd == 0, "--head-dim must divide the model width 768"
b, t, h = args.batch, args.seq, d // hd
dev, bf16 = "cuda", torch.bfloat16
torch.manual_seed(0)


def timed(f):
    f(); f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / args.iters


def report(kernel, shape, s, flops):
    print(json.dumps({"kernel": kernel, "shape": shape, "ms": round(s * 1e3, 4),
                      "tflops": round(flops / s / 1e12, 1)}))


qkv = torch.randn(b, t, h, 3 * hd, device=dev, dtype=bf16, requires_grad=True)
shape = f"b{b} h{h} t{t} d{hd} causal bf16"
fwd_flops = 4 * b * h * t * t * hd / 2


def attn():
    q, k, vv = qkv.split(hd, dim=3)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2), is_causal=True)


with torch.no_grad():
    report("attention_fwd", shape, timed(attn), fwd_flops)
out = attn()
g = torch.randn_like(out)


def fwd_bwd():
    o = attn()
    torch.autograd.grad(o, qkv, g)


# the backward alone: forward + backward minus the forward
s_fb = timed(fwd_bwd)
with torch.no_grad():
    s_f = timed(attn)
report("attention_bwd", shape, s_fb - s_f, 2.5 * fwd_flops)
if args.attention_only:
    raise SystemExit(0)

rows = b * t
# The memory-bound ends of the step, as benches/gpu_kernels.rs: the embedding table's gradient
# (f32, the same skewed ids) and the cross-entropy backward over bf16 logits (forward + backward
# minus the forward), GB/s of the bytes each must move.
vocab = 50257
ids = torch.tensor([min(max(int(math.exp(((i * 0.6180339887) % 1.0) * math.log(vocab))) - 1, 0),
                        vocab - 1) for i in range(rows)], device=dev)
dy = torch.randn(rows, d, device=dev)
s_e = timed(lambda: torch.ops.aten.embedding_dense_backward(dy, ids, v, -1, False))
print(json.dumps({"kernel": "embedding_bwd", "shape": f"{rows} ids, {v}x{d} f32",
                  "ms": round(s_e * 1e3, 4), "tflops": 0.0,
                  "gbps": round((v * d + rows * d) * 4 / s_e / 1e9)}))
logits = torch.randn(rows, v, device=dev, dtype=bf16, requires_grad=True)
s_fb = timed(lambda: torch.autograd.grad(F.cross_entropy(logits, ids), logits))
with torch.no_grad():
    s_f = timed(lambda: F.cross_entropy(logits, ids))
s_ce = s_fb - s_f
print(json.dumps({"kernel": "cross_entropy_bwd", "shape": f"{rows}x{v} bf16",
                  "ms": round(s_ce * 1e3, 4), "tflops": 0.0,
                  "gbps": round(rows * v * 2 * 2 / s_ce / 1e9)}))
del logits

for name, k, n in [("qkv", d, 3 * d), ("attn_proj", d, d), ("mlp_fc", d, 4 * d),
                   ("mlp_proj", 4 * d, d), ("lm_head", d, v)]:
    x = torch.randn(rows, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16)
    g = torch.randn(rows, n, device=dev, dtype=bf16)
    shape, flops = f"{rows}x{k}x{n} bf16", 2 * rows * k * n
    # forward x·Wᵀ, input gradient g·W, weight gradient xᵀ·g (as benches/gpu_kernels.rs)
    report(f"matmul_{name}", shape, timed(lambda: x @ w.t()), flops)
    report(f"matmul_{name}_dx", shape, timed(lambda: g @ w), flops)
    report(f"matmul_{name}_dw", shape, timed(lambda: x.t() @ g), flops)
