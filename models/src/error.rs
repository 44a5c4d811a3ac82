//! The one error type of the models crate.

use std::path::PathBuf;

/// What can go wrong building, loading, feeding or parallelising a model: a bad model shape, a
/// data file or configuration that cannot be used, a file (checkpoint, safetensors) that cannot
/// be written or read, a parallelisation that does not fit. Every message says what to do.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    // ---- the model's shape
    /// The width does not split into heads.
    #[error(
        "n_embd {n_embd} does not divide into n_head {n_head} heads; choose n_embd a multiple of n_head"
    )]
    Heads {
        /// Model width.
        n_embd: usize,
        /// Heads.
        n_head: usize,
    },
    /// A size of zero.
    #[error("{what} must be at least 1")]
    Zero {
        /// Which size.
        what: &'static str,
    },
    /// A dropout probability outside [0, 1).
    #[error("dropout {0} must be in [0, 1)")]
    Dropout(f64),
    /// An unknown preset name.
    #[error(
        "unknown preset '{0}'; choose one of tiny, small, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b"
    )]
    UnknownPreset(String),
    // ---- data
    /// The data file does not exist.
    #[error(
        "data file {} not found: check the path (relative paths are from the working directory) or use the embedded corpus",
        path.display()
    )]
    Missing {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// A data pattern (`--data 'shards/train_*.bin'`) that is not a pattern or names no file.
    #[error(
        "data pattern {}: {reason} (a pattern is glob syntax: `*`, `?`, `[…]`; quote it so the shell does not expand it)",
        pattern.display()
    )]
    BadPattern {
        /// The pattern.
        pattern: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The data file has no bytes.
    #[error("data file {} is empty: point at a non-empty text or .bin token file", path.display())]
    EmptyFile {
        /// The empty file.
        path: PathBuf,
    },
    /// A text file that is not valid UTF-8.
    #[error(
        "{} is not UTF-8 text (invalid byte at offset {offset}): convert it to UTF-8, or name a token file *.bin",
        path.display()
    )]
    NotUtf8 {
        /// The text file.
        path: PathBuf,
        /// Byte offset of the first invalid sequence.
        offset: usize,
    },
    /// A `.bin` file with an llm.c-like header that cannot be read.
    #[error(
        "{}: bad llm.c header: {reason}; regenerate it with llm.c's dev/data scripts, or write raw little-endian u16 tokens (nanoGPT format)",
        path.display()
    )]
    BadHeader {
        /// The token file.
        path: PathBuf,
        /// What is wrong with the header.
        reason: String,
    },
    /// A nanoGPT `.bin` (raw little-endian u16 tokens) with an odd number of bytes.
    #[error(
        "{} has an odd length ({len} bytes) but a nanoGPT .bin holds little-endian u16 tokens: the file is truncated or not a token file; regenerate it",
        path.display()
    )]
    OddLength {
        /// The token file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
    },
    /// An llm.c `.bin` whose header's token count disagrees with the file's length.
    #[error(
        "{}: the llm.c header says {expected} tokens but the file holds {found}: the file is truncated or damaged; regenerate it",
        path.display()
    )]
    TokenCountMismatch {
        /// The token file.
        path: PathBuf,
        /// Tokens announced by the header.
        expected: u64,
        /// Tokens the file's length holds.
        found: u64,
    },
    /// A corpus (or one of its splits) with fewer than `block_size + 1` tokens: not one sequence
    /// with its shifted target fits.
    #[error(
        "the {split} data has {tokens} tokens, fewer than block_size + 1 = {needed}: use a larger corpus, a smaller block_size, or a smaller validation fraction"
    )]
    TooShort {
        /// Which part of the data: "train", "val", or "whole".
        split: &'static str,
        /// Tokens it holds.
        tokens: usize,
        /// Tokens one sequence needs (`block_size + 1`).
        needed: usize,
    },
    /// The global batch cannot be shared equally among the data-parallel ranks.
    #[error(
        "global batch {global_batch} is not divisible by {ranks} data-parallel ranks: use a global batch that is a multiple of {ranks}"
    )]
    BatchNotDivisible {
        /// Sequences per step, over all ranks.
        global_batch: usize,
        /// Data-parallel ranks.
        ranks: usize,
    },
    /// A rank outside `0..ranks`.
    #[error(
        "rank {rank} is out of range for {ranks} data-parallel ranks: ranks are numbered 0..{ranks}"
    )]
    BadRank {
        /// The rank asked for.
        rank: usize,
        /// Data-parallel ranks (0 is invalid too).
        ranks: usize,
    },
    /// The data holds a token id the model cannot embed (found with [`crate::data::TokenDataset::check_vocab`]).
    #[error(
        "token id {token} is >= the vocab size {vocab_size}: the data was tokenised with a larger vocabulary; use the matching tokenizer or a vocab_size of at least {}",
        *token as u64 + 1
    )]
    TokenOutOfVocab {
        /// The largest token id in the data.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A tokenizer name that is neither `bytes` nor `gpt2`.
    #[error("unknown tokenizer {0:?}: use \"bytes\" or \"gpt2\"")]
    UnknownTokenizer(String),
    /// The bundled GPT-2 BPE tables failed to load (a broken `tiktoken-rs` build).
    #[error("could not build the GPT-2 tokenizer ({0}): rebuild, or use the bytes tokenizer")]
    Tokenizer(String),
    // ---- files
    /// I/O on a file or directory.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A file (a checkpoint, a safetensors file) that is missing, corrupt, truncated or of another
    /// model or run.
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// A checkpoint or weights file (`wildfire_checkpoint`).
    #[error(transparent)]
    Checkpoint(#[from] wildfire_checkpoint::Error),
    // ---- parallelisation
    /// Inconsistent parallelisation flags.
    #[error("{0}")]
    Config(String),
    /// The parallel layer refused (a mesh, a tensor-parallel plan, a shard that does not divide).
    #[error(transparent)]
    Parallel(#[from] wildfire_parallel::Error),
}

impl Error {
    /// Wraps an I/O error with the path it happened on; a missing file becomes [`Error::Missing`].
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Self::Missing { path }
        } else {
            Self::Io { path, source }
        }
    }
}
