//! DDP gradient buckets: data-parallel gradients all-reduced in buckets as they are born.
//!
//! With [`RankPolicy::bucket_bytes`](crate::RankPolicy) set, a replicated parameter's gradient
//! (DDP, ZeRO-1) is not kept for `sync_gradients` but added, where backward makes it, to the
//! rank's open bucket; a bucket that reaches the size is all-reduced as one flat buffer on the
//! rank's communication queue (PyTorch DDP's `bucket_cap_mb`, 25 MB there), in the
//! gradient-reduction dtype when one is set, and each gradient in it is a value that waits for
//! its slice at its first use. The last bucket is issued by `sync_gradients`.
//! [`RankPolicy::reduce_in_flight`](crate::RankPolicy) buckets may be in flight (0: each is
//! waited for as soon as it is issued).
//!
//! **A parameter used twice** (a tied embedding) gets two gradients that backward adds before
//! the step: reduced in buckets, that would be two all-reduces where the blocking path does one,
//! and a different rounding. So the gradients of a step are numbered as they are born, and each
//! use of one before `sync_gradients` is seen (a [`Watch`]); the births used before the sync
//! are, from the next step on, kept out of the buckets as summands, added, and all-reduced once
//! by `sync_gradients` — as PyTorch DDP rebuilds its buckets from the first iteration's order.
//! The first step keeps every gradient out of the buckets (it only watches). The gradients kept
//! out go into the last bucket at the sync ([`add_at_sync`]), so a step's all-reduces are its
//! buckets, one call each. Every rank runs
//! the same program, so every rank plans alike and issues the same calls; and an all-reduce of
//! a flat buffer is element for element the all-reduce of each gradient in it, so the results
//! are bitwise those of DDP without buckets.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn_backend::{Backend, DType, Shape, TensorMetadata};

use super::{Awaited, DTensor};
use crate::collectives::{PendingTensor, ReduceStep};
use crate::comm::ReduceOp;
use crate::device::{DistDevice, RankContext, Resolve};
use crate::error::Error;
use crate::placement::Layout;
use crate::policy::GradientReduction;

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
            let step = ReduceStep {
                axis: self.axis,
                op: self.op,
                dim: None,
            };
            *state = State::Issued(crate::collectives::issue_reduction(
                &self.device,
                all,
                &[step],
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

/// The uses of a step's DDP gradients before `sync_gradients`, by birth number.
pub(crate) struct Watch {
    open: AtomicBool,
    used: Mutex<BTreeSet<usize>>,
}

impl Watch {
    fn new() -> Self {
        Self {
            open: AtomicBool::new(true),
            used: Mutex::default(),
        }
    }

    /// Birth `birth` was used (counted until the step's backward ends).
    pub(crate) fn saw(&self, birth: usize) {
        if self.open.load(Ordering::Acquire) {
            self.used
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(birth);
        }
    }
}

/// A rank's buckets (kept type-erased in its context): the open one, and the plan.
struct Buckets<B: Backend> {
    open: Option<Arc<Bucket<B>>>,
    /// This step's gradients so far.
    births: usize,
    /// The births kept out of the buckets (used before the last step's sync); `None` until a
    /// step has been watched.
    plan: Option<Arc<BTreeSet<usize>>>,
    watch: Arc<Watch>,
}

impl<B: Backend> Buckets<B> {
    fn new() -> Self {
        Self {
            open: None,
            births: 0,
            plan: None,
            watch: Arc::new(Watch::new()),
        }
    }
}

/// The all-reduce that reduces `grad` to `target`, if that is all it takes: its axis and op.
fn all_reduce_of<B: Backend>(grad: &DTensor<B>, target: &Layout) -> Option<(usize, ReduceOp)> {
    match grad.reduction_steps(target).as_deref() {
        Some(
            &[
                ReduceStep {
                    axis,
                    op,
                    dim: None,
                },
            ],
        ) => Some((axis, op)),
        _ => None,
    }
}

/// The bucket size when this rank's replicated gradients go into DDP buckets: reduced at the
/// sync (DDP, ZeRO-1) and a size set.
pub(crate) fn limit(ctx: &RankContext) -> Option<usize> {
    ctx.with_policy(|p| {
        (p.sharding.gradient_reduction == GradientReduction::AtSync && p.bucket_bytes > 0)
            .then_some(p.bucket_bytes)
    })
}

/// Whether `grad` goes into a bucket: its reduction to `target` is one all-reduce (see
/// [`DTensor::reduction_steps`]).
pub(crate) fn fits<B: Backend>(grad: &DTensor<B>, target: &Layout) -> bool {
    all_reduce_of(grad, target).is_some()
}

/// Add `grad`, a per-rank summand that [`fits`], born in backward, to the rank's open bucket
/// (issued once it holds `limit` bytes): the value that stands for the reduced gradient. A
/// birth the plan keeps out comes back as the summand it is, for `sync_gradients` to reduce.
pub(crate) fn add<B: Backend>(grad: DTensor<B>, target: &Layout, limit: usize) -> DTensor<B> {
    let mut grad = grad.ready();
    let ctx = grad.device.context().clone();
    let (birth, kept_out, watch) = ctx.with_buckets::<Buckets<B>, _>(|state| {
        let s = state.get_or_insert_with(Buckets::new);
        let birth = s.births;
        s.births += 1;
        let kept_out = s.plan.as_ref().is_none_or(|p| p.contains(&birth));
        (birth, kept_out, s.watch.clone())
    });
    if kept_out {
        let watched = Awaited::done(grad.local.clone()).watched(birth, watch);
        grad.meta = super::Meta::with_awaited(&grad.meta, Some(Arc::new(watched)));
        return grad;
    }
    fill(grad, target, limit, Some((birth, watch)))
}

/// Add `grad`, a gradient `sync_gradients` reduces (one the plan kept out of the buckets in
/// backward, summed), to the rank's open bucket: the last bucket, issued by [`flush`], holds
/// it with the gradients born last, so a step's all-reduces are its buckets.
pub(crate) fn add_at_sync<B: Backend>(
    grad: DTensor<B>,
    target: &Layout,
    limit: usize,
) -> DTensor<B> {
    fill(grad.ready(), target, limit, None)
}

/// Put `grad` in the open bucket (told to `watch` at each use, as a birth).
fn fill<B: Backend>(
    grad: DTensor<B>,
    target: &Layout,
    limit: usize,
    watch: Option<(usize, Arc<Watch>)>,
) -> DTensor<B> {
    let Some((axis, op)) = all_reduce_of(&grad, target) else {
        unreachable!("the caller checked that it fits")
    };
    let ctx = grad.device.context().clone();
    let own = grad.local.dtype();
    let dtype = ctx
        .with_policy(|p| p.grad_reduce_dtype)
        .map_or(own, DType::from);
    let local_shape = grad.local.shape().to_vec();
    let n: usize = local_shape.iter().product();
    let part = if dtype == own {
        grad.local.clone()
    } else {
        B::float_cast(grad.local.clone(), dtype.into())
    };
    let mut full = Vec::new();
    let (bucket, offset) = ctx.with_buckets::<Buckets<B>, _>(|state| {
        let s = state.get_or_insert_with(Buckets::new);
        let reuse = s.open.as_ref().is_some_and(|o| {
            o.accepts(axis, op, dtype) && matches!(*o.state.lock().unwrap(), State::Open { .. })
        });
        if !reuse {
            // Another axis, op or dtype (or issued because a gradient in it was needed).
            if let Some(old) = s.open.take() {
                full.push(old);
            }
            s.open = Some(Arc::new(Bucket {
                state: Mutex::new(State::Open {
                    parts: Vec::new(),
                    elements: 0,
                }),
                device: grad.device.clone(),
                axis,
                op,
                dtype,
            }));
        }
        let bucket = s.open.clone().expect("set above");
        let offset = {
            let mut state = bucket.state.lock().unwrap();
            let State::Open { parts, elements } = &mut *state else {
                unreachable!("an open bucket")
            };
            let offset = *elements;
            parts.push(part);
            *elements += n;
            offset
        };
        if (offset + n) * dtype.size() >= limit
            && let Some(o) = s.open.take()
        {
            full.push(o);
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
    let mut awaited = Awaited::in_bucket(bucket, offset, local_shape.clone(), own.into());
    if let Some((birth, watch)) = watch {
        awaited = awaited.watched(birth, watch);
    }
    DTensor::awaiting(
        Arc::new(awaited),
        local_shape,
        own,
        layout,
        grad.shape.clone(),
        grad.device.clone(),
        true,
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

/// The step's backward is over (`sync_gradients` starts): the births used so far are the ones
/// the next step keeps out of the buckets. Uses from here on (the sync's own) are not counted.
pub(crate) fn end_backward<B: Backend>(ctx: &RankContext) {
    ctx.with_buckets::<Buckets<B>, _>(|state| {
        if let Some(s) = state.as_mut()
            && s.births > 0
        {
            s.watch.open.store(false, Ordering::Release);
            let used = std::mem::take(&mut *s.watch.used.lock().unwrap_or_else(|e| e.into_inner()));
            s.plan = Some(Arc::new(used));
            s.births = 0;
            s.watch = Arc::new(Watch::new());
        }
    });
}

/// Issue the rank's open bucket (`sync_gradients`, after backward).
pub(crate) fn flush<B: Backend>(ctx: &RankContext) -> Result<(), Error> {
    end_backward::<B>(ctx);
    match ctx.with_buckets::<Buckets<B>, _>(|state| state.as_mut().and_then(|s| s.open.take())) {
        Some(open) => close(ctx, open),
        None => Ok(()),
    }
}
