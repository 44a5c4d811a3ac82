//! FSDP and the ZeRO family over the data axes: `fully_shard` places the parameters and sets the
//! rank's [`ShardingPolicy`] (which the backend reads to reduce gradients); [`FsdpOptimizer`]
//! wraps any Burn optimizer so its state is sharded.
//!
//! | strategy | parameters rest | gradients | optimizer state | bytes (f32, AdamW) |
//! |---|---|---|---|---|
//! | `NoShard` (DDP) | replicated | all-reduced once after backward (`sync_gradients`) | replicated | 16Ψ |
//! | `ShardOptimizer` (ZeRO-1) | replicated | all-reduced once after backward, sliced for the step | sharded | 8Ψ + 8Ψ/N |
//! | `ShardGradOp` (ZeRO-2) | replicated, re-gathered after the step | reduce-scattered where born | sharded | 4Ψ + 12Ψ/N |
//! | `FullShard` (ZeRO-3) | sharded, gathered per use (forward and again in backward) | reduce-scattered where born | sharded | 16Ψ/N |
//! | `Hybrid` (HSDP) | `FullShard` over `dp_shard`, replicated over `dp_replicate` | reduce-scattered / all-reduced | sharded over `dp_shard` | 16Ψ/N_shard |
//!
//! Shards are `Shard(0)`, padded with zero rows where the first dimension does not divide by the
//! shard count N (each rank holds ⌈rows/N⌉ rows; gathering trims the padding), as FSDP2 does, so
//! any shape shards. A parameter with fewer rows than N stays replicated, and so does one whose
//! first dimension a tensor-parallel split already divides unevenly for N.

use crate::data_parallel::{DistributedBackend, dtensor, from_dtensor, redistribute, replicate};
use crate::device::RankContext;
use crate::error::Error;
use crate::mesh::{AxisKind, DeviceMesh};
use crate::params::{Mapped, ModulePath, TryParamMapper, map_value, try_map_params};
use crate::placement::{Layout, Placement};
use crate::policy::{GradientReduction, ShardingPolicy};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// How parameters, gradients and optimizer state are spread over the data axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FsdpStrategy {
    /// DDP: everything replicated.
    NoShard,
    /// ZeRO-1: optimizer state sharded.
    ShardOptimizer,
    /// ZeRO-2: gradients and optimizer state sharded; parameters gathered once per step.
    ShardGradOp,
    /// ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded.
    FullShard,
    /// HSDP: `FullShard` over the `dp_shard` axis, replicated over `dp_replicate`.
    Hybrid,
}

/// The data axes a strategy shards over on `mesh`.
fn shard_axes(mesh: &DeviceMesh, strategy: FsdpStrategy) -> Result<Vec<usize>, Error> {
    let data: Vec<usize> = (0..mesh.axes().len())
        .filter(|&a| mesh.axis(a).kind == AxisKind::Data)
        .collect();
    Ok(match strategy {
        FsdpStrategy::NoShard => Vec::new(),
        FsdpStrategy::Hybrid => {
            let shard = mesh.axis_index("dp_shard")?;
            mesh.axis_index("dp_replicate")?;
            vec![shard]
        }
        _ => data,
    })
}

struct Sharder<'a> {
    mesh: &'a DeviceMesh,
    axes: Vec<usize>,
    ctx: Option<Arc<RankContext>>,
    shapes: std::collections::BTreeSet<Vec<usize>>,
}

impl<B: DistributedBackend> TryParamMapper<B> for Sharder<'_> {
    type Error = Error;

    fn try_map<const D: usize>(
        &mut self,
        _path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Mapped<B, D, Error> {
        // Replicate -> Shard(0) is a local slice: no collective, so stopping at a failure keeps
        // the ranks' collectives matched.
        map_value(param, |tensor| {
            let t = dtensor(tensor);
            self.ctx.get_or_insert_with(|| t.device().context().clone());
            self.shapes.insert(t.global_shape().to_vec());
            let target = crate::placement::shard_dim0(
                t.layout().clone(),
                &t.global_shape().to_vec(),
                &self.axes,
                self.mesh,
            );
            redistribute(tensor.clone(), &target)
        })
    }
}

/// Sharded initialisation of a module built with Burn's lazy parameters (every burn-nn module:
/// `Param::uninitialized` keeps the shape and the initialiser until first use): each parameter
/// is made directly as this rank's piece in the layout that `plan` (tensor parallelism) and
/// `strategy` (over the data axes) give it, so no rank ever holds a parameter whole. Random
/// initialisers draw piece by piece from a counter-based stream per parameter (seeded by `seed`
/// and the parameter's path, [`crate::rng::fill_distribution`]): the pieces are those of the same
/// call at world size 1, whatever the mesh. Constants fill their pieces. An initialiser made of
/// more than one op (Burn's `Orthogonal`) and an already initialised parameter are made whole
/// and laid out after (sliced). Then lay the module out as usual ([`crate::tensor_parallel`],
/// [`fully_shard`]): the parameters already have their layouts, so nothing moves.
pub fn init_sharded<B: DistributedBackend, M: Module<B>>(
    module: M,
    mesh: &DeviceMesh,
    plan: Option<&crate::TpPlan>,
    strategy: FsdpStrategy,
    seed: u64,
) -> Result<M, Error> {
    use crate::params::{ParamVisitor, visit_params};

    struct Shapes(Vec<(String, Vec<usize>)>);
    impl<B: burn::tensor::backend::Backend> ParamVisitor<B> for Shapes {
        fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
            self.0.push((path.name(), param.lazy_shape().to_vec()));
        }
    }

    struct Init<'a> {
        layouts: std::vec::IntoIter<Layout>,
        mesh: &'a DeviceMesh,
        seed: u64,
    }
    impl<B: DistributedBackend> TryParamMapper<B> for Init<'_> {
        type Error = Error;

        fn try_map<const D: usize>(
            &mut self,
            path: &ModulePath,
            param: Param<Tensor<B, D>>,
        ) -> Mapped<B, D, Error> {
            let layout = self.layouts.next().expect("one layout per parameter");
            let device = B::dist_device(&param.lazy_device());
            if device.mesh() != self.mesh {
                let e = Error::InvalidLayout {
                    shape: param.lazy_shape().to_vec(),
                    mesh: self.mesh.to_string(),
                    reason: format!("the parameter lives on mesh {}", device.mesh()),
                };
                return Err((e, param));
            }
            let ctx = device.context().clone();
            if !param.is_initialized() {
                // FNV-1a of the path: the parameter's stream, the same on every rank and mesh.
                let name = path.name();
                let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
                });
                ctx.set_init_scope(Some(crate::device::InitScope {
                    shape: param.lazy_shape().to_vec(),
                    layout: layout.clone(),
                    stream: crate::rng::mix_seed(self.seed, hash, 0),
                }));
            }
            // Consumed (made) inside the scope.
            map_value(param, |tensor| {
                ctx.set_init_scope(None);
                redistribute(tensor.clone(), &layout)
            })
        }
    }

    let mut shapes = Shapes(Vec::new());
    visit_params(&module, &mut shapes);
    let layouts = planned_layouts(&shapes.0, mesh, plan, strategy)?;
    let mut init = Init {
        layouts: layouts.into_iter(),
        mesh,
        seed,
    };
    try_map_params(module, &mut init)
}

/// FSDP prefetch: call before each training step's first forward pass (the engine's
/// `StepRunner` does). It hands the rank this step's parameters, in the model's order; the rank
/// records the order the step gathers them in and, from the next step on, keeps up to
/// [`RankPolicy::prefetch`](crate::RankPolicy) of the next gathers of that order in flight on
/// its communication queue while it computes (forward: the next blocks' parameters; backward:
/// the previous blocks'). The gathers, their count and every result are those of the blocking
/// path ([`RankContext::prefetch_stats`] counts what was served ahead). The parameters are let
/// go at [`sync_gradients`](crate::sync_gradients). Does nothing unless the parameters rest
/// sharded (FullShard, HSDP) and the policy's `prefetch` is above 0.
pub fn prefetch_parameters<B, X, M>(model: &M)
where
    B: AutodiffBackend<InnerBackend = crate::Distributed<X>>,
    X: burn_backend::Backend,
    M: AutodiffModule<B>,
{
    struct Collect<X: burn_backend::Backend>(Vec<crate::tensor::DTensor<X>>);
    impl<B, X> ModuleVisitor<B> for Collect<X>
    where
        B: AutodiffBackend<InnerBackend = crate::Distributed<X>>,
        X: burn_backend::Backend,
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(B::inner(param.val().into_primitive().tensor()));
        }
    }
    let mut params = Collect::<X>(Vec::new());
    model.visit(&mut params);
    let ctx = match params.0.first() {
        Some(p) => p.device().context().clone(),
        None => crate::device::current_device::<X>().context().clone(),
    };
    let depth = ctx.with_policy(|p| {
        if p.sharding.param_shard_axes.is_empty() {
            0
        } else {
            p.prefetch
        }
    });
    crate::tensor::prefetch::start_step::<X>(&ctx, params.0, depth);
}

/// Lay `module` out for `strategy` over the data axes of `mesh` and set this rank's
/// [`ShardingPolicy`]. Call once, after the model is built (and after tensor parallelism, if any). Parameters
/// keep their `ParamId`s; every rank starts from rank 0's values.
pub fn fully_shard<B: DistributedBackend, M: Module<B>>(
    module: M,
    mesh: &DeviceMesh,
    strategy: FsdpStrategy,
) -> Result<M, Error> {
    let axes = shard_axes(mesh, strategy)?;
    let module = replicate(module, mesh)?;
    let rests_sharded = matches!(strategy, FsdpStrategy::FullShard | FsdpStrategy::Hybrid);
    let mut sharder = Sharder {
        mesh,
        axes: if rests_sharded {
            axes.clone()
        } else {
            Vec::new()
        },
        ctx: None,
        shapes: Default::default(),
    };
    let module = try_map_params(module, &mut sharder)?;
    let ctx = sharder.ctx.unwrap_or_else(|| {
        crate::device::current_device::<B::Inner>()
            .context()
            .clone()
    });
    let param_shapes = sharder.shapes;
    ctx.update_policy(|p| {
        p.sharding = ShardingPolicy {
            param_shapes,
            ..sharding_policy(strategy, axes)
        }
    });
    Ok(module)
}

/// The layout of every parameter of a model after [`crate::tensor_parallel`] with `plan` (when
/// given) and [`fully_shard`] with `strategy` on `mesh`, computed from the parameters' paths and
/// shapes alone (in visiting order, as [`crate::visit_params`] reports them). A model built
/// directly in these layouts (sharded initialisation: each rank materialises only its pieces)
/// comes out of those two calls unchanged; they then only set the rank's policy.
pub fn planned_layouts(
    params: &[(String, Vec<usize>)],
    mesh: &DeviceMesh,
    plan: Option<&crate::TpPlan>,
    strategy: FsdpStrategy,
) -> Result<Vec<Layout>, Error> {
    planned_layouts_with_experts(params, mesh, plan, &crate::ExpertPlan::new(), strategy)
}

/// [`planned_layouts`] with the stacked expert weights `experts` names split over the expert
/// axis ([`crate::expert_parallel`], applied between tensor parallelism and FSDP).
pub fn planned_layouts_with_experts(
    params: &[(String, Vec<usize>)],
    mesh: &DeviceMesh,
    plan: Option<&crate::TpPlan>,
    experts: &crate::ExpertPlan,
    strategy: FsdpStrategy,
) -> Result<Vec<Layout>, Error> {
    let splits = match plan {
        Some(plan) => {
            let axis = mesh
                .axis_index("tp")
                .map_err(|_| Error::NoTpAxis(mesh.to_string()))?;
            let scan: Vec<(String, String, Vec<usize>)> = params
                .iter()
                .map(|(path, shape)| {
                    let (module, field) = path.rsplit_once('.').unwrap_or(("", path));
                    (module.to_string(), field.to_string(), shape.clone())
                })
                .collect();
            let splits = crate::tensor_parallel::assign(plan, &scan, mesh.axis_size(axis))?;
            Some((axis, splits))
        }
        None => None,
    };
    let axes = shard_axes(mesh, strategy)?;
    let rests_sharded = matches!(strategy, FsdpStrategy::FullShard | FsdpStrategy::Hybrid);
    params
        .iter()
        .enumerate()
        .map(|(i, (path, shape))| {
            let mut layout = Layout::replicated(mesh);
            if let Some((axis, splits)) = &splits
                && let Some(dim) = splits[i]
            {
                layout = layout.with(*axis, Placement::Shard(dim));
            }
            if experts.covers(path) {
                layout = crate::expert_parallel::split_experts(layout, path, shape, mesh)?;
            }
            if rests_sharded {
                layout = crate::placement::shard_dim0(layout, shape, &axes, mesh);
            }
            Ok(layout)
        })
        .collect()
}

/// Where `strategy` puts parameters, gradients and optimizer state, sharding over `axes`.
fn sharding_policy(strategy: FsdpStrategy, axes: Vec<usize>) -> ShardingPolicy {
    use FsdpStrategy::*;
    let params = match strategy {
        FullShard | Hybrid => axes.clone(),
        NoShard | ShardOptimizer | ShardGradOp => Vec::new(),
    };
    let (grads, reduction) = match strategy {
        NoShard | ShardOptimizer => (Vec::new(), GradientReduction::AtSync),
        ShardGradOp | FullShard | Hybrid => (axes.clone(), GradientReduction::WhereBorn),
    };
    let optimizer = match strategy {
        NoShard => Vec::new(),
        ShardOptimizer | ShardGradOp | FullShard | Hybrid => axes,
    };
    ShardingPolicy::new(params, grads, optimizer, reduction)
}

/// The layout a parameter's optimizer state (AdamW's moments) has under its rank's sharding
/// policy: the parameter's model-axis splits, data axes replicated, then dim 0 split over the
/// optimizer's shard axes — the parameter's own layout for DDP, FSDP and HSDP, a shard of a
/// replicated parameter for ZeRO-1/2. A checkpoint loader builds the state in this layout.
pub fn optimizer_state_layout<B: burn::tensor::backend::Backend>(
    param: &crate::tensor::DTensor<B>,
) -> crate::placement::Layout {
    let device = param.device();
    let mesh = device.mesh();
    let axes = device
        .context()
        .policy()
        .sharding
        .optimizer_shard_axes()
        .to_vec();
    let shape = param.global_shape().to_vec();
    let start = device.context().data_unsplit(&shape, param.layout());
    crate::placement::shard_dim0(start, &shape, &axes, mesh)
}

/// Any Burn optimizer, with its state sharded as the strategy says: for ZeRO-1 the (replicated)
/// gradients are sliced to the shard before the step; for ZeRO-1/2 the updated (sharded)
/// parameters are all-gathered back to replicated after it. For DDP and FSDP it only delegates.
#[derive(Clone)]
pub struct FsdpOptimizer<O> {
    inner: O,
}

impl<O> FsdpOptimizer<O> {
    /// Wrap `inner`.
    pub fn new(inner: O) -> Self {
        Self { inner }
    }
}

struct Slicer<'a> {
    grads: &'a mut GradientsParams,
    /// The data axes the optimizer state is sharded over.
    axes: &'a [usize],
}

impl<B> ModuleVisitor<B> for Slicer<'_>
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let t = dtensor(&grad);
        let mesh = t.device().mesh().clone();
        let target = crate::placement::shard_dim0(
            t.layout().clone(),
            &t.global_shape().to_vec(),
            self.axes,
            &mesh,
        );
        // Replicate -> Shard is a local slice: no communication.
        let sliced = t
            .redistribute(&target)
            .unwrap_or_else(|e| crate::error::raise(e));
        self.grads
            .register::<B::InnerBackend, D>(param.id, from_dtensor::<B::InnerBackend, D>(sliced));
    }
}

/// Gathers ZeRO-1/2's sharded updates back to replicated parameters. It goes on through every
/// parameter after a failure (keeping the first error): each gather is a collective, and a rank
/// that stopped early would leave its peers waiting in theirs.
struct Regather {
    error: Option<Error>,
}

impl<B: DistributedBackend> ModuleMapper<B> for Regather {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        map_value(param, |tensor| {
            let t = dtensor(tensor);
            let mesh = t.device().mesh().clone();
            // Stacked expert weights stay split over the expert axis.
            let shape = t.global_shape().to_vec();
            let unsplit = t.device().context().data_unsplit(&shape, t.layout());
            let mut target = t.layout().clone();
            for (a, axis) in mesh.axes().iter().enumerate() {
                if axis.kind == AxisKind::Data && matches!(target.get(a), Placement::Shard(_)) {
                    target.set(a, unsplit.get(a));
                }
            }
            redistribute(tensor.clone(), &target)
        })
        .unwrap_or_else(|(e, param)| {
            self.error.get_or_insert(e);
            param
        })
    }
}

impl<O, M, B> Optimizer<M, B> for FsdpOptimizer<O>
where
    O: Optimizer<M, B>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    B: DistributedBackend,
{
    type Record = O::Record;

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        let sharding = first_context(&module)
            .map(|ctx| ctx.policy().sharding)
            .unwrap_or_default();
        let optimizer_sharded = !sharding.optimizer_shard_axes().is_empty();
        // ZeRO-1: the optimizer state is sharded, the gradients arrive replicated.
        if optimizer_sharded && sharding.grad_shard_axes().is_empty() {
            module.visit(&mut Slicer {
                grads: &mut grads,
                axes: sharding.optimizer_shard_axes(),
            });
        }
        let module = self.inner.step(lr, module, grads);
        // ZeRO-1/2: the parameters rest replicated, their updates come out sharded.
        if optimizer_sharded && sharding.param_shard_axes().is_empty() {
            let mut regather = Regather { error: None };
            let module = module.map(&mut regather);
            if let Some(e) = regather.error {
                crate::error::raise(e);
            }
            return module;
        }
        module
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        // Multi-device gradients are not a data-parallel concept here: delegate unchanged.
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: self.inner.load_record(record),
        }
    }
}

/// The rank context of a module's first parameter.
fn first_context<B: DistributedBackend, M: Module<B>>(module: &M) -> Option<Arc<RankContext>> {
    struct First(Option<Arc<RankContext>>);
    impl<B: DistributedBackend> ModuleVisitor<B> for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.0.is_none() {
                self.0 = Some(dtensor(&param.val()).device().context().clone());
            }
        }
    }
    let mut f = First(None);
    module.visit(&mut f);
    f.0
}

/// Bytes of this rank's local pieces of `module`'s parameters on the device (an offloaded
/// piece, in host memory between uses, counts none).
pub fn parameter_bytes<B: DistributedBackend, M: Module<B>>(module: &M) -> u64 {
    struct Sum(u64);
    impl<B: DistributedBackend> ModuleVisitor<B> for Sum {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = dtensor(&param.val());
            if !t.is_offloaded() {
                self.0 += t.local_bytes() as u64;
            }
        }
    }
    let mut s = Sum(0);
    module.visit(&mut s);
    s.0
}

/// Bytes of this rank's local pieces of the gradients of `module`'s parameters.
pub fn gradient_bytes<B, M>(module: &M, grads: &GradientsParams) -> u64
where
    B: AutodiffBackend,
    B::InnerBackend: DistributedBackend,
    M: AutodiffModule<B>,
{
    struct Sum<'a>(&'a GradientsParams, u64);
    impl<B> ModuleVisitor<B> for Sum<'_>
    where
        B: AutodiffBackend,
        B::InnerBackend: DistributedBackend,
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.get::<B::InnerBackend, D>(param.id) {
                self.1 += dtensor(&g).local_bytes() as u64;
            }
        }
    }
    let mut s = Sum(grads, 0);
    module.visit(&mut s);
    s.1
}
