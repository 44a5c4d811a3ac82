//! Unscale, detect overflow and measure the global gradient norm with **one** all-reduce over
//! the whole mesh of `[found_inf, Σ‖g‖²]`, each element counted exactly once whatever the layout
//! (a replicated gradient's local sum is divided by its replication count; shards add up), then
//! clip — so an overflow on any rank makes every rank skip, and the norm equals the single-device
//! norm for DDP, FSDP and tensor-parallel layouts.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use wildfire_parallel::{Distributed, Error, Group, Placement, ReduceOp, dtensor};

/// The outcome of [`unscale_check_clip`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradCheck {
    /// Global L2 norm of the unscaled gradients (before clipping; NaN or inf on overflow).
    pub norm: f32,
    /// Some gradient on some rank was not finite.
    pub found_inf: bool,
    /// The factor the gradients were multiplied by to clip (1: not clipped).
    pub clip_factor: f32,
}

struct Visit<'a, X: Backend> {
    grads: &'a mut GradientsParams,
    /// Parameters left out of the norm (a pipeline stage's copy of a tied parameter, counted
    /// on the stage that holds the original).
    skip: &'a [ParamId],
    inv_scale: f32,
    sum_sq: f64,
    ctx: Option<std::sync::Arc<wildfire_parallel::RankContext>>,
    clip: Option<f32>,
    _x: std::marker::PhantomData<X>,
}

impl<B, X> ModuleVisitor<B> for Visit<'_, X>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<Distributed<X>, D>(param.id) else {
            return;
        };
        let factor = self.clip.unwrap_or(self.inv_scale);
        let grad = if factor != 1.0 {
            grad.mul_scalar(factor)
        } else {
            grad
        };
        if self.clip.is_none() && !self.skip.contains(&param.id) {
            let t = dtensor(&grad);
            t.device().context().count_host_read();
            self.ctx.get_or_insert_with(|| t.device().context().clone());
            let copies = copies(&t);
            let local = Tensor::<X, D>::from_primitive(TensorPrimitive::Float(t.into_local()));
            let sq: f32 = local.powi_scalar(2).sum().into_scalar().elem();
            self.sum_sq += f64::from(sq) / copies as f64;
        }
        self.grads.register::<Distributed<X>, D>(param.id, grad);
    }
}

/// How many ranks hold the same piece of `t` (the product of its replicated axes): a local sum
/// divided by it counts every element once in a sum over the whole mesh. The pipeline axis is
/// not one of them: its ranks hold different stages, each parameter on one of them.
pub(crate) fn copies<X: Backend>(t: &wildfire_parallel::DTensor<X>) -> usize {
    let mesh = t.device().mesh();
    t.layout()
        .placements()
        .iter()
        .enumerate()
        .filter(|&(a, p)| {
            matches!(p, Placement::Replicate | Placement::Local) && !mesh.axis(a).is_pipeline()
        })
        .map(|(a, _)| mesh.axis_size(a))
        .product()
}

/// Multiply every gradient by `inv_scale` (1 / loss scale), agree across the whole mesh on
/// overflow and the global norm (one all-reduce), and when finite and above `max_norm`, scale the
/// gradients down to it. Call after `sync_gradients` (gradients at their parameters' placements).
pub fn unscale_check_clip<B, X, M>(
    model: &M,
    grads: &mut GradientsParams,
    inv_scale: f32,
    max_norm: Option<f32>,
) -> Result<GradCheck, Error>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
    M: AutodiffModule<B>,
{
    check_with_loss(model, grads, inv_scale, max_norm, false)
}

/// [`unscale_check_clip`], with this rank's loss being non-finite counted as an overflow too (in
/// the same all-reduce), so a step whose loss is NaN on any rank is skipped on every rank.
pub(crate) fn check_with_loss<B, X, M>(
    model: &M,
    grads: &mut GradientsParams,
    inv_scale: f32,
    max_norm: Option<f32>,
    loss_not_finite: bool,
) -> Result<GradCheck, Error>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
    M: AutodiffModule<B>,
{
    check_models(
        std::slice::from_ref(model),
        std::slice::from_mut(grads),
        inv_scale,
        max_norm,
        loss_not_finite,
        &[],
        None,
    )
}

/// [`check_with_loss`] over several modules (a pipeline rank's model chunks, `grads[i]` the
/// gradients of `models[i]`) in one all-reduce, the parameters in `skip` left out of the norm
/// (still unscaled and clipped). `ctx`: the rank's context, for a rank whose modules may hold
/// no gradient (it still joins the all-reduce).
pub(crate) fn check_models<B, X, M>(
    models: &[M],
    grads: &mut [GradientsParams],
    inv_scale: f32,
    max_norm: Option<f32>,
    loss_not_finite: bool,
    skip: &[ParamId],
    ctx: Option<std::sync::Arc<wildfire_parallel::RankContext>>,
) -> Result<GradCheck, Error>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
    M: AutodiffModule<B>,
{
    let (mut sum_sq, mut ctx) = (0.0, ctx);
    for (model, grads) in models.iter().zip(grads.iter_mut()) {
        let mut v = Visit::<X> {
            grads,
            skip,
            inv_scale,
            sum_sq: 0.0,
            ctx: ctx.take(),
            clip: None,
            _x: std::marker::PhantomData,
        };
        model.visit(&mut v);
        sum_sq += v.sum_sq;
        ctx = v.ctx;
    }
    let local_inf = loss_not_finite || !sum_sq.is_finite();
    let (found_inf, total) = match &ctx {
        Some(ctx) if ctx.world_size() > 1 => {
            let data = TensorData::new(
                vec![
                    if local_inf { 1.0f64 } else { 0.0 },
                    if local_inf { 0.0 } else { sum_sq },
                ],
                [2],
            );
            let out = ctx
                .comm()
                .all_reduce(Group::World, data, ReduceOp::Sum)?
                .to_vec::<f64>()
                .expect("f64");
            (out[0] > 0.0, out[1])
        }
        _ => (local_inf, sum_sq),
    };
    let norm = if found_inf {
        f32::INFINITY
    } else {
        total.sqrt() as f32
    };
    let mut clip_factor = 1.0;
    if let Some(max) = max_norm
        && !found_inf
        && norm > max
    {
        clip_factor = max / (norm + 1e-6);
        for (model, grads) in models.iter().zip(grads.iter_mut()) {
            model.visit(&mut Visit::<X> {
                grads,
                skip,
                inv_scale: 1.0,
                sum_sq: 0.0,
                ctx: None,
                clip: Some(clip_factor),
                _x: std::marker::PhantomData,
            });
        }
    }
    Ok(GradCheck {
        norm,
        found_inf,
        clip_factor,
    })
}
