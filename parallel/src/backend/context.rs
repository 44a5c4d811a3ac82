//! Context parallelism's attention: every sequence is split over the context axis (see
//! [`CpLayout`]), each member holding its chunks of the queries, keys and values, and attention
//! meets the other members' keys and values block by block.
//!
//! The sequence is cut into chunks of `c` positions. A query chunk `x` meets key/value chunk `y`
//! as one `c × c` block of the backend's attention kernel: whole (no mask) when `y < x`, causal
//! when `y = x`, not at all when `y > x` (non-causal attention: every block whole). The blocks'
//! partial results are combined with the online-softmax rule: for outputs `o₁, o₂` and
//! log-sum-exps `l₁, l₂`, `l = l₁ + softplus(l₂ − l₁)` and `o = o₁·e^{l₁−l} + o₂·e^{l₂−l}`.
//! Backward runs each block's kernel backward with the combined output and log-sum-exp (the
//! probabilities `exp(s − l)` and `D = rowsum(dO∘O)` of the whole row), which gives every
//! block's exact share of dQ, dK and dV.
//!
//! The keys and values reach a member in one of two ways ([`CpRotate`]):
//! * **Ring**: at step `s` a member holds the keys and values of the member `s` places before
//!   it; it sends them on to the next member before computing on them, and receives the next
//!   ones after (`cp − 1` transfers of its key/value piece each way). In backward the key/value
//!   gradient of a piece travels with it, each member adding its share, and reaches the owner
//!   after `cp − 1` hops: `2·(cp − 1)` transfers, twice the forward's.
//! * **All-gather**: one all-gather of the keys and of the values per call, the blocks visited
//!   in the ring's order (the forward gives the ring's numbers bitwise), and in backward one
//!   reduce-scatter of their gradients.
//!
//! Accumulators (outputs, log-sum-exps, gradients) are f32 whatever the compute dtype; the
//! results come back in the operands' dtype, the log-sum-exp in the kernel's (f32 from the fused
//! kernels, the compute dtype where a backend falls back to Burn ops).

use crate::collectives;
use crate::comm::{Group, ReduceOp};
use crate::device::DistDevice;
use crate::dims::{CpLayout, CpRotate};
use crate::error::raise;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use burn_backend::TensorMetadata;
use wildfire_kernels::{AttentionGrads, AttentionOutput, FusedOps};

type P<B> = <B as burn_backend::BackendTypes>::FloatTensorPrimitive;

fn t<B: FusedOps, const D: usize>(p: P<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn p<B: FusedOps, const D: usize>(t: Tensor<B, D>) -> P<B> {
    t.into_primitive().tensor()
}

/// The context-parallel group of a rank whose policy splits sequences over an axis of two or
/// more members.
#[derive(Clone, Debug)]
pub(crate) struct Context {
    /// Members of the group.
    cp: usize,
    /// This member's index.
    index: usize,
    /// The global ranks of the group, in group order.
    ranks: Vec<usize>,
    axis: usize,
    layout: CpLayout,
    rotate: CpRotate,
}

/// How a query chunk meets a key/value chunk.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Whole,
    Causal,
}

impl Context {
    /// `device`'s context-parallel group, when its policy has one of two or more members.
    pub(crate) fn of<B: burn_backend::Backend>(device: &DistDevice<B>) -> Option<Self> {
        let c = device.ctx.with_policy(|p| p.context)?;
        let mesh = device.mesh();
        let cp = mesh.axis_size(c.axis);
        (cp > 1).then(|| Self {
            cp,
            index: mesh.group_index(device.rank(), c.axis),
            ranks: mesh.group_ranks(device.rank(), c.axis),
            axis: c.axis,
            layout: c.layout,
            rotate: c.rotate,
        })
    }

    /// The global positions of this member's `len` sequence positions.
    pub(crate) fn positions(&self, len: usize) -> Vec<usize> {
        self.layout.positions(self.cp, self.index, len)
    }

    /// The ranges of a sequence of `t` positions this member holds, in its order
    /// ([`CpLayout::ranges`]).
    pub(crate) fn ranges(&self, t: usize) -> Result<Vec<std::ops::Range<usize>>, crate::Error> {
        self.layout.ranges(self.cp, self.index, t)
    }

    /// The chunks member `member` holds.
    fn held(&self, member: usize) -> Vec<usize> {
        self.layout.held(self.cp, member)
    }

    /// How query chunk `x` meets key/value chunk `y`.
    fn block(x: usize, y: usize, causal: bool) -> Option<Block> {
        match (causal, y.cmp(&x)) {
            (false, _) | (true, std::cmp::Ordering::Less) => Some(Block::Whole),
            (true, std::cmp::Ordering::Equal) => Some(Block::Causal),
            (true, std::cmp::Ordering::Greater) => None,
        }
    }

    /// The member whose keys and values this one holds at ring step `s`.
    fn at_step(&self, s: usize) -> usize {
        (self.index + self.cp - s) % self.cp
    }

    fn next(&self) -> usize {
        self.ranks[(self.index + 1) % self.cp]
    }

    fn prev(&self) -> usize {
        self.ranks[(self.index + self.cp - 1) % self.cp]
    }

    /// Checks the local sequence splits into this member's chunks.
    fn chunk_len(&self, len: usize) -> usize {
        let held = self.held(self.index).len();
        if len == 0 || !len.is_multiple_of(held) {
            raise(crate::Error::InvalidDims {
                reason: format!(
                    "a context-parallel member's {len} positions do not split into its {held} \
                     chunks ({} layout): the sequence must be a multiple of {}",
                    self.layout,
                    self.layout.chunks(self.cp)
                ),
            });
        }
        len / held
    }
}

/// The running combination of one query chunk's blocks, in f32.
struct Combined<B: FusedOps> {
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
}

impl<B: FusedOps> Combined<B> {
    /// `acc` combined with one more block's output and log-sum-exp.
    fn merge(acc: Option<Self>, out: Tensor<B, 4>, lse: Tensor<B, 3>) -> Self {
        let (out, lse) = (out.cast(FloatDType::F32), lse.cast(FloatDType::F32));
        let Some(acc) = acc else {
            return Self { out, lse };
        };
        // l = l₁ + softplus(l₂ − l₁), softplus(d) = max(d, 0) + log1p(e^{−|d|}).
        let d = lse.clone() - acc.lse.clone();
        let combined = acc.lse.clone() + d.clone().clamp_min(0.0) + d.abs().neg().exp().log1p();
        let weight = |l: Tensor<B, 3>| (l - combined.clone()).exp().unsqueeze_dim::<4>(3);
        Self {
            out: acc.out * weight(acc.lse) + out * weight(lse),
            lse: combined,
        }
    }
}

/// Zeros of `shape` in f32 on `device`.
fn zeros<B: FusedOps>(shape: burn::tensor::Shape, device: &B::Device) -> Tensor<B, 4> {
    t(B::float_zeros(shape, device, FloatDType::F32))
}

/// `a + b` where either may be missing.
fn add<B: FusedOps>(a: Option<Tensor<B, 4>>, b: Tensor<B, 4>) -> Tensor<B, 4> {
    match a {
        Some(a) => a + b,
        None => b,
    }
}

/// `x` passed on to the next member while the previous member's comes in: one exchange on the
/// rank's communication queue, waited for with [`Exchange::wait`].
struct Exchange<B: FusedOps>(collectives::PendingTensor<B>);

impl<B: FusedOps> Exchange<B> {
    fn issue(device: &DistDevice<B>, ctx: &Context, x: &Tensor<B, 4>) -> Self {
        Self(collectives::issue_exchange(
            device,
            ctx.next(),
            p(x.clone()),
            ctx.prev(),
        ))
    }

    fn wait(self) -> Tensor<B, 4> {
        t(self.0.wait().unwrap_or_else(|e| raise(e)))
    }
}

/// Keys and values in flight together.
type InFlight<B> = (Exchange<B>, Exchange<B>);

fn issue_pair<B: FusedOps>(
    device: &DistDevice<B>,
    ctx: &Context,
    (k, v): (&Tensor<B, 4>, &Tensor<B, 4>),
) -> InFlight<B> {
    (
        Exchange::issue(device, ctx, k),
        Exchange::issue(device, ctx, v),
    )
}

fn wait_pair<B: FusedOps>((k, v): InFlight<B>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    (k.wait(), v.wait())
}

/// `f`, traced as the compute region `cp attention` of the rank (beside its exchanges).
fn region<B: FusedOps, R>(device: &DistDevice<B>, f: impl FnOnce() -> R) -> R {
    let started = std::time::Instant::now();
    let out = f();
    device
        .context()
        .comm()
        .member()
        .trace_region("cp attention", started);
    out
}

/// `x` all-gathered over the context group along the sequence (dim 2), members in group order.
fn gather<B: FusedOps>(device: &DistDevice<B>, ctx: &Context, x: Tensor<B, 4>) -> Tensor<B, 4> {
    let g = collectives::all_gather(device, Group::Axis(ctx.axis), p(x), 2);
    t(g.unwrap_or_else(|e| raise(e)))
}

/// Attention of this member's queries `[b, h, len, hd]` over the whole sequence's keys and
/// values, this member's `[b, kv, len, hd]` pieces of which it holds: its output and
/// log-sum-exp, as [`FusedOps::fused_attention`] gives them for its positions.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention<B: FusedOps>(
    ctx: &Context,
    device: &DistDevice<B>,
    q: P<B>,
    k: P<B>,
    v: P<B>,
    scale: f64,
    causal: bool,
) -> AttentionOutput<B> {
    let dtype = q.dtype();
    let q = t::<B, 4>(q);
    let len = q.dims()[2];
    let c = ctx.chunk_len(len);
    let mine = ctx.held(ctx.index);
    let queries: Vec<Tensor<B, 4>> = (0..mine.len())
        .map(|i| q.clone().narrow(2, i * c, c))
        .collect();
    let mut acc: Vec<Option<Combined<B>>> = mine.iter().map(|_| None).collect();
    // The kernel's log-sum-exp dtype (f32 from the fused kernels; the compute dtype where a
    // backend falls back to Burn ops): the combined one goes back in it, as its backward takes it.
    let mut lse_dtype = None;
    let mut visit = |member: usize, k: &Tensor<B, 4>, v: &Tensor<B, 4>| {
        for (slot, y) in ctx.held(member).into_iter().enumerate() {
            let (kc, vc) = (
                k.clone().narrow(2, slot * c, c),
                v.clone().narrow(2, slot * c, c),
            );
            for (i, &x) in mine.iter().enumerate() {
                let Some(block) = Context::block(x, y, causal) else {
                    continue;
                };
                let o = B::fused_attention(
                    p(queries[i].clone()),
                    p(kc.clone()),
                    p(vc.clone()),
                    scale,
                    block == Block::Causal,
                );
                lse_dtype.get_or_insert(o.lse.dtype());
                acc[i] = Some(Combined::merge(acc[i].take(), t(o.output), t(o.lse)));
            }
        }
    };
    let (k, v) = (t::<B, 4>(k), t::<B, 4>(v));
    match ctx.rotate {
        CpRotate::AllGather => {
            let (kg, vg) = (gather(device, ctx, k), gather(device, ctx, v));
            for s in 0..ctx.cp {
                let j = ctx.at_step(s);
                let piece = |x: &Tensor<B, 4>| x.clone().narrow(2, j * len, len);
                visit(j, &piece(&kg), &piece(&vg));
            }
        }
        CpRotate::Ring => {
            let mut held = (k, v);
            for s in 0..ctx.cp {
                // The next member's pieces come in while these are computed on.
                let next = (s + 1 < ctx.cp).then(|| issue_pair(device, ctx, (&held.0, &held.1)));
                region(device, || visit(ctx.at_step(s), &held.0, &held.1));
                if let Some(next) = next {
                    held = wait_pair(next);
                }
            }
        }
    }
    let (outs, lses): (Vec<_>, Vec<_>) = acc
        .into_iter()
        .map(|a| {
            let a = a.expect("every query chunk meets its own keys");
            (a.out, a.lse)
        })
        .unzip();
    AttentionOutput {
        output: p(Tensor::cat(outs, 2).cast(FloatDType::from(dtype))),
        lse: p(Tensor::cat(lses, 2).cast(FloatDType::from(
            lse_dtype.expect("every query chunk meets its own keys"),
        ))),
    }
}

/// The gradients of [`attention`] from its output and log-sum-exp: this member's queries', and
/// its keys' and values' (every member's queries' shares of them summed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward<B: FusedOps>(
    ctx: &Context,
    device: &DistDevice<B>,
    q: P<B>,
    k: P<B>,
    v: P<B>,
    output: P<B>,
    lse: P<B>,
    d_output: P<B>,
    scale: f64,
    causal: bool,
) -> AttentionGrads<B> {
    let (q_dtype, k_dtype, v_dtype) = (q.dtype(), k.dtype(), v.dtype());
    let q = t::<B, 4>(q);
    let len = q.dims()[2];
    let c = ctx.chunk_len(len);
    let mine = ctx.held(ctx.index);
    let (o, d_o, l) = (t::<B, 4>(output), t::<B, 4>(d_output), t::<B, 3>(lse));
    let chunk4 = |x: &Tensor<B, 4>, i: usize| x.clone().narrow(2, i * c, c);
    let rows: Vec<_> = (0..mine.len())
        .map(|i| {
            (
                chunk4(&q, i),
                chunk4(&o, i),
                chunk4(&d_o, i),
                l.clone().narrow(2, i * c, c),
            )
        })
        .collect();
    let inner = device.inner().clone();
    let mut dq: Vec<Option<Tensor<B, 4>>> = mine.iter().map(|_| None).collect();
    // This member's queries' share of the gradients of member `member`'s keys and values
    // (f32, zeros where no block met them).
    let mut shares = |member: usize, k: &Tensor<B, 4>, v: &Tensor<B, 4>| {
        let mut dk = Vec::new();
        let mut dv = Vec::new();
        for (slot, y) in ctx.held(member).into_iter().enumerate() {
            let (kc, vc) = (chunk4(k, slot), chunk4(v, slot));
            let (mut gk, mut gv) = (None, None);
            for (i, &x) in mine.iter().enumerate() {
                let Some(block) = Context::block(x, y, causal) else {
                    continue;
                };
                let (qi, oi, doi, li) = rows[i].clone();
                let g = B::fused_attention_backward(
                    p(qi),
                    p(kc.clone()),
                    p(vc.clone()),
                    p(oi),
                    p(li),
                    p(doi),
                    scale,
                    block == Block::Causal,
                );
                let f32 = |x: P<B>| t::<B, 4>(x).cast(FloatDType::F32);
                dq[i] = Some(add(dq[i].take(), f32(g.q)));
                gk = Some(add(gk, f32(g.k)));
                gv = Some(add(gv, f32(g.v)));
            }
            dk.push(gk.unwrap_or_else(|| zeros(kc.shape(), &inner)));
            dv.push(gv.unwrap_or_else(|| zeros(vc.shape(), &inner)));
        }
        (Tensor::cat(dk, 2), Tensor::cat(dv, 2))
    };
    let (k, v) = (t::<B, 4>(k), t::<B, 4>(v));
    let (dk, dv) = match ctx.rotate {
        CpRotate::AllGather => {
            let (kg, vg) = (gather(device, ctx, k), gather(device, ctx, v));
            let mut pieces: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>> = vec![None; ctx.cp];
            for s in 0..ctx.cp {
                let j = ctx.at_step(s);
                let piece = |x: &Tensor<B, 4>| x.clone().narrow(2, j * len, len);
                pieces[j] = Some(shares(j, &piece(&kg), &piece(&vg)));
            }
            let (dks, dvs): (Vec<_>, Vec<_>) = pieces.into_iter().flatten().unzip();
            let scatter = |parts: Vec<Tensor<B, 4>>| {
                let g = collectives::reduce_scatter(
                    device,
                    Group::Axis(ctx.axis),
                    p(Tensor::cat(parts, 2)),
                    2,
                    ReduceOp::Sum,
                );
                t::<B, 4>(g.unwrap_or_else(|e| raise(e)))
            };
            (scatter(dks), scatter(dvs))
        }
        CpRotate::Ring => {
            // Step s holds the pieces of the member s before this one; they go on to the next
            // member while this one computes its share of their gradients, which then follow
            // them (the share the members before added carried in with it): after the last
            // step the next member is the owner, and the previous member's last exchange
            // brings this one's own gradients home.
            let mut pieces = Some(issue_pair(device, ctx, (&k, &v)));
            let own = region(device, || shares(ctx.index, &k, &v));
            let mut carried: Option<InFlight<B>> = None;
            for s in 1..ctx.cp {
                let held = wait_pair(pieces.take().expect("issued at the step before"));
                if s + 1 < ctx.cp {
                    pieces = Some(issue_pair(device, ctx, (&held.0, &held.1)));
                }
                let (gk, gv) = region(device, || shares(ctx.at_step(s), &held.0, &held.1));
                let (ck, cv) = carried.take().map(wait_pair).unzip();
                let sum = (add(ck, gk), add(cv, gv));
                carried = Some(issue_pair(device, ctx, (&sum.0, &sum.1)));
            }
            let back = wait_pair(carried.expect("a group of two or more takes a step"));
            (own.0 + back.0, own.1 + back.1)
        }
    };
    let dq: Vec<_> = dq
        .into_iter()
        .map(|g| g.expect("every query chunk meets its own keys"))
        .collect();
    AttentionGrads {
        q: p(Tensor::cat(dq, 2).cast(FloatDType::from(q_dtype))),
        k: p(dk.cast(FloatDType::from(k_dtype))),
        v: p(dv.cast(FloatDType::from(v_dtype))),
    }
}
