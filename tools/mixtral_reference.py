#!/usr/bin/env python3
"""Write tests/fixtures/mixtral_tiny/: a tiny Mixtral as Hugging Face `transformers` saves it
(`MixtralForCausalLM`: every block a mixture of 4 SwiGLU experts, top-2 of a softmax
renormalised), and its logits on fixed tokens.

2 layers, 4 query heads over 2 key/value heads, width 32, experts of width 48, a 256-token
vocabulary, 64 positions, RoPE θ 1,000,000 (Mixtral's), an output head of its own. Every parameter
is perturbed away from its initialisation (the norms and the routers included), the routers
enough that tokens spread over the experts. Beside the model, `reference.safetensors` holds the
tokens (`tokens`, i64 `[2, 24]`), the model's logits on them (`logits`, f32 `[2, 24, 256]`), its
loss (`loss`, f32 `[1]`: next-token targets; no router loss, `output_router_logits` off) and the
experts each token chose in each layer (`chosen`, i64 `[2, 2·24, 2]`, best first), so a test can
tell a routing difference from an arithmetic one.

transformers 5 saves a Mixtral's experts one by one (`block_sparse_moe.experts.{e}.w1`, `w2`,
`w3`), as the Hub's files hold them.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers safetensors numpy
    /tmp/tv/bin/python tools/mixtral_reference.py
"""
import pathlib

import torch
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/mixtral_tiny"


def main():
    config = MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
        sliding_window=None, router_jitter_noise=0.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(20261128)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            p.add_(scale * torch.randn_like(p))
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    (OUT / "generation_config.json").unlink(missing_ok=True)
    tokens = torch.tensor([[(11 * i + 5 * b + 3) % 256 for i in range(24)] for b in range(2)])
    with torch.no_grad():
        result = model(tokens, labels=tokens, output_router_logits=True)
    chosen = torch.stack([
        torch.topk(torch.softmax(logits.float(), dim=-1), 2, dim=-1).indices
        for logits in result.router_logits
    ])
    with torch.no_grad():
        plain = model(tokens, labels=tokens)
    save_file({
        "tokens": tokens.to(torch.int64).contiguous(),
        "logits": plain.logits.float().contiguous(),
        "loss": plain.loss.float().reshape(1).contiguous(),
        "chosen": chosen.to(torch.int64).contiguous(),
    }, OUT / "reference.safetensors", metadata={
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    })
    counts = torch.bincount(chosen.flatten(), minlength=4).tolist()
    print(f"wrote {OUT}: loss {plain.loss.item():.6f}, expert choices {counts}")


if __name__ == "__main__":
    main()
