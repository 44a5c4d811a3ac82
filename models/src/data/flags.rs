//! The data flags of a run ([`DataFlags`]): what it trains on, how it is tokenised and cached,
//! and how much is held out; loaded into a tokenizer and a dataset, and split into the training
//! and validation samplers.

use super::{BatchSampler, DataSource, TokenDataset, TokenSlice, Tokenizer, TokenizerKind};
use crate::Error;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What a run trains on (clap flags under "Data", flattened into a binary's own flags; serde for
/// the run's stored configuration).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct DataFlags {
    /// Training data: a text file, or a nanoGPT / llm.c `.bin` token file (default: the
    /// embedded corpus). A text file is tokenised once and its tokens cached beside it as
    /// `<file>.<tokenizer>.tokens` (keyed by the file's content: an edit tokenises again, a
    /// fresh checkout does not); `--token-cache` puts the cache elsewhere.
    #[serde(rename = "data")]
    #[arg(long = "data", help_heading = "Data")]
    pub path: Option<PathBuf>,
    /// Folder for the token cache of a text `--data` file (made if missing), instead of the
    /// data file's own folder.
    #[serde(default)]
    #[arg(long, value_name = "DIR", help_heading = "Data")]
    pub token_cache: Option<PathBuf>,
    /// Tokenizer for text: bytes or gpt2 (GPT-2 BPE, offline).
    #[arg(long, default_value = "bytes", help_heading = "Data")]
    pub tokenizer: TokenizerKind,
    /// A Hugging Face `tokenizer.json` for text instead (Llama-3's, beside its weights), read
    /// from the file: its vocabulary sizes the model; the token cache is keyed by its content.
    #[serde(default)]
    #[arg(long, value_name = "FILE", help_heading = "Data")]
    pub tokenizer_file: Option<PathBuf>,
    /// Fraction of the tokens held out for validation.
    #[arg(long, default_value_t = 0.1, help_heading = "Data")]
    pub val_fraction: f64,
}

impl Default for DataFlags {
    /// The embedded corpus as bytes, a tenth held out (what the flags give when none is passed).
    fn default() -> Self {
        Self {
            path: None,
            token_cache: None,
            tokenizer: TokenizerKind::Bytes,
            tokenizer_file: None,
            val_fraction: 0.1,
        }
    }
}

impl DataFlags {
    /// Refuse values that cannot make a run, before any data is read: a held-out share
    /// outside `[0, 1)`.
    pub fn check(&self) -> Result<(), Error> {
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(Error::Config("--val-fraction must be in [0, 1)".into()));
        }
        Ok(())
    }

    /// Where the tokens come from.
    pub fn source(&self) -> DataSource {
        match &self.path {
            Some(path) => DataSource::File(path.clone()),
            None => DataSource::Embedded,
        }
    }

    /// The tokenizer (`--tokenizer-file`'s, else `--tokenizer`'s) and every token of the data (a
    /// text file's tokens through its cache).
    pub fn load(&self) -> Result<(Tokenizer, TokenDataset), Error> {
        let tokenizer = match &self.tokenizer_file {
            Some(file) => Tokenizer::from_file(file)?,
            None => Tokenizer::new(self.tokenizer)?,
        };
        let cache = self.token_cache.as_deref();
        let dataset = TokenDataset::load_with_cache(&self.source(), &tokenizer, true, cache)?;
        Ok((tokenizer, dataset))
    }

    /// `dataset` split into training and held-out tokens, each with its sampler of global
    /// batches of `global_batch` rows of `block_size` tokens (the held-out one seeded apart),
    /// checked against its tokens (the held-out one only when `validate`).
    pub fn samplers<'d>(
        &self,
        dataset: &'d TokenDataset,
        seed: u64,
        block_size: usize,
        global_batch: usize,
        validate: bool,
    ) -> Result<[(TokenSlice<'d>, BatchSampler); 2], Error> {
        self.check()?;
        let (train, val) = dataset.split(self.val_fraction);
        let sampler = BatchSampler {
            seed,
            block_size,
            global_batch,
        };
        sampler.check(train)?;
        let val_sampler = BatchSampler {
            seed: seed ^ 0x0056_414C,
            ..sampler.clone()
        };
        if validate && self.val_fraction > 0.0 {
            val_sampler.check(val)?;
        }
        Ok([(train, sampler), (val, val_sampler)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samplers_split_the_data_and_refuse_a_bad_fraction() {
        let flags = DataFlags::default();
        let (_, dataset) = flags.load().unwrap();
        let [(train, sampler), (val, val_sampler)] =
            flags.samplers(&dataset, 7, 32, 4, true).unwrap();
        assert_eq!(train.len() + val.len(), dataset.len());
        assert!(val.len() * 9 < dataset.len() && val.len() * 11 > dataset.len());
        assert_eq!(
            (sampler.seed, sampler.block_size, sampler.global_batch),
            (7, 32, 4)
        );
        assert_ne!(
            val_sampler.seed, sampler.seed,
            "held-out batches are drawn apart"
        );
        for fraction in [1.0, -0.1, f64::NAN] {
            let bad = DataFlags {
                val_fraction: fraction,
                ..DataFlags::default()
            };
            let err = bad.samplers(&dataset, 7, 32, 4, true).unwrap_err();
            assert!(err.to_string().contains("--val-fraction"), "{err}");
        }
    }

    #[test]
    fn microbatches_split_a_ranks_rows_in_order() {
        assert_eq!(
            BatchSampler::microbatches(4..12, 4),
            [4..6, 6..8, 8..10, 10..12]
        );
        let whole = BatchSampler::microbatches(0..3, 1);
        assert_eq!((whole.len(), whole[0].clone()), (1, 0..3));
    }
}
