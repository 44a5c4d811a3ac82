//! Placements and layouts: how a logical (global) tensor is laid out over the mesh.

use crate::comm::ReduceOp;
use crate::mesh::{AxisKind, DeviceMesh};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// How a tensor is laid out along one mesh axis (PyTorch DTensor's placements, plus `Local`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Placement {
    /// Every member of the axis group holds the whole tensor.
    Replicate,
    /// Member `i` holds chunk `i` of tensor dimension `dim` (equal chunks).
    Shard(usize),
    /// Every member holds a summand (or a candidate for max); the value is the reduction. Only
    /// linear ops let it pass; anything else reduces it first.
    Partial(ReduceOp),
    /// Data axes only: per-rank batch data, no global tensor implied (activations under DDP/FSDP).
    Local,
}

impl Placement {
    /// Whether this placement spreads a global tensor over the group (`Shard` or `Partial`).
    pub fn is_distributed(self) -> bool {
        matches!(self, Placement::Shard(_) | Placement::Partial(_))
    }

    /// A `Partial` that linear ops may carry along (sums and averages, not max).
    pub(crate) fn is_linear_partial(self) -> bool {
        matches!(self, Placement::Partial(ReduceOp::Sum | ReduceOp::Avg))
    }
}

/// One [`Placement`] per mesh axis, in the mesh's axis order.
#[derive(Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout(SmallVec<[Placement; 4]>);

impl Clone for Layout {
    /// A copy of the placements (SmallVec's own `clone` pushes them one by one; every op clones
    /// its operands' layouts).
    #[inline]
    fn clone(&self) -> Self {
        Layout(SmallVec::from_slice(&self.0))
    }
}

impl Layout {
    /// A layout from explicit placements (one per mesh axis).
    pub fn new(placements: impl IntoIterator<Item = Placement>) -> Self {
        Layout(placements.into_iter().collect())
    }

    /// `Replicate` on every axis: every rank holds the whole tensor.
    pub fn replicated(mesh: &DeviceMesh) -> Self {
        Layout(SmallVec::from_elem(Placement::Replicate, mesh.axes().len()))
    }

    /// The layout of a freshly created tensor (a batch, a mask, a newly initialised parameter):
    /// `Local` on data axes, `Replicate` on model axes — or `Replicate` everywhere inside
    /// [`create_replicated`].
    pub fn fresh(mesh: &DeviceMesh) -> Self {
        let data = if FRESH_REPLICATED.with(|f| f.get()) {
            Placement::Replicate
        } else {
            Placement::Local
        };
        Layout(
            mesh.axes()
                .iter()
                .map(|axis| match axis.kind {
                    AxisKind::Data => data,
                    AxisKind::Model => Placement::Replicate,
                })
                .collect(),
        )
    }

    /// This layout with `placement` on mesh axis `axis`.
    pub fn with(mut self, axis: usize, placement: Placement) -> Self {
        self.0[axis] = placement;
        self
    }

    /// The placements, one per mesh axis.
    pub fn placements(&self) -> &[Placement] {
        &self.0
    }

    /// Number of mesh axes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the layout has no axes (never true for a layout built from a mesh).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Placement on one axis.
    pub fn get(&self, axis: usize) -> Placement {
        self.0[axis]
    }

    pub(crate) fn set(&mut self, axis: usize, placement: Placement) {
        self.0[axis] = placement;
    }

    /// The layout the fallback uses: every `Shard` and `Partial` becomes `Replicate`; `Local`
    /// stays (per-rank data has no global value to gather).
    pub fn unsharded(&self) -> Self {
        Layout(
            self.0
                .iter()
                .map(|p| match p {
                    Placement::Local => Placement::Local,
                    _ => Placement::Replicate,
                })
                .collect(),
        )
    }

    /// This layout with every `Partial` reduced to `Replicate` (what a reduction of a partial
    /// value gives; shards stay).
    pub fn reduced(&self) -> Self {
        Layout(
            self.0
                .iter()
                .map(|&p| match p {
                    Placement::Partial(_) => Placement::Replicate,
                    p => p,
                })
                .collect(),
        )
    }

    /// Whether any axis shards or holds partial values.
    pub fn is_distributed(&self) -> bool {
        self.0.iter().any(|p| p.is_distributed())
    }

    /// Whether any axis holds partial values.
    pub fn has_partial(&self) -> bool {
        self.0.iter().any(|p| matches!(p, Placement::Partial(_)))
    }

    /// Whether every axis is `Local` or `Replicate`: nothing split, nothing partial.
    pub fn is_plain(&self) -> bool {
        (self.0.iter()).all(|p| matches!(p, Placement::Local | Placement::Replicate))
    }

    /// The number of chunks tensor dimension `dim` is split into (product over the axes that shard it).
    pub fn shards_of(&self, dim: usize, mesh: &DeviceMesh) -> usize {
        self.0
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == Placement::Shard(dim))
            .map(|(axis, _)| mesh.axis_size(axis))
            .product()
    }

    /// Where `rank`'s piece of a tensor of global `shape` lies under this layout, per dimension:
    /// the global index range of its real elements and the extent of its local piece. The extent
    /// is larger than the range where a data-axis split pads (the rows past the real ones are
    /// zeros), and the range is empty for a rank that holds only padding. Nested splits of one
    /// dimension go in mesh-axis order, the first axis outermost, as [`crate::DTensor`] lays them.
    pub fn local_box(
        &self,
        shape: &[usize],
        mesh: &DeviceMesh,
        rank: usize,
    ) -> Vec<(std::ops::Range<usize>, usize)> {
        let coords = mesh.coords(rank);
        (0..shape.len())
            .map(|dim| {
                let (mut index, mut parts) = (0, 1);
                for (a, &coord) in coords.iter().enumerate() {
                    if self.get(a) == Placement::Shard(dim) {
                        index = index * mesh.axis_size(a) + coord;
                        parts *= mesh.axis_size(a);
                    }
                }
                let n = shape[dim];
                let extent = n.div_ceil(parts);
                let start = (index * extent).min(n);
                (start..((index + 1) * extent).min(n), extent)
            })
            .collect()
    }

    /// This rank's local piece of a tensor of global `shape` in this layout, padded to the
    /// layout's extents (zeros past the tensor's end), its values given per row of the box:
    /// `fill(flat index in the whole tensor of the row's first element, the row)`. With
    /// [`crate::DTensor::from_local_padded`], a sharded tensor that no rank ever held whole.
    pub fn draw_local(
        &self,
        shape: &[usize],
        mesh: &DeviceMesh,
        rank: usize,
        mut fill: impl FnMut(usize, &mut [f32]),
    ) -> (Vec<f32>, Vec<usize>) {
        let local_box = self.local_box(shape, mesh, rank);
        let extents: Vec<usize> = local_box.iter().map(|(_, e)| *e).collect();
        let mut local = vec![0.0; extents.iter().product()];
        let lens: Vec<usize> = local_box.iter().map(|(r, _)| r.len()).collect();
        // One contiguous run per row of the box (along the last dim), rows in row-major order.
        let run = lens.last().copied().unwrap_or(1);
        for_each_row(&lens, |row| {
            let (mut global, mut at) = (0, 0);
            for d in 0..shape.len() {
                let i = row.get(d).copied().unwrap_or(0);
                global = global * shape[d] + local_box[d].0.start + i;
                at = at * extents[d] + i;
            }
            fill(global, &mut local[at..at + run]);
        });
        (local, extents)
    }

    /// Whether `rank` is the one rank that speaks for its piece: the first member (coordinate 0)
    /// of every axis the piece is replicated over — not the pipeline axis, whose ranks hold
    /// different stages. Saving only such pieces writes every element once. A layout with
    /// partial or per-rank (`Local`) values has no such piece.
    pub fn owns_piece(&self, mesh: &DeviceMesh, rank: usize) -> bool {
        mesh.coords(rank)
            .iter()
            .zip(self.placements())
            .zip(mesh.axes())
            .all(|((&coord, p), axis)| match p {
                Placement::Shard(_) => true,
                Placement::Replicate => coord == 0 || axis.is_pipeline(),
                Placement::Partial(_) | Placement::Local => false,
            })
    }

    /// The global shape of a tensor whose local piece has `local` shape under this layout.
    pub fn global_shape(&self, local: &[usize], mesh: &DeviceMesh) -> Vec<usize> {
        let mut shape = local.to_vec();
        for (axis, p) in self.0.iter().enumerate() {
            if let Placement::Shard(dim) = p {
                shape[*dim] *= mesh.axis_size(axis);
            }
        }
        shape
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|p| format!("{p:?}")).collect();
        write!(f, "[{}]", parts.join(", "))
    }
}

/// The one rule for where data-parallel shards go, used both to place parameters (`fully_shard`)
/// and to reduce gradients (the rank's `ShardingPolicy`), so the two always agree: dim 0 is split
/// over `axes`. When no model axis splits dim 0, it is split over the axes in order while it has
/// at least one row per shard, padded where it does not divide (see [`crate::DTensor`]); nested
/// inside the `Shard(0)`s `layout` already has (a row-parallel weight's on a model axis, stacked
/// expert weights' on the expert axis), dim 0 is split over the axes in order while it divides,
/// an axis where it does not being left as it is.
pub(crate) fn shard_dim0(
    mut layout: Layout,
    shape: &[usize],
    axes: &[usize],
    mesh: &DeviceMesh,
) -> Layout {
    if shape.is_empty() {
        return layout;
    }
    // Dim 0 already split: on model axes (a row-parallel weight), and on data axes (stacked
    // expert weights over the expert axis, or a layout this rule made before).
    let mut parts: usize = (0..layout.len())
        .filter(|&a| layout.get(a) == Placement::Shard(0))
        .map(|a| mesh.axis_size(a))
        .product();
    let pad = parts == 1;
    for &a in axes {
        let size = mesh.axis_size(a);
        if size == 1 || layout.get(a) == Placement::Shard(0) {
            // Nothing to split over a group of one, or split already.
            continue;
        }
        let fits = if pad {
            shape[0] >= parts * size
        } else {
            shape[0].is_multiple_of(parts * size)
        };
        if fits {
            parts *= size;
            layout.set(a, Placement::Shard(0));
        }
    }
    layout
}

thread_local! {
    static FRESH_REPLICATED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with tensors created from host data counted as `Replicate` on the data axes instead
/// of per-rank `Local`: for values every rank creates identically, such as a checkpoint loaded on
/// every rank (model weights, optimizer state). The caller vouches that the values are identical;
/// nothing is communicated to check it.
pub fn create_replicated<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            FRESH_REPLICATED.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(FRESH_REPLICATED.with(|c| c.replace(true)));
    f()
}

/// Call `f` with the index of every row of a box of `size` (its leading dims; a row runs along
/// the last), in row-major order: once with `[]` for a rank-0 or rank-1 box, never for an empty
/// one.
pub fn for_each_row(size: &[usize], mut f: impl FnMut(&[usize])) {
    if size.contains(&0) {
        return;
    }
    let lead = &size[..size.len().saturating_sub(1)];
    let mut row = vec![0; lead.len()];
    for _ in 0..lead.iter().product::<usize>() {
        f(&row);
        for d in (0..lead.len()).rev() {
            row[d] += 1;
            if row[d] < lead[d] {
                break;
            }
            row[d] = 0;
        }
    }
}
