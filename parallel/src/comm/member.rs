//! What every communicator is, whatever moves its data: one rank of a mesh, counting its calls.

use std::fmt;
use std::sync::Mutex;
use std::time::Instant;

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
    /// The trace of this rank's collectives and compute regions, while tracing.
    trace: Mutex<Option<Vec<TraceEvent>>>,
}

/// One span of a rank's trace (see [`Member::set_tracing`]): a collective (from its issue to its
/// completion) or a compute region, in microseconds since the process's first traced moment.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TraceEvent {
    /// The collective's kind (`AllGather`, …) or the region's name (`forward`, …).
    pub name: String,
    /// The collective's kind; `None` for a compute region.
    pub kind: Option<CollectiveKind>,
    /// Start, in µs since the trace's epoch (shared by the ranks of one process).
    pub start_us: f64,
    /// Duration in µs.
    pub dur_us: f64,
    /// For a collective, when it was issued (µs since the epoch): before `start_us` when it
    /// waited on the rank's communication queue ([`super::CommQueue`]) behind earlier calls.
    #[serde(default)]
    pub issued_us: f64,
    /// The mesh axis or group a collective ran over (empty for a region).
    pub group: String,
    /// The bytes a collective counted (0 for a region).
    pub bytes: u64,
}

/// The moment every trace of this process counts from.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn micros(t: Instant) -> f64 {
    t.saturating_duration_since(epoch()).as_secs_f64() * 1e6
}

impl Member {
    /// Rank `rank` of `mesh`, nothing recorded yet.
    pub fn new(rank: usize, mesh: DeviceMesh) -> Self {
        Self {
            rank,
            mesh,
            stats: Mutex::default(),
            trace: Mutex::default(),
        }
    }

    /// Start (`true`, forgetting any earlier trace) or stop recording this rank's trace: every
    /// collective from issue to completion, and the compute regions its caller marks
    /// ([`Member::trace_region`]).
    pub fn set_tracing(&self, on: bool) {
        epoch();
        *lock(&self.trace) = on.then(Vec::new);
    }

    /// Whether the trace is being recorded.
    pub fn tracing(&self) -> bool {
        lock(&self.trace).is_some()
    }

    /// Record the compute region `name`, from `start` to now (nothing unless tracing).
    pub fn trace_region(&self, name: &str, start: Instant) {
        self.trace_span(name, None, start, start, "", 0);
    }

    /// Records in the trace, when it is on, a span `name` issued at `issued` and run from
    /// `started` to now.
    fn trace_span(
        &self,
        name: &str,
        kind: Option<CollectiveKind>,
        issued: Instant,
        started: Instant,
        group: &str,
        bytes: u64,
    ) {
        let end = Instant::now();
        if let Some(trace) = lock(&self.trace).as_mut() {
            trace.push(TraceEvent {
                name: name.into(),
                kind,
                start_us: micros(started),
                dur_us: micros(end) - micros(started),
                issued_us: micros(issued),
                group: group.into(),
                bytes,
            });
        }
    }

    /// The trace so far, taken (recording goes on if it was on).
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        lock(&self.trace)
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
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

    /// Records `call`, which returned `result`, with the bytes [`Call::counted_bytes`] says; in
    /// the trace too when it is on and `times` says when the call was issued and when it began
    /// to run.
    pub(crate) fn record(
        &self,
        call: &Call,
        result: Option<&TensorData>,
        times: Option<(Instant, Instant)>,
    ) {
        let label = call.group().label(&self.mesh).unwrap_or("?");
        let bytes = call.counted_bytes(result) as u64;
        lock(&self.stats).record(call.kind(), label, bytes);
        if let Some((issued, started)) = times {
            let name = format!("{:?}", call.kind());
            self.trace_span(&name, Some(call.kind()), issued, started, label, bytes);
        }
    }

    /// Records a point-to-point exchange ([`super::CommQueue::issue_exchange`]) in the trace,
    /// when it is on: issued at `issued`, run from `started` to now, `bytes` received.
    pub(crate) fn trace_exchange(&self, issued: Instant, started: Instant, bytes: u64) {
        let kind = Some(CollectiveKind::Recv);
        self.trace_span("SendRecv", kind, issued, started, "p2p", bytes);
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
