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
    /// Training data: a text file, a nanoGPT / llm.c `.bin` token file, or a quoted pattern of
    /// several (`'fineweb_train_*.bin'`: every file it matches, in the order of their names, one
    /// after the other) (default: the embedded corpus). A text file is tokenised once and its
    /// tokens cached beside it as `<file>.<tokenizer>.tokens` (keyed by the file's content: an
    /// edit tokenises again, a fresh checkout does not); `--token-cache` puts the cache elsewhere.
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
    /// Held-out data given apart (nanoGPT's `val.bin`, llm.c's `'fineweb_val_*.bin'`; a file or
    /// a pattern, as `--data`): validation reads only it, and all of `--data` trains.
    #[serde(default)]
    #[arg(long, value_name = "FILE|PATTERN", help_heading = "Data")]
    pub val_data: Option<PathBuf>,
    /// Fraction of the tokens held out for validation, the end of `--data` (default 0.1; not
    /// with `--val-data`).
    #[arg(long, help_heading = "Data")]
    pub val_fraction: Option<f64>,
}

impl Default for DataFlags {
    /// The embedded corpus as bytes, a tenth held out (what the flags give when none is passed).
    fn default() -> Self {
        Self {
            path: None,
            token_cache: None,
            tokenizer: TokenizerKind::Bytes,
            tokenizer_file: None,
            val_data: None,
            val_fraction: None,
        }
    }
}

impl DataFlags {
    /// The share of `--data` held out when no `--val-data` is given: `--val-fraction`, else 0.1.
    pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

    /// Refuse values that cannot make a run, before any data is read: a held-out share
    /// outside `[0, 1)`, or one beside a held-out set given apart.
    pub fn check(&self) -> Result<(), Error> {
        if let Some(fraction) = self.val_fraction {
            if !(0.0..1.0).contains(&fraction) {
                return Err(Error::Config("--val-fraction must be in [0, 1)".into()));
            }
            if self.val_data.is_some() {
                return Err(Error::Config(
                    "--val-fraction holds out the end of --data, --val-data a set of its own: give one of them".into(),
                ));
            }
        }
        Ok(())
    }

    /// The share of `--data` held out for validation (0 with `--val-data`: all of it trains).
    pub fn val_fraction(&self) -> f64 {
        match (&self.val_data, self.val_fraction) {
            (Some(_), _) => 0.0,
            (None, fraction) => fraction.unwrap_or(Self::DEFAULT_VAL_FRACTION),
        }
    }

    /// Where the tokens come from.
    pub fn source(&self) -> DataSource {
        match &self.path {
            Some(path) => DataSource::File(path.clone()),
            None => DataSource::Embedded,
        }
    }

    /// The tokenizer (`--tokenizer-file`'s, else `--tokenizer`'s) and every token of the data (a
    /// text file's tokens through its cache), `--val-data`'s after `--data`'s
    /// ([`TokenDataset::with_held_out`]).
    pub fn load(&self) -> Result<(Tokenizer, TokenDataset), Error> {
        self.check()?;
        let tokenizer = match &self.tokenizer_file {
            Some(file) => Tokenizer::from_file(file)?,
            None => Tokenizer::new(self.tokenizer)?,
        };
        let cache = self.token_cache.as_deref();
        let mut dataset = TokenDataset::load_with_cache(&self.source(), &tokenizer, true, cache)?;
        if let Some(val) = &self.val_data {
            let source = DataSource::File(val.clone());
            let val = TokenDataset::load_with_cache(&source, &tokenizer, true, cache)?;
            dataset = TokenDataset::with_held_out(dataset, val);
        }
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
        let (train, val) = match dataset.held_out() {
            Some(at) => dataset.split_at(at),
            None => dataset.split(self.val_fraction()),
        };
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
        if validate && (dataset.held_out().is_some() || self.val_fraction() > 0.0) {
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
                val_fraction: Some(fraction),
                ..DataFlags::default()
            };
            let err = bad.samplers(&dataset, 7, 32, 4, true).unwrap_err();
            assert!(err.to_string().contains("--val-fraction"), "{err}");
        }
    }

    /// `--val-data`: all of `--data` trains, validation reads the other file; beside
    /// `--val-fraction` it is refused before anything is read.
    #[test]
    fn a_held_out_set_given_apart_is_what_validation_reads() {
        let dir = crate::data::scratch::ScratchDir::new("val-data");
        let bin = |name: &str, tokens: std::ops::Range<u16>| {
            let path = dir.path().join(name);
            let bytes: Vec<u8> = tokens.flat_map(|t| t.to_le_bytes()).collect();
            std::fs::write(&path, bytes).unwrap();
            path
        };
        let flags = DataFlags {
            path: Some(bin("train.bin", 0..100)),
            val_data: Some(bin("val.bin", 200..240)),
            ..DataFlags::default()
        };
        assert_eq!(flags.val_fraction(), 0.0);
        let (_, dataset) = flags.load().unwrap();
        let [(train, _), (val, _)] = flags.samplers(&dataset, 7, 8, 4, true).unwrap();
        assert_eq!(train.to_vec(), (0..100).collect::<Vec<u32>>());
        assert_eq!(val.to_vec(), (200..240).collect::<Vec<u32>>());
        // Too short to validate on is the held-out set's error.
        let err = flags.samplers(&dataset, 7, 64, 4, true).unwrap_err();
        assert!(
            matches!(
                err,
                Error::TooShort {
                    split: "val",
                    tokens: 40,
                    ..
                }
            ),
            "{err}"
        );

        let both = DataFlags {
            val_fraction: Some(0.1),
            path: Some(dir.path().join("missing.bin")),
            ..flags
        };
        let err = both.load().unwrap_err();
        assert!(err.to_string().contains("--val-data"), "{err}");
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
