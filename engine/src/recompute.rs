//! Activation recomputation (checkpointing) for any Burn model, through Burn 0.21's public API.
//!
//! Two mechanisms, one [`Recomputer`] per training step:
//!
//! * **Regions** ([`ForwardHooks::block`](wildfire_kernels::hooks::ForwardHooks::block), policies `Full` and `EveryNth`): the region (a
//!   transformer block) runs once with gradients off — nothing inside it is recorded — and its
//!   output enters the graph as a fresh leaf; only the region's input is kept. In
//!   [`Recomputer::backward`] the loss is back-propagated down to the region outputs, then each
//!   region, last first, is re-run with gradients on and back-propagated with the gradient that
//!   reached its output (`Σ y·ḡ`, whose gradient is `ḡ` exactly), down to the previous region's
//!   output. Every backward pass is a top-level one: Burn 0.21 deadlocks on a `backward()` nested
//!   inside a custom op's backward (the nested pass's graph cleaner locks every graph, including
//!   the one being traversed — verified), and even *recording* an op inside a backward step
//!   blocks, since the graph registry stays locked for the whole traversal. The gradients of the
//!   passes are merged per parameter, so the caller gets one `Gradients` as from `loss.backward()`.
//!   Requirement: regions are cut points — the model reaches a region's input only through the
//!   previous region's output (true of a stack of blocks; each block's input is its own region's
//!   input). Any `Module` works: the region is a closure over the module, written once.
//! * **Selective** ([`Recomputer`'s `attention_heads`](wildfire_kernels::hooks::ForwardHooks::attention_heads)): the attention core
//!   `softmax(mask(q·kᵀ·scale))·v` (with dropout on the probabilities) is one custom autodiff op
//!   whose backward is written out on the inner backend. With `Selective` it keeps only q, k, v and
//!   recomputes the score and probability tiles in backward (FlashAttention-style); otherwise it
//!   keeps the probabilities and the dropout mask. The same backward formulas serve both, so the
//!   policies agree bitwise.
//!
//! Random numbers are replayed by construction: every region and dropout site draws from a
//! stream seeded by `(step seed, layer, site)` — the GPT's dropout masks are drawn on the host from
//! that seed (identical on every backend and thread), and each region also re-seeds the backend
//! (`Backend::seed`) before it runs and before its recomputation, for modules that draw from the
//! backend (burn-nn's `Dropout`).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer as AdCheckpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use std::cell::RefCell;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::Auxiliary;
use wildfire_parallel::Error;
use wildfire_parallel::internal::RecomputeScope;

pub use wildfire_kernels::hooks::Recompute;
pub use wildfire_parallel::rng::mix_seed;

/// An inverted-dropout mask drawn on the host from `seed`: each element is `1/(1-p)` with
/// probability `1-p`, else 0. The same seed gives the same mask on every backend and thread.
pub fn dropout_mask<B: Backend, const D: usize>(
    seed: u64,
    shape: [usize; D],
    p: f64,
    device: &B::Device,
) -> Tensor<B, D> {
    let n: usize = shape.iter().product();
    let keep = 1.0 - p;
    let scale = (1.0 / keep) as f32;
    let mut state = wildfire_parallel::rng::SplitMix64::new(seed);
    let values: Vec<f32> = (0..n)
        .map(|_| if state.next_unit() < keep { scale } else { 0.0 })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The attention core's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Multiplies the scores (usually `1/√head_dim`).
    pub scale: f64,
    /// Query `i` sees keys `j <= i + (s - t)` only.
    pub causal: bool,
    /// Dropout probability on the attention probabilities.
    pub dropout: f64,
    /// Seed of the dropout mask.
    pub seed: u64,
}

/// Probabilities `softmax(mask(q·kᵀ·scale))` and the dropout mask (scaled), if any.
fn probabilities<B: FusedOps>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    spec: &AttentionSpec,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    // The scale on q (t·hd values) rather than on the scores (t·s).
    let scores = q
        .clone()
        .mul_scalar(spec.scale)
        .matmul(k.clone().swap_dims(2, 3));
    let dims = scores.dims();
    let att = if spec.causal {
        // Masked keys get probability exactly 0.
        float(B::fused_causal_softmax(prim(scores)))
    } else {
        burn::tensor::activation::softmax(scores, 3)
    };
    let keep =
        (spec.dropout > 0.0).then(|| dropout_mask(spec.seed, dims, spec.dropout, &q.device()));
    (att, keep)
}

/// The attention core from Burn ops (differentiated by Burn's autodiff where `B` has it): the
/// reference for [`Recomputer`'s `attention_heads`](wildfire_kernels::hooks::ForwardHooks::attention_heads)'s custom op, and its implementation on backends
/// without autodiff.
pub fn attention_reference<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    spec: &AttentionSpec,
) -> Tensor<B, 4> {
    let (att, keep) = probabilities(&q, &k, spec);
    let att = match keep {
        Some(keep) => att * keep,
        None => att,
    };
    att.matmul(v)
}

/// The written-out backward of the attention core: `(dq, dk, dv)`.
fn attention_backward<B: Backend>(
    [q, k, v]: [Tensor<B, 4>; 3],
    att: Tensor<B, 4>,
    keep: Option<Tensor<B, 4>>,
    dy: Tensor<B, 4>,
    spec: &AttentionSpec,
) -> [Tensor<B, 4>; 3] {
    let att_d = match &keep {
        Some(keep) => att.clone() * keep.clone(),
        None => att.clone(),
    };
    let dv = att_d.swap_dims(2, 3).matmul(dy.clone());
    let datt = dy.matmul(v.swap_dims(2, 3));
    let datt = match keep {
        Some(keep) => datt * keep,
        None => datt,
    };
    // Softmax backward: p ⊙ (ḡ − Σ_j ḡ_j p_j). Masked positions have p = 0 exactly (exp of
    // -1e9 below the row max underflows), so their gradient is 0 with no mask pass.
    let row = (datt.clone() * att.clone()).sum_dim(3);
    let dscores = (datt - row) * att;
    // scores = (q·s)·kᵀ: the scale goes on the t·hd-sized results, not the t·s scores.
    let dq = dscores.clone().matmul(k).mul_scalar(spec.scale);
    let dk = dscores.swap_dims(2, 3).matmul(q).mul_scalar(spec.scale);
    [dq, dk, dv]
}

fn float<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

#[derive(Debug)]
struct AttentionOp;

#[derive(Clone, Debug)]
struct AttentionState<X: Backend> {
    q: FloatTensor<X>,
    k: FloatTensor<X>,
    v: FloatTensor<X>,
    /// Probabilities and dropout mask; `None`: recompute them in backward (selective).
    saved: Option<(FloatTensor<X>, Option<FloatTensor<X>>)>,
    spec: AttentionSpec,
}

impl<X: FusedOps> Backward<X, 3> for AttentionOp {
    type State = AttentionState<X>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut AdCheckpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dy = float::<X, 4>(grads.consume::<X>(&ops.node));
        let s = ops.state;
        let (q, k, v) = (float::<X, 4>(s.q), float(s.k), float(s.v));
        let (att, keep) = match s.saved {
            Some((att, keep)) => (float(att), keep.map(float)),
            None => probabilities(&q, &k, &s.spec),
        };
        let [dq, dk, dv] = attention_backward([q, k, v], att, keep, dy, &s.spec);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<X>(node.id, prim(grad));
            }
        }
    }
}

/// A stand-in for a region's output that keeps its autodiff node (to look its gradient up) but
/// not its values: the output itself may be needed by no one else once the next block ran.
fn grad_handle<X: Backend, C: CheckpointStrategy>(
    t: &FloatTensor<Autodiff<X, C>>,
) -> FloatTensor<Autodiff<X, C>> {
    let device = X::float_device(&t.primitive);
    let mut handle = t.clone();
    handle.primitive = X::float_zeros([1].into(), &device, burn::tensor::FloatDType::F32);
    handle
}

type AttentionFn<B> =
    fn(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, &AttentionSpec, bool) -> Tensor<B, 4>;

fn attention_autodiff<X: FusedOps, C: CheckpointStrategy>(
    q: Tensor<Autodiff<X, C>, 4>,
    k: Tensor<Autodiff<X, C>, 4>,
    v: Tensor<Autodiff<X, C>, 4>,
    spec: &AttentionSpec,
    recompute: bool,
) -> Tensor<Autodiff<X, C>, 4> {
    let (q, k, v) = (prim(q), prim(k), prim(v));
    let (qi, ki, vi) = (
        float::<X, 4>(q.primitive.clone()),
        float::<X, 4>(k.primitive.clone()),
        float::<X, 4>(v.primitive.clone()),
    );
    let (att, keep) = probabilities(&qi, &ki, spec);
    let att_d = match &keep {
        Some(keep) => att.clone() * keep.clone(),
        None => att.clone(),
    };
    let y = prim(att_d.matmul(vi));
    let out = match AttentionOp
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let saved = (!recompute).then(|| (prim(att), keep.map(prim)));
            prep.finish(
                AttentionState {
                    q: q.primitive,
                    k: k.primitive,
                    v: v.primitive,
                    saved,
                    spec: *spec,
                },
                y,
            )
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    float(out)
}

/// One recorded region: its input (kept, with its graph), its output leaf, and how to re-run it.
struct Region<'a, B: Backend> {
    input: FloatTensor<B>,
    output: FloatTensor<B>,
    seed: u64,
    recompute: RecomputeFn<'a, B>,
}

type RecomputeFn<'a, B> = Box<dyn Fn(&Recomputer<'a, B>, FloatTensor<B>) -> FloatTensor<B> + 'a>;
type HandleFn<B> = fn(&FloatTensor<B>) -> FloatTensor<B>;
type Fence<'a> = Box<dyn Fn() -> Result<(), Error> + 'a>;

const SITE_BLOCK: u64 = 1;
const SITE_ATTENTION: u64 = 2;

/// Recomputation and random streams for one forward/backward of a model (see the module docs).
///
/// Build one per micro-batch with [`Recomputer::new`] (training, autodiff backends) or
/// [`Recomputer::inference`]; the model's forward calls [`block`](wildfire_kernels::hooks::ForwardHooks::block),
/// [`attention_heads`](wildfire_kernels::hooks::ForwardHooks::attention_heads) and [`dropout`](wildfire_kernels::hooks::ForwardHooks::dropout); then
/// [`backward`](Self::backward) replaces `loss.backward()`.
pub struct Recomputer<'a, B: Backend> {
    policy: Recompute,
    seed: u64,
    training: bool,
    attention: Option<AttentionFn<B>>,
    handle: Option<HandleFn<B>>,
    regions: RefCell<Vec<Region<'a, B>>>,
    fence: Option<Fence<'a>>,
    /// Run once after the loss's own backward pass, before the regions' (the step's phases).
    after_loss_pass: Option<Box<dyn Fn() + 'a>>,
    /// The factor backward's root carries (loss scale over micro-batches): auxiliary losses
    /// are weighted by it.
    objective_weight: f64,
    /// Per block, its auxiliary loss (detached) and routing, as the last forward of the block
    /// gave them (a recomputed block's replay writes the same values again).
    auxiliary: RefCell<std::collections::BTreeMap<usize, Auxiliary<B>>>,
}

impl<'a, X: FusedOps, C: CheckpointStrategy> Recomputer<'a, Autodiff<X, C>> {
    /// A training step's checkpointer: `policy` decides what is recomputed; `seed` (vary it per
    /// step and micro-batch, and per data-parallel rank) seeds every dropout mask and region.
    pub fn new(policy: Recompute, seed: u64) -> Self {
        Self {
            policy,
            seed,
            training: true,
            attention: Some(attention_autodiff::<X, C>),
            handle: Some(grad_handle::<X, C>),
            ..Self::inference()
        }
    }
}

impl<'a, B: Backend> Recomputer<'a, B> {
    /// No recomputation and no dropout (evaluation, generation; any backend).
    pub fn inference() -> Self {
        Self {
            policy: Recompute::None,
            seed: 0,
            training: false,
            attention: None,
            handle: None,
            regions: RefCell::new(Vec::new()),
            fence: None,
            after_loss_pass: None,
            objective_weight: 1.0,
            auxiliary: RefCell::default(),
        }
    }

    /// Backward starts from the loss times `weight` (the loss scale over the micro-batches):
    /// auxiliary losses get the same weight
    /// ([`ForwardHooks::auxiliary_loss`](wildfire_kernels::hooks::ForwardHooks::auxiliary_loss)).
    /// 1 by default.
    pub fn with_objective_weight(mut self, weight: f64) -> Self {
        self.objective_weight = weight;
        self
    }

    /// The auxiliary losses (detached) and routing of the forward so far, by block, taken
    /// (empty for a dense model).
    pub fn auxiliary(&self) -> Vec<(usize, Auxiliary<B>)> {
        std::mem::take(&mut *self.auxiliary.borrow_mut())
            .into_iter()
            .collect()
    }

    /// The policy.
    pub fn policy(&self) -> Recompute {
        self.policy
    }

    /// Whether dropout is applied.
    pub fn training(&self) -> bool {
        self.training
    }

    /// Regions recorded so far (recomputed by [`backward`](Self::backward)).
    pub fn regions(&self) -> usize {
        self.regions.borrow().len()
    }

    /// Run after every backward pass of [`backward`](Self::backward): with ranks as threads, a
    /// world barrier that keeps the ranks' passes apart (Burn 0.21 locks every graph at the end
    /// of a backward pass).
    pub fn with_fence(mut self, fence: impl Fn() -> Result<(), Error> + 'a) -> Self {
        self.fence = Some(Box::new(fence));
        self
    }

    /// Run `f` once after the loss's backward pass, before the recomputed regions' passes
    /// (also when there are none): where the step's backward phase ends and its recomputed
    /// phase begins ([`PhasePeaks`](crate::PhasePeaks)).
    pub fn with_after_loss_pass(mut self, f: impl Fn() + 'a) -> Self {
        self.after_loss_pass = Some(Box::new(f));
        self
    }

    /// The seed of the random stream of `(layer, site)` in this step.
    pub fn seed_of(&self, layer: usize, site: u64) -> u64 {
        mix_seed(self.seed, layer as u64, site)
    }
}

impl<'a, B: AutodiffBackend> Recomputer<'a, B> {
    /// `loss.backward()` with the recorded regions recomputed: one backward pass for the loss,
    /// then one per region (last first); the parameter gradients of all passes merged, as if
    /// from one pass. The forward must have run on parameters no earlier backward reached —
    /// a fresh model, or [`fresh_leaves`](wildfire_parallel::fresh_leaves) per micro-batch when
    /// gradients are accumulated, as [`StepRunner`](crate::StepRunner) does — or Burn 0.21 may
    /// free the graph under a region before its pass (and its gradients are lost).
    pub fn backward<M: AutodiffModule<B>>(
        &self,
        loss: Tensor<B, 1>,
        model: &M,
    ) -> Result<B::Gradients, Error> {
        self.backward_with_inputs::<M, 1>(loss, model, &[])
    }

    /// [`backward`](Self::backward) that also sums, over every pass, the gradients of `inputs`:
    /// leaves the forward started from (a pipeline stage's received activation, whose gradient
    /// a region that starts at it gets only in its own pass).
    pub fn backward_with_inputs<M: AutodiffModule<B>, const D: usize>(
        &self,
        loss: Tensor<B, 1>,
        model: &M,
        inputs: &[Tensor<B, D>],
    ) -> Result<B::Gradients, Error> {
        let device = loss.device();
        let mut main = loss.backward();
        self.fenced()?;
        if let Some(f) = &self.after_loss_pass {
            f();
        }
        let mut regions = std::mem::take(&mut *self.regions.borrow_mut());
        if regions.is_empty() {
            return Ok(main);
        }
        let mut pending: Vec<Option<FloatTensor<B::InnerBackend>>> =
            (0..regions.len()).map(|_| None).collect();
        harvest::<B>(&regions, &mut main, &mut pending);
        let _scope = RecomputeScope::enter();
        while let Some(region) = regions.pop() {
            let Some(grad) = pending[regions.len()].take() else {
                // The output did not reach the loss: nothing to propagate.
                continue;
            };
            B::seed(&device, region.seed);
            let y = (region.recompute)(self, region.input);
            let weighted = B::float_sum(B::float_mul(y, B::from_inner(grad)));
            let mut pass = B::backward(weighted);
            self.fenced()?;
            harvest::<B>(&regions, &mut pass, &mut pending);
            model.visit(&mut MergeGrads::<B> {
                from: &mut pass,
                into: &mut main,
            });
            for x in inputs {
                if let Some(g) = x.grad_remove(&mut pass) {
                    let g = match x.grad_remove(&mut main) {
                        Some(old) => g + old,
                        None => g,
                    };
                    x.grad_replace(&mut main, g);
                }
            }
        }
        Ok(main)
    }

    fn fenced(&self) -> Result<(), Error> {
        match &self.fence {
            Some(fence) => fence(),
            None => Ok(()),
        }
    }
}

/// Move the gradients that reached the regions' outputs into their accumulators.
fn harvest<B: AutodiffBackend>(
    regions: &[Region<'_, B>],
    grads: &mut B::Gradients,
    pending: &mut [Option<FloatTensor<B::InnerBackend>>],
) {
    for (region, slot) in regions.iter().zip(pending.iter_mut()) {
        if let Some(g) = B::grad_remove(&region.output, grads) {
            *slot = Some(match slot.take() {
                Some(old) => {
                    <B::InnerBackend as FloatTensorOps<B::InnerBackend>>::float_add(g, old)
                }
                None => g,
            });
        }
    }
}

struct MergeGrads<'g, B: AutodiffBackend> {
    from: &'g mut B::Gradients,
    into: &'g mut B::Gradients,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for MergeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if let Some(g) = t.grad_remove(self.from) {
            // As Burn's own accumulation: new + old.
            let g = match t.grad_remove(self.into) {
                Some(old) => g + old,
                None => g,
            };
            t.grad_replace(self.into, g);
        }
    }
}

/// The model-side face of a `Recomputer`: a model written against
/// [`ForwardHooks`](wildfire_kernels::hooks::ForwardHooks) gets its blocks recomputed, its
/// dropout masks replayed and its attention core recomputed as the policy says.
impl<'a, B: FusedOps> wildfire_kernels::hooks::ForwardHooks<'a, B> for Recomputer<'a, B> {
    /// Block `index` of `count` in the model: `f(module, x, self)`, recomputed in backward if the
    /// policy says so. While training, the backend is seeded with the block's stream first (also
    /// when not recomputed, so every policy draws the same numbers).
    fn block<M, F, const D: usize>(
        &self,
        index: usize,
        count: usize,
        module: &M,
        x: Tensor<B, D>,
        f: F,
    ) -> Tensor<B, D>
    where
        M: Module<B> + 'a,
        F: Fn(&M, Tensor<B, D>, &Self) -> Tensor<B, D> + 'a,
    {
        let device = x.device();
        let seed = self.seed_of(index, SITE_BLOCK);
        if self.training {
            B::seed(&device, seed);
        }
        if !(self.training && self.policy.recomputes_block(index, count) && B::ad_enabled(&device))
        {
            return f(module, x, self);
        }
        // Gradients off: the parameters' copies are untracked, so nothing inside is recorded.
        let frozen = module.clone().no_grad();
        // (`detach` keeps `require_grad` in Burn; `set_require_grad(false)` makes an untracked
        // value.)
        let y = f(&frozen, x.clone().set_require_grad(false), self)
            .set_require_grad(false)
            .require_grad();
        self.regions.borrow_mut().push(Region {
            input: prim(x),
            output: match self.handle {
                Some(handle) => handle(&prim(y.clone())),
                None => prim(y.clone()),
            },
            seed,
            recompute: {
                // The region owns its module (shared parameter handles, no values copied).
                let module = module.clone();
                Box::new(move |ckpt, input| prim(f(&module, float(input), ckpt)))
            },
        });
        y
    }

    /// [`attention_heads`](wildfire_kernels::hooks::ForwardHooks::attention_heads) on packed projections `qkv` `[b, t, h, 3·hd]` (per head:
    /// queries, keys, values side by side), giving `[b, t, h, hd]`. Without dropout, on a backend
    /// with fused attention, one op that never splits `qkv` nor transposes the output
    /// ([`FusedOps::fused_attention_qkv`]); otherwise q, k and v are split out and go through
    /// [`attention_heads`](wildfire_kernels::hooks::ForwardHooks::attention_heads) and its recomputation policy.
    fn attention_qkv(
        &self,
        layer: usize,
        qkv: Tensor<B, 4>,
        scale: f64,
        causal: bool,
        dropout: f64,
    ) -> Tensor<B, 4> {
        let dropout = if self.training { dropout } else { 0.0 };
        if B::FUSED.attention && dropout == 0.0 {
            return wildfire_kernels::ops::attention_qkv(qkv, scale, causal);
        }
        let qkv = wildfire_kernels::ops::split_qkv(qkv);
        self.attention_heads(layer, qkv, scale, causal, dropout)
            .swap_dims(1, 2)
    }

    /// The attention core `softmax(mask(q·kᵀ·scale))·v` of layer `layer` on `qkv` = `[q, k, v]`,
    /// `[b, h, t, hd]` each, with dropout on the probabilities while training. Without dropout,
    /// on a backend with fused kernels ([`FusedOps::FUSED`]`.attention`), this is the flash-attention kernel:
    /// it keeps only q, k, v, the output and one log-sum-exp per query, and its backward
    /// recomputes the probabilities from it — what `Selective` asks for, under every policy.
    fn attention_heads(
        &self,
        layer: usize,
        [q, k, v]: [Tensor<B, 4>; 3],
        scale: f64,
        causal: bool,
        dropout: f64,
    ) -> Tensor<B, 4> {
        let spec = AttentionSpec {
            scale,
            causal,
            dropout: if self.training { dropout } else { 0.0 },
            seed: self.seed_of(layer, SITE_ATTENTION),
        };
        if B::FUSED.attention && spec.dropout == 0.0 {
            return wildfire_kernels::ops::attention(q, k, v, scale, causal);
        }
        // Grouped key/value heads repeated for the query heads each serves (the fused kernel
        // above reads them in place).
        let h = q.dims()[1];
        let repeat = |x| wildfire_kernels::reference::repeat_heads(x, h);
        let (k, v) = (repeat(k), repeat(v));
        match self.attention {
            Some(op) => op(q, k, v, &spec, self.policy == Recompute::Selective),
            None => attention_reference(q, k, v, &spec),
        }
    }

    /// While training: `x` carrying the block's loss into backward with the objective's
    /// weight, the loss (detached) and routing kept for the step's record
    /// ([`Recomputer::auxiliary`]).
    fn auxiliary_loss(&self, layer: usize, x: Tensor<B, 3>, aux: Auxiliary<B>) -> Tensor<B, 3> {
        if !self.training {
            return x;
        }
        let kept = Auxiliary {
            loss: aux.loss.clone().detach(),
            routing: aux.routing,
        };
        self.auxiliary.borrow_mut().insert(layer, kept);
        wildfire_kernels::ops::carry_loss(x, aux.loss, self.objective_weight)
    }

    /// Inverted dropout with probability `p` at `(layer, site)` while training; identity otherwise.
    fn dropout<const D: usize>(
        &self,
        layer: usize,
        site: u64,
        x: Tensor<B, D>,
        p: f64,
    ) -> Tensor<B, D> {
        if !self.training || p <= 0.0 {
            return x;
        }
        let mask = dropout_mask(self.seed_of(layer, 16 + site), x.dims(), p, &x.device());
        x * mask
    }
}
