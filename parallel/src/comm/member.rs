//! What every communicator is, whatever moves its data: one rank of a mesh, counting its calls.

use std::fmt;
use std::sync::Mutex;

use burn::tensor::TensorData;

use super::{Call, CollectiveKind, CommStats, Error, check_rank, lock};
use crate::mesh::DeviceMesh;

/// One rank of a mesh and the statistics of its calls, recorded from any thread: the part every
/// [`Communicator`](super::Communicator) shares, from which the trait answers `rank`, `mesh`,
/// `stats` and `reset_stats`.
#[derive(Debug)]
pub struct Member {
    rank: usize,
    mesh: DeviceMesh,
    stats: Mutex<CommStats>,
}

impl Member {
    /// Rank `rank` of `mesh`, nothing recorded yet.
    pub fn new(rank: usize, mesh: DeviceMesh) -> Self {
        Self {
            rank,
            mesh,
            stats: Mutex::default(),
        }
    }

    /// This rank, in `0..mesh().world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The mesh the ranks are arranged in.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The statistics so far.
    pub fn stats(&self) -> CommStats {
        lock(&self.stats).clone()
    }

    /// Forgets them.
    pub fn reset_stats(&self) {
        *lock(&self.stats) = CommStats::default();
    }

    /// Records `call`, which returned `result`, with the bytes [`Call::counted_bytes`] says.
    pub(crate) fn record(&self, call: &Call, result: Option<&TensorData>) {
        let label = call.group().label(&self.mesh).unwrap_or("?");
        let bytes = call.counted_bytes(result) as u64;
        lock(&self.stats).record(call.kind(), label, bytes);
    }

    /// Records a point-to-point message of `bytes`.
    pub(crate) fn record_p2p(&self, kind: CollectiveKind, bytes: usize) {
        lock(&self.stats).record(kind, "p2p", bytes as u64);
    }

    /// Fails unless `peer`, the other end of a point-to-point message, is a rank of the world.
    pub(crate) fn check_peer(&self, peer: usize) -> Result<(), Error> {
        check_rank(peer, self.mesh.world_size(), "the world")
    }

    /// `name { rank: 0, mesh: "…", .. }`: how the host communicators print themselves.
    pub(crate) fn debug_as(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(name)
            .field("rank", &self.rank)
            .field("mesh", &self.mesh.to_string())
            .finish_non_exhaustive()
    }
}
