//! Per-rank communication statistics, like PyTorch's `CommDebugMode`: how many calls of each
//! kind went to each group, and how many bytes they carried.

use std::collections::BTreeMap;
use std::fmt;

use super::CollectiveKind;

/// The call count and byte volume of one (kind, group) entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommCount {
    /// Number of successful calls.
    pub count: u64,
    /// Bytes, as defined on [`CommStats`].
    pub bytes: u64,
}

/// What one rank communicated, per [`CollectiveKind`] and group label.
///
/// The group label is the axis name for [`Group::Axis`](super::Group::Axis), `world` for
/// [`Group::World`](super::Group::World), and `p2p` for send and recv.
///
/// `bytes` is the byte size of the buffer **this rank passes in**, not the traffic on the wire
/// (which depends on the algorithm):
///
/// | call | bytes |
/// |---|---|
/// | all-reduce | the tensor |
/// | all-gather | the local piece (not the gathered result) |
/// | reduce-scatter | the full input (not the returned chunk) |
/// | broadcast | the broadcast tensor, on every rank, root or not |
/// | barrier | 0 |
/// | send | the sent buffer |
/// | recv | the received buffer |
///
/// Only calls that succeed are recorded. Collectives on a group of one rank are recorded too,
/// although they move nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommStats {
    entries: BTreeMap<(CollectiveKind, String), CommCount>,
}

impl CommStats {
    /// Records one call of `kind` on the group labelled `group`, carrying `bytes`.
    pub fn record(&mut self, kind: CollectiveKind, group: &str, bytes: u64) {
        let entry = self.entries.entry((kind, group.to_owned())).or_default();
        entry.count += 1;
        entry.bytes += bytes;
    }

    /// Calls of `kind`, over every group.
    pub fn count(&self, kind: CollectiveKind) -> u64 {
        self.of_kind(kind).map(|entry| entry.count).sum()
    }

    /// Bytes of `kind`, over every group.
    pub fn bytes(&self, kind: CollectiveKind) -> u64 {
        self.of_kind(kind).map(|entry| entry.bytes).sum()
    }

    /// Calls of `kind` on the group labelled `group` (`dp`, `tp`, `world`, `p2p`, …).
    pub fn count_on(&self, kind: CollectiveKind, group: &str) -> u64 {
        self.get(kind, group).count
    }

    /// Bytes of `kind` on the group labelled `group`.
    pub fn bytes_on(&self, kind: CollectiveKind, group: &str) -> u64 {
        self.get(kind, group).bytes
    }

    /// The entry of `kind` on `group` (zero when there were no such calls).
    pub fn get(&self, kind: CollectiveKind, group: &str) -> CommCount {
        self.entries
            .get(&(kind, group.to_owned()))
            .copied()
            .unwrap_or_default()
    }

    /// Bytes of every kind on every group.
    pub fn total_bytes(&self) -> u64 {
        self.entries.values().map(|entry| entry.bytes).sum()
    }

    /// Calls of every kind on every group.
    pub fn total_count(&self) -> u64 {
        self.entries.values().map(|entry| entry.count).sum()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every entry, ordered by kind, then group label.
    pub fn iter(&self) -> impl Iterator<Item = (CollectiveKind, &str, CommCount)> + '_ {
        self.entries
            .iter()
            .map(|((kind, group), entry)| (*kind, group.as_str(), *entry))
    }

    /// These statistics and `other`'s together (e.g. a rank's host and device collectives).
    pub fn merged(&self, other: &CommStats) -> CommStats {
        let mut entries = self.entries.clone();
        for (key, count) in &other.entries {
            let entry = entries.entry(key.clone()).or_default();
            entry.count += count.count;
            entry.bytes += count.bytes;
        }
        CommStats { entries }
    }

    /// What was recorded after `earlier`, a snapshot of these statistics taken before (for
    /// example the calls of one training step).
    ///
    /// # Panics
    /// If `earlier` holds an entry larger than this one's, i.e. it is not an earlier snapshot
    /// (statistics were reset in between).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut entries = BTreeMap::new();
        for (key, now) in &self.entries {
            let before = earlier.entries.get(key).copied().unwrap_or_default();
            assert!(
                before.count <= now.count && before.bytes <= now.bytes,
                "CommStats::since: the snapshot is not an earlier state of these statistics"
            );
            if now.count > before.count {
                entries.insert(
                    key.clone(),
                    CommCount {
                        count: now.count - before.count,
                        bytes: now.bytes - before.bytes,
                    },
                );
            }
        }
        CommStats { entries }
    }

    fn of_kind(&self, kind: CollectiveKind) -> impl Iterator<Item = &CommCount> {
        self.entries
            .iter()
            .filter(move |((entry_kind, _), _)| *entry_kind == kind)
            .map(|(_, entry)| entry)
    }
}

impl fmt::Display for CommStats {
    /// A small table: one row per (kind, group), then the total.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<16}{:<14}{:>8}{:>16}",
            "collective", "group", "calls", "bytes"
        )?;
        for (kind, group, entry) in self.iter() {
            writeln!(
                f,
                "{:<16}{:<14}{:>8}{:>16}",
                kind.to_string(),
                group,
                entry.count,
                entry.bytes
            )?;
        }
        write!(
            f,
            "{:<16}{:<14}{:>8}{:>16}",
            "total",
            "",
            self.total_count(),
            self.total_bytes()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_per_kind_and_group() {
        let mut stats = CommStats::default();
        stats.record(CollectiveKind::AllReduce, "dp", 40);
        stats.record(CollectiveKind::AllReduce, "tp", 8);
        let snapshot = stats.clone();
        stats.record(CollectiveKind::AllReduce, "dp", 40);
        stats.record(CollectiveKind::Barrier, "world", 0);
        assert_eq!(stats.count(CollectiveKind::AllReduce), 3);
        assert_eq!(stats.bytes(CollectiveKind::AllReduce), 88);
        assert_eq!(stats.count_on(CollectiveKind::AllReduce, "dp"), 2);
        assert_eq!(stats.bytes_on(CollectiveKind::AllReduce, "tp"), 8);
        assert_eq!(stats.count_on(CollectiveKind::AllGather, "dp"), 0);
        assert_eq!(stats.total_bytes(), 88);
        assert_eq!(stats.total_count(), 4);
        assert_eq!(stats.iter().count(), 3);

        let step = stats.since(&snapshot);
        assert_eq!(step.count_on(CollectiveKind::AllReduce, "dp"), 1);
        assert_eq!(step.count_on(CollectiveKind::AllReduce, "tp"), 0);
        assert_eq!(step.total_bytes(), 40);

        let table = stats.to_string();
        assert!(table.contains("all_reduce      dp"), "{table}");
        assert!(
            table.lines().last().unwrap().starts_with("total"),
            "{table}"
        );
    }
}
