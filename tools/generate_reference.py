#!/usr/bin/env python3
"""Write tests/fixtures/trained/generate.json: what `transformers`' greedy `generate` continues a
few prompts with, for the two models of tests/fixtures/trained/ (`tools/trained_reference.py`:
a tiny GPT-2 and a tiny Llama-3 trained briefly on Shakespeare's bytes), so a test can check that
`gpt_pretrain --init-from DIR --steps 0 --prompt TEXT --temperature 0` prints the same text.

Each entry: the family, the prompt (bytes, as the byte tokenizer's ids), the continuation's ids
(`max_new_tokens` of them: the prompt plus them stays within the models' 64 positions, so both
sides attend over every token with its own position; fewer where the entry names an
`eos_token_id`, which `generate` stops at — the test writes it into a copy of the model's
`config.json`, where `transformers` reads it) and, per generated token, the gap between
the largest and the second-largest logit (`transformers`' scores of that step): the margin by
which a greedy choice could flip under rounding. The test asserts the smallest gap is far above
f32 rounding, so the comparison is exact, not lucky.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers safetensors numpy
    /tmp/tv/bin/python tools/generate_reference.py
"""
import json
import pathlib

import torch
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests/fixtures/trained"
PROMPTS = ["ROMEO:\n", "First Citizen:\nWe are"]
# (family, prompt, end-of-text byte): a model stopped by a byte its greedy text reaches.
STOPPED = [("gpt2", "ROMEO:\n", ord("a")), ("llama", "ROMEO:\n", ord("e"))]
NEW_TOKENS = 40


def main():
    entries = []
    runs = [(f, p, None) for f in ["gpt2", "llama"] for p in PROMPTS] + STOPPED
    for family, prompt, eos in runs:
        model = AutoModelForCausalLM.from_pretrained(FIXTURES / family).eval()
        ids = torch.tensor([list(prompt.encode())])
        # The fixtures' own end-of-text ids (0 and 2) are bytes Shakespeare never has.
        stop = {} if eos is None else {"eos_token_id": eos}
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 num_beams=1, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, **stop)
        new = out.sequences[0, ids.shape[1]:].tolist()
        if eos is None:
            assert len(new) == NEW_TOKENS, f"{family}: stopped early at an end-of-text token"
        else:
            assert new[-1] == eos and eos not in new[:-1] and len(new) < NEW_TOKENS, new
        gaps = []
        for scores in out.scores:
            top = torch.topk(scores[0].float(), 2).values
            gaps.append(float(top[0] - top[1]))
        entries.append({
            "family": family,
            "prompt": prompt,
            "eos_token_id": eos,
            "continuation": new,
            "text": bytes(new).decode("utf-8", errors="replace"),
            "top2_gaps": gaps,
        })
        print(f"{family} {prompt!r} -> {bytes(new)!r}, smallest gap {min(gaps):.4g}")
    meta = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}
    path = FIXTURES / "generate.json"
    path.write_text(json.dumps({"generated_by": meta, "entries": entries}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
