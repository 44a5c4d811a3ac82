//! Seeded batch sampling that does not depend on the data-parallel degree.

use burn::prelude::{Backend, Int, Tensor};
use std::ops::Range;

use super::{Error, TokenSlice};

/// Seeded sampling where the *global* batch of a step is the same set of sequences whatever the
/// data-parallel degree: sequence `row` (`0..global_batch`) of step `step` starts at an offset that
/// depends only on `(seed, step, row)` and the length of the data it samples from (see
/// [`BatchSampler::offset`]). A run on 1 rank and on 8 ranks therefore sees the same tokens in the
/// same rows, and resuming at step `s` needs no sampler state beyond `s`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchSampler {
    /// Seed of the offsets; use different seeds (or the same sampler on another slice) for the
    /// validation batches.
    pub seed: u64,
    /// Tokens per sequence (the model's context length); each row reads `block_size + 1` tokens.
    pub block_size: usize,
    /// Sequences per step over all data-parallel ranks.
    pub global_batch: usize,
}

/// A bijective 64-bit mix: the first value of the splitmix64 stream seeded with `z`.
fn mix(z: u64) -> u64 {
    wildfire_parallel::rng::SplitMix64::new(z).next_u64()
}

impl BatchSampler {
    /// `rows` (a rank's rows of the global batch) split in order into `count` micro-batches of
    /// equal size (a remainder is left out: the batch checks make the split exact).
    pub fn microbatches(rows: Range<usize>, count: usize) -> Vec<Range<usize>> {
        let size = rows.len() / count.max(1);
        let at = |i: usize| rows.start + i * size;
        (0..count).map(|i| at(i)..at(i) + size).collect()
    }

    /// Where row `row` of step `step` starts in data of `len` tokens: uniform over the
    /// `len - block_size` starts whose `block_size + 1` tokens fit (`len > block_size` required),
    /// from a hash of `(seed, step, row)` alone.
    pub fn offset(&self, step: u64, row: usize, len: usize) -> usize {
        assert!(len > self.block_size, "offset needs len > block_size");
        let starts = (len - self.block_size) as u128;
        let h = mix(mix(mix(self.seed) ^ step) ^ row as u64);
        ((u128::from(h) * starts) >> 64) as usize
    }

    /// Checks that `data` holds at least one sequence and its target (`block_size + 1` tokens).
    pub fn check(&self, data: TokenSlice<'_>) -> Result<(), Error> {
        if data.len() <= self.block_size {
            return Err(Error::TooShort {
                split: data.name(),
                tokens: data.len(),
                needed: self.block_size + 1,
            });
        }
        Ok(())
    }

    /// Rows `rows` of step `step`'s global batch, as `(inputs, targets)`: each
    /// `rows.len() * block_size` token ids, row-major, with `targets` the inputs shifted by one
    /// token. Errors if `data` is shorter than `block_size + 1` tokens.
    ///
    /// # Panics
    /// If `rows` reaches past `global_batch` (take rows from [`BatchSampler::rows_for`]).
    pub fn batch(
        &self,
        data: TokenSlice<'_>,
        step: u64,
        rows: Range<usize>,
    ) -> Result<(Vec<u32>, Vec<u32>), Error> {
        assert!(
            rows.end <= self.global_batch,
            "rows {rows:?} outside the global batch of {}",
            self.global_batch
        );
        self.check(data)?;
        let n = rows.len() * self.block_size;
        let mut inputs = Vec::with_capacity(n);
        let mut targets = Vec::with_capacity(n);
        let mut window = Vec::with_capacity(self.block_size + 1);
        for row in rows {
            let start = self.offset(step, row, data.len());
            window.clear();
            data.extend_range(start..start + self.block_size + 1, &mut window);
            inputs.extend_from_slice(&window[..self.block_size]);
            targets.extend_from_slice(&window[1..]);
        }
        Ok((inputs, targets))
    }

    /// [`BatchSampler::batch`] as `[rows, block_size]` integer tensors (inputs, targets) on
    /// `device`.
    pub fn tensors<B: Backend>(
        &self,
        data: TokenSlice<'_>,
        step: u64,
        rows: Range<usize>,
        device: &B::Device,
    ) -> Result<[Tensor<B, 2, Int>; 2], Error> {
        let shape = [rows.len(), self.block_size];
        let (x, y) = self.batch(data, step, rows)?;
        let to = |v: Vec<u32>| {
            let ids: Vec<i64> = v.into_iter().map(i64::from).collect();
            Tensor::from_data(burn::tensor::TensorData::new(ids, shape), device)
        };
        Ok([to(x), to(y)])
    }

    /// The rows that rank `rank` of `ranks` data-parallel ranks takes: an equal contiguous slice of
    /// the global batch. Errors unless `ranks` divides `global_batch` and `rank < ranks`.
    pub fn rows_for(&self, rank: usize, ranks: usize) -> Result<Range<usize>, Error> {
        if rank >= ranks {
            return Err(Error::BadRank { rank, ranks });
        }
        if !self.global_batch.is_multiple_of(ranks) {
            return Err(Error::BatchNotDivisible {
                global_batch: self.global_batch,
                ranks,
            });
        }
        let per_rank = self.global_batch / ranks;
        Ok(rank * per_rank..(rank + 1) * per_rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TokenDataset;

    /// `global_batch` rows of `block_size` tokens per step, offsets from `seed`.
    fn sampler(seed: u64, block_size: usize, global_batch: usize) -> BatchSampler {
        BatchSampler {
            seed,
            block_size,
            global_batch,
        }
    }

    fn dataset(len: u32) -> TokenDataset {
        // Distinct tokens make a window's content identify its offset.
        TokenDataset::from_tokens(
            (0..len)
                .map(|i| i.wrapping_mul(2_654_435_761) % 50_000)
                .collect(),
        )
    }

    #[test]
    fn global_batch_is_the_same_for_any_number_of_ranks() {
        let data = dataset(10_000);
        let sampler = sampler(7, 16, 8);
        let all = data.all();
        // Reference: the whole global batch in one call.
        let (inputs, targets) = sampler.batch(all, 3, 0..8).unwrap();
        assert_eq!(inputs.len(), 8 * 16);
        for ranks in [1, 2, 4] {
            let mut got_inputs = Vec::new();
            let mut got_targets = Vec::new();
            for rank in 0..ranks {
                let rows = sampler.rows_for(rank, ranks).unwrap();
                assert_eq!(rows.len(), 8 / ranks);
                let (i, t) = sampler.batch(all, 3, rows).unwrap();
                got_inputs.extend(i);
                got_targets.extend(t);
            }
            assert_eq!(got_inputs, inputs, "{ranks} ranks");
            assert_eq!(got_targets, targets, "{ranks} ranks");
        }
    }

    #[test]
    fn targets_are_inputs_shifted_and_sampling_is_deterministic() {
        let data = dataset(5_000);
        let sampler = sampler(1, 32, 4);
        let all = data.all();
        let (inputs, targets) = sampler.batch(all, 0, 0..4).unwrap();
        for row in 0..4 {
            let start = sampler.offset(0, row, all.len());
            let window: Vec<u32> = (start..start + 33).map(|i| all.get(i)).collect();
            assert_eq!(inputs[row * 32..(row + 1) * 32], window[..32]);
            assert_eq!(targets[row * 32..(row + 1) * 32], window[1..]);
        }
        assert_eq!(
            sampler.batch(all, 0, 0..4).unwrap(),
            (inputs.clone(), targets)
        );
        let (next, _) = sampler.batch(all, 1, 0..4).unwrap();
        assert_ne!(next, inputs, "different steps differ");
        let reseeded = BatchSampler { seed: 2, ..sampler };
        assert_ne!(
            reseeded.batch(all, 0, 0..4).unwrap().0,
            inputs,
            "different seeds differ"
        );
    }

    #[test]
    fn offsets_cover_the_valid_range() {
        let sampler = sampler(0, 8, 1);
        // 10 tokens, block 8: starts 0 and 1 are the only ones; both occur.
        let mut seen = [false; 2];
        for step in 0..64 {
            seen[sampler.offset(step, 0, 10)] = true;
        }
        assert_eq!(seen, [true, true]);
        // Exactly block_size + 1 tokens: one start.
        let data = dataset(9);
        let (i, t) = sampler.batch(data.all(), 5, 0..1).unwrap();
        assert_eq!((i.len(), t.len()), (8, 8));
    }

    #[test]
    fn bad_ranks_and_short_data_are_typed_errors() {
        let sampler = sampler(0, 64, 6);
        let err = sampler.rows_for(0, 4).unwrap_err();
        assert!(matches!(
            err,
            Error::BatchNotDivisible {
                global_batch: 6,
                ranks: 4
            }
        ));
        assert!(err.to_string().contains("multiple of 4"), "{err}");
        assert!(matches!(sampler.rows_for(3, 3), Err(Error::BadRank { .. })));
        assert!(matches!(sampler.rows_for(0, 0), Err(Error::BadRank { .. })));
        assert_eq!(sampler.rows_for(2, 3).unwrap(), 4..6);

        let data = dataset(64);
        let err = sampler.batch(data.all(), 0, 0..6).unwrap_err();
        assert!(
            matches!(
                err,
                Error::TooShort {
                    tokens: 64,
                    needed: 65,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("64 tokens, fewer than block_size + 1 = 65"),
            "{err}"
        );
        let data = dataset(1000);
        let (train, val) = data.split(0.05);
        assert!(sampler.check(train).is_ok());
        let err = sampler.check(val).unwrap_err();
        assert!(
            err.to_string().starts_with("the val data has 50 tokens"),
            "{err}"
        );
    }
}
