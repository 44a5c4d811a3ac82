"""transformers' greedy `generate` on GPT-2 124M's shape (randomly initialised, f32, CPU), with
and without its key/value cache: the peer of `cargo bench --bench generate`, the same prompt
(ids i * 7919 % 50257), the same number of new tokens, the same JSON lines.

    python benches/pytorch/generate_gpt.py [--prompt 32] [--tokens 32] [--no-uncached]
"""

import argparse
import json
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-uncached", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=50304,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).eval()
    prompt = torch.tensor([[(i * 7919) % 50257 for i in range(args.prompt)]])

    def generate(n, cache):
        # Exactly `n` new tokens: no end-of-text stop, no padding warnings.
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=cache,
            eos_token_id=None,
            pad_token_id=0,
        )

    modes = ["cached"] + ([] if args.no_uncached else ["uncached"])
    with torch.inference_mode():
        generate(2, True)  # warm-up
        for mode in modes:
            start = time.perf_counter()
            out = generate(args.tokens, mode == "cached")
            seconds = time.perf_counter() - start
            print(
                json.dumps(
                    {
                        "bench": "generate",
                        "framework": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}",
                        "mode": mode,
                        "model": "gpt2-124m shape",
                        "prompt": args.prompt,
                        "tokens": args.tokens,
                        "seconds": round(seconds, 4),
                        "tokens_per_s": round(args.tokens / seconds, 2),
                        "threads": torch.get_num_threads(),
                    }
                ),
                flush=True,
            )
            assert out.shape[1] == args.prompt + args.tokens


if __name__ == "__main__":
    main()
