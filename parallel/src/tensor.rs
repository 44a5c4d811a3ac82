//! `DTensor`: the decorator's float primitive — a local piece plus a layout over the mesh.

use crate::collectives::ReduceStep;
use crate::comm::{Group, ReduceOp};
use crate::device::DistDevice;
use crate::error::Error;
use crate::mesh::DeviceMesh;
use crate::placement::{Layout, Placement};
use burn_backend::{Backend, DType, FloatDType, Shape, Slice, TensorMetadata};
use smallvec::SmallVec;
use std::sync::{Arc, Mutex};

pub(crate) mod buckets;
pub(crate) mod prefetch;

/// A distributed tensor: this rank's local piece, its [`Layout`] over the mesh, and the global
/// (logical) shape, which is what Burn, autodiff and the optimizers see.
///
/// Shards are equal. A dimension split only over data axes (FSDP's parameter, gradient and
/// optimizer-state shards) that does not divide by the shard count `P` is padded with zeros to
/// `⌈size/P⌉·P` while split: every rank holds `⌈size/P⌉` rows, the last ones padding, and
/// gathering trims it again — so any shape shards. A dimension split over a model axis must
/// divide, otherwise creating or redistributing to that layout fails with
/// [`Error::Indivisible`] naming the shape and the sizes.
pub struct DTensor<B: Backend> {
    pub(crate) local: B::FloatTensorPrimitive,
    pub(crate) layout: Layout,
    pub(crate) shape: Shape,
    pub(crate) device: DistDevice<B>,
    /// Reductions already done for this partial value, shared by its clones: a partial sum used
    /// by two ops is reduced once (every rank runs the same program, so all hit the cache alike).
    memo: Memo<B>,
    /// Counts the local piece in the rank's live-bytes accounting while this value exists.
    track: Tracker,
    /// A value still being reduced on the rank's communication queue (an asynchronous gradient
    /// reduction): `local` is a stand-in until [`DTensor::ready`] waits for it.
    awaited: Option<Arc<Awaited<B>>>,
}

/// The local piece of a value still being reduced on the rank's communication queue: the first
/// use waits for it ([`DTensor::ready`]); clones share it.
pub(crate) struct Awaited<B: Backend> {
    state: Mutex<Option<AwaitState<B>>>,
    /// A DDP gradient's place in its step's births, told to the step's watch at each use (see
    /// [`buckets`]).
    watch: Option<(usize, Arc<buckets::Watch>)>,
}

enum AwaitState<B: Backend> {
    Pending(crate::collectives::PendingTensor<B>),
    /// Elements `offset..offset + shape.product()` of a DDP bucket's all-reduce, in `shape`,
    /// cast to `dtype` (the bucket's may be the gradient-reduction dtype).
    InBucket {
        bucket: Arc<buckets::Bucket<B>>,
        offset: usize,
        shape: Vec<usize>,
        dtype: burn_backend::FloatDType,
    },
    Done(B::FloatTensorPrimitive),
    Failed(Error),
    /// A computation deferred to the first use or to [`crate::RankContext::run_deferred`]: a
    /// weight gradient whose matmul a zero-bubble schedule runs in its `W` action.
    Deferred(Box<dyn FnOnce() -> B::FloatTensorPrimitive + Send>),
}

impl<B: Backend> Awaited<B> {
    fn with_state(state: AwaitState<B>) -> Self {
        Self {
            state: Mutex::new(Some(state)),
            watch: None,
        }
    }

    fn new(pending: crate::collectives::PendingTensor<B>) -> Self {
        Self::with_state(AwaitState::Pending(pending))
    }

    fn in_bucket(
        bucket: Arc<buckets::Bucket<B>>,
        offset: usize,
        shape: Vec<usize>,
        dtype: burn_backend::FloatDType,
    ) -> Self {
        Self::with_state(AwaitState::InBucket {
            bucket,
            offset,
            shape,
            dtype,
        })
    }

    /// A piece that `compute` gives, computed at the first use (or when resolved).
    pub(crate) fn deferred(compute: Box<dyn FnOnce() -> B::FloatTensorPrimitive + Send>) -> Self {
        Self::with_state(AwaitState::Deferred(compute))
    }

    /// A piece already in hand, only watched.
    fn done(local: B::FloatTensorPrimitive) -> Self {
        Self::with_state(AwaitState::Done(local))
    }

    /// Tell `watch` of every use, as birth `birth`.
    fn watched(mut self, birth: usize, watch: Arc<buckets::Watch>) -> Self {
        self.watch = Some((birth, watch));
        self
    }

    /// The local piece, waited for once (an error is the collective's, every time).
    fn local(&self) -> Result<B::FloatTensorPrimitive, Error> {
        if let Some((birth, watch)) = &self.watch {
            watch.saw(*birth);
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(&*state, Some(AwaitState::Done(_) | AwaitState::Failed(_))) {
            let result = match state.take() {
                Some(AwaitState::Pending(pending)) => pending.wait(),
                Some(AwaitState::InBucket {
                    bucket,
                    offset,
                    shape,
                    dtype,
                }) => bucket.result().map(|all| {
                    let n: usize = shape.iter().product();
                    let mine = B::float_reshape(
                        slice_dim::<B>(all, 0, offset..offset + n),
                        Shape::from(shape),
                    );
                    if mine.dtype() == DType::from(dtype) {
                        mine
                    } else {
                        B::float_cast(mine, dtype)
                    }
                }),
                Some(AwaitState::Deferred(compute)) => Ok(compute()),
                _ => unreachable!("not resolved"),
            };
            *state = Some(match result {
                Ok(local) => AwaitState::Done(local),
                Err(e) => AwaitState::Failed(e),
            });
        }
        match state.as_ref() {
            Some(AwaitState::Done(local)) => Ok(local.clone()),
            Some(AwaitState::Failed(e)) => Err(e.clone()),
            _ => unreachable!("resolved above"),
        }
    }
}

impl<B: Backend> crate::device::Resolve for Awaited<B> {
    fn resolve(&self) -> Result<(), Error> {
        self.local().map(drop)
    }
}

/// A parameter's gather issued ahead of its use ([`DTensor::issue_gather`]).
pub(crate) struct PendingGather<B: Backend> {
    local: crate::collectives::PendingTensor<B>,
    /// The gathered bytes, counted while the call is in flight.
    _in_flight: Tracker,
    axis: usize,
    dim: usize,
}

/// Adds a local piece's bytes to its rank's live count on creation, removes them when the last
/// clone is dropped: clones share the local buffer (Burn's primitives are reference-counted), so
/// a value saved by several autodiff nodes is counted once.
#[derive(Clone)]
pub(crate) struct Tracker {
    _shared: Arc<TrackerInner>,
}

struct TrackerInner {
    bytes: i64,
    /// A parameter gathered over data axes for use (FSDP): also counted as "gathered".
    gathered: bool,
    ctx: Arc<crate::device::RankContext>,
    /// The piece cast to another dtype by the precision policy ([`DTensor::local_in`]), shared
    /// by the value's clones and dropped with them.
    cast: Mutex<Option<CastCopy>>,
}

/// A piece's copy in another dtype (type-erased: the tracker is not generic over the backend),
/// counted in the rank's live bytes while it is kept.
struct CastCopy {
    dtype: burn_backend::FloatDType,
    local: Box<dyn std::any::Any + Send + Sync>,
    _track: Tracker,
}

impl Tracker {
    fn new(bytes: usize, ctx: &Arc<crate::device::RankContext>) -> Self {
        Self::with_kind(bytes, false, ctx)
    }

    fn with_kind(bytes: usize, gathered: bool, ctx: &Arc<crate::device::RankContext>) -> Self {
        let bytes = bytes as i64;
        if gathered {
            ctx.add_gathered_bytes(bytes);
        }
        ctx.add_live_bytes(bytes);
        Self {
            _shared: Arc::new(TrackerInner {
                bytes,
                gathered,
                ctx: ctx.clone(),
                cast: Mutex::new(None),
            }),
        }
    }
}

impl Drop for TrackerInner {
    fn drop(&mut self) {
        if self.gathered {
            self.ctx.add_gathered_bytes(-self.bytes);
        }
        self.ctx.add_live_bytes(-self.bytes);
    }
}

fn local_bytes<P: TensorMetadata>(local: &P) -> usize {
    local.shape().num_elements() * local.dtype().size()
}

type Memo<B> = Option<MemoCell<B>>;
/// Per target layout: the local piece and its byte tracker (a cached piece stays counted in the
/// rank's live bytes while the cache, i.e. the source value, holds it).
type MemoCell<B> = Arc<
    Mutex<
        Vec<(
            Layout,
            <B as burn_backend::BackendTypes>::FloatTensorPrimitive,
            Tracker,
        )>,
    >,
>;

impl<B: Backend> Clone for DTensor<B> {
    fn clone(&self) -> Self {
        Self {
            local: self.local.clone(),
            layout: self.layout.clone(),
            shape: self.shape.clone(),
            device: self.device.clone(),
            memo: self.memo.clone(),
            track: self.track.clone(),
            awaited: self.awaited.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for DTensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DTensor")
            .field("shape", &self.shape.to_vec())
            .field("layout", &self.layout)
            .field("local", &self.local.shape().to_vec())
            .field("rank", &self.device.rank())
            .finish()
    }
}

impl<B: Backend> TensorMetadata for DTensor<B> {
    fn dtype(&self) -> DType {
        self.local.dtype()
    }

    fn shape(&self) -> Shape {
        self.shape.clone()
    }
}

impl<B: Backend> DTensor<B> {
    /// Wrap this rank's `local` piece of a tensor laid out as `layout`.
    pub fn from_local(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        device: &DistDevice<B>,
    ) -> Result<Self, Error> {
        let mesh = device.mesh();
        let rank = local.shape().num_dims();
        check_layout(&layout, rank, None, mesh)?;
        let global = layout.global_shape(&local.shape(), mesh);
        check_layout(&layout, rank, Some(&global), mesh)?;
        Ok(Self::new_unchecked(local, layout, device.clone()))
    }

    /// Distribute a full tensor that every rank holds identically (no communication: each rank
    /// keeps its chunks; `Partial(Sum)` keeps the value on group member 0 and zeros elsewhere).
    pub fn from_full(
        full: B::FloatTensorPrimitive,
        layout: &Layout,
        device: &DistDevice<B>,
    ) -> Result<Self, Error> {
        let start = Self::from_local(full, Layout::replicated(device.mesh()), device)?;
        start.redistribute(layout)
    }

    /// Wrap this rank's `local` piece of a tensor of global shape `global` laid out as `layout`,
    /// where dimensions split only over data axes may be padded (see the type's docs): the
    /// local piece must have the padded chunk's shape.
    pub fn from_local_padded(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        global: &[usize],
        device: &DistDevice<B>,
    ) -> Result<Self, Error> {
        let mesh = device.mesh();
        check_layout(&layout, global.len(), Some(global), mesh)?;
        let expected: Vec<usize> = (0..global.len())
            .map(|d| {
                let parts = layout.shards_of(d, mesh);
                global[d].div_ceil(parts)
            })
            .collect();
        if local.shape().to_vec() != expected {
            return Err(Error::InvalidLayout {
                shape: global.to_vec(),
                mesh: mesh.to_string(),
                reason: format!(
                    "a local piece of shape {:?} is not this layout's chunk {expected:?} ({layout})",
                    local.shape().to_vec()
                ),
            });
        }
        Ok(Self::new_shaped(
            local,
            layout,
            Shape::from(global.to_vec()),
            device.clone(),
        ))
    }

    pub(crate) fn new_unchecked(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        device: DistDevice<B>,
    ) -> Self {
        let shape = Shape::from(layout.global_shape(&local.shape().to_vec(), device.mesh()));
        Self::new_shaped(local, layout, shape, device)
    }

    /// Like `new_unchecked`, with the global shape given (a padded piece's cannot be inferred).
    pub(crate) fn new_shaped(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
    ) -> Self {
        // Partial values are memoised: reducing them twice would double the traffic. A gathered
        // shard must not outlive its use (FSDP frees it and gathers again) — except, when asked
        // (`RankPolicy::keep_sequence_gathers`), a sequence-parallel activation's gather,
        // kept for the backward of the column-parallel layers that use it.
        let memo = memo_for(&layout, &shape, &device);
        let track = Tracker::new(local_bytes(&local), device.context());
        Self {
            local,
            layout,
            shape,
            device,
            memo,
            track,
            awaited: None,
        }
    }

    /// A value taken from a memo: shares the cached piece's tracker (counted once).
    fn cached(
        local: B::FloatTensorPrimitive,
        track: Tracker,
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
    ) -> Self {
        let memo = memo_for(&layout, &shape, &device);
        Self {
            local,
            layout,
            shape,
            device,
            memo,
            track,
            awaited: None,
        }
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The local piece on this rank.
    pub fn local(&self) -> &B::FloatTensorPrimitive {
        &self.local
    }

    /// A value with this one's layout, global shape and device, and `local` as this rank's
    /// piece (the result of a kernel run on the local piece, e.g. an optimizer update).
    pub fn with_local(&self, local: B::FloatTensorPrimitive) -> Self {
        Self::new_shaped(
            local,
            self.layout.clone(),
            self.shape.clone(),
            self.device.clone(),
        )
    }

    /// Take the local piece.
    pub fn into_local(self) -> B::FloatTensorPrimitive {
        self.ready().local
    }

    /// Whether the local piece carries padding rows (a dimension split over data axes that does
    /// not divide).
    pub fn is_padded(&self) -> bool {
        !self.padded_dims().is_empty()
    }

    /// The dimensions whose local piece carries padding (none without a `Shard`: the common case
    /// returns before looking at shapes).
    fn padded_dims(&self) -> SmallVec<[usize; 4]> {
        let sharded = |p: &Placement| matches!(p, Placement::Shard(_));
        if !self.layout.placements().iter().any(sharded) {
            return SmallVec::new();
        }
        let mesh = self.device.mesh();
        let local = self.local.shape();
        (0..local.num_dims())
            .filter(|&d| local[d] * self.layout.shards_of(d, mesh) != self.shape[d])
            .collect()
    }

    /// The same value with every padded split gathered (a no-op without padding): for ops that
    /// need exact local shapes.
    pub(crate) fn unpadded(self) -> Self {
        let this = self.ready();
        let padded = this.padded_dims();
        if padded.is_empty() {
            return this;
        }
        this.unpadded_now(padded)
    }

    fn unpadded_now(self, padded: SmallVec<[usize; 4]>) -> Self {
        let mut target = self.layout.clone();
        for d in padded {
            for a in 0..target.len() {
                if target.get(a) == Placement::Shard(d) {
                    target.set(a, Placement::Replicate);
                }
            }
        }
        self.redistribute(&target)
            .unwrap_or_else(|e| crate::error::raise(e))
    }

    /// A gradient reduction: [`redistribute`](Self::redistribute) with the collectives in the
    /// rank's gradient-reduction dtype when one is set and differs and there is something to
    /// reduce (cast before, back after).
    pub(crate) fn reduce_gradient(self, target: &Layout) -> Result<Self, Error> {
        let this = self.ready();
        this.reduce_gradient_now(target)
    }

    fn reduce_gradient_now(self, target: &Layout) -> Result<Self, Error> {
        let own = self.local.dtype();
        let Some(dtype) = self.device.ctx.with_policy(|p| p.grad_reduce_dtype) else {
            return self.redistribute(target);
        };
        if DType::from(dtype) == own || !self.layout.has_partial() || &self.layout == target {
            return self.redistribute(target);
        }
        let cast = B::float_cast(self.local, dtype);
        let low = Self::new_shaped(cast, self.layout, self.shape, self.device);
        let out = low.redistribute(target)?;
        let back = B::float_cast(out.local, own.into());
        Ok(Self::new_shaped(back, out.layout, out.shape, out.device))
    }

    /// Whether `other` is a clone of this value (they share the local piece).
    pub(crate) fn same_value(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.track._shared, &other.track._shared)
    }

    /// The global shape.
    pub fn global_shape(&self) -> &Shape {
        &self.shape
    }

    /// The device (inner device + rank context).
    pub fn device(&self) -> &DistDevice<B> {
        &self.device
    }

    /// The full value on every rank: `Shard` axes are gathered and `Partial` axes reduced;
    /// `Local` axes stay per-rank.
    pub fn full(self) -> Result<B::FloatTensorPrimitive, Error> {
        let target = self.layout.unsharded();
        Ok(self.redistribute(&target)?.local)
    }

    /// If this partial value has already been reduced (another use asked for it), that reduced
    /// value: as good as a replicated operand, for free. Otherwise `self`.
    pub(crate) fn settled(self) -> Self {
        self.ready().settled_now()
    }

    /// The local piece in `dtype`, for the precision policy of rule `op`: the piece itself when it
    /// has that dtype, else its cast — made once per value, then kept with it (its clones share
    /// the copy, as `torch.autocast` caches the casts of its weights: an f32 master weight is cast
    /// once per step however many micro-batches, recomputations and backward passes use it) and
    /// counted in [`OpCounters::casts`](crate::OpCounters) under `op` and in the live bytes.
    pub(crate) fn local_in(&self, op: &'static str, dtype: FloatDType) -> B::FloatTensorPrimitive {
        debug_assert!(
            self.awaited.is_none(),
            "{op}: cast of a value still in flight"
        );
        if FloatDType::from(self.local.dtype()) == dtype {
            return self.local.clone();
        }
        let mut slot = self.track._shared.cast.lock().unwrap();
        if let Some(copy) = slot.as_ref().filter(|c| c.dtype == dtype) {
            return copy
                .local
                .downcast_ref::<B::FloatTensorPrimitive>()
                .expect("a value's cast copy is of its backend")
                .clone();
        }
        let local = B::float_cast(self.local.clone(), dtype);
        self.device.ctx.count_cast(op);
        *slot = Some(CastCopy {
            dtype,
            local: Box::new(local.clone()),
            _track: Tracker::new(local_bytes(&local), self.device.context()),
        });
        local
    }

    fn settled_now(self) -> Self {
        let Some(memo) = &self.memo else { return self };
        let reduced = self.layout.reduced();
        let cached = memo
            .lock()
            .unwrap()
            .iter()
            .find(|(l, _, _)| l == &reduced)
            .map(|(_, t, track)| (t.clone(), track.clone()));
        match cached {
            Some((local, track)) => Self::cached(local, track, reduced, self.shape, self.device),
            None => self,
        }
    }

    /// This value with its local piece in hand: an asynchronous reduction still in flight (see
    /// [`RankPolicy::reduce_in_flight`](crate::RankPolicy)) is waited for. Every op does this
    /// to its inputs; call it before reading [`DTensor::local`] of a gradient that
    /// `sync_gradients` has not seen.
    pub fn ready(mut self) -> Self {
        if let Some(awaited) = self.awaited.take() {
            self.local = awaited.local().unwrap_or_else(|e| crate::error::raise(e));
        }
        self
    }

    /// The collectives that reduce this value to `target`, in the order
    /// [`redistribute`](Self::redistribute) runs them, when that is nothing but reductions: every
    /// axis that changes goes from `Partial` (not `Max`) to `Replicate` (an all-reduce) or to
    /// `Shard(d)` by a reduce-scatter straight into the shard (no other axis splitting `d`) — a
    /// gradient's reduction under DDP, FSDP and HSDP (reduce-scatter, then all-reduce across
    /// the replicas) — with nothing memoised. Axes of size 1 only change their placement.
    /// `None`: anything else, or nothing to reduce.
    pub(crate) fn reduction_steps(&self, target: &Layout) -> Option<Vec<ReduceStep>> {
        let mesh = self.device.mesh();
        let n = mesh.axes().len();
        if self
            .memo
            .as_ref()
            .is_some_and(|m| !m.lock().unwrap().is_empty())
        {
            return None;
        }
        let mut layout = self.layout.clone();
        let mut shape = self.local.shape().to_vec();
        let mut steps = Vec::new();
        for a in (0..n).rev() {
            let (from, to) = (layout.get(a), target.get(a));
            if from == to {
                continue;
            }
            let Placement::Partial(op) = from else {
                return None;
            };
            if op == ReduceOp::Max {
                return None;
            }
            let size = mesh.axis_size(a);
            match to {
                _ if size == 1 && matches!(to, Placement::Replicate) => {}
                Placement::Replicate => steps.push(ReduceStep {
                    axis: a,
                    op,
                    dim: None,
                }),
                Placement::Shard(d) if size > 1 => {
                    let others = (0..n).filter(|&b| b != a).any(|b| {
                        layout.get(b) == Placement::Shard(d) || target.get(b) == Placement::Shard(d)
                    });
                    // Padding is done before the first call only.
                    let padded = shape[d].div_ceil(size) * size;
                    if others || (!steps.is_empty() && padded != shape[d]) {
                        return None;
                    }
                    shape[d] = padded / size;
                    steps.push(ReduceStep {
                        axis: a,
                        op,
                        dim: Some(d),
                    });
                }
                _ => return None,
            }
            layout.set(a, to);
        }
        (!steps.is_empty() && &layout == target).then_some(steps)
    }

    /// [`Self::reduce_gradient`] issued on the rank's communication queue: the value returned
    /// stands for the reduced gradient (its layout, shape and bytes) and waits for it at its
    /// first use ([`Self::ready`]); the rank keeps at most
    /// [`RankPolicy::reduce_in_flight`](crate::RankPolicy) such reductions outstanding. The
    /// reduction's collectives (a reduce-scatter, an all-reduce, or both under HSDP) go as one
    /// chain, in the gradient-reduction dtype when one is set (cast before, back after), as the
    /// blocking path does; one that is more than reductions ([`Self::reduction_steps`]) runs
    /// now.
    pub(crate) fn reduce_gradient_async(self, target: &Layout) -> Result<Self, Error> {
        let this = self.ready();
        let Some(steps) = this.reduction_steps(target) else {
            return this.reduce_gradient_now(target);
        };
        let ctx = this.device.context().clone();
        let own = this.local.dtype();
        let mut local = this.local;
        if let Some(d) = steps[0].dim {
            let size = this.device.mesh().axis_size(steps[0].axis);
            local = pad::<B>(local, d, size, &this.device.inner);
        }
        let mut local_shape = local.shape().to_vec();
        for step in &steps {
            if let Some(d) = step.dim {
                local_shape[d] /= this.device.mesh().axis_size(step.axis);
            }
        }
        let layout = target.clone();
        let cast = ctx
            .with_policy(|p| p.grad_reduce_dtype)
            .filter(|&d| DType::from(d) != own);
        let pending = match cast {
            Some(low) => {
                let low = B::float_cast(local, low);
                let pending = crate::collectives::issue_reduction(&this.device, low, &steps);
                crate::collectives::PendingTensor::Cast(Box::new(pending), own.into())
            }
            None => crate::collectives::issue_reduction(&this.device, local, &steps),
        };
        let awaited = Arc::new(Awaited::new(pending));
        ctx.count_prefetch(|c| c.reductions += 1);
        ctx.await_later(awaited.clone())?;
        Ok(Self::awaiting(
            awaited,
            local_shape,
            own,
            layout,
            this.shape,
            this.device,
        ))
    }

    /// A value of `layout` whose local piece (`local_shape`, `dtype`) `awaited` will give: until
    /// then a stand-in of that shape that holds no memory (one NaN, broadcast: an op that read it
    /// without waiting would poison the step loudly, never silently), its bytes counted.
    pub(crate) fn awaiting(
        awaited: Arc<Awaited<B>>,
        local_shape: Vec<usize>,
        dtype: DType,
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
    ) -> Self {
        let float = burn_backend::FloatDType::from(dtype);
        let one = B::float_full(
            Shape::from(vec![1; local_shape.len()]),
            burn_backend::Scalar::Float(f64::NAN),
            &device.inner,
            float,
        );
        let bytes = local_shape.iter().product::<usize>() * dtype.size();
        let stand_in = B::float_expand(one, Shape::from(local_shape));
        let memo = memo_for(&layout, &shape, &device);
        let track = Tracker::new(bytes, device.context());
        Self {
            local: stand_in,
            layout,
            shape,
            device,
            memo,
            track,
            awaited: Some(awaited),
        }
    }

    /// The last split of a padded dim `d` gathered (`layout` splits it no more): the padding
    /// dropped.
    fn without_padding(
        local: B::FloatTensorPrimitive,
        shape: &Shape,
        layout: &Layout,
        d: usize,
        mesh: &DeviceMesh,
    ) -> B::FloatTensorPrimitive {
        let size = shape[d];
        if layout.shards_of(d, mesh) == 1 && local.shape()[d] != size {
            slice_dim::<B>(local, d, 0..size)
        } else {
            local
        }
    }

    /// A value's identity, shared by its clones (the same local piece).
    pub(crate) fn identity(&self) -> usize {
        Arc::as_ptr(&self.track._shared) as usize
    }

    /// Whether redistributing to `target` is one all-gather of a sharded parameter (FSDP's
    /// gather): exactly one data axis of size > 1 changes, from `Shard(d)` to `Replicate`, and no
    /// other axis splits `d`. Its axis and `d`.
    pub(crate) fn parameter_gather(&self, target: &Layout) -> Option<(usize, usize)> {
        let mesh = self.device.mesh();
        let changed: Vec<usize> = (0..mesh.axes().len())
            .filter(|&a| self.layout.get(a) != target.get(a))
            .collect();
        let [a] = changed[..] else { return None };
        let Placement::Shard(d) = self.layout.get(a) else {
            return None;
        };
        let alone =
            (0..mesh.axes().len()).all(|b| b == a || self.layout.get(b) != Placement::Shard(d));
        (target.get(a) == Placement::Replicate
            && mesh.axis(a).kind == crate::mesh::AxisKind::Data
            && mesh.axis_size(a) > 1
            && alone
            && self.memo.is_none())
        .then_some((a, d))
    }

    /// Issue the gather [`Self::parameter_gather`] found, on the rank's communication queue;
    /// its bytes count as gathered while it is in flight.
    pub(crate) fn issue_gather(&self, axis: usize, dim: usize) -> PendingGather<B> {
        let size = self.device.mesh().axis_size(axis);
        let bytes = local_bytes(&self.local) * size;
        PendingGather {
            local: crate::collectives::issue_all_gather(
                &self.device,
                Group::Axis(axis),
                self.local.clone(),
                dim,
            ),
            _in_flight: Tracker::with_kind(bytes, true, self.device.context()),
            axis,
            dim,
        }
    }

    /// The value [`Self::redistribute`] to `target` makes, from a gather issued earlier.
    pub(crate) fn finish_gather(
        &self,
        pending: PendingGather<B>,
        target: &Layout,
    ) -> Result<Self, Error> {
        let (axis, dim) = (pending.axis, pending.dim);
        debug_assert_eq!(self.parameter_gather(target), Some((axis, dim)));
        let local = pending.local.wait()?;
        let mut layout = self.layout.clone();
        layout.set(axis, Placement::Replicate);
        let local = Self::without_padding(local, &self.shape, &layout, dim, self.device.mesh());
        let track = Tracker::with_kind(local_bytes(&local), true, self.device.context());
        Ok(Self {
            local,
            layout,
            shape: self.shape.clone(),
            device: self.device.clone(),
            memo: None,
            track,
            awaited: None,
        })
    }

    /// Change the layout, with the collectives that takes (none when only slicing).
    ///
    /// Axes are first brought to `Replicate` from the last to the first (gather `Shard`, reduce
    /// `Partial`, or reduce-scatter straight into the target shard), then the target placements
    /// are applied from the first axis to the last (slice for `Shard`, keep the value on member 0
    /// for `Partial(Sum)`), so nested shards of one dimension keep their order.
    pub fn redistribute(self, target: &Layout) -> Result<Self, Error> {
        let this = self.ready();
        this.redistribute_now(target)
    }

    fn redistribute_now(self, target: &Layout) -> Result<Self, Error> {
        if &self.layout == target {
            return Ok(self);
        }
        let mesh = self.device.mesh().clone();
        let n = mesh.axes().len();
        check_layout(
            target,
            self.shape.num_dims(),
            Some(&self.shape.to_vec()),
            &mesh,
        )?;
        let cached = self.memo.as_ref().and_then(|memo| {
            let memo = memo.lock().unwrap();
            memo.iter()
                .find(|(l, _, _)| l == target)
                .map(|(_, t, track)| (t.clone(), track.clone()))
        });
        if let Some((local, track)) = cached {
            return Ok(Self::cached(
                local,
                track,
                target.clone(),
                self.shape,
                self.device,
            ));
        }
        if let Some(gathered) = prefetch::take(&self, target) {
            return gathered;
        }
        let memo = self.memo.clone();
        let communicates = self.layout.is_distributed();
        let rank = self.device.rank();
        let mut layout = self.layout.clone();
        let mut local = self.local;
        let mut gathered_data = false;

        // Which axes must come back to Replicate first.
        let mut undo = vec![false; n];
        for a in 0..n {
            if layout.get(a) != target.get(a) {
                undo[a] = true;
                let dims = [layout.get(a), target.get(a)];
                for p in dims {
                    if let Placement::Shard(d) = p {
                        for (b, u) in undo.iter_mut().enumerate().skip(a + 1) {
                            if layout.get(b) == Placement::Shard(d) {
                                *u = true;
                            }
                        }
                    }
                }
            }
        }
        for a in (0..n).rev() {
            if !undo[a] {
                continue;
            }
            let from = layout.get(a);
            let to = target.get(a);
            let invalid = |reason: &str| Error::InvalidRedistribution {
                axis: mesh.axis(a).name.clone(),
                from: format!("{from:?}"),
                to: format!("{to:?}"),
                reason: reason.into(),
            };
            if mesh.axis_size(a) == 1 && from != Placement::Local {
                // A group of one: its member's piece is the whole value, already reduced.
                layout.set(a, Placement::Replicate);
                continue;
            }
            match from {
                Placement::Replicate => {}
                Placement::Local => {
                    // On a group of one, per-rank data is the global value.
                    if to != Placement::Local && mesh.axis_size(a) > 1 {
                        return Err(invalid(
                            "per-rank data has no global value; create the tensor with the layout \
                             it needs (e.g. DTensor::from_full)",
                        ));
                    }
                }
                Placement::Shard(d) => {
                    gathered_data |= mesh.axis(a).kind == crate::mesh::AxisKind::Data;
                    local = crate::collectives::all_gather(&self.device, Group::Axis(a), local, d)?;
                    layout.set(a, Placement::Replicate);
                    local = Self::without_padding(local, &self.shape, &layout, d, &mesh);
                }
                Placement::Partial(op) => {
                    // Reduce-scatter straight into the shard only if no other axis splits the
                    // same dimension (nested shards must be split outer axis first).
                    let later_shards = |d: usize| {
                        (0..n).filter(|&b| b != a).any(|b| {
                            layout.get(b) == Placement::Shard(d)
                                || target.get(b) == Placement::Shard(d)
                        })
                    };
                    match to {
                        Placement::Shard(d) if op != ReduceOp::Max && !later_shards(d) => {
                            let size = mesh.axis_size(a);
                            local = pad::<B>(local, d, size, &self.device.inner);
                            local = crate::collectives::reduce_scatter(
                                &self.device,
                                Group::Axis(a),
                                local,
                                d,
                                op,
                            )?;
                            layout.set(a, to);
                        }
                        _ => {
                            local = crate::collectives::all_reduce(
                                &self.device,
                                Group::Axis(a),
                                local,
                                op,
                            )?;
                            layout.set(a, Placement::Replicate);
                        }
                    }
                }
            }
        }
        for a in 0..n {
            let to = target.get(a);
            if layout.get(a) == to {
                continue;
            }
            let index = mesh.group_index(rank, a);
            let size = mesh.axis_size(a);
            match to {
                Placement::Shard(d) => {
                    // The first split of a dim: pad it to a multiple of all its splits.
                    if local.shape()[d] == self.shape[d] {
                        let parts = target.shards_of(d, &mesh);
                        local = pad::<B>(local, d, parts, &self.device.inner);
                    }
                    let len = local.shape()[d] / size;
                    local = slice_dim::<B>(local, d, index * len..(index + 1) * len);
                }
                Placement::Partial(ReduceOp::Sum) if index != 0 => {
                    let dtype = local.dtype().into();
                    local = B::float_zeros(local.shape(), &self.device.inner, dtype);
                }
                Placement::Partial(_) | Placement::Local | Placement::Replicate => {}
            }
            layout.set(a, to);
        }
        let track = Tracker::with_kind(local_bytes(&local), gathered_data, self.device.context());
        if communicates && let Some(memo) = memo {
            memo.lock()
                .unwrap()
                .push((layout.clone(), local.clone(), track.clone()));
        }
        Ok(Self {
            local,
            layout,
            shape: self.shape,
            device: self.device,
            memo: None,
            track,
            awaited: None,
        })
    }
}

/// A memo for values whose redistributions are worth keeping: partial values, and (when asked)
/// sequence-sharded activations.
fn memo_for<B: Backend>(layout: &Layout, shape: &Shape, device: &DistDevice<B>) -> Memo<B> {
    (layout.has_partial() || keeps_sequence_gather(layout, shape, device))
        .then(MemoCell::<B>::default)
}

/// Whether this value is a sequence-parallel activation (`[b, t, d]` split over the sequence on
/// the sequence-parallel axis) whose gathers are kept (`RankPolicy::keep_sequence_gathers`).
fn keeps_sequence_gather<B: Backend>(
    layout: &Layout,
    shape: &Shape,
    device: &DistDevice<B>,
) -> bool {
    let (keep, axis) = device
        .context()
        .with_policy(|p| (p.keep_sequence_gathers, p.sequence_parallel));
    keep && shape.num_dims() == 3
        && axis.is_some_and(|axis| layout.get(axis) == Placement::Shard(1))
}

/// The entries `range` of `local` along `dim`, every other dim whole.
fn slice_dim<B: Backend>(
    local: B::FloatTensorPrimitive,
    dim: usize,
    range: std::ops::Range<usize>,
) -> B::FloatTensorPrimitive {
    let mut slices: Vec<Slice> = local
        .shape()
        .to_vec()
        .iter()
        .map(|&s| Slice::new(0, Some(s as isize), 1))
        .collect();
    slices[dim] = Slice::new(range.start as isize, Some(range.end as isize), 1);
    B::float_slice(local, &slices)
}

/// `local` with zero rows appended along `dim` up to a multiple of `parts`.
fn pad<B: Backend>(
    local: B::FloatTensorPrimitive,
    dim: usize,
    parts: usize,
    device: &B::Device,
) -> B::FloatTensorPrimitive {
    let mut shape = local.shape().to_vec();
    let size = shape[dim];
    let padded = size.div_ceil(parts) * parts;
    if padded == size {
        return local;
    }
    shape[dim] = padded - size;
    let dtype = local.dtype().into();
    let zeros = B::float_zeros(Shape::from(shape), device, dtype);
    B::float_cat(vec![local, zeros], dim)
}

/// Check that `layout` fits a tensor of rank `rank` on `mesh`, and, given its global shape
/// `dims`, that every sharded dimension divides evenly.
pub(crate) fn check_layout(
    layout: &Layout,
    rank: usize,
    dims: Option<&[usize]>,
    mesh: &crate::mesh::DeviceMesh,
) -> Result<(), Error> {
    let invalid = |reason: String| Error::InvalidLayout {
        shape: dims.map(<[usize]>::to_vec).unwrap_or_default(),
        mesh: mesh.to_string(),
        reason,
    };
    if layout.len() != mesh.axes().len() {
        return Err(invalid(format!(
            "{} placements for {} mesh axes",
            layout.len(),
            mesh.axes().len()
        )));
    }
    for (a, p) in layout.placements().iter().enumerate() {
        match p {
            Placement::Shard(d) if *d >= rank => {
                return Err(invalid(format!(
                    "axis '{}' shards dimension {d} of a rank-{rank} tensor",
                    mesh.axis(a).name
                )));
            }
            Placement::Local if mesh.axis(a).kind == crate::mesh::AxisKind::Model => {
                return Err(invalid(format!(
                    "`Local` is only meaningful on data axes, not on model axis '{}'",
                    mesh.axis(a).name
                )));
            }
            _ => {}
        }
    }
    let Some(dims) = dims else { return Ok(()) };
    for d in 0..rank {
        let shards = layout.shards_of(d, mesh);
        // Splits over data axes only may pad; a model-axis split must divide.
        let data_only = (0..layout.len()).all(|a| {
            layout.get(a) != Placement::Shard(d) || mesh.axis(a).kind == crate::mesh::AxisKind::Data
        });
        // (Not below one row per shard: a size-1 dim is a broadcast dim.)
        let pads = data_only && dims[d] >= shards;
        if shards > 1 && dims[d] % shards != 0 && !pads {
            return Err(Error::Indivisible {
                what: format!("a tensor of shape {dims:?} as {layout}"),
                dim: d,
                size: dims[d],
                shards,
            });
        }
    }
    Ok(())
}
