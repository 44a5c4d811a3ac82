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
//! # Ok::<(), wildfire_models::Error>(())
//! ```

mod corpus;
mod dataset;
mod flags;
mod sampler;
mod tokenizer;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub(crate) use crate::Error;

pub use corpus::embedded_corpus;
pub use dataset::{TokenDataset, TokenSlice};
pub use flags::DataFlags;
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
        let err = Error::io("x.txt", std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(matches!(err, Error::Missing { .. }), "{err}");
        assert!(err.to_string().contains("x.txt"));
    }
}
