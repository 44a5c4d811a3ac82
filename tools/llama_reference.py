#!/usr/bin/env python3
"""Write tests/fixtures/llama_tiny/: two tiny Llama-3 models as Hugging Face `transformers` saves
them, and their logits on fixed tokens.

- `untied/`: 2 layers, 4 query heads over 2 key/value heads (grouped-query attention), width 32,
  SwiGLU width 64, a 256-token vocabulary, 64 positions, Llama-3.2's RoPE (θ 500,000 and the
  `llama3` frequency scaling: factor 32, low/high frequency factors 1 and 4, 8,192 original
  positions, which at head width 8 puts one frequency in each of its three regimes), an output
  head of its own (`tie_word_embeddings: false`, as Llama-3-8B).
- `tied/`: the same shape with the head tied to the token table (as Llama-3.2-1B/3B).

Every parameter is perturbed away from its initialisation (the norms' weights included, so a
misplaced row or column shows). Beside each model, `reference.safetensors` holds the tokens
(`tokens`, i64 `[2, 24]`), `LlamaForCausalLM`'s logits on them (`logits`, f32 `[2, 24, 256]`) and
its loss (`loss`, f32 `[1]`: next-token targets, the labels shifted inside the model).

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers safetensors numpy
    /tmp/tv/bin/python tools/llama_reference.py
"""
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/llama_tiny"


def tiny_config(tie):
    """The fixtures' tiny Llama-3 (see the module docs); `tools/trained_reference.py` uses it too."""
    return LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=tie, attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def write(name, tie, seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tie)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    tokens = torch.tensor([[(11 * i + 5 * b + 3) % 256 for i in range(24)] for b in range(2)])
    with torch.no_grad():
        result = model(tokens, labels=tokens)
    save_file({
        "tokens": tokens.to(torch.int64).contiguous(),
        "logits": result.logits.float().contiguous(),
        "loss": result.loss.float().reshape(1).contiguous(),
    }, out / "reference.safetensors", metadata={
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    })
    print(f"wrote {out}: loss {result.loss.item():.6f}")


def main():
    write("untied", False, 20261127)
    write("tied", True, 20261128)


if __name__ == "__main__":
    main()
