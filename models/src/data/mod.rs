//! The token data pipeline for GPT pretraining: text → tokens → a (memory-mapped) dataset → the
//! rows of each step's global batch.
//!
//! - [`Tokenizer`]: raw bytes (vocab 256) or GPT-2 BPE (`r50k_base`, vocab 50257), offline.
//! - [`TokenDataset`]: tokens from a [`DataSource`]: the built-in [`embedded_corpus`], an llm.c or
//!   nanoGPT `.bin` token file (memory-mapped), or a UTF-8 text file tokenised once and cached next
//!   to it as `<file>.<tokenizer>.tokens` (memory-mapped on later runs).
//! - [`BatchSampler`]: seeded sampling where sequence `row` of step `step` starts at an offset that
//!   depends only on `(seed, step, row)`, so the global batch of a step is the same set of sequences
//!   whatever the data-parallel degree; each rank takes [`BatchSampler::rows_for`] its rows.
//!
//! ```
//! use wildfire_models::data::{BatchSampler, DataSource, TokenDataset, Tokenizer, TokenizerKind};
//!
//! let tokenizer = Tokenizer::new(TokenizerKind::Bytes)?;
//! let data = TokenDataset::load(&DataSource::Embedded, &tokenizer)?;
//! data.check_vocab(tokenizer.vocab_size())?;
//! let (train, _val) = data.split(0.1);
//! let sampler = BatchSampler { seed: 1337, block_size: 64, global_batch: 8 };
//! let rows = sampler.rows_for(1, 2)?; // rank 1 of 2 takes rows 4..8
//! let (inputs, targets) = sampler.batch(train, 0, rows)?;
//! assert_eq!(inputs.len(), 4 * 64);
//! assert_eq!(inputs[1..64], targets[..63]);
//! # Ok::<(), wildfire_models::data::DataError>(())
//! ```

mod corpus;
mod dataset;
mod sampler;
mod tokenizer;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub use corpus::embedded_corpus;
pub use dataset::{TokenDataset, TokenSlice};
pub use sampler::BatchSampler;
pub use tokenizer::{GPT2_END_OF_TEXT, Tokenizer, TokenizerKind};

/// Where tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// The built-in corpus ([`embedded_corpus`]), tokenised in memory: no file, no download.
    Embedded,
    /// A file: `*.bin` is a token file (llm.c or nanoGPT format); anything else is UTF-8 text,
    /// tokenised and cached next to it. See [`TokenDataset::load`].
    File(PathBuf),
}

impl FromStr for DataSource {
    type Err = std::convert::Infallible;

    /// `"embedded"` is [`DataSource::Embedded`]; anything else is a path (write `./embedded` for a
    /// file of that name).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(if s == "embedded" {
            Self::Embedded
        } else {
            Self::File(PathBuf::from(s))
        })
    }
}

impl fmt::Display for DataSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Embedded => f.write_str("embedded"),
            Self::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A user error in the data pipeline: a bad file, path, or data configuration. Every message says
/// what to do about it.
#[derive(thiserror::Error, Debug)]
pub enum DataError {
    /// The data file does not exist.
    #[error(
        "data file {} not found: check the path (relative paths are from the working directory) or use the embedded corpus",
        path.display()
    )]
    Missing {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// The data file has no bytes.
    #[error("data file {} is empty: point at a non-empty text or .bin token file", path.display())]
    Empty {
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
    /// The data holds a token id the model cannot embed (found with [`TokenDataset::check_vocab`]).
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
    /// An I/O error on a named file.
    #[error("{}: {source}: check the path and its permissions", path.display())]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl DataError {
    /// Wraps an I/O error with the path it happened on; a missing file becomes [`DataError::Missing`].
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Self::Missing { path }
        } else {
            Self::Io { path, source }
        }
    }
}

/// Test helpers: a unique scratch directory under `std::env::temp_dir()`, removed on drop.
#[cfg(test)]
pub(crate) mod scratch {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh directory, removed (best effort) when dropped.
    pub struct ScratchDir(PathBuf);

    impl ScratchDir {
        pub fn new(name: &str) -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let dir = std::env::temp_dir().join(format!(
                "wildfire-data-{name}-{}-{}-{nanos}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for ScratchDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_source_parses_and_displays() {
        assert_eq!(
            "embedded".parse::<DataSource>().unwrap(),
            DataSource::Embedded
        );
        let file: DataSource = "data/input.txt".parse().unwrap();
        assert_eq!(file, DataSource::File("data/input.txt".into()));
        assert_eq!(file.to_string(), "data/input.txt");
        assert_eq!(DataSource::Embedded.to_string(), "embedded");
    }

    #[test]
    fn io_not_found_is_missing() {
        let err = DataError::io("x.txt", std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(matches!(err, DataError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("x.txt"));
    }
}
