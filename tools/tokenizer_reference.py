#!/usr/bin/env python3
"""Write tests/fixtures/tokenizer/: a small tokenizer built as Llama-3's is (`tokenizer.json`
for the Rust `tokenizers` crate to load), and what Hugging Face `tokenizers` makes of some texts.

Llama-3's own `tokenizer.json` (128,256 tokens, 9 MB) is not redistributable here and not
reachable offline, so this one copies its structure on a 512-token vocabulary: a byte-level BPE
with `ignore_merges`, Llama-3's pre-tokenizer (its split regex — contractions, letters, numbers
of at most three digits, punctuation, newlines, whitespace with the negative look-ahead — then
byte-level without a prefix space), the byte-level decoder, the special tokens
`<|begin_of_text|>` and `<|end_of_text|>` (the ids after the BPE's), and the template that puts
`<|begin_of_text|>` first. It is trained on the first 200,000 bytes of
`../shared/data/tinyshakespeare.txt`.

`reference.json` holds each text with the ids `tokenizers` gives without the template
(`add_special_tokens=False`: a special token written in the text still reads as itself) and the
text it decodes back to.

    /tmp/tv/bin/python tools/tokenizer_reference.py   # transformers' venv has tokenizers
"""
import json
import pathlib

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/tokenizer"
CORPUS = ROOT.parent / "shared/data/tinyshakespeare.txt"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "You're all resolved rather to die than to famish? We'd     rather not.\n\n\n",
    "In 1623, 36 plays; 154 sonnets and 12345678 words.",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🔥🔥!",
    "<|begin_of_text|>ROMEO: O, she doth teach the torches<|end_of_text|>to burn bright!",
    "  leading spaces,\ttabs\t\tand trailing   ",
    "",
]


def main():
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    text = CORPUS.read_text()[:200_000]
    trainer = trainers.BpeTrainer(vocab_size=512, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)])
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    cases = []
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False).ids
        cases.append({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    (OUT / "reference.json").write_text(json.dumps({
        "tokenizers": __import__("tokenizers").__version__,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "cases": cases,
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}: vocab {tok.get_vocab_size(with_added_tokens=True)}, bos {bos}")
    for c in cases:
        print(len(c["ids"]), repr(c["decoded"][:40]))


if __name__ == "__main__":
    main()
