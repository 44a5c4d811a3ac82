//! DDP gradient buckets: data-parallel gradients all-reduced in buckets as they are born.
//!
//! With [`RankPolicy::bucket_bytes`](crate::RankPolicy) set, a replicated parameter's gradient
//! (DDP, ZeRO-1) is not kept for `sync_gradients` but added, where backward makes it, to the
//! rank's open bucket; a bucket that reaches the size is all-reduced as one flat buffer on the
//! rank's communication queue (PyTorch DDP's `bucket_cap_mb`, 25 MB there), and each gradient in
//! it is a value that waits for its slice at its first use. A bucket still open when one of its
//! gradients is needed (a tied parameter's two gradients are added) or at `sync_gradients` is
//! issued then. Every rank fills its buckets in the same order, so every rank issues the same
//! calls; an all-reduce of the flat buffer is element for element the all-reduce of each
//! gradient, so the results are bitwise those of reducing each gradient where it is born.
//! [`RankPolicy::reduce_in_flight`](crate::RankPolicy) buckets may be in flight (0: each is
//! waited for as soon as it is issued).

use std::sync::{Arc, Mutex};

use burn_backend::{Backend, DType, Shape, TensorMetadata};

use super::{Awaited, DTensor};
use crate::collectives::PendingTensor;
use crate::comm::{Group, ReduceOp};
use crate::device::{DistDevice, RankContext, Resolve};
use crate::error::Error;
use crate::placement::Layout;

/// One bucket: the gradients' local pieces while it is open, then its all-reduce.
pub(crate) struct Bucket<B: Backend> {
    state: Mutex<State<B>>,
    device: DistDevice<B>,
    axis: usize,
    op: ReduceOp,
    dtype: DType,
}

enum State<B: Backend> {
    Open {
        parts: Vec<B::FloatTensorPrimitive>,
        elements: usize,
    },
    Issued(PendingTensor<B>),
    Done(B::FloatTensorPrimitive),
    Failed(Error),
}

impl<B: Backend> Bucket<B> {
    fn accepts(&self, axis: usize, op: ReduceOp, dtype: DType) -> bool {
        (self.axis, self.op, self.dtype) == (axis, op, dtype)
    }

    /// Issue its all-reduce if it is still open (one flat buffer of every part, in order).
    fn issue(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let State::Open { parts, .. } = &mut *state {
            let flat: Vec<B::FloatTensorPrimitive> = std::mem::take(parts)
                .into_iter()
                .map(|p| {
                    let n = p.shape().num_elements();
                    B::float_reshape(p, Shape::from(vec![n]))
                })
                .collect();
            let all = if flat.len() == 1 {
                flat.into_iter().next().expect("one part")
            } else {
                B::float_cat(flat, 0)
            };
            self.device.context().count_prefetch(|c| c.buckets += 1);
            *state = State::Issued(crate::collectives::issue_all_reduce(
                &self.device,
                Group::Axis(self.axis),
                all,
                self.op,
            ));
        }
    }

    /// The all-reduced flat buffer (issued first if still open).
    pub(crate) fn result(&self) -> Result<B::FloatTensorPrimitive, Error> {
        self.issue();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(&*state, State::Issued(_)) {
            let State::Issued(pending) = std::mem::replace(
                &mut *state,
                State::Failed(Error::Unsupported(String::new())),
            ) else {
                unreachable!("matched above")
            };
            *state = match pending.wait() {
                Ok(all) => State::Done(all),
                Err(e) => State::Failed(e),
            };
        }
        match &*state {
            State::Done(all) => Ok(all.clone()),
            State::Failed(e) => Err(e.clone()),
            _ => unreachable!("issued above"),
        }
    }
}

impl<B: Backend> Resolve for Bucket<B> {
    fn resolve(&self) -> Result<(), Error> {
        self.result().map(drop)
    }
}

/// A rank's open bucket (kept type-erased in its context).
struct Open<B: Backend>(Arc<Bucket<B>>);

/// Whether `grad` goes into a bucket: its reduction to `target` is one all-reduce (see
/// [`DTensor::single_reduction`]).
pub(crate) fn fits<B: Backend>(grad: &DTensor<B>, target: &Layout) -> bool {
    matches!(grad.single_reduction(target), Some((_, _, None)))
}

/// Add `grad`, a per-rank summand that [`fits`], to the rank's open bucket (issued once it
/// holds `limit` bytes): the value that stands for the reduced gradient.
pub(crate) fn add<B: Backend>(grad: DTensor<B>, target: &Layout, limit: usize) -> DTensor<B> {
    let Some((axis, op, None)) = grad.single_reduction(target) else {
        unreachable!("the caller checked that it fits")
    };
    let grad = grad.ready();
    let ctx = grad.device.context().clone();
    let dtype = grad.local.dtype();
    let local_shape = grad.local.shape().to_vec();
    let n: usize = local_shape.iter().product();
    let mut full = Vec::new();
    let (bucket, offset) = ctx.with_buckets::<Open<B>, _>(|open| {
        let reuse = open.as_ref().is_some_and(|o| {
            o.0.accepts(axis, op, dtype) && matches!(*o.0.state.lock().unwrap(), State::Open { .. })
        });
        if !reuse {
            // Another axis, op or dtype (or issued because a gradient in it was needed).
            if let Some(old) = open.take() {
                full.push(old.0);
            }
            *open = Some(Open(Arc::new(Bucket {
                state: Mutex::new(State::Open {
                    parts: Vec::new(),
                    elements: 0,
                }),
                device: grad.device.clone(),
                axis,
                op,
                dtype,
            })));
        }
        let bucket = open.as_ref().expect("set above").0.clone();
        let offset = {
            let mut state = bucket.state.lock().unwrap();
            let State::Open { parts, elements } = &mut *state else {
                unreachable!("an open bucket")
            };
            let offset = *elements;
            parts.push(grad.local.clone());
            *elements += n;
            offset
        };
        if (offset + n) * dtype.size() >= limit
            && let Some(o) = open.take()
        {
            full.push(o.0);
        }
        (bucket, offset)
    });
    for bucket in full {
        if let Err(e) = close(&ctx, bucket) {
            crate::error::raise(e);
        }
    }
    let mut layout = grad.layout.clone();
    layout.set(axis, target.get(axis));
    let awaited = Arc::new(Awaited::in_bucket(bucket, offset, local_shape.clone()));
    DTensor::awaiting(
        awaited,
        local_shape,
        dtype,
        layout,
        grad.shape.clone(),
        grad.device.clone(),
    )
}

/// Issue `bucket` and keep it outstanding (waited for at once when nothing may be in flight).
fn close<B: Backend>(ctx: &RankContext, bucket: Arc<Bucket<B>>) -> Result<(), Error> {
    bucket.issue();
    if ctx.with_policy(|p| p.reduce_in_flight) == 0 {
        return bucket.resolve();
    }
    ctx.await_later(bucket)
}

/// Issue the rank's open bucket (`sync_gradients`, after backward).
pub(crate) fn flush<B: Backend>(ctx: &RankContext) -> Result<(), Error> {
    match ctx.with_buckets::<Open<B>, _>(|open| open.take()) {
        Some(open) => close(ctx, open.0),
        None => Ok(()),
    }
}
