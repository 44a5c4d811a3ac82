#!/usr/bin/env python3
"""Train Wildfire's GPT in PyTorch eager on the CPU (f32, no torch.compile): the peer of
`examples/gpt_pretrain` in benches/cpu_vs_pytorch.sh.

The model is models/src/gpt.rs as nanoGPT's model.py would write it: GPT-2 blocks, pre-LayerNorm
(eps 1e-5, with bias), learned positions, tied input/output embeddings, biases on every Linear,
exact (erf) GELU, attention through F.scaled_dot_product_attention(is_causal=True) (nanoGPT's
"flash" path). The training loop mirrors src/pretrain.rs:
  - AdamW betas (0.9, 0.95), eps 1e-5 (Burn's default), decoupled weight decay on EVERY parameter
    (Burn's AdamW has no parameter groups; nanoGPT would exempt biases, LayerNorms and embeddings),
    PyTorch's fused CPU kernel (fused=True; foreach where the torch is older than 2.4);
  - lr: linear warmup lr*(step+1)/warmup, then cosine to min-lr at --steps (ours: min = lr/10);
  - global gradient-norm clipping at 1.0; mean cross-entropy over all positions;
  - batches from Wildfire's seeded sampler (same rows as ours: splitmix64 of (seed, step, row)),
    train = first 90% of the tokens, val = the rest; val loss = mean over --eval-iters batches of the
    val sampler (seed ^ 0x56414C, batches 0..eval_iters), after steps where (step+1) % eval_every == 0
    and after the last step;
  - the initial weights are Wildfire's exactly (its host-side splitmix64 + Box-Muller streams), and
    c_attn's columns are grouped by head as ours ([q0 k0 v0 q1 k1 v1 ...]).
Timing: each step from batch sampling to the optimizer update and loss.item(), evaluation excluded;
the first step (warm-up) is excluded. The last stdout line is one JSON object.
"""
import argparse, json, math, os, struct, sys, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

M64 = (1 << 64) - 1
GOLDEN, C1, C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(z):  # splitmix64's finaliser (models/src/data/sampler.rs)
    z = (z + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * C1) & M64
    z = ((z ^ (z >> 27)) * C2) & M64
    return z ^ (z >> 31)


def batch(data, seed, step, batch_size, block):
    """Rows 0..batch_size of `step` (BatchSampler::batch): inputs and next-token targets."""
    starts = len(data) - block
    offs = [(mix(mix(mix(seed) ^ step) ^ row) * starts) >> 64 for row in range(batch_size)]
    idx = np.array(offs)[:, None] + np.arange(block + 1)[None, :]
    rows = torch.from_numpy(data[idx].astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def wf_normal(seed, count, shape, std):
    """Wildfire's `Init::normal` (models/src/gpt.rs): stream `count` of splitmix64 + Box-Muller."""
    n = math.prod(shape)
    m = n + (n & 1)
    state = np.uint64(seed ^ ((count * GOLDEN) & M64))
    z = state + np.arange(1, m + 1, dtype=np.uint64) * np.uint64(GOLDEN)  # wraps mod 2^64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(C1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(C2)
    u = ((z ^ (z >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) / 2.0**53
    r, theta = np.sqrt(-2.0 * np.log(np.maximum(u[0::2], 1e-300))), 2.0 * np.pi * u[1::2]
    out = np.empty(m, dtype=np.float32)
    out[0::2], out[1::2] = (r * np.cos(theta)).astype(np.float32), (r * np.sin(theta)).astype(np.float32)
    return torch.from_numpy((out[:n] * np.float32(std)).reshape(shape))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        qkv = self.c_attn(self.ln_1(x)).view(B, T, self.n_head, 3 * hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(hd, dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, d, init_seed=1337, used=None):
        super().__init__()
        # Wildfire masks a padded vocabulary's entries out of the logits (logit -1e4): the same.
        mask = torch.zeros(vocab)
        mask[(used or vocab):] = -1e4
        self.register_buffer("pad_mask", mask if used and used < vocab else None)
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        # Wildfire's init, in its stream order; its Linear weights are [in, out]: transpose.
        count = 0

        def normal(shape, std):
            nonlocal count
            count += 1
            return wf_normal(init_seed, count, shape, std)

        proj_std = np.float32(0.02) / np.sqrt(np.float32(2 * n_layer))
        with torch.no_grad():
            for b in self.blocks:
                for lin, std in ((b.c_attn, 0.02), (b.attn_proj, proj_std), (b.c_fc, 0.02), (b.mlp_proj, proj_std)):
                    lin.weight.copy_(normal((lin.in_features, lin.out_features), std).T)
                    lin.bias.zero_()
            self.wte.weight.copy_(normal((vocab, d), 0.02))
            self.wpe.weight.copy_(normal((block, d), 0.02))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output projection
        if self.pad_mask is not None:
            logits = logits + self.pad_mask
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def load_tokens(path, vocab):
    """(tokens, where from). bytes: the file's raw bytes. gpt2: Wildfire's token cache
    `<file>.gpt2.tokens` (same ids as ours; accepted when it records the file's length), else
    tiktoken's "gpt2" (r50k) encoding, else random ids (throughput only)."""
    if vocab == "bytes":
        return np.fromfile(path, dtype=np.uint8), "bytes"
    cache = path + ".gpt2.tokens"
    if os.path.exists(cache):
        head = open(cache, "rb").read(64)
        width, kind, _, src_len = struct.unpack("<IIIQ", head[12:32])
        if head[:8] == b"WFTOKENS" and kind == 1 and src_len == os.path.getsize(path):
            dtype = np.uint16 if width == 2 else np.uint32
            return np.fromfile(cache, dtype=dtype, offset=64), "wildfire gpt2 cache"
    text = open(path, encoding="utf-8").read()
    try:
        import tiktoken
        return np.array(tiktoken.get_encoding("gpt2").encode(text, allowed_special="all"), dtype=np.uint32), "tiktoken gpt2"
    except Exception as e:  # not installed, or its BPE table cannot be downloaded
        print(f"gpt2 tokenizer unavailable ({type(e).__name__}): RANDOM token ids, for throughput only", file=sys.stderr)
        return np.random.default_rng(0).integers(0, 50257, len(text) // 3, dtype=np.uint32), "random"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--n-layer", type=int, default=4); a("--n-head", type=int, default=4)
    a("--n-embd", type=int, default=128); a("--block-size", type=int, default=128)
    a("--batch-size", type=int, default=8); a("--steps", type=int, default=300)
    a("--lr", type=float, default=1e-3); a("--min-lr", type=float, help="default: lr/10 (ours)")
    a("--warmup", type=int, default=20); a("--weight-decay", type=float, default=0.1)
    a("--clip", type=float, default=1.0); a("--val-fraction", type=float, default=0.1)
    a("--vocab", choices=["bytes", "gpt2"], default="bytes"); a("--data", required=True)
    a("--eval-every", type=int, default=50); a("--eval-iters", type=int, default=4)
    a("--seed", type=int, default=1337); a("--threads", type=int, help="default: all cores")
    a("--log-every", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr

    tokens, source = load_tokens(args.data, args.vocab)
    n_used = 256 if args.vocab == "bytes" else max(50257, int(tokens.max()) + 1)
    n_vocab = n_used if args.vocab == "bytes" else -(-n_used // 64) * 64
    n_train = int(len(tokens) * (1.0 - args.val_fraction))
    train, val = tokens[:n_train], tokens[n_train:]
    model = GPT(n_vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, used=n_used)
    params = sum(q.numel() for q in model.parameters())
    # PyTorch's fastest AdamW on the CPU: the fused kernel (torch >= 2.4), else the multi-tensor
    # (foreach) one.
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-5, weight_decay=args.weight_decay)
    try:
        opt, adamw_kind = torch.optim.AdamW(model.parameters(), fused=True, **adamw), "fused"
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"fused AdamW unavailable ({e}): foreach", file=sys.stderr)
        opt, adamw_kind = torch.optim.AdamW(model.parameters(), foreach=True, **adamw), "foreach"

    def lr_at(step):  # PretrainConfig::lr_at
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - min_lr)

    @torch.no_grad()
    def evaluate():
        model.eval()
        seed = args.seed ^ 0x0056414C
        total = sum(model(*batch(val, seed, i, args.batch_size, args.block_size)).item()
                    for i in range(args.eval_iters))
        model.train()
        return total / args.eval_iters

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {params:,} parameters, "
          f"vocab {n_vocab}, {len(tokens):,} tokens ({source})", file=sys.stderr)
    timed, first, val_loss, loss_v = 0.0, 0.0, None, float("nan")
    for step in range(args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(*batch(train, args.seed, step, args.batch_size, args.block_size))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip) if args.clip > 0 else torch.tensor(0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        dt = time.perf_counter() - t0
        if step == 0:
            first = dt
        else:
            timed += dt
        last = step + 1 == args.steps
        ev = (args.eval_every > 0 and (step + 1) % args.eval_every == 0) or last
        if ev and args.eval_iters > 0 and len(val) > args.block_size:
            val_loss = evaluate()
        if step % args.log_every == 0 or last or ev:
            vl = f" | val_loss {val_loss:.4f}" if ev and val_loss is not None else ""
            print(f"step {step} | loss {loss_v:.4f} | lr {lr:.2e} | grad_norm {norm.item():.3f} | "
                  f"{dt * 1e3:.1f} ms{vl}", file=sys.stderr, flush=True)

    tokens_per_step = args.batch_size * args.block_size
    timed_steps = args.steps - 1
    print(json.dumps({
        "framework": "pytorch", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "tokens_per_s": tokens_per_step * timed_steps / timed if timed_steps else None,
        "train_seconds": timed, "timed_steps": timed_steps, "first_step_seconds": first,
        "steps": args.steps, "loss": loss_v, "val_loss": val_loss, "params": params,
        "vocab": n_vocab, "tokens": source, "adamw": adamw_kind,
    }))


if __name__ == "__main__":
    main()
