//! Checkpoints kept in host memory for a fast restart (`--memory-checkpoints`): at each save
//! every rank keeps its own files of the checkpoint and a copy of its buddy's (the previous
//! rank's, a ring), so losing any one rank — its memory with it — loses no file; a restart reads
//! the checkpoint from memory ([`super::Checkpoint::in_memory`]), no file. When a rank and its
//! buddy are both lost, [`MemoryCheckpoints::recover`] gives nothing and the restart reads the
//! disk checkpoint.
//!
//! Ranks as threads share one store (one process); the holder of each copy is the rank whose
//! memory it models, so [`MemoryCheckpoints::lose`] drops exactly what a lost rank held. The
//! latest complete checkpoint is kept, and the one being saved after it.

use super::load::MemoryFiles;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// One rank's files of one checkpoint, by name.
pub type RankFiles = Vec<(String, Arc<Vec<u8>>)>;

/// The checkpoints the ranks of this process hold in memory (see the module's documentation).
#[derive(Debug, Default)]
pub struct MemoryCheckpoints {
    inner: Mutex<Inner>,
}

/// holder rank → owner rank → that owner's files (the holder's own, and its buddy's copy).
type Held = BTreeMap<usize, BTreeMap<usize, RankFiles>>;

#[derive(Debug, Default)]
struct Inner {
    /// step → (world size, what each rank holds of it).
    steps: BTreeMap<usize, (usize, Held)>,
}

impl Inner {
    /// The files of `step` when every rank's survive somewhere and the metadata is there.
    fn whole(&self, step: usize) -> Option<MemoryFiles> {
        let (world, held) = self.steps.get(&step)?;
        let mut files = MemoryFiles::new();
        for owner in 0..*world {
            let copy = held.values().find_map(|owners| owners.get(&owner))?;
            files.extend(copy.iter().cloned());
        }
        files.contains_key("metadata.json").then_some(files)
    }
}

impl MemoryCheckpoints {
    /// An empty store.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The rank that holds a copy of `rank`'s files: the next one on the ring.
    pub fn buddy(rank: usize, world: usize) -> usize {
        (rank + 1) % world
    }

    /// Rank `rank` of `world` keeps `files`, its part of the checkpoint of `step` (rank 0's
    /// include the metadata and run state), and gives its buddy a copy. Once a step is whole,
    /// the older ones are dropped.
    pub fn put(&self, step: usize, world: usize, rank: usize, files: RankFiles) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner
            .steps
            .keys()
            .next_back()
            .is_some_and(|&newest| newest > step)
            && !inner.steps.contains_key(&step)
        {
            return; // an older save finishing after a newer one started
        }
        let (_, held) = inner
            .steps
            .entry(step)
            .or_insert_with(|| (world, BTreeMap::new()));
        let buddy = Self::buddy(rank, world);
        held.entry(buddy).or_default().insert(rank, files.clone());
        held.entry(rank).or_default().insert(rank, files);
        if inner.whole(step).is_some() {
            inner.steps.retain(|&s, _| s >= step);
        }
    }

    /// `ranks` were lost: whatever they held is gone.
    pub fn lose(&self, ranks: &[usize]) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (_, held) in inner.steps.values_mut() {
            for rank in ranks {
                held.remove(rank);
            }
        }
    }

    /// The newest checkpoint every rank's files of which survive (from its own memory or its
    /// buddy's): its step and files; `None` when nothing is held or both copies of some rank's
    /// files are gone.
    pub fn recover(&self) -> Option<(usize, Arc<MemoryFiles>)> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .steps
            .keys()
            .rev()
            .find_map(|&step| inner.whole(step).map(|files| (step, Arc::new(files))))
    }

    /// Bytes held (every copy).
    pub fn bytes(&self) -> u64 {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .steps
            .values()
            .flat_map(|(_, held)| held.values())
            .flat_map(|owners| owners.values().flatten())
            .map(|(_, bytes)| bytes.len() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(rank: usize) -> RankFiles {
        let mut files = vec![(format!("rank-{rank}"), Arc::new(vec![rank as u8; 3]))];
        if rank == 0 {
            files.push(("metadata.json".into(), Arc::new(b"{}".to_vec())));
        }
        files
    }

    /// Losing one rank loses no file (its buddy holds a copy); losing a rank and its buddy
    /// loses that rank's files; a newer step replaces the older.
    #[test]
    fn one_lost_rank_is_recovered_from_its_buddy() {
        let store = MemoryCheckpoints::new();
        assert!(store.recover().is_none());
        for rank in 0..4 {
            store.put(5, 4, rank, files(rank));
        }
        assert_eq!(store.bytes(), 2 * (4 * 3 + 2));
        store.lose(&[2]);
        let (step, got) = store.recover().expect("rank 2's files are held by rank 3");
        assert_eq!(step, 5);
        assert_eq!(got.len(), 5);
        assert_eq!(&*got["rank-2"], &[2, 2, 2]);
        store.lose(&[3]);
        assert!(
            store.recover().is_none(),
            "rank 2 and its buddy 3 are both gone"
        );
        // A newer checkpoint, partly saved, leaves the older one recoverable; whole, it
        // replaces it.
        for rank in 0..4 {
            store.put(10, 4, rank, files(rank));
        }
        for rank in 0..3 {
            store.put(15, 4, rank, files(rank));
        }
        assert_eq!(store.recover().map(|(s, f)| (s, f.len())), Some((10, 5)));
        store.put(15, 4, 3, files(3));
        assert_eq!(store.recover().map(|(s, _)| s), Some(15));
        assert_eq!(store.bytes(), 2 * (4 * 3 + 2), "step 10 dropped");
        store.lose(&[0, 2]);
        assert!(store.recover().is_some(), "0 and 2 are not buddies");
    }
}
