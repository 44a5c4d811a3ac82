//! Tokenizers: raw bytes, GPT-2's BPE (`r50k_base` from `tiktoken-rs`, bundled: no download),
//! or a Hugging Face `tokenizer.json` from a local file (Llama-3's, through the `tokenizers`
//! crate).

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tiktoken_rs::CoreBPE;

use super::Error;

/// Which tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per UTF-8 byte: vocab 256, no merges. Good for tiny models and tests.
    Bytes,
    /// GPT-2's byte-level BPE (`r50k_base`): vocab 50257, `<|endoftext|>` = 50256.
    Gpt2,
    /// A Hugging Face `tokenizer.json` ([`Tokenizer::from_file`]; `--tokenizer-file`).
    Json,
}

impl TokenizerKind {
    /// The name used on the command line, in configs and in cache file names.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::Gpt2 => "gpt2",
            Self::Json => "json",
        }
    }
}

impl FromStr for TokenizerKind {
    type Err = Error;

    /// `"bytes"` or `"gpt2"` (case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bytes" => Ok(Self::Bytes),
            "gpt2" => Ok(Self::Gpt2),
            _ => Err(Error::UnknownTokenizer(s.to_owned())),
        }
    }
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// GPT-2's vocabulary: 50000 merges + 256 bytes + `<|endoftext|>`.
const GPT2_VOCAB_SIZE: usize = 50257;

/// GPT-2's `<|endoftext|>` token id.
pub const GPT2_END_OF_TEXT: u32 = 50256;

/// The UTF-8 encoding of U+FFFD, written for token ids a tokenizer cannot decode.
const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();

/// A text ↔ token-id codec. Cheap to clone (the GPT-2 tables are built once per process, a
/// `tokenizer.json` once per [`Tokenizer::from_file`]).
#[derive(Clone)]
pub struct Tokenizer {
    kind: TokenizerKind,
    /// GPT-2's BPE, `Some` iff `kind == Gpt2`.
    bpe: Option<&'static CoreBPE>,
    /// A `tokenizer.json`, `Some` iff `kind == Json`.
    json: Option<Arc<JsonTokenizer>>,
}

/// A loaded `tokenizer.json`: the codec, its file's content hash (the token cache's key) and
/// its vocabulary with the added tokens.
struct JsonTokenizer {
    codec: tokenizers::Tokenizer,
    hash: u64,
    vocab: usize,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .finish()
    }
}

/// GPT-2's BPE, built on first use from the tables bundled in `tiktoken-rs`.
fn gpt2_bpe() -> Result<&'static CoreBPE, Error> {
    static BPE: OnceLock<CoreBPE> = OnceLock::new();
    if let Some(bpe) = BPE.get() {
        return Ok(bpe);
    }
    let bpe = tiktoken_rs::r50k_base().map_err(|e| Error::Tokenizer(e.to_string()))?;
    // Two threads may race to build it; either result is the same.
    Ok(BPE.get_or_init(|| bpe))
}

impl Tokenizer {
    /// Builds the tokenizer (for GPT-2, from the bundled BPE tables: no network).
    pub fn new(kind: TokenizerKind) -> Result<Self, Error> {
        let bpe = match kind {
            TokenizerKind::Bytes => None,
            TokenizerKind::Gpt2 => Some(gpt2_bpe()?),
            TokenizerKind::Json => {
                return Err(Error::Tokenizer(
                    "a tokenizer.json is read from its file: Tokenizer::from_file".into(),
                ));
            }
        };
        Ok(Self {
            kind,
            bpe,
            json: None,
        })
    }

    /// A Hugging Face `tokenizer.json` (as `transformers` saves it beside a model: Llama-3's,
    /// for one), read from `path` (no download). Its special tokens written in a text read as
    /// themselves; no template is applied (a data file holds its own document markers).
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let invalid =
            |e| Error::Tokenizer(format!("{}: not a tokenizer.json: {e}", path.display()));
        let mut codec = tokenizers::Tokenizer::from_bytes(&bytes).map_err(invalid)?;
        // A file may carry a model's input settings (`truncation` to its context, `padding`):
        // a data file is encoded whole, every token kept.
        codec.with_truncation(None).map_err(invalid)?;
        codec.with_padding(None);
        let vocab = codec.get_vocab_size(true);
        let json = JsonTokenizer {
            codec,
            hash: xxhash_rust::xxh3::xxh3_64(&bytes),
            vocab,
        };
        Ok(Self {
            kind: TokenizerKind::Json,
            bpe: None,
            json: Some(Arc::new(json)),
        })
    }

    /// The name of the token cache files it makes: its kind, and for a `tokenizer.json` its
    /// content hash (another file, another cache).
    pub fn cache_name(&self) -> String {
        match &self.json {
            Some(json) => format!("json-{:016x}", json.hash),
            None => self.kind.to_string(),
        }
    }

    /// Which tokenizer this is.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// The token that ends a document, where the tokenizer has one of its own: GPT-2's
    /// `<|endoftext|>` (50256, which nanoGPT's and llm.c's data scripts put between documents).
    /// Bytes have none; a `tokenizer.json` does not say which of its tokens ends a text (a
    /// model's `generation_config.json` does: [`crate::hf::eos_tokens`]).
    pub fn end_of_text(&self) -> Option<u32> {
        (self.kind == TokenizerKind::Gpt2).then_some(GPT2_END_OF_TEXT)
    }

    /// Token ids are `0..vocab_size()`: 256 for bytes, 50257 for GPT-2, a `tokenizer.json`'s
    /// vocabulary with its added tokens.
    pub fn vocab_size(&self) -> usize {
        match (self.kind, &self.json) {
            (TokenizerKind::Bytes, _) => 256,
            (TokenizerKind::Gpt2, _) => GPT2_VOCAB_SIZE,
            (TokenizerKind::Json, json) => json.as_ref().map_or(0, |j| j.vocab),
        }
    }

    /// Encodes `text`. GPT-2 reads `<|endoftext|>` as its special token 50256 (as nanoGPT's and
    /// llm.c's data scripts insert between documents); bytes sees it as 13 bytes.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        if let Some(json) = &self.json {
            // Encoding fails only on a truncation or padding setting it cannot meet, and
            // `from_file` turned both off.
            let encoding = json.codec.encode_fast(text, false);
            return encoding
                .expect("a tokenizer.json without truncation or padding encodes any text")
                .get_ids()
                .to_vec();
        }
        match self.bpe {
            None => text.bytes().map(u32::from).collect(),
            Some(bpe) => bpe.encode_with_special_tokens(text),
        }
    }

    /// Decodes `tokens`. Byte sequences that are not UTF-8 (e.g. a multi-byte character cut in two)
    /// and ids outside the vocabulary decode as U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> String {
        if let Some(json) = &self.json {
            // Runs of known ids decoded as the file says; an unknown id as U+FFFD.
            let mut text = String::new();
            for run in tokens.split_inclusive(|&t| t as usize >= json.vocab) {
                let (known, unknown) = match run.split_last() {
                    Some((&last, init)) if last as usize >= json.vocab => (init, true),
                    _ => (run, false),
                };
                let part = json.codec.decode(known, false);
                text.push_str(part.as_deref().unwrap_or("\u{FFFD}"));
                if unknown {
                    text.push('\u{FFFD}');
                }
            }
            return text;
        }
        let mut bytes = Vec::with_capacity(tokens.len() * 2);
        match self.bpe {
            None => {
                for &t in tokens {
                    match u8::try_from(t) {
                        Ok(b) => bytes.push(b),
                        Err(_) => bytes.extend_from_slice(REPLACEMENT),
                    }
                }
            }
            Some(bpe) => {
                for &t in tokens {
                    match bpe.decode_bytes(&[t]) {
                        Ok(b) => bytes.extend_from_slice(&b),
                        Err(_) => bytes.extend_from_slice(REPLACEMENT),
                    }
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Encodes a large `text` in chunks on all cores, calling `progress(bytes)` as chunks finish.
    /// The result equals [`Tokenizer::encode`] of the whole text: chunks end only where GPT-2's
    /// pre-tokeniser splits anyway (see [`chunk_ends`]).
    pub(crate) fn encode_chunked(
        &self,
        text: &str,
        chunk_bytes: usize,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Vec<u32> {
        // Bytes need no chunks; a tokenizer.json's pre-tokeniser may not split where GPT-2's
        // does (a dummy prefix, a normaliser), so its text is encoded whole.
        if self.bpe.is_none() {
            let tokens = self.encode(text);
            progress(text.len() as u64);
            return tokens;
        }
        let ends = chunk_ends(text, chunk_bytes);
        let chunks: Vec<&str> = ends
            .iter()
            .scan(0, |start, &end| {
                let chunk = &text[*start..end];
                *start = end;
                Some(chunk)
            })
            .collect();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(chunks.len());
        if threads <= 1 {
            let mut tokens = Vec::new();
            for chunk in chunks {
                tokens.extend(self.encode(chunk));
                progress(chunk.len() as u64);
            }
            return tokens;
        }
        // Workers take chunks in order from a shared counter; results go back in chunk order.
        let next = AtomicUsize::new(0);
        let mut parts: Vec<(usize, Vec<u32>)> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(chunk) = chunks.get(i) else { break };
                            done.push((i, self.encode(chunk)));
                            progress(chunk.len() as u64);
                        }
                        done
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("tokenizer worker panicked"))
                .collect()
        });
        parts.sort_unstable_by_key(|(i, _)| *i);
        let mut tokens = Vec::with_capacity(parts.iter().map(|(_, t)| t.len()).sum());
        for (_, part) in parts {
            tokens.extend(part);
        }
        tokens
    }
}

/// End offsets of chunks of about `chunk_bytes` each (the last is `text.len()`), cut only right
/// after a `'\n'` that has a non-whitespace character on both sides.
///
/// Why that is safe for GPT-2's pre-tokeniser
/// (`'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+$|\s+(?!\S)|\s`): no piece holds
/// both whitespace and non-whitespace except through a leading *space*, so the whole text has a
/// piece boundary on each side of such a `'\n'`, and the `'\n'` alone is a piece: `\s` in the whole
/// text, `\s+$` at the end of the chunk. `<|endoftext|>` holds no `'\n'`, so it is never cut.
pub(crate) fn chunk_ends(text: &str, chunk_bytes: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let is_ws = |b: u8| b.is_ascii_whitespace() || b >= 0x80; // non-ASCII may be Unicode space
    let mut ends = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        let mut cut = bytes.len();
        let mut i = start + chunk_bytes.max(1);
        while i + 1 < bytes.len() {
            if bytes[i] == b'\n' && !is_ws(bytes[i - 1]) && !is_ws(bytes[i + 1]) {
                cut = i + 1;
                break;
            }
            i += 1;
        }
        ends.push(cut);
        start = cut;
    }
    ends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_parses_displays_and_serialises() {
        for kind in [TokenizerKind::Bytes, TokenizerKind::Gpt2] {
            assert_eq!(kind.to_string().parse::<TokenizerKind>().unwrap(), kind);
        }
        assert_eq!(
            "GPT2".parse::<TokenizerKind>().unwrap(),
            TokenizerKind::Gpt2
        );
        let err = "bpe".parse::<TokenizerKind>().unwrap_err();
        assert!(err.to_string().contains("\"bytes\" or \"gpt2\""), "{err}");
    }

    /// A `tokenizer.json` built as Llama-3's (`tools/tokenizer_reference.py`: its split regex
    /// with the look-ahead, byte-level BPE, special tokens) gives the ids Hugging Face
    /// `tokenizers` gives and decodes them back; its cache name follows its content.
    #[test]
    fn a_tokenizer_json_gives_the_ids_hugging_face_gives() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
        let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
        let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(tok.kind(), TokenizerKind::Json);
        assert_eq!(
            tok.vocab_size() as u64,
            reference["vocab_size"].as_u64().unwrap()
        );
        let cases = reference["cases"].as_array().unwrap();
        assert!(cases.len() >= 6);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let ids: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tok.encode(text), ids, "{text:?}");
            assert_eq!(
                tok.decode(&ids),
                case["decoded"].as_str().unwrap(),
                "{text:?}"
            );
        }
        // Special tokens in the text read as themselves; an id past the vocabulary as U+FFFD.
        let bos = tok.encode("<|begin_of_text|>");
        assert_eq!(bos, [512]);
        let hi = tok.encode("hi");
        let mut ids = hi.clone();
        ids.push(10_000);
        ids.extend(&hi);
        assert_eq!(tok.decode(&ids), "hi\u{FFFD}hi");
        // A file that truncates to a model's context still encodes a whole text: truncation
        // and padding are a model's input settings, not the data's.
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
        json["truncation"] = serde_json::json!({
            "direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0
        });
        json["padding"] = serde_json::json!({
            "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "!"
        });
        let limited =
            std::env::temp_dir().join(format!("wildfire-truncating-{}.json", std::process::id()));
        std::fs::write(&limited, serde_json::to_vec(&json).unwrap()).unwrap();
        let limited_tok = Tokenizer::from_file(&limited).unwrap();
        std::fs::remove_file(&limited).unwrap();
        let case = &cases[0];
        let text = case["text"].as_str().unwrap();
        let ids = limited_tok.encode(text);
        assert_eq!(ids.len(), case["ids"].as_array().unwrap().len(), "{ids:?}");
        assert_eq!(ids, tok.encode(text));
        assert_ne!(limited_tok.cache_name(), tok.cache_name());
        assert!(tok.cache_name().starts_with("json-"));
        assert_ne!(tok.cache_name(), "json");
        let bad = std::env::temp_dir().join(format!("wildfire-bad-{}.json", std::process::id()));
        std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
        let err = Tokenizer::from_file(&bad).expect_err("refused").to_string();
        assert!(err.contains("not a tokenizer.json"), "{err}");
        std::fs::remove_file(&bad).unwrap();
    }

    #[test]
    fn bytes_round_trip() {
        let tok = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        assert_eq!(tok.vocab_size(), 256);
        let text = "Hello, wörld! ✓\n<|endoftext|>";
        let ids = tok.encode(text);
        assert_eq!(ids.len(), text.len());
        assert_eq!(&ids[..5], &[72, 101, 108, 108, 111]);
        assert_eq!(tok.decode(&ids), text);
        // A character cut in two, and an id outside the vocab, decode lossily.
        assert_eq!(tok.decode(&[0xC3, 104, 300]), "\u{FFFD}h\u{FFFD}");
    }

    #[test]
    fn gpt2_matches_reference_ids_and_round_trips() {
        let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        assert_eq!(tok.vocab_size(), 50257);
        // Reference ids from OpenAI's GPT-2 encoder (tiktoken "gpt2" / HF GPT2TokenizerFast).
        assert_eq!(tok.encode("Hello world"), [15496, 995]);
        assert_eq!(tok.encode("<|endoftext|>"), [GPT2_END_OF_TEXT]);
        assert_eq!(tok.end_of_text(), Some(GPT2_END_OF_TEXT));
        let bytes = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        assert_eq!(bytes.end_of_text(), None);
        let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n<|endoftext|>Ünïcödé ✓";
        assert_eq!(tok.decode(&tok.encode(text)), text);
        assert_eq!(tok.decode(&[15496, 60000]), "Hello\u{FFFD}");
    }

    #[test]
    fn chunked_gpt2_equals_whole_text() {
        let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        let text =
            "It was a dark night.\nThe  wind\n\n  howled.\nNo\t\nrest \nfor 12 cats'\nsake!\n\
                    <|endoftext|>\nA new story:\nÜber  \u{3000}\ncafé.\n"
                .repeat(20);
        let whole = tok.encode(&text);
        for chunk in [1, 7, 40, 333] {
            let ends = chunk_ends(&text, chunk);
            assert!(ends.len() > 1 || chunk == 333);
            assert_eq!(*ends.last().unwrap(), text.len());
            let seen = AtomicUsize::new(0);
            let got = tok.encode_chunked(&text, chunk, &|n| {
                seen.fetch_add(n as usize, Ordering::Relaxed);
            });
            assert_eq!(got, whole, "chunk size {chunk}");
            assert_eq!(seen.into_inner(), text.len());
        }
    }
}
