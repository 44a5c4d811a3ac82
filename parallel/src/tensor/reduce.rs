//! Gradient reductions of a [`DTensor`]: in the gradient-reduction dtype, as a chain of
//! reductions issued on the rank's communication queue, and the stand-in that waits for one.

use super::*;

impl<B: Backend> DTensor<B> {
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
        let low = Self::new_shaped(
            cast,
            self.meta.layout.clone(),
            self.meta.shape.clone(),
            self.meta.device.clone(),
        );
        let out = low.redistribute(target)?;
        let back = B::float_cast(out.local, own.into());
        Ok(Self::new_shaped(
            back,
            out.meta.layout.clone(),
            out.meta.shape.clone(),
            out.meta.device.clone(),
        ))
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
            let size = this.meta.device.mesh().axis_size(steps[0].axis);
            local = pad::<B>(local, d, size, &this.meta.device.inner);
        }
        let mut local_shape = local.shape().to_vec();
        for step in &steps {
            if let Some(d) = step.dim {
                local_shape[d] /= this.meta.device.mesh().axis_size(step.axis);
            }
        }
        let layout = target.clone();
        let cast = ctx
            .with_policy(|p| p.grad_reduce_dtype)
            .filter(|&d| DType::from(d) != own);
        let pending = match cast {
            Some(low) => {
                let low = B::float_cast(local, low);
                let pending = crate::collectives::issue_reduction(&this.meta.device, low, &steps);
                crate::collectives::PendingTensor::Cast(Box::new(pending), own.into())
            }
            None => crate::collectives::issue_reduction(&this.meta.device, local, &steps),
        };
        let awaited = Arc::new(Awaited::new(pending));
        ctx.count_prefetch(|c| c.reductions += 1);
        ctx.await_later(awaited.clone())?;
        Ok(Self::awaiting(
            awaited,
            local_shape,
            own,
            layout,
            this.meta.shape.clone(),
            this.meta.device.clone(),
            true,
        ))
    }

    /// A value of `layout` whose local piece (`local_shape`, `dtype`) `awaited` will give: until
    /// then a stand-in of that shape that holds no memory (one NaN, broadcast: an op that read it
    /// without waiting would poison the step loudly, never silently), its bytes counted when
    /// `counted` (not for a piece kept in host memory: [`DTensor::with_host`]).
    pub(crate) fn awaiting(
        awaited: Arc<Awaited<B>>,
        local_shape: Vec<usize>,
        dtype: DType,
        layout: Layout,
        shape: Shape,
        device: DistDevice<B>,
        counted: bool,
    ) -> Self {
        let bytes = local_shape.iter().product::<usize>() * dtype.size();
        let track = Track::Own(Count::new(
            if counted { bytes } else { 0 },
            false,
            device.context(),
        ));
        let float = burn_backend::FloatDType::from(dtype);
        let one = B::float_reshape(
            nan_scalar::<B>(&device.inner, float),
            Shape::from(vec![1; local_shape.len()]),
        );
        let stand_in = B::float_expand(one, Shape::from(local_shape));
        Self::with_parts(stand_in, layout, shape, device, track, Some(awaited))
    }
}

/// A one-element NaN of `dtype` on `device`, made once per thread and kept (a fill is a kernel
/// launch on a GPU backend, and every awaited value's stand-in expands one: a multi-tensor
/// optimizer step hands back three or four per parameter).
fn nan_scalar<B: Backend>(
    device: &B::Device,
    dtype: burn_backend::FloatDType,
) -> B::FloatTensorPrimitive {
    use std::any::{Any, TypeId};
    type Kept = Vec<(TypeId, burn_backend::FloatDType, Box<dyn Any>)>;
    std::thread_local! {
        static KEPT: std::cell::RefCell<Kept> = const { std::cell::RefCell::new(Vec::new()) };
    }
    KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        let found = kept
            .iter()
            .filter(|(t, d, _)| *t == TypeId::of::<B>() && *d == dtype)
            .filter_map(|(_, _, x)| x.downcast_ref::<(B::Device, B::FloatTensorPrimitive)>())
            .find(|(d, _)| d == device)
            .map(|(_, x)| x.clone());
        found.unwrap_or_else(|| {
            let x = B::float_full(
                Shape::from(vec![1]),
                burn_backend::Scalar::Float(f64::NAN),
                device,
                dtype,
            );
            kept.push((
                TypeId::of::<B>(),
                dtype,
                Box::new((device.clone(), x.clone())),
            ));
            x
        })
    })
}
