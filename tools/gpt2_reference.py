#!/usr/bin/env python3
"""Write tests/fixtures/gpt2_tiny/: a tiny GPT-2 as Hugging Face `transformers` saves it
(`model.safetensors`, `config.json`: 2 layers, 4 heads, width 64, a 256-token vocabulary, 32
positions, the exact GELU so the built-in model's activation applies; the same weights in bf16
and f16 as `model-bf16.safetensors` / `model-f16.safetensors`) with every parameter
perturbed away from its initialisation (biases and LayerNorms included, so a misplaced column
shows), and `reference.safetensors`: the tokens (`tokens`, i64 `[2, 24]`), `GPT2LMHeadModel`'s logits on
them (`logits`, f32 `[2, 24, 256]`; `logits_f16` of the rounded weights) and its
loss (`loss`, f32 `[1]`), and the logits of the same weights under GPT-2's own tanh GELU
(`logits_tanh`, `activation_function: "gelu_new"`).
The tests import the file and compare Wildfire's logits, and export it back and compare the
tensors bitwise.

And tests/fixtures/gpt2_vocab/: a GPT-2 with the real 50,257-token vocabulary (1 layer, 2 heads,
width 2 — head width 1 — 16 positions, the exact GELU), every parameter perturbed, saved in bf16
as `transformers` saves a bf16 model, and `reference.safetensors`: tokens (`tokens`, i64 `[2, 12]`,
the highest ids among them), the log-sum-exp of each position's 50,257 logits (`lse`, f32
`[2, 12]`), the logits at 64 columns (`cols`, i64 `[64]`, the vocabulary's last 16 among them;
`logits_at`, f32 `[2, 12, 64]`) and the loss (`loss`, f32 `[1]`), computed in f32 from the bf16
weights. Wildfire pads this vocabulary to 50,304: the padded columns must stay out of the
log-sum-exp and the loss.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers safetensors numpy
    /tmp/tv/bin/python tools/gpt2_reference.py
"""
import pathlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/gpt2_tiny"


def perturbed(seed, scale, **shape):
    """A GPT-2 of `shape` (the exact GELU, no dropout) from `seed`, every parameter moved by
    `scale`·N(0, 1) away from its initialisation (so a misplaced column shows)."""
    torch.manual_seed(seed)
    config = GPT2Config(**shape, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return config, model


def save(model, out):
    """`model` as `transformers` saves it, in `out` (without the generation config)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)


def main():
    config, model = perturbed(20261127, 0.05, vocab_size=256, n_positions=32, n_embd=64,
                              n_layer=2, n_head=4)
    save(model, OUT)
    tokens = [[(7 * i + 3 * b + 1) % 256 for i in range(24)] for b in range(2)]
    idx = torch.tensor(tokens)
    with torch.no_grad():
        out = model(idx, labels=idx)
    from safetensors.torch import save_file
    reference = {
        "tokens": idx.to(torch.int64).contiguous(),
        "logits": out.logits.float().contiguous(),
        "loss": out.loss.float().reshape(1).contiguous(),
    }
    # The same weights stored in bf16 and f16, as Hugging Face ships larger models, and the
    # logits of those weights widened back to f32.
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for dtype, name in ((torch.float16, "f16"),):
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()},
                  OUT / f"model-{name}.safetensors")
        rounded = GPT2LMHeadModel(config).eval()
        rounded.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        with torch.no_grad():
            reference[f"logits_{name}"] = rounded(idx).logits.float().contiguous()
    reference["logits_tanh"] = tanh_logits(idx)
    save_file(reference, OUT / "reference.safetensors", metadata={
        "transformers": __import__("transformers").__version__, "torch": torch.__version__})
    print(f"wrote {OUT}")


VOCAB_OUT = OUT.parent / "gpt2_vocab"


def vocab_fixture():
    """tests/fixtures/gpt2_vocab (see the module docs)."""
    _, model = perturbed(20261128, 0.5, vocab_size=50257, n_positions=16, n_embd=2, n_layer=1,
                         n_head=2)
    model = model.to(torch.bfloat16)
    save(model, VOCAB_OUT)
    model = model.float()
    tokens = [[(4099 * i + 7919 * b + 50250) % 50257 for i in range(12)] for b in range(2)]
    tokens[0][3] = 50256
    idx = torch.tensor(tokens)
    with torch.no_grad():
        out = model(idx, labels=idx)
    logits = out.logits.float()
    cols = torch.cat([torch.arange(0, 24), torch.arange(20000, 50000, 1250), torch.arange(50241, 50257)])
    from safetensors.torch import save_file
    save_file({
        "tokens": idx.to(torch.int64).contiguous(),
        "lse": torch.logsumexp(logits, dim=-1).contiguous(),
        "cols": cols.to(torch.int64).contiguous(),
        "logits_at": logits[:, :, cols].contiguous(),
        "loss": out.loss.float().reshape(1).contiguous(),
    }, VOCAB_OUT / "reference.safetensors", metadata={
        "transformers": __import__("transformers").__version__, "torch": torch.__version__})
    print(f"wrote {VOCAB_OUT}")


def tanh_logits(idx):
    """The written weights' logits under the tanh GELU (`gelu_new`), GPT-2's own activation."""
    config = GPT2Config.from_pretrained(OUT)
    config.activation_function = "gelu_new"
    model = GPT2LMHeadModel.from_pretrained(OUT, config=config).eval()
    with torch.no_grad():
        return model(idx).logits.float().contiguous()


if __name__ == "__main__":
    main()
    vocab_fixture()
