//! The decorator's device: (inner device, rank, mesh, communicator), and per-rank op counters.

use crate::comm::{CommQueue, Communicator, DeviceCollectives, InProcessWorld};
use crate::mesh::{AxisKind, DeviceMesh};
use crate::policy::RankPolicy;
use burn::tensor::backend::{Backend, DeviceId, DeviceOps};
use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock, Weak};

/// Device type id reported to Burn for `Distributed` devices ("WF").
const TYPE_ID: u16 = 0x5746;

mod dist;
pub use dist::*;

/// Counters of the redistributions the decorator inserted, by op name (the analogue of
/// PyTorch's `CommDebugMode` for implicit communication).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpCounters {
    /// Ops without a propagation rule that had to gather or reduce an input (the fallback).
    pub fallbacks: BTreeMap<&'static str, u64>,
    /// Redistributions a propagation rule asked for (e.g. reducing a `Partial` before a
    /// non-linear op, or gathering a sharded weight for an FSDP matmul).
    pub redistributions: BTreeMap<&'static str, u64>,
    /// Float tensors read to the host (`into_data`, `into_scalar`: each waits for the device).
    pub host_reads: u64,
    /// Offloaded pieces uploaded by the rank's own thread for a use (`--offload params`:
    /// [`crate::DTensor::offloaded`]).
    pub host_uploads: u64,
    /// Offloaded shards handed to an FSDP gather as they are, from host memory: the shard is
    /// never uploaded, the gathered parameter is (on the communication thread).
    pub host_gathers: u64,
    /// Work the layers above count by name (`muon newton-schulz`: the Newton–Schulz iterations
    /// this rank ran).
    pub work: BTreeMap<&'static str, u64>,
    /// Results of calls queued on the communication thread, uploaded to the device there (a
    /// gathered parameter, a reduced gradient bucket, a ring's received block), beside the
    /// compute rather than when waited for.
    pub comm_uploads: u64,
    /// Dtype casts run on the inner backend, by the op that asked (`float_cast` for explicit
    /// casts; the precision policy's casts under the rule that needed them — a weight cast to
    /// the compute dtype is counted once per value, its cached copy serves every later use).
    pub casts: BTreeMap<&'static str, u64>,
}

impl OpCounters {
    /// Total number of fallback redistributions.
    pub fn fallback_total(&self) -> u64 {
        self.fallbacks.values().sum()
    }

    /// Total number of casts.
    pub fn cast_total(&self) -> u64 {
        self.casts.values().sum()
    }
}

/// Run `f` on the state of type `T` in `slot` (a state of another type is dropped).
fn with_slot<T: Any + Send, R>(
    slot: &Mutex<Option<Box<dyn Any + Send>>>,
    f: impl FnOnce(&mut Option<T>) -> R,
) -> R {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if !slot.as_ref().is_some_and(|b| b.is::<Option<T>>()) {
        *slot = Some(Box::new(None::<T>));
    }
    let state = slot
        .as_mut()
        .and_then(|b| b.downcast_mut::<Option<T>>())
        .expect("set above");
    f(state)
}

/// A reduction in flight that can be waited for (`tensor::Awaited`), the backend type erased.
pub(crate) trait Resolve: Send + Sync {
    /// Wait for it (its result is kept for its value's first use).
    fn resolve(&self) -> Result<(), crate::Error>;
}

/// Overlap counters of a rank ([`RankContext::prefetch_stats`]): FSDP's prefetched gathers (see
/// [`crate::prefetch_parameters`]) and the asynchronous gradient reductions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Parameter gathers issued ahead of their use.
    pub issued: u64,
    /// Gathers served by one issued ahead.
    pub used: u64,
    /// Gathers issued ahead and never used (a step left the recorded order).
    pub wasted: u64,
    /// Steps that left the recorded order.
    pub diverged: u64,
    /// Gradient reductions issued asynchronously ([`RankPolicy::reduce_in_flight`](crate::RankPolicy)).
    pub reductions: u64,
    /// DDP gradient buckets all-reduced ([`RankPolicy::bucket_bytes`](crate::RankPolicy)).
    pub buckets: u64,
}

/// A rank's memory by kind ([`RankContext::memory_report`]), in bytes of local pieces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryReport {
    /// All live tensors.
    pub live: u64,
    /// The peak of `live` since the last reset.
    pub peak: u64,
    /// The model's parameters (this rank's pieces).
    pub params: u64,
    /// The gradients (this rank's pieces).
    pub grads: u64,
    /// Parameters gathered over data axes for use (FSDP), alive now.
    pub gathered: u64,
    /// The peak of `gathered` since the last reset.
    pub peak_gathered: u64,
    /// The rest: optimizer state, activations kept for backward, temporaries.
    pub other: u64,
}

type DeviceStats = Box<dyn Fn() -> crate::comm::CommStats + Send + Sync>;

/// Everything a rank needs to run distributed ops: its rank, the mesh and a communicator; the
/// run's [`RankPolicy`]; its accounting; and where it is in the step's protocol.
pub struct RankContext {
    /// The communicator, behind the rank's queue of issued collectives.
    comm: Arc<CommQueue>,
    /// Collectives on the inner backend's tensors, when installed.
    collectives: InstalledCollectives,
    /// The run's policy: set once, before the parallelism transforms, which fill in their parts.
    policy: RwLock<RankPolicy>,
    /// Memory (bytes of live tensors) and op counters.
    accounting: Accounting,
    /// Where the rank is in the training step's protocol.
    protocol: StepProtocol,
    /// This rank's random stream, once seeded (`Backend::seed`): ranks as threads then draw
    /// deterministically, whatever the other threads do (the inner backend's stream is often one
    /// per process).
    rng: Mutex<Option<rand::rngs::StdRng>>,
    /// Sharded initialisation ([`crate::init_sharded`]): the next tensor of this shape that a
    /// creation op makes is this rank's piece of it in this layout, random values drawn from
    /// this stream piece by piece.
    init_scope: Mutex<Option<InitScope>>,
    /// The parameters built now are about to be overwritten by a load (a resumed checkpoint):
    /// a model's initialiser draws no values ([`RankContext::build_for_load`]).
    building_for_load: AtomicBool,
    /// FSDP prefetch: the step's parameters, the recorded gather order and the gathers in
    /// flight (`tensor::prefetch::Prefetch<B>`, the backend type erased), and its counters.
    prefetch: Mutex<Option<Box<dyn Any + Send>>>,
    prefetch_stats: Mutex<PrefetchStats>,
    /// The open DDP gradient bucket (`tensor::buckets`, the backend type erased).
    buckets: Mutex<Option<Box<dyn Any + Send>>>,
    /// Asynchronous gradient reductions issued and not yet waited for, oldest first.
    outstanding: Mutex<std::collections::VecDeque<Arc<dyn Resolve>>>,
    /// Zero-bubble split backward: while `Some`, the weight gradients of linear layers are
    /// deferred and listed here ([`RankContext::begin_deferring_weight_gradients`]).
    deferred: Mutex<Option<Vec<Arc<dyn Resolve>>>>,
}

/// One parameter's sharded initialisation (see [`RankContext`]'s `init_scope`).
#[derive(Clone, Debug)]
pub(crate) struct InitScope {
    pub(crate) shape: Vec<usize>,
    pub(crate) layout: crate::placement::Layout,
    pub(crate) stream: u64,
}

/// The device collectives installed on a rank.
#[derive(Default)]
struct InstalledCollectives {
    /// An `Arc<dyn DeviceCollectives<B>>`, the backend type erased.
    collectives: Mutex<Option<Box<dyn Any + Send + Sync>>>,
    /// Their statistics, when they are not the host communicator's.
    stats: Mutex<Option<DeviceStats>>,
}

/// A rank's accounting: the bytes of the local pieces of its live distributed tensors, and the
/// redistributions its ops inserted.
#[derive(Default)]
struct Accounting {
    /// Bytes of the local pieces of all live distributed tensors of this rank, and the peak.
    live_bytes: AtomicI64,
    peak_bytes: AtomicI64,
    /// The peak since the current phase of the step began ([`RankContext::start_phase`]).
    phase_peak_bytes: AtomicI64,
    /// Of those, the copies of sharded values gathered over data axes (FSDP's gathered
    /// parameters), and their peak.
    gathered_bytes: AtomicI64,
    peak_gathered_bytes: AtomicI64,
    /// The memory budget was crossed: it is not enforced again while the rank fails (its
    /// tensors are dropped as it unwinds), until the policy is set again.
    budget_crossed: AtomicBool,
    /// The policy's memory budget (0: none), kept here so that the accounting every new tensor
    /// does reads an atomic, not the policy's lock.
    budget: AtomicU64,
    /// Bytes this rank keeps in host memory for its training state (an offloaded optimizer's
    /// moments: [`HostBytes`]), outside the device accounting above, and the peak.
    host_bytes: AtomicI64,
    peak_host_bytes: AtomicI64,
    counters: Mutex<OpCounters>,
}

/// Host memory a rank holds for its training state (an offloaded optimizer's moments), counted
/// in [`RankContext::host_bytes`] while this lives.
pub struct HostBytes {
    bytes: i64,
    ctx: Arc<RankContext>,
}

impl HostBytes {
    /// Count `bytes` of host memory on `ctx`'s rank until this is dropped.
    pub fn new(ctx: &Arc<RankContext>, bytes: usize) -> Self {
        let bytes = bytes as i64;
        let memory = &ctx.accounting;
        let now = memory.host_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        memory.peak_host_bytes.fetch_max(now, Ordering::Relaxed);
        Self {
            bytes,
            ctx: ctx.clone(),
        }
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        let memory = &self.ctx.accounting;
        memory.host_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({})", self.bytes)
    }
}

/// Device memory a rank holds outside its distributed tensors (an 8-bit optimizer's codes and
/// block scales, kept as the inner backend's tensors), counted in [`RankContext::live_bytes`]
/// (and against the memory budget) while this lives, like a distributed tensor's piece.
pub struct DeviceBytes {
    bytes: i64,
    ctx: Arc<RankContext>,
}

impl DeviceBytes {
    /// Count `bytes` of device memory on `ctx`'s rank until this is dropped.
    pub fn new(ctx: &Arc<RankContext>, bytes: usize) -> Self {
        let bytes = bytes as i64;
        ctx.add_live_bytes(bytes);
        Self {
            bytes,
            ctx: ctx.clone(),
        }
    }
}

impl Drop for DeviceBytes {
    fn drop(&mut self) {
        self.ctx.add_live_bytes(-self.bytes);
    }
}

impl std::fmt::Debug for DeviceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBytes({})", self.bytes)
    }
}

/// Where a rank is in the protocol of a training step.
#[derive(Default)]
struct StepProtocol {
    /// A backward pass produced data-parallel gradients that `sync_gradients` has not seen yet.
    pending_sync: AtomicBool,
    /// Gradient accumulation: forward after an unsynchronised backward is allowed.
    no_sync: AtomicBool,
}

impl std::fmt::Debug for RankContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {}/{} on {}",
            self.rank(),
            self.world_size(),
            self.mesh()
        )
    }
}

impl RankContext {
    /// A context over a communicator (which knows the rank and the mesh).
    pub fn new(comm: Arc<dyn Communicator>) -> Arc<Self> {
        Arc::new(Self {
            comm: Arc::new(CommQueue::new(comm)),
            collectives: InstalledCollectives::default(),
            policy: RwLock::new(RankPolicy::default()),
            accounting: Accounting::default(),
            protocol: StepProtocol::default(),
            rng: Mutex::new(None),
            init_scope: Mutex::new(None),
            building_for_load: AtomicBool::new(false),
            prefetch: Mutex::new(None),
            prefetch_stats: Mutex::default(),
            buckets: Mutex::new(None),
            outstanding: Mutex::default(),
            deferred: Mutex::default(),
        })
    }

    /// Run this rank's redistributions on `collectives`, on the inner backend's own tensors
    /// (NCCL on CUDA), instead of staging them through the host communicator. The host
    /// communicator stays for host-side calls (scalars, barriers, checkpoints). One backend's
    /// collectives at a time: installing replaces the previous ones.
    pub fn set_device_collectives<B: Backend>(&self, collectives: Arc<dyn DeviceCollectives<B>>) {
        // Counted once when the device collectives are the host communicator too.
        let same = std::ptr::addr_eq(Arc::as_ptr(&collectives), Arc::as_ptr(self.comm.inner()));
        let counted = collectives.clone();
        *self.collectives.stats.lock().unwrap() =
            (!same).then(|| Box::new(move || counted.stats()) as DeviceStats);
        *self.collectives.collectives.lock().unwrap() = Some(Box::new(collectives));
    }

    /// Go back to the host communicator for every collective.
    pub fn clear_device_collectives(&self) {
        *self.collectives.collectives.lock().unwrap() = None;
        *self.collectives.stats.lock().unwrap() = None;
    }

    /// The device collectives installed for backend `B`, if any.
    pub fn device_collectives<B: Backend>(&self) -> Option<Arc<dyn DeviceCollectives<B>>> {
        self.collectives
            .collectives
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|any| any.downcast_ref::<Arc<dyn DeviceCollectives<B>>>())
            .cloned()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        self.comm.mesh()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.mesh().world_size()
    }

    /// The communicator.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// The communicator's queue: collectives issued now and waited for later
    /// ([`CommQueue::issue`]).
    pub fn queue(&self) -> &CommQueue {
        &self.comm
    }

    /// Everything this rank communicated: the host communicator's statistics plus those of the
    /// installed device collectives (NCCL counts its own calls).
    pub fn comm_stats(&self) -> crate::comm::CommStats {
        let host = self.comm.stats();
        match self.collectives.stats.lock().unwrap().as_ref() {
            Some(device) => host.merged(&device()),
            None => host,
        }
    }

    /// The rank's queue, shared (e.g. for [`HostStaged::queued`](crate::HostStaged::queued)).
    pub fn queue_arc(&self) -> Arc<CommQueue> {
        self.comm.clone()
    }

    /// The communicator, shared (e.g. to build device collectives over it).
    pub fn comm_arc(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }

    /// A snapshot of the op counters.
    pub fn counters(&self) -> OpCounters {
        self.accounting.counters.lock().unwrap().clone()
    }

    /// Reset the op counters (and the communicator's statistics).
    pub fn reset_counters(&self) {
        *self.accounting.counters.lock().unwrap() = OpCounters::default();
        self.comm.reset_stats();
    }

    pub(crate) fn count_fallback(&self, op: &'static str) {
        tracing::trace!(op, "fallback redistribution");
        *self
            .accounting
            .counters
            .lock()
            .unwrap()
            .fallbacks
            .entry(op)
            .or_default() += 1;
    }

    /// Count one read of a tensor to the host ([`OpCounters::host_reads`]). The decorator counts
    /// its own `into_data`; code that reads a local piece on the inner backend directly (the
    /// engine's gradient checks) calls this, so the count covers every read of a step.
    pub fn count_host_read(&self) {
        self.accounting.counters.lock().unwrap().host_reads += 1;
    }

    /// Count one upload of an offloaded piece ([`OpCounters::host_uploads`]).
    pub(crate) fn count_host_upload(&self) {
        self.accounting.counters.lock().unwrap().host_uploads += 1;
    }

    /// Count `n` units of the work `name` ([`OpCounters::work`]).
    pub fn count_work(&self, name: &'static str, n: u64) {
        *self
            .accounting
            .counters
            .lock()
            .unwrap()
            .work
            .entry(name)
            .or_default() += n;
    }

    /// Count one offloaded shard gathered from host memory ([`OpCounters::host_gathers`]).
    pub(crate) fn count_host_gather(&self) {
        self.accounting.counters.lock().unwrap().host_gathers += 1;
    }

    /// Count one upload on the communication thread ([`OpCounters::comm_uploads`]).
    pub(crate) fn count_comm_upload(&self) {
        self.accounting.counters.lock().unwrap().comm_uploads += 1;
    }

    /// Count one cast on the inner backend, asked for by `op` ([`OpCounters::casts`]).
    pub(crate) fn count_cast(&self, op: &'static str) {
        *self
            .accounting
            .counters
            .lock()
            .unwrap()
            .casts
            .entry(op)
            .or_default() += 1;
    }

    pub(crate) fn count_redistribution(&self, op: &'static str) {
        *self
            .accounting
            .counters
            .lock()
            .unwrap()
            .redistributions
            .entry(op)
            .or_default() += 1;
    }

    /// Whether some data axis has more than one member (gradients must be reduced).
    pub fn is_data_parallel(&self) -> bool {
        self.mesh()
            .axes()
            .iter()
            .any(|a| a.kind == AxisKind::Data && a.size > 1)
    }

    /// Seed this rank's random stream.
    pub(crate) fn seed(&self, seed: u64) {
        use rand::SeedableRng;
        *self.rng.lock().unwrap() = Some(rand::rngs::StdRng::seed_from_u64(seed));
    }

    /// Run `build`, which builds a model whose every parameter is then loaded (a checkpoint
    /// resumed, each element checked as covered): the models' initialisers in their layouts
    /// (`wildfire_models`' `init_gpt`, `init_llama` and their stages) leave the pieces zero
    /// instead of drawing values a load would throw away — at GPT-2 124M, the larger part of a
    /// restart's reload. Nothing else changes: the same layouts, ids and shapes.
    pub fn build_for_load<R>(&self, build: impl FnOnce() -> R) -> R {
        struct Reset<'a>(&'a AtomicBool);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        self.building_for_load.store(true, Ordering::Relaxed);
        let _reset = Reset(&self.building_for_load);
        build()
    }

    /// Whether the parameters built now are about to be loaded ([`RankContext::build_for_load`]).
    pub fn is_building_for_load(&self) -> bool {
        self.building_for_load.load(Ordering::Relaxed)
    }

    /// Make the next creation op of `scope.shape` this rank's piece (`None`: stop).
    pub(crate) fn set_init_scope(&self, scope: Option<InitScope>) {
        *self.init_scope.lock().unwrap() = scope;
    }

    /// The initialisation scope for a tensor of `shape`, taken: it applies once.
    pub(crate) fn take_init_scope(&self, shape: &[usize]) -> Option<InitScope> {
        let mut scope = self.init_scope.lock().unwrap();
        if scope.as_ref().is_some_and(|s| s.shape == shape) {
            scope.take()
        } else {
            None
        }
    }

    /// Run `f` on the rank's prefetch state of type `T` (a state of another type is dropped).
    pub(crate) fn with_prefetch<T: Any + Send, R>(&self, f: impl FnOnce(&mut Option<T>) -> R) -> R {
        with_slot(&self.prefetch, f)
    }

    /// Run `f` on the rank's open gradient bucket of type `T`.
    pub(crate) fn with_buckets<T: Any + Send, R>(&self, f: impl FnOnce(&mut Option<T>) -> R) -> R {
        with_slot(&self.buckets, f)
    }

    pub(crate) fn count_prefetch(&self, f: impl FnOnce(&mut PrefetchStats)) {
        f(&mut self
            .prefetch_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner()));
    }

    /// Keep `reduction` outstanding, waiting for the oldest ones beyond the policy's
    /// `reduce_in_flight`.
    pub(crate) fn await_later(&self, reduction: Arc<dyn Resolve>) -> Result<(), crate::Error> {
        let limit = self.with_policy(|p| p.reduce_in_flight).max(1);
        let due: Vec<Arc<dyn Resolve>> = {
            let mut outstanding = self.outstanding.lock().unwrap_or_else(|e| e.into_inner());
            outstanding.push_back(reduction);
            let over = outstanding.len().saturating_sub(limit);
            outstanding.drain(..over).collect()
        };
        due.iter().try_for_each(|r| r.resolve())
    }

    /// Zero-bubble split backward (the `I` of ZB-H1): from now until
    /// [`end_deferring_weight_gradients`](Self::end_deferring_weight_gradients), a linear layer's
    /// weight gradient is not computed in backward while gradients are kept unreduced
    /// ([`set_no_sync`](Self::set_no_sync)): it is a stand-in whose matmul (with its saved
    /// input and output gradient) runs at its first use or when the batch is run (the `W`).
    pub fn begin_deferring_weight_gradients(&self) {
        *self.deferred.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// Stop deferring; the weight gradients deferred since the begin, to run later.
    pub fn end_deferring_weight_gradients(&self) -> DeferredWeights {
        DeferredWeights(
            self.deferred
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_default(),
        )
    }

    /// Whether weight gradients are being deferred now (only while gradients stay unreduced).
    pub(crate) fn defers_weight_gradients(&self) -> bool {
        self.no_sync()
            && self
                .deferred
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    /// List a deferred weight gradient.
    pub(crate) fn defer(&self, deferred: Arc<dyn Resolve>) {
        if let Some(list) = self
            .deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            list.push(deferred);
        }
    }

    /// Wait for every outstanding asynchronous reduction (`sync_gradients` does, before the
    /// optimizer step).
    pub(crate) fn resolve_outstanding(&self) -> Result<(), crate::Error> {
        let due: Vec<Arc<dyn Resolve>> = self
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        due.iter().try_for_each(|r| r.resolve())
    }

    /// What FSDP prefetch did on this rank so far.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        *self
            .prefetch_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Draw from this rank's stream, if seeded.
    pub(crate) fn with_rng<R>(&self, f: impl FnOnce(&mut rand::rngs::StdRng) -> R) -> Option<R> {
        self.rng.lock().unwrap().as_mut().map(f)
    }

    pub(crate) fn mark_gradients_pending(&self) {
        if self.is_data_parallel() {
            self.protocol.pending_sync.store(true, Ordering::Relaxed);
        }
    }

    pub(crate) fn gradients_pending(&self) -> bool {
        self.protocol.pending_sync.load(Ordering::Relaxed) && !self.no_sync()
    }

    pub(crate) fn clear_gradients_pending(&self) {
        self.protocol.pending_sync.store(false, Ordering::Relaxed);
    }

    /// Whether gradient reduction is deferred (see [`Self::set_no_sync`]).
    pub fn no_sync(&self) -> bool {
        self.protocol.no_sync.load(Ordering::Relaxed)
    }

    /// Gradient accumulation (PyTorch's `no_sync`): while set, gradients are not reduced where
    /// they are born — they stay per-rank summands (`Partial(Avg)`) and add up over micro-batches
    /// with no communication — and a forward pass may follow an unsynchronised backward.
    /// `sync_gradients` after the last micro-batch reduces the sums once.
    pub fn set_no_sync(&self, no_sync: bool) {
        self.protocol.no_sync.store(no_sync, Ordering::Relaxed);
    }

    pub(crate) fn add_live_bytes(&self, bytes: i64) {
        let memory = &self.accounting;
        let now = memory.live_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if bytes <= 0 {
            // A release makes no peak: every count it came down from was a peak candidate
            // when it was reached, and was offered as one by the thread that added it.
            return;
        }
        self.offer_peak(now);
    }

    /// `bytes` more than are live, held for a moment: an op's output made while its operand,
    /// whose count the output takes over, still exists. A peak candidate, as
    /// `add_live_bytes(bytes)` then `add_live_bytes(-bytes)` would offer, without changing the
    /// count.
    #[inline]
    pub(crate) fn offer_transient_bytes(&self, bytes: i64) {
        let now = self.accounting.live_bytes.load(Ordering::Relaxed) + bytes;
        self.offer_peak(now);
    }

    /// `now` live bytes as a candidate for the peaks, checked against the budget.
    #[inline]
    fn offer_peak(&self, now: i64) {
        let memory = &self.accounting;
        // Peaks only rise, so one that is already higher needs no read-modify-write (a
        // `fetch_max` is a locked compare-and-swap even when it changes nothing).
        if memory.peak_bytes.load(Ordering::Relaxed) < now {
            memory.peak_bytes.fetch_max(now, Ordering::Relaxed);
        }
        if memory.phase_peak_bytes.load(Ordering::Relaxed) < now {
            memory.phase_peak_bytes.fetch_max(now, Ordering::Relaxed);
        }
        if memory.budget_crossed.load(Ordering::Relaxed) {
            return;
        }
        let budget = memory.budget.load(Ordering::Relaxed);
        if budget > 0 && now as u64 > budget {
            // Stop enforcing while this rank fails (its tensors are dropped as it unwinds).
            memory.budget_crossed.store(true, Ordering::Relaxed);
            crate::error::raise(crate::Error::MemoryBudget {
                rank: self.rank(),
                bytes: now as u64,
                budget,
            });
        }
    }

    /// Bytes held by the local pieces of this rank's live distributed tensors. Clones share their
    /// piece and count once; a view made by an op (a reshape, a slice) counts as its own piece,
    /// so this is an upper bound where the backend shares buffers between them.
    pub fn live_bytes(&self) -> u64 {
        self.accounting.live_bytes.load(Ordering::Relaxed).max(0) as u64
    }

    /// Bytes this rank holds in host memory for its training state ([`HostBytes`]: an offloaded
    /// optimizer's moments), beside the device's [`Self::live_bytes`].
    pub fn host_bytes(&self) -> u64 {
        self.accounting.host_bytes.load(Ordering::Relaxed).max(0) as u64
    }

    /// The highest [`Self::host_bytes`] since the rank started.
    pub fn peak_host_bytes(&self) -> u64 {
        self.accounting
            .peak_host_bytes
            .load(Ordering::Relaxed)
            .max(0) as u64
    }

    /// The highest [`Self::live_bytes`] since the last [`Self::reset_peak_bytes`].
    pub fn peak_bytes(&self) -> u64 {
        self.accounting.peak_bytes.load(Ordering::Relaxed).max(0) as u64
    }

    /// Start a new peak measurement from the current live bytes.
    pub fn reset_peak_bytes(&self) {
        let memory = &self.accounting;
        let live = memory.live_bytes.load(Ordering::Relaxed);
        memory.peak_bytes.store(live, Ordering::Relaxed);
        let gathered = memory.gathered_bytes.load(Ordering::Relaxed);
        memory
            .peak_gathered_bytes
            .store(gathered, Ordering::Relaxed);
    }

    /// Start a phase of the step (its forward, backward, …): [`Self::phase_peak_bytes`] measures
    /// from the current live bytes. Independent of [`Self::reset_peak_bytes`], whose step peak
    /// spans the phases.
    pub fn start_phase(&self) {
        let memory = &self.accounting;
        let live = memory.live_bytes.load(Ordering::Relaxed);
        memory.phase_peak_bytes.store(live, Ordering::Relaxed);
    }

    /// The highest [`Self::live_bytes`] since the last [`Self::start_phase`].
    pub fn phase_peak_bytes(&self) -> u64 {
        self.accounting
            .phase_peak_bytes
            .load(Ordering::Relaxed)
            .max(0) as u64
    }

    pub(crate) fn add_gathered_bytes(&self, bytes: i64) {
        let memory = &self.accounting;
        let now = memory.gathered_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        memory.peak_gathered_bytes.fetch_max(now, Ordering::Relaxed);
    }

    /// Of [`Self::live_bytes`], the copies gathered over data axes (FSDP's parameters gathered
    /// for use, freed after it).
    pub fn gathered_bytes(&self) -> u64 {
        self.accounting
            .gathered_bytes
            .load(Ordering::Relaxed)
            .max(0) as u64
    }

    /// The highest [`Self::gathered_bytes`] since the last [`Self::reset_peak_bytes`].
    pub fn peak_gathered_bytes(&self) -> u64 {
        self.accounting
            .peak_gathered_bytes
            .load(Ordering::Relaxed)
            .max(0) as u64
    }

    /// This rank's memory by kind, from the accounting: `params` and `grads` as measured on the
    /// model and its gradients (see `fsdp::parameter_bytes` / `gradient_bytes`), the gathered
    /// parameter copies, and the rest (optimizer state, activations kept for backward,
    /// temporaries).
    pub fn memory_report(&self, params: u64, grads: u64) -> MemoryReport {
        let live = self.live_bytes();
        let gathered = self.gathered_bytes();
        MemoryReport {
            live,
            peak: self.peak_bytes(),
            params,
            grads,
            gathered,
            peak_gathered: self.peak_gathered_bytes(),
            other: live.saturating_sub(params + grads + gathered),
        }
    }

    /// The run's policy.
    pub fn policy(&self) -> RankPolicy {
        self.with_policy(RankPolicy::clone)
    }

    /// Set the run's policy, in one call, once per run: before the parallelism transforms
    /// (`tensor_parallel` fills in the sequence parallelism, `fully_shard` the sharding), or with
    /// their parts kept (`RankPolicy { compute_dtype, ..ctx.policy() }`); to change fields of
    /// it later, [`Self::update_policy`].
    pub fn set_policy(&self, policy: RankPolicy) {
        self.update_policy(|p| *p = policy);
    }

    /// Change fields of the run's policy (what the parallelism transforms do).
    pub fn update_policy(&self, f: impl FnOnce(&mut RankPolicy)) {
        let mut policy = self.policy.write().unwrap();
        f(&mut policy);
        // A new budget is enforced afresh.
        let memory = &self.accounting;
        (memory.budget).store(policy.memory_budget.unwrap_or(0), Ordering::Relaxed);
        memory.budget_crossed.store(false, Ordering::Relaxed);
    }

    /// Read the policy in place (the backend reads it in every op: no clone).
    pub(crate) fn with_policy<R>(&self, f: impl FnOnce(&RankPolicy) -> R) -> R {
        f(&self.policy.read().unwrap())
    }

    /// `layout` with every data axis `Replicate`, save a stacked expert weight's split over the
    /// expert axis (a parameter of global `shape` among the policy's
    /// [`expert_shapes`](crate::RankPolicy::expert_shapes)): where the data-parallel rules start
    /// from.
    pub(crate) fn data_unsplit(
        &self,
        shape: &[usize],
        layout: &crate::placement::Layout,
    ) -> crate::placement::Layout {
        use crate::placement::Placement;
        let mesh = self.mesh();
        let expert = self
            .with_policy(|p| p.expert_shapes.contains(shape))
            .then(|| mesh.expert_axis().map(|(a, _)| a))
            .flatten();
        let mut out = layout.clone();
        for (a, axis) in mesh.axes().iter().enumerate() {
            if axis.kind == AxisKind::Data && Some(a) != expert {
                out.set(a, Placement::Replicate);
            }
        }
        out
    }

    /// Where a data-parallel gradient of global shape `shape` (model-axis placements `base`)
    /// goes on each data axis (`Shard(0)` on the sharding policy's gradient shard axes when the
    /// first dimension divides, else `Replicate`); model axes are left `Replicate`.
    pub(crate) fn grad_layout(
        &self,
        shape: &[usize],
        base: &crate::placement::Layout,
    ) -> crate::placement::Layout {
        use crate::placement::Placement;
        let (axes, transposed) = self.with_policy(|p| {
            let s = &p.sharding;
            let transposed = shape.len() == 2
                && !s.param_shapes.contains(shape)
                && s.param_shapes.contains(&vec![shape[1], shape[0]]);
            (s.grad_shard_axes.clone(), transposed)
        });
        let mesh = self.mesh();
        let start = self.data_unsplit(shape, base);
        // The gradient of a parameter used transposed (a tied embedding as the head's weight),
        // with nothing split on model axes: split as the parameter is (its dim 0, here dim 1),
        // so adding it to the parameter's other gradient moves nothing.
        if transposed && !start.is_distributed() {
            let param =
                crate::placement::shard_dim0(start.clone(), &[shape[1], shape[0]], &axes, mesh);
            let parts: usize = (0..param.len())
                .filter(|&a| param.get(a) == Placement::Shard(0))
                .map(|a| mesh.axis_size(a))
                .product();
            if parts > 1 && shape[1].is_multiple_of(parts) {
                let mut out = start;
                for a in 0..param.len() {
                    if param.get(a) == Placement::Shard(0) {
                        out.set(a, Placement::Shard(1));
                    }
                }
                return out;
            }
        }
        crate::placement::shard_dim0(start, shape, &axes, mesh)
    }
}
