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
mod redistribute;
mod reduce;

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
    pub(crate) meta: Arc<Meta<B>>,
}

/// A value's metadata, shared by its clones (one allocation per value, its byte count
/// included). Its [`Form`] (layout, global shape, device) is shared further, with every value an
/// elementwise op makes from it: an op's output on plain layouts allocates only this.
pub struct Meta<B: Backend> {
    form: Arc<Form<B>>,
    /// Reductions already done for this partial value, shared by its clones: a partial sum used
    /// by two ops is reduced once (every rank runs the same program, so all hit the cache alike).
    memo: Memo<B>,
    /// Counts the local piece in the rank's live-bytes accounting while this value exists.
    track: Track<B>,
    /// A value still being reduced on the rank's communication queue (an asynchronous gradient
    /// reduction): `local` is a stand-in until [`DTensor::ready`] waits for it.
    pub(crate) awaited: Option<Arc<Awaited<B>>>,
}

/// How a value's local piece is counted in the rank's live bytes.
enum Track<B: Backend> {
    /// By the value itself: counted when made, uncounted when its metadata (the last clone) is
    /// dropped. The common case, an op's fresh output: no allocation besides the metadata's.
    Own(Count),
    /// By a tracker it shares with other values (a memoised reduction and the values taken from
    /// the memo; an offloaded parameter's upload).
    Shared(Tracker),
    /// By another value's metadata: the same piece, seen through a new value ([`DTensor::ready`]
    /// of an awaited one).
    Of(Arc<Meta<B>>),
}

/// A value's layout, global shape and device: what an elementwise op's output has in common
/// with its operand (the same `Arc`), so that the op neither copies the layout and the shape nor
/// takes another reference to the rank's context, and an op on two values of one form knows it
/// without comparing them.
pub struct Form<B: Backend> {
    pub(crate) layout: Layout,
    pub(crate) shape: Shape,
    pub(crate) device: DistDevice<B>,
    /// `layout.is_plain()`: every axis `Local` or `Replicate`.
    plain: bool,
    /// `shape.num_elements()`.
    elements: usize,
}

impl<B: Backend> std::ops::Deref for Meta<B> {
    type Target = Form<B>;
    #[inline]
    fn deref(&self) -> &Form<B> {
        &self.form
    }
}

impl<B: Backend> Meta<B> {
    /// New metadata of its own form.
    fn new(
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
        memo: Memo<B>,
        track: Track<B>,
        awaited: Option<Arc<Awaited<B>>>,
    ) -> Arc<Self> {
        let plain = layout.is_plain();
        let elements = shape.num_elements();
        Arc::new(Self {
            form: Arc::new(Form {
                layout,
                shape,
                device,
                plain,
                elements,
            }),
            memo,
            track,
            awaited,
        })
    }

    /// Whether `self` and `other` are laid out alike with nothing split or partial, over one
    /// global shape (one form, or equal ones).
    #[inline]
    pub(crate) fn same_plain_form(&self, other: &Self) -> bool {
        self.form.plain
            && (Arc::ptr_eq(&self.form, &other.form)
                || (self.form.layout == other.form.layout && self.form.shape == other.form.shape))
    }

    /// The count of the local piece, and the value's identity (shared by everything that
    /// counts the same piece).
    fn count(&self) -> (&Count, usize) {
        match &self.track {
            Track::Own(count) => (count, self as *const Self as usize),
            Track::Shared(t) => (&t._shared.count, Arc::as_ptr(&t._shared) as usize),
            Track::Of(meta) => meta.count(),
        }
    }

    /// A track of the same count as `meta`'s, for another value of the same piece.
    fn share(meta: &Arc<Self>) -> Track<B> {
        match &meta.track {
            Track::Own(_) => Track::Of(meta.clone()),
            Track::Shared(t) => Track::Shared(t.clone()),
            Track::Of(m) => Track::Of(m.clone()),
        }
    }

    /// The same metadata with `awaited` in place of this one's, as a new value of the same piece.
    pub(crate) fn with_awaited(meta: &Arc<Self>, awaited: Option<Arc<Awaited<B>>>) -> Arc<Self> {
        Self::successor(meta, Self::share(meta), awaited)
    }

    /// `meta`'s layout, shape, device and memo for a new value counted by `track`.
    fn successor(meta: &Arc<Self>, track: Track<B>, awaited: Option<Arc<Awaited<B>>>) -> Arc<Self> {
        Arc::new(Self {
            form: meta.form.clone(),
            memo: meta.memo.clone(),
            track,
            awaited,
        })
    }
}

impl<B: Backend> Drop for Meta<B> {
    fn drop(&mut self) {
        if let Track::Own(count) = &self.track {
            count.release(self.device.context());
        }
    }
}

impl<B: Backend> std::ops::Deref for DTensor<B> {
    type Target = Meta<B>;
    #[inline]
    fn deref(&self) -> &Meta<B> {
        &self.meta
    }
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
    Deferred(DeferredPiece<B>),
    /// A piece kept in host memory between uses (an offloaded parameter, `--offload params`):
    /// every use uploads it anew, and the state never changes — the device holds the piece only
    /// while the op (or the gather) that uploaded it holds it, as FSDP holds a gathered weight.
    Host(HostPiece<B>),
}

/// An offloaded piece: its values in host memory, the device it is uploaded to, and its bytes
/// counted in the rank's host bytes.
pub(crate) struct HostPiece<B: Backend> {
    data: burn_backend::TensorData,
    device: B::Device,
    _held: crate::device::HostBytes,
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
    pub(crate) fn deferred(compute: DeferredPiece<B>) -> Self {
        Self::with_state(AwaitState::Deferred(compute))
    }

    /// A piece kept in host memory (see [`AwaitState::Host`]).
    fn host(
        data: burn_backend::TensorData,
        device: B::Device,
        held: crate::device::HostBytes,
    ) -> Self {
        Self::with_state(AwaitState::Host(HostPiece {
            data,
            device,
            _held: held,
        }))
    }

    /// `f` of the host piece, when this piece is kept in host memory.
    fn on_host<R>(&self, f: impl FnOnce(&HostPiece<B>) -> R) -> Option<R> {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(AwaitState::Host(h)) => Some(f(h)),
            _ => None,
        }
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
        self.resolved().map(|(local, _)| local)
    }

    /// The local piece and whether it is a fresh upload of a host piece (every use of one
    /// uploads it; the other states are waited for once).
    fn resolved(&self) -> Result<(B::FloatTensorPrimitive, bool), Error> {
        if let Some((birth, watch)) = &self.watch {
            watch.saw(*birth);
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(AwaitState::Host(h)) = &*state {
            return Ok((B::float_from_data(h.data.clone(), &h.device), true));
        }
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
            Some(AwaitState::Done(local)) => Ok((local.clone(), false)),
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
/// a value saved by several autodiff nodes is counted once. For bytes counted apart from a value
/// or shared by several ([`Track::Shared`]); a value counts its own piece in its metadata.
#[derive(Clone)]
pub(crate) struct Tracker {
    _shared: Arc<TrackerInner>,
}

struct TrackerInner {
    count: Count,
    ctx: Arc<crate::device::RankContext>,
}

/// Bytes counted in a rank's live bytes, released by the owner ([`Meta`]'s or
/// [`TrackerInner`]'s drop).
struct Count {
    bytes: i64,
    /// The identity of the offloaded value this piece was uploaded from (0: none): an upload
    /// is the same parameter to the prefetch ([`DTensor::identity`]).
    origin: usize,
    /// A parameter gathered over data axes for use (FSDP): also counted as "gathered".
    gathered: bool,
    /// The piece cast to another dtype by the precision policy ([`DTensor::local_in`]), shared
    /// by the value's clones and dropped with them.
    cast: Mutex<Option<CastCopy>>,
}

impl Count {
    /// `bytes` counted on `ctx`'s rank (also as gathered when `gathered`).
    #[inline]
    fn new(bytes: usize, gathered: bool, ctx: &crate::device::RankContext) -> Self {
        let bytes = bytes as i64;
        if gathered {
            ctx.add_gathered_bytes(bytes);
        }
        ctx.add_live_bytes(bytes);
        Self {
            bytes,
            origin: 0,
            gathered,
            cast: Mutex::new(None),
        }
    }

    fn release(&self, ctx: &crate::device::RankContext) {
        if self.gathered {
            ctx.add_gathered_bytes(-self.bytes);
        }
        ctx.add_live_bytes(-self.bytes);
    }
}

/// A piece's copy in another dtype (type-erased: the tracker is not generic over the backend),
/// counted in the rank's live bytes while it is kept.
struct CastCopy {
    dtype: burn_backend::FloatDType,
    /// The copy (`B::FloatTensorPrimitive`), or a [`DeferredCopy`] until first asked for.
    local: Box<dyn std::any::Any + Send + Sync>,
    _track: Tracker,
}

/// A cast copy that a deferred computation gives at its first use
/// ([`DTensor::with_deferred_cast_copy`]).
struct DeferredCopy<B: Backend>(Mutex<Option<DeferredPiece<B>>>);

/// A local piece computed later, once.
pub type DeferredPiece<B> =
    Box<dyn FnOnce() -> <B as burn_backend::BackendTypes>::FloatTensorPrimitive + Send>;

impl Tracker {
    fn new(bytes: usize, ctx: &Arc<crate::device::RankContext>) -> Self {
        Self::with_kind(bytes, false, ctx)
    }

    fn with_kind(bytes: usize, gathered: bool, ctx: &Arc<crate::device::RankContext>) -> Self {
        Self {
            _shared: Arc::new(TrackerInner {
                count: Count::new(bytes, gathered, ctx),
                ctx: ctx.clone(),
            }),
        }
    }

    /// The tracker of a piece uploaded from the offloaded value of identity `origin`.
    fn uploaded(bytes: usize, origin: usize, ctx: &Arc<crate::device::RankContext>) -> Self {
        let mut track = Self::new(bytes, ctx);
        Arc::get_mut(&mut track._shared)
            .expect("a new tracker is not shared")
            .count
            .origin = origin;
        track
    }
}

impl Drop for TrackerInner {
    fn drop(&mut self) {
        self.count.release(&self.ctx);
    }
}

/// A copy of `shape` in one `memcpy` (its derived `clone` pushes the dims one by one, and every
/// op copies a shape or two).
#[inline]
pub(crate) fn copy_shape(shape: &Shape) -> Shape {
    Shape::new_raw(smallvec::SmallVec::from_slice(shape.as_slice()))
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
    #[inline]
    fn clone(&self) -> Self {
        Self {
            local: self.local.clone(),
            meta: self.meta.clone(),
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
        copy_shape(&self.shape)
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
        let track = Track::Own(Count::new(local_bytes(&local), false, device.context()));
        Self::with_parts(local, layout, shape, device, track, None)
    }

    /// A value of `local` counted by `track`, with the memo its layout calls for.
    fn with_parts(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
        track: Track<B>,
        awaited: Option<Arc<Awaited<B>>>,
    ) -> Self {
        // Partial values are memoised: reducing them twice would double the traffic. A gathered
        // shard must not outlive its use (FSDP frees it and gathers again) — except, when asked
        // (`RankPolicy::keep_sequence_gathers`), a sequence-parallel activation's gather,
        // kept for the backward of the column-parallel layers that use it.
        let memo = memo_for(&layout, &shape, &device);
        Self {
            local,
            meta: Meta::new(layout, shape, device, memo, track, awaited),
        }
    }

    /// A fresh value of `like`'s layout, global shape and device: an elementwise op's output.
    #[inline]
    pub(crate) fn fresh_like(local: B::FloatTensorPrimitive, like: &Meta<B>) -> Self {
        if !like.form.plain {
            return Self::new_shaped(
                local,
                like.layout.clone(),
                like.shape.clone(),
                like.device.clone(),
            );
        }
        // Nothing partial or split (no memo; no padding: the piece is the whole shape): the
        // same form.
        debug_assert_eq!(
            local.shape(),
            like.shape,
            "a plain piece is the whole value"
        );
        let bytes = like.form.elements * local.dtype().size();
        Self {
            local,
            meta: Arc::new(Meta {
                form: like.form.clone(),
                memo: None,
                track: Track::Own(Count::new(bytes, false, like.device.context())),
                awaited: None,
            }),
        }
    }

    /// An elementwise op's output `local` made from the value whose metadata is `meta`, which
    /// the op consumed: [`Self::fresh_like`], except that where that value ends here (no other
    /// clone), plain, counted by itself alone and of the output's byte count, its metadata —
    /// form and count — passes to the output as it is: no allocation, no reference count or
    /// live-byte count moved. The moment both pieces existed is still offered as a peak, as
    /// counting the output and then releasing the operand would.
    #[inline]
    pub(crate) fn fresh_from(local: B::FloatTensorPrimitive, mut meta: Arc<Meta<B>>) -> Self {
        let bytes = meta.form.elements * local.dtype().size();
        if let Some(m) = Arc::get_mut(&mut meta)
            && m.form.plain
            && m.memo.is_none()
            && m.awaited.is_none()
            && let Track::Own(count) = &mut m.track
            && count.bytes == bytes as i64
            && !count.gathered
            && count.origin == 0
            && count.cast.get_mut().is_ok_and(|c| c.is_none())
        {
            m.form.device.context().offer_transient_bytes(bytes as i64);
            return Self { local, meta };
        }
        Self::fresh_like(local, &meta)
    }

    /// A value taken from a memo: shares the cached piece's tracker (counted once).
    fn cached(
        local: B::FloatTensorPrimitive,
        track: Tracker,
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
    ) -> Self {
        Self::with_parts(local, layout, shape, device, Track::Shared(track), None)
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The local piece on this rank, in hand: a value still awaited — a reduction in flight, a
    /// deferred optimizer result or weight gradient, an offloaded piece — has only a NaN
    /// stand-in here, so call [`DTensor::ready`] (or [`DTensor::into_local`]) first. Debug
    /// builds panic on a stand-in; for its shape or dtype alone use [`DTensor::local_shape`] and
    /// [`DTensor::local_dtype`], which are right either way.
    #[track_caller]
    pub fn local(&self) -> &B::FloatTensorPrimitive {
        debug_assert!(
            self.meta.awaited.is_none(),
            "DTensor::local of a value still awaited (a NaN stand-in): call `ready` first"
        );
        &self.local
    }

    /// The local piece's shape (a stand-in's is the awaited piece's).
    pub fn local_shape(&self) -> Shape {
        self.local.shape()
    }

    /// The local piece's dtype (a stand-in's is the awaited piece's).
    pub fn local_dtype(&self) -> DType {
        self.local.dtype()
    }

    /// The local piece's size in bytes (a stand-in's is the awaited piece's).
    pub fn local_bytes(&self) -> usize {
        local_bytes(&self.local)
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

    /// This value with its local piece replaced by `f` of it, the layout, global shape and device
    /// kept ([`DTensor::with_local`] without holding the old piece while `f` runs: an in-place
    /// kernel, such as Flex's AdamW, finds its buffer unshared and writes it without a copy).
    pub fn map_local(
        self,
        f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
    ) -> Self {
        let (layout, shape, device) =
            (self.layout.clone(), self.shape.clone(), self.device.clone());
        Self::new_shaped(f(self.into_local()), layout, shape, device)
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

    /// [`Self::unpadded`] of a parameter operand that its rule redistributes before reading
    /// its piece: an offloaded piece without padding stays in host memory, for the
    /// redistribution to upload (through its planned gather, issued ahead, when it has one).
    pub(crate) fn unpadded_param(self) -> Self {
        if self.is_offloaded() && self.padded_dims().is_empty() {
            return self;
        }
        self.unpadded()
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

    /// Whether `other` is a clone of this value (they share the local piece).
    pub(crate) fn same_value(&self, other: &Self) -> bool {
        self.count().1 == other.count().1
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
    /// value: as good as a replicated operand, for free. Otherwise `self`, in hand — except an
    /// offloaded parameter, left for the redistribution that follows to upload.
    #[inline]
    pub(crate) fn settled(self) -> Self {
        if self.memo.is_none() && self.is_offloaded() {
            // An offloaded parameter (never partial) is uploaded by the redistribution every
            // rule runs next (`to_layout`): by its planned gather, issued ahead, when it has one.
            return self;
        }
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
        let mut slot = self.count().0.cast.lock().unwrap();
        if let Some(copy) = slot.as_mut().filter(|c| c.dtype == dtype) {
            if let Some(deferred) = copy.local.downcast_ref::<DeferredCopy<B>>() {
                let compute = deferred.0.lock().unwrap().take();
                let compute = compute.expect("a deferred cast copy is computed once");
                copy.local = Box::new(compute());
            }
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

    /// The dtype of the cast copy this value keeps (the precision policy's), once a rule has
    /// asked for one: what the optimizer's step writes for the value that replaces it
    /// ([`DTensor::with_cast_copy`]).
    pub fn cast_copy_dtype(&self) -> Option<FloatDType> {
        self.count()
            .0
            .cast
            .lock()
            .unwrap()
            .as_ref()
            .map(|c| c.dtype)
    }

    /// This value keeping `copy` — its local piece in another dtype, written elsewhere (by the
    /// optimizer kernel that wrote the value) — as its cast copy: the next rule asking for that
    /// dtype takes it instead of casting. Counted in the live bytes like a cast; not in
    /// [`OpCounters::casts`](crate::OpCounters), since no cast ran.
    pub fn with_cast_copy(self, copy: B::FloatTensorPrimitive) -> Self {
        assert_eq!(
            copy.shape(),
            self.local.shape(),
            "a cast copy has its value's shape"
        );
        let (dtype, bytes) = (FloatDType::from(copy.dtype()), local_bytes(&copy));
        self.keep_cast_copy(dtype, bytes, Box::new(copy))
    }

    /// This value keeping `local` (a copy, or a [`DeferredCopy`]) as its cast copy in `dtype`,
    /// its `bytes` counted in the live bytes while kept.
    fn keep_cast_copy(
        self,
        dtype: FloatDType,
        bytes: usize,
        local: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        let track = Tracker::new(bytes, self.device.context());
        *self.count().0.cast.lock().unwrap() = Some(CastCopy {
            dtype,
            local,
            _track: track,
        });
        self
    }

    /// [`DTensor::with_cast_copy`] of a copy in `dtype` that `compute` gives when a rule first
    /// asks for it (written by the same deferred launch as this value: see
    /// [`DTensor::deferred_like`]). Its bytes are counted from now.
    pub fn with_deferred_cast_copy(self, dtype: FloatDType, compute: DeferredPiece<B>) -> Self {
        let bytes = self.local.shape().num_elements() * DType::from(dtype).size();
        let deferred = DeferredCopy::<B>(Mutex::new(Some(compute)));
        self.keep_cast_copy(dtype, bytes, Box::new(deferred))
    }

    /// A value with this one's layout, global shape and device whose local piece (this one's
    /// local shape, in `dtype`) `compute` gives at its first use — as a deferred weight gradient
    /// is: an optimizer that runs many parameters' updates in one launch (`FusedAdamW` on a
    /// GPU) hands each result back this way, and the first use of any runs the launch. Counted
    /// in the live bytes from now; until resolved its [`DTensor::local`] is a stand-in.
    pub fn deferred_like(&self, dtype: DType, compute: DeferredPiece<B>) -> Self {
        let awaited = Arc::new(Awaited::deferred(compute));
        DTensor::awaiting(
            awaited,
            self.local.shape().to_vec(),
            dtype,
            self.layout.clone(),
            self.shape.clone(),
            self.device.clone(),
            true,
        )
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
            Some((local, track)) => Self::cached(
                local,
                track,
                reduced,
                self.shape.clone(),
                self.device.clone(),
            ),
            None => self,
        }
    }

    /// This value with its local piece in hand: an asynchronous reduction still in flight (see
    /// [`RankPolicy::reduce_in_flight`](crate::RankPolicy)) is waited for. Every op does this
    /// to its inputs; call it before reading [`DTensor::local`] of a gradient that
    /// `sync_gradients` has not seen.
    #[inline]
    pub fn ready(mut self) -> Self {
        if let Some(awaited) = self.meta.awaited.clone() {
            let (local, uploaded) = awaited
                .resolved()
                .unwrap_or_else(|e| crate::error::raise(e));
            if uploaded {
                // An offloaded piece: this use's upload, a value of its own, counted while it
                // lives.
                let origin = self.identity();
                self.device.ctx.count_host_upload();
                let track = Tracker::uploaded(local_bytes(&local), origin, self.device.context());
                self.meta = Meta::successor(&self.meta, Track::Shared(track), None);
            } else if let Some(meta) = Arc::get_mut(&mut self.meta) {
                meta.awaited = None;
            } else {
                // Clones still waiting share the count.
                self.meta = Meta::with_awaited(&self.meta, None);
            }
            self.local = local;
        }
        self
    }

    /// Whether the local piece is kept in host memory between uses (an offloaded parameter):
    /// each use uploads it ([`DTensor::ready`]); [`DTensor::local`] is a stand-in.
    pub fn is_offloaded(&self) -> bool {
        self.awaited
            .as_ref()
            .is_some_and(|a| a.on_host(|_| ()).is_some())
    }

    /// The local piece's values in host memory, when [offloaded](Self::is_offloaded).
    pub fn host_data(&self) -> Option<burn_backend::TensorData> {
        self.awaited
            .as_ref()
            .and_then(|a| a.on_host(|h| h.data.clone()))
    }

    /// This value with its local piece moved to host memory (`--offload params`, FSDP2's
    /// `CPUOffloadPolicy`, ZeRO-Infinity's parameter offload): one read from the device now;
    /// then every use uploads the piece anew and lets it go with the op, and the rank's
    /// accounting counts the piece in [`host_bytes`](crate::RankContext::host_bytes), not in its
    /// live device bytes. An FSDP gather of an offloaded shard uploads it when issued, so the
    /// prefetch uploads ahead of use. A value already offloaded is returned as it is.
    pub fn offloaded(self) -> Self {
        if self.is_offloaded() {
            return self;
        }
        let this = self.ready();
        this.device.ctx.count_host_read();
        let data = crate::comm::read::<B>(this.local.clone());
        this.with_host(data)
    }

    /// A value with this one's layout, global shape and device whose local piece is `data`,
    /// kept in host memory (see [`DTensor::offloaded`]): an optimizer stepped on the host
    /// hands its new parameter piece back this way. `data` must have the local piece's shape.
    pub fn with_host(&self, data: burn_backend::TensorData) -> Self {
        let local_shape = self.local.shape().to_vec();
        assert_eq!(
            data.shape.to_vec(),
            local_shape,
            "a host piece has the local piece's shape"
        );
        let held = crate::device::HostBytes::new(self.device.context(), data.bytes.len());
        let dtype = data.dtype;
        let awaited = Arc::new(Awaited::host(data, self.device.inner.clone(), held));
        // Nothing of it is on the device between uses: a zero-byte tracker (its identity is
        // the parameter's for the prefetch).
        DTensor::awaiting(
            awaited,
            local_shape,
            dtype,
            self.layout.clone(),
            self.shape.clone(),
            self.device.clone(),
            false,
        )
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
    // The policy (behind a lock) is read only for a value that could be one: every new tensor
    // comes here.
    if shape.num_dims() != 3 || !layout.placements().contains(&Placement::Shard(1)) {
        return false;
    }
    let (keep, axis) = device
        .context()
        .with_policy(|p| (p.keep_sequence_gathers, p.sequence_parallel));
    keep && axis.is_some_and(|axis| layout.get(axis) == Placement::Shard(1))
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
