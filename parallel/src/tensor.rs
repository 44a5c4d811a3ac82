//! `DTensor`: the decorator's float primitive — a local piece plus a layout over the mesh.

use crate::comm::{Group, ReduceOp};
use crate::device::DistDevice;
use crate::error::DistError;
use crate::placement::{Layout, Placement};
use burn_backend::{Backend, DType, Shape, Slice, TensorData, TensorMetadata};
use std::sync::{Arc, Mutex};

/// A distributed tensor: this rank's local piece, its [`Layout`] over the mesh, and the global
/// (logical) shape, which is what Burn, autodiff and the optimizers see.
///
/// Shards are equal: a dimension sharded `n` ways must divide by `n`, otherwise creating or
/// redistributing to that layout fails with [`DistError::Indivisible`] naming the shape and the
/// sizes. (FSDP pads its flat parameter buffers instead of relying on uneven shards.)
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
    ctx: Arc<crate::device::RankContext>,
}

impl Tracker {
    fn new(bytes: usize, ctx: &Arc<crate::device::RankContext>) -> Self {
        let bytes = bytes as i64;
        ctx.add_live_bytes(bytes);
        Self {
            _shared: Arc::new(TrackerInner {
                bytes,
                ctx: ctx.clone(),
            }),
        }
    }
}

impl Drop for TrackerInner {
    fn drop(&mut self) {
        self.ctx.add_live_bytes(-self.bytes);
    }
}

fn local_bytes<P: TensorMetadata>(local: &P) -> usize {
    local.shape().num_elements() * local.dtype().size()
}

type Memo<B> = Option<MemoCell<B>>;
type MemoCell<B> = Arc<
    Mutex<
        Vec<(
            Layout,
            <B as burn_backend::BackendTypes>::FloatTensorPrimitive,
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

/// Read a primitive back to the host.
pub(crate) fn read<B: Backend>(t: B::FloatTensorPrimitive) -> TensorData {
    burn_backend::read_sync(B::float_into_data(t)).expect("reading a local tensor failed")
}

impl<B: Backend> DTensor<B> {
    /// Wrap this rank's `local` piece of a tensor laid out as `layout`.
    pub fn from_local(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        device: &DistDevice<B>,
    ) -> Result<Self, DistError> {
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
    ) -> Result<Self, DistError> {
        let start = Self::from_local(full, Layout::replicated(device.mesh()), device)?;
        start.redistribute(layout)
    }

    pub(crate) fn new_unchecked(
        local: B::FloatTensorPrimitive,
        layout: Layout,
        device: DistDevice<B>,
    ) -> Self {
        let shape = Shape::from(layout.global_shape(&local.shape().to_vec(), device.mesh()));
        // Only partial values are memoised: reducing them twice would double the traffic, while
        // a gathered shard must not outlive its use (FSDP frees it and gathers again).
        let partial = layout
            .placements()
            .iter()
            .any(|p| matches!(p, Placement::Partial(_)));
        let memo = partial.then(MemoCell::<B>::default);
        let track = Tracker::new(local_bytes(&local), device.context());
        Self {
            local,
            layout,
            shape,
            device,
            memo,
            track,
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

    /// Take the local piece.
    pub fn into_local(self) -> B::FloatTensorPrimitive {
        self.local
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
    pub fn full(self) -> Result<B::FloatTensorPrimitive, DistError> {
        let target = self.layout.unsharded();
        Ok(self.redistribute(&target)?.local)
    }

    /// If this partial value has already been reduced (another use asked for it), that reduced
    /// value: as good as a replicated operand, for free. Otherwise `self`.
    pub(crate) fn settled(self) -> Self {
        let Some(memo) = &self.memo else { return self };
        let mut reduced = self.layout.clone();
        for a in 0..reduced.len() {
            if matches!(reduced.get(a), Placement::Partial(_)) {
                reduced.set(a, Placement::Replicate);
            }
        }
        let cached = memo
            .lock()
            .unwrap()
            .iter()
            .find(|(l, _)| l == &reduced)
            .map(|(_, t)| t.clone());
        match cached {
            Some(local) => Self::new_unchecked(local, reduced, self.device),
            None => self,
        }
    }

    /// Change the layout, with the collectives that takes (none when only slicing).
    ///
    /// Axes are first brought to `Replicate` from the last to the first (gather `Shard`, reduce
    /// `Partial`, or reduce-scatter straight into the target shard), then the target placements
    /// are applied from the first axis to the last (slice for `Shard`, keep the value on member 0
    /// for `Partial(Sum)`), so nested shards of one dimension keep their order.
    pub fn redistribute(self, target: &Layout) -> Result<Self, DistError> {
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
                .find(|(l, _)| l == target)
                .map(|(_, t)| t.clone())
        });
        if let Some(local) = cached {
            return Ok(Self::new_unchecked(local, target.clone(), self.device));
        }
        let memo = self.memo.clone();
        let communicates = self.layout.is_distributed();
        let comm = self.device.ctx.comm();
        let rank = self.device.rank();
        let mut layout = self.layout.clone();
        let mut local = self.local;

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
            let invalid = |reason: &str| DistError::InvalidRedistribution {
                axis: mesh.axis(a).name.clone(),
                from,
                to,
                reason: reason.into(),
            };
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
                    let data = comm.all_gather(Group::Axis(a), read::<B>(local), d)?;
                    local = B::float_from_data(data, &self.device.inner);
                    layout.set(a, Placement::Replicate);
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
                            let data =
                                comm.reduce_scatter(Group::Axis(a), read::<B>(local), d, op)?;
                            local = B::float_from_data(data, &self.device.inner);
                            layout.set(a, to);
                        }
                        _ => {
                            let data = comm.all_reduce(Group::Axis(a), read::<B>(local), op)?;
                            local = B::float_from_data(data, &self.device.inner);
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
                    let len = local.shape().to_vec()[d] / size;
                    let mut slices: Vec<Slice> = local
                        .shape()
                        .to_vec()
                        .iter()
                        .map(|&s| Slice::new(0, Some(s as isize), 1))
                        .collect();
                    slices[d] = Slice::new(
                        (index * len) as isize,
                        Some(((index + 1) * len) as isize),
                        1,
                    );
                    local = B::float_slice(local, &slices);
                }
                Placement::Partial(ReduceOp::Sum) if index != 0 => {
                    let dtype = local.dtype().into();
                    local = B::float_zeros(local.shape(), &self.device.inner, dtype);
                }
                Placement::Partial(_) | Placement::Local | Placement::Replicate => {}
            }
            layout.set(a, to);
        }
        if communicates && let Some(memo) = memo {
            memo.lock().unwrap().push((layout.clone(), local.clone()));
        }
        let track = Tracker::new(local_bytes(&local), self.device.context());
        Ok(Self {
            local,
            layout,
            shape: self.shape,
            device: self.device,
            memo: None,
            track,
        })
    }
}

/// Check that `layout` fits a tensor of rank `rank` on `mesh`, and, given its global shape
/// `dims`, that every sharded dimension divides evenly.
pub(crate) fn check_layout(
    layout: &Layout,
    rank: usize,
    dims: Option<&[usize]>,
    mesh: &crate::mesh::DeviceMesh,
) -> Result<(), DistError> {
    let invalid = |reason: String| DistError::InvalidLayout {
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
        if shards > 1 && dims[d] % shards != 0 {
            return Err(DistError::Indivisible {
                what: format!("a tensor of shape {dims:?} as {layout}"),
                dim: d,
                size: dims[d],
                shards,
            });
        }
    }
    Ok(())
}
