#!/usr/bin/env python3
"""Write tests/fixtures/trained/: a tiny GPT-2 and a tiny Llama-3 briefly trained by
`transformers` on Shakespeare's bytes, with the loss `transformers` gives on every window of a
held-out text, so a test can check that `gpt_pretrain --init-from DIR` reports the validation
loss `transformers` gives on the same windows.

- `gpt2/`: `GPT2LMHeadModel`, 2 layers, 4 heads, width 32, 64 positions, a 256-token (bytes)
  vocabulary, GPT-2's tanh GELU (`gelu_new`).
- `llama/`: `LlamaForCausalLM`, 2 layers, 4 query heads over 2 key/value heads, width 32, SwiGLU
  width 64, 64 positions, Llama-3.2's rotary scaling, an untied head.

Both train 300 AdamW steps (lr 3e-3, batches of 16 × 32 bytes) on the first 200,000 bytes of
`../shared/data/tinyshakespeare.txt`, which end well before `data.txt` (6,000 bytes from offset
1,000,000). `windows.safetensors` holds `loss` (f32 `[len(data.txt) - 32]`): entry `s` is the mean
next-token cross-entropy of the window whose 32 inputs start at byte `s` (targets shifted by
one), computed in f32 by `transformers`.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers safetensors numpy
    /tmp/tv/bin/python tools/trained_reference.py
"""
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from llama_reference import tiny_config
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/trained"
CORPUS = ROOT.parent / "shared/data/tinyshakespeare.txt"
BLOCK = 32


def models():
    gpt2 = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0)
    llama = tiny_config(tie=False)  # the untied fixture's shape
    return [("gpt2", GPT2LMHeadModel(gpt2)), ("llama", LlamaForCausalLM(llama))]


def main():
    data = CORPUS.read_bytes()
    train = torch.tensor(list(data[:200_000]), dtype=torch.long)
    held = data[1_000_000:1_006_000]
    ids = torch.tensor(list(held), dtype=torch.long)
    starts = torch.arange(len(held) - BLOCK)
    windows = torch.stack([ids[s:s + BLOCK] for s in starts])
    targets = torch.stack([ids[s + 1:s + BLOCK + 1] for s in starts])
    # Seeded before the models are built: their initial weights are part of the fixture.
    torch.manual_seed(20261127)
    for name, model in models():
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        model.train()
        for step in range(300):
            rows = torch.randint(0, len(train) - BLOCK - 1, (16,))
            x = torch.stack([train[r:r + BLOCK] for r in rows])
            y = torch.stack([train[r + 1:r + BLOCK + 1] for r in rows])
            loss = F.cross_entropy(model(x).logits.reshape(-1, 256), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            losses = torch.cat([
                F.cross_entropy(model(w).logits.reshape(-1, 256), t.reshape(-1),
                                reduction="none").reshape(-1, BLOCK).mean(1)
                for w, t in zip(windows.split(512), targets.split(512))
            ])
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        (out / "generation_config.json").unlink(missing_ok=True)
        save_file({"loss": losses.float().contiguous()}, out / "windows.safetensors", metadata={
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
            "train_loss": f"{loss.item():.6f}",
        })
        print(f"wrote {out}: last train loss {loss.item():.4f}, "
              f"held-out mean {losses.mean().item():.4f}")
    (OUT / "data.txt").write_bytes(held)


if __name__ == "__main__":
    main()
