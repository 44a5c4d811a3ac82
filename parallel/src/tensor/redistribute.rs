//! Redistribution of a [`DTensor`]: to any layout (gathers, reductions, reduce-scatters,
//! slices), FSDP's parameter gathers issued ahead of use, and the padding of uneven shards.

use super::*;

impl<B: Backend> DTensor<B> {
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
        match self.count() {
            (count, id) if count.origin == 0 => id,
            (count, _) => count.origin,
        }
    }

    /// Whether redistributing to `target` is one all-gather of a sharded parameter (FSDP's
    /// gather): exactly one data axis of size > 1 changes, from `Shard(d)` to `Replicate`, and no
    /// other axis splits `d`. Its axis and `d`.
    pub(crate) fn parameter_gather(&self, target: &Layout) -> Option<(usize, usize)> {
        if self.memo.is_some() {
            return None;
        }
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
            && alone)
            .then_some((a, d))
    }

    /// Issue the gather [`Self::parameter_gather`] found, on the rank's communication queue;
    /// its bytes count as gathered while it is in flight.
    pub(crate) fn issue_gather(&self, axis: usize, dim: usize) -> PendingGather<B> {
        let size = self.device.mesh().axis_size(axis);
        let bytes = local_bytes(&self.local) * size;
        // An offloaded shard goes to the gather from host memory as it is, when the
        // collectives take host buffers; else the buffer they hand back is uploaded here, when
        // the gather is issued (ahead of its use under the prefetch).
        let group = Group::Axis(axis);
        let from_host = self.host_data().map(|data| {
            crate::collectives::issue_all_gather_from_host(&self.device, group, data, dim)
        });
        let issue = |local| crate::collectives::issue_all_gather(&self.device, group, local, dim);
        let local = match from_host {
            Some(Ok(pending)) => {
                self.device.ctx.count_host_gather();
                pending
            }
            Some(Err(data)) => {
                self.device.ctx.count_host_upload();
                issue(crate::comm::upload::<B>(data, self.device.inner()))
            }
            None => issue(self.clone().ready().local),
        };
        PendingGather {
            local,
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
        let track = Track::Own(Count::new(local_bytes(&local), true, self.device.context()));
        Ok(Self {
            local,
            meta: Meta::new(
                layout,
                self.shape.clone(),
                self.device.clone(),
                None,
                track,
                None,
            ),
        })
    }

    /// Change the layout, with the collectives that takes (none when only slicing).
    ///
    /// Axes are first brought to `Replicate` from the last to the first (gather `Shard`, reduce
    /// `Partial`, or reduce-scatter straight into the target shard), then the target placements
    /// are applied from the first axis to the last (slice for `Shard`, keep the value on member 0
    /// for `Partial(Sum)`), so nested shards of one dimension keep their order.
    pub fn redistribute(self, target: &Layout) -> Result<Self, Error> {
        // A parameter's planned gather first: it needs only the layout, and it was issued with
        // the piece in hand (an offloaded shard's from host memory, ahead of use).
        if let Some(gathered) = prefetch::take(&self, target) {
            return gathered;
        }
        // An offloaded shard not prefetched (the first step, a validation pass) goes to its
        // gather from host memory all the same.
        if self.is_offloaded()
            && let Some((axis, dim)) = self.parameter_gather(target)
        {
            let pending = self.issue_gather(axis, dim);
            return self.finish_gather(pending, target);
        }
        self.ready().redistribute_now(target)
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
                self.shape.clone(),
                self.device.clone(),
            ));
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
        // Partial values becoming nested shards of one dimension (FSDP's gradients over two
        // data axes: ep × dp, dp × cp): one reduce-scatter per axis, the outer axis first (each
        // splits what the one before left), after padding the dimension to a multiple of all
        // its splits — instead of an all-reduce on every axis but the innermost.
        for d in 0..self.meta.shape.num_dims() {
            let axes: Vec<usize> = (0..n)
                .filter(|&a| target.get(a) == Placement::Shard(d) && mesh.axis_size(a) > 1)
                .collect();
            let op = match layout.get(axes.first().copied().unwrap_or(0)) {
                Placement::Partial(op) if op != ReduceOp::Max => op,
                _ => continue,
            };
            let nested = axes.len() > 1
                && axes
                    .iter()
                    .all(|&a| undo[a] && layout.get(a) == Placement::Partial(op))
                && (0..n).all(|b| {
                    layout.get(b) != Placement::Shard(d)
                        && (target.get(b) != Placement::Shard(d) || axes.contains(&b))
                });
            if !nested {
                continue;
            }
            local = pad::<B>(
                local,
                d,
                target.shards_of(d, &mesh),
                &self.meta.device.inner,
            );
            for &a in &axes {
                local = crate::collectives::reduce_scatter(
                    &self.meta.device,
                    Group::Axis(a),
                    local,
                    d,
                    op,
                )?;
                layout.set(a, Placement::Shard(d));
                undo[a] = false;
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
                    local = crate::collectives::all_gather(
                        &self.meta.device,
                        Group::Axis(a),
                        local,
                        d,
                    )?;
                    layout.set(a, Placement::Replicate);
                    local = Self::without_padding(local, &self.meta.shape, &layout, d, &mesh);
                }
                Placement::Partial(op) => {
                    // Reduce-scatter straight into the shard only if no other axis splits the
                    // same dimension (nested shards must be split outer axis first) — or only
                    // outer axes do, already as the target has them, and the dimension divides
                    // evenly (the piece is then an outer chunk, split further: a stacked expert
                    // weight's gradient, its experts split over the expert axis).
                    let later_shards = |d: usize| {
                        let others = (0..n).filter(|&b| b != a).filter(|&b| {
                            layout.get(b) == Placement::Shard(d)
                                || target.get(b) == Placement::Shard(d)
                        });
                        let mut others = others.peekable();
                        if others.peek().is_none() {
                            return false;
                        }
                        let even = self.meta.shape[d].is_multiple_of(target.shards_of(d, &mesh));
                        !(even && others.all(|b| b < a && layout.get(b) == target.get(b)))
                    };
                    match to {
                        Placement::Shard(d) if op != ReduceOp::Max && !later_shards(d) => {
                            let size = mesh.axis_size(a);
                            local = pad::<B>(local, d, size, &self.meta.device.inner);
                            local = crate::collectives::reduce_scatter(
                                &self.meta.device,
                                Group::Axis(a),
                                local,
                                d,
                                op,
                            )?;
                            layout.set(a, to);
                        }
                        _ => {
                            local = crate::collectives::all_reduce(
                                &self.meta.device,
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
                    if local.shape()[d] == self.meta.shape[d] {
                        let parts = target.shards_of(d, &mesh);
                        local = pad::<B>(local, d, parts, &self.meta.device.inner);
                    }
                    let len = local.shape()[d] / size;
                    local = slice_dim::<B>(local, d, index * len..(index + 1) * len);
                }
                Placement::Partial(ReduceOp::Sum) if index != 0 => {
                    let dtype = local.dtype().into();
                    local = B::float_zeros(local.shape(), &self.meta.device.inner, dtype);
                }
                Placement::Partial(_) | Placement::Local | Placement::Replicate => {}
            }
            layout.set(a, to);
        }
        let bytes = local_bytes(&local);
        let ctx = self.meta.device.context();
        let track = match memo {
            Some(memo) if communicates => {
                // Counted once, by the memo's entry and every value taken from it.
                let track = Tracker::with_kind(bytes, gathered_data, ctx);
                memo.lock()
                    .unwrap()
                    .push((layout.clone(), local.clone(), track.clone()));
                Track::Shared(track)
            }
            _ => Track::Own(Count::new(bytes, gathered_data, ctx)),
        };
        Ok(Self {
            local,
            meta: Meta::new(
                layout,
                self.meta.shape.clone(),
                self.meta.device.clone(),
                None,
                track,
                None,
            ),
        })
    }
}
