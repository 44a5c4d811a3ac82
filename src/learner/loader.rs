//! The distributed sampler: a Burn `DataLoader` of one data-parallel rank's part of every global
//! batch.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;

use super::LearnerError;
use wildfire_parallel::rng::SplitMix64;

/// A Burn [`DataLoader`] over rank `index`'s part of every global batch of `global_batch` rows,
/// for `ranks` data-parallel ranks (PyTorch's `DistributedSampler` with `drop_last`).
///
/// Epoch `e` (the loader's `e`-th [`iter`](DataLoader::iter), counting from 1) visits the
/// dataset in the order of a Fisher–Yates shuffle seeded with `(seed, e)` — the same on every
/// rank, another every epoch — cut into `len / global_batch` global batches (a last partial one
/// is dropped, so every rank runs the same number of steps). Global batch `k` is rows
/// `k·G .. (k+1)·G` of that order, and rank `r` takes its `r`-th slice of `G / ranks` rows, so
/// the global batch, and with it the training, does not depend on the number of ranks: one
/// rank (`ranks = 1`) reads each global batch whole, in the same order.
pub struct ShardedLoader<B: Backend, I, O> {
    batcher: Arc<dyn Batcher<B, I, O>>,
    dataset: Arc<dyn Dataset<I>>,
    global_batch: usize,
    seed: u64,
    index: usize,
    ranks: usize,
    device: B::Device,
    /// Epochs begun (shared by the clones `to_device` and `slice` make).
    epochs: Arc<AtomicUsize>,
    /// The global batches this loader visits (all, unless sliced).
    batches: Range<usize>,
}

impl<B: Backend, I, O> std::fmt::Debug for ShardedLoader<B, I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedLoader")
            .field("global_batch", &self.global_batch)
            .field("rank", &self.index)
            .field("ranks", &self.ranks)
            .field("batches", &self.batches)
            .finish()
    }
}

impl<B: Backend, I: Send + Sync + 'static, O: Send + 'static> ShardedLoader<B, I, O> {
    /// Rank `index` of `ranks` over `dataset`, batches made by `batcher` on `device`.
    pub fn new(
        batcher: impl Batcher<B, I, O> + 'static,
        dataset: impl Dataset<I> + 'static,
        global_batch: usize,
        seed: u64,
        index: usize,
        ranks: usize,
        device: B::Device,
    ) -> Result<Self, LearnerError> {
        if ranks == 0 || index >= ranks {
            return Err(LearnerError::Config(format!(
                "data-parallel rank {index} of {ranks}"
            )));
        }
        if global_batch == 0 || !global_batch.is_multiple_of(ranks) {
            return Err(LearnerError::Config(format!(
                "a global batch of {global_batch} rows does not split over {ranks} data-parallel \
                 ranks: choose a multiple of {ranks}"
            )));
        }
        let batches = dataset.len() / global_batch;
        if batches == 0 {
            return Err(LearnerError::Config(format!(
                "a dataset of {} rows holds no global batch of {global_batch}",
                dataset.len()
            )));
        }
        Ok(Self {
            batcher: Arc::new(batcher),
            dataset: Arc::new(dataset),
            global_batch,
            seed,
            index,
            ranks,
            device,
            epochs: Arc::new(AtomicUsize::new(0)),
            batches: 0..batches,
        })
    }
}

impl<B: Backend, I, O> ShardedLoader<B, I, O> {
    /// Count epochs in `epochs` (shared with whoever sets it when a run resumes).
    pub fn with_epochs(mut self, epochs: Arc<AtomicUsize>) -> Self {
        self.epochs = epochs;
        self
    }

    /// This rank's rows per step.
    pub fn local_batch(&self) -> usize {
        self.global_batch / self.ranks
    }

    /// The order of epoch `epoch` (1-based): the rows of the dataset, shuffled.
    pub fn order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset.len()).collect();
        let mut rng =
            SplitMix64::new(self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for i in (1..order.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }

    fn clone_with(&self, device: B::Device, batches: Range<usize>) -> Self {
        Self {
            batcher: self.batcher.clone(),
            dataset: self.dataset.clone(),
            global_batch: self.global_batch,
            seed: self.seed,
            index: self.index,
            ranks: self.ranks,
            device,
            epochs: self.epochs.clone(),
            batches,
        }
    }
}

impl<B, I, O> DataLoader<B, O> for ShardedLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let epoch = self.epochs.fetch_add(1, Ordering::SeqCst) + 1;
        Box::new(Epoch {
            order: self.order(epoch),
            loader: self,
            next: self.batches.start,
        })
    }

    fn num_items(&self) -> usize {
        self.batches.len() * self.local_batch()
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(self.clone_with(device.clone(), self.batches.clone()))
    }

    /// Items `start..end` of this rank's items, rounded to whole steps.
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let local = self.local_batch();
        let first = self.batches.start + start / local;
        let last = (self.batches.start + end / local).min(self.batches.end);
        Arc::new(self.clone_with(self.device.clone(), first..last.max(first)))
    }
}

/// One epoch of a [`ShardedLoader`].
struct Epoch<'a, B: Backend, I, O> {
    order: Vec<usize>,
    loader: &'a ShardedLoader<B, I, O>,
    next: usize,
}

impl<B: Backend, I, O> Iterator for Epoch<'_, B, I, O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        let loader = self.loader;
        if self.next >= loader.batches.end {
            return None;
        }
        let local = loader.local_batch();
        let start = self.next * loader.global_batch + loader.index * local;
        self.next += 1;
        let items = self.order[start..start + local]
            .iter()
            .map(|&row| {
                loader
                    .dataset
                    .get(row)
                    .unwrap_or_else(|| panic!("row {row} of a dataset of {}", loader.dataset.len()))
            })
            .collect();
        Some(loader.batcher.batch(items, &loader.device))
    }
}

impl<B: Backend, I, O> DataLoaderIterator<O> for Epoch<'_, B, I, O> {
    fn progress(&self) -> Progress {
        let local = self.loader.local_batch();
        Progress::new(
            (self.next - self.loader.batches.start) * local,
            self.loader.batches.len() * local,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[derive(Clone)]
    struct Rows;

    impl Batcher<Flex, usize, Vec<usize>> for Rows {
        fn batch(&self, items: Vec<usize>, _: &burn::tensor::Device<Flex>) -> Vec<usize> {
            items
        }
    }

    struct Numbers(usize);

    impl Dataset<usize> for Numbers {
        fn get(&self, index: usize) -> Option<usize> {
            (index < self.0).then_some(index)
        }
        fn len(&self) -> usize {
            self.0
        }
    }

    fn loader(index: usize, ranks: usize) -> ShardedLoader<Flex, usize, Vec<usize>> {
        ShardedLoader::new(Rows, Numbers(50), 12, 7, index, ranks, Default::default()).unwrap()
    }

    /// The ranks' parts of every step are disjoint and together the one-rank step, in order;
    /// every rank runs the same number of steps (the last partial global batch dropped); the
    /// order changes from epoch to epoch and is the same for every rank count.
    #[test]
    fn ranks_split_each_global_batch_and_epochs_reshuffle() {
        let one = loader(0, 1);
        let first: Vec<Vec<usize>> = one.iter().collect();
        let second: Vec<Vec<usize>> = one.iter().collect();
        assert_eq!(first.len(), 4);
        assert_ne!(first, second, "the second epoch reshuffles");
        for ranks in [2, 3, 4] {
            let parts: Vec<Vec<Vec<usize>>> = (0..ranks)
                .map(|r| {
                    let l = loader(r, ranks);
                    l.iter().for_each(drop); // the first epoch
                    l.iter().collect()
                })
                .collect();
            for (step, whole) in second.iter().enumerate() {
                let joined: Vec<usize> = parts.iter().flat_map(|p| p[step].clone()).collect();
                assert_eq!(&joined, whole, "{ranks} ranks, step {step}");
            }
            assert_eq!(loader(0, ranks).num_items(), 4 * 12 / ranks);
        }
        let mut all: Vec<usize> = first.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 48, "no row twice in an epoch");
    }

    #[test]
    fn splits_that_cannot_work_are_refused() {
        let refused = |r: Result<ShardedLoader<Flex, usize, Vec<usize>>, LearnerError>,
                       words: &str| {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(words), "{words}: {e}");
        };
        refused(
            ShardedLoader::new(Rows, Numbers(50), 10, 0, 0, 4, Default::default()),
            "does not split over 4",
        );
        refused(
            ShardedLoader::new(Rows, Numbers(5), 8, 0, 0, 2, Default::default()),
            "holds no global batch",
        );
        refused(
            ShardedLoader::new(Rows, Numbers(50), 8, 0, 2, 2, Default::default()),
            "rank 2 of 2",
        );
    }
}
