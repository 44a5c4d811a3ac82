//! Data parallelism (DDP): give parameters a placement, and reduce the gradients that were not
//! reduced where they were born.

use crate::backend::Distributed;
use crate::comm::{Group, ReduceOp};
use crate::device::DistDevice;
use crate::error::Error;
use crate::mesh::{AxisKind, DeviceMesh};
use crate::params::{
    Mapped, ModulePath, TryParamMapper, TryParamVisitor, map_value, try_map_params,
    try_visit_params,
};
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::{AutodiffModule, Module, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

/// Backends whose float tensors are distributed tensors: `Distributed<B>` and
/// `Autodiff<Distributed<B>>`.
pub trait DistributedBackend: burn::tensor::backend::Backend {
    /// The backend under the decorator.
    type Inner: Backend;

    /// The distributed tensor behind a float tensor (a cheap clone).
    fn dtensor(tensor: &FloatTensor<Self>) -> DTensor<Self::Inner>;

    /// A float tensor from a distributed tensor (a new leaf under autodiff).
    fn from_dtensor(tensor: DTensor<Self::Inner>) -> FloatTensor<Self>;

    /// The rank's device behind this backend's device.
    fn dist_device(device: &Self::Device) -> DistDevice<Self::Inner>;
}

impl<B: Backend> DistributedBackend for Distributed<B> {
    type Inner = B;

    fn dtensor(tensor: &FloatTensor<Self>) -> DTensor<B> {
        tensor.clone()
    }

    fn from_dtensor(tensor: DTensor<B>) -> FloatTensor<Self> {
        tensor
    }

    fn dist_device(device: &DistDevice<B>) -> DistDevice<B> {
        device.clone()
    }
}

impl<B: Backend, C: CheckpointStrategy> DistributedBackend for Autodiff<Distributed<B>, C> {
    type Inner = B;

    fn dtensor(tensor: &FloatTensor<Self>) -> DTensor<B> {
        <Self as AutodiffBackend>::inner(tensor.clone())
    }

    fn from_dtensor(tensor: DTensor<B>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(tensor)
    }

    fn dist_device(device: &DistDevice<B>) -> DistDevice<B> {
        device.clone()
    }
}

/// The distributed tensor behind a Burn tensor.
pub fn dtensor<B: DistributedBackend, const D: usize>(tensor: &Tensor<B, D>) -> DTensor<B::Inner> {
    B::dtensor(&tensor.clone().into_primitive().tensor())
}

/// A Burn tensor from a distributed tensor (under autodiff: a new leaf, `require_grad` unset).
pub fn from_dtensor<B: DistributedBackend, const D: usize>(
    tensor: DTensor<B::Inner>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::from_dtensor(tensor)))
}

/// Give `tensor` a new layout (with the collectives that takes). Under autodiff the result is a
/// new leaf with the same `require_grad`, for parameters and inputs, not for activations.
pub fn redistribute<B: DistributedBackend, const D: usize>(
    tensor: Tensor<B, D>,
    layout: &Layout,
) -> Result<Tensor<B, D>, Error> {
    let require_grad = tensor.is_require_grad();
    let t = dtensor(&tensor).redistribute(layout)?;
    let out = from_dtensor::<B, D>(t);
    Ok(if require_grad {
        out.require_grad()
    } else {
        out
    })
}

/// Every float parameter of `module` with its local piece kept in host memory between uses
/// (`--offload params`: [`DTensor::offloaded`]); ids and `require_grad` are kept. Parameters
/// already offloaded stay as they are. Each use uploads the piece anew, so offload the
/// parameters of a model sharded with FSDP's full strategy, whose every use gathers its weights
/// anyway: a replicated parameter would be uploaded whole at every use.
pub fn offload_parameters<B: DistributedBackend, M: Module<B>>(module: M) -> M {
    try_map_dtensors(module, |_, t| Ok::<_, Error>(t.offloaded()))
        .unwrap_or_else(|e| crate::error::raise(e))
}

/// Map every float parameter of `module` as a distributed tensor (whatever its rank) with its
/// path, until `f` fails: then that error. Ids and `require_grad` are kept.
pub(crate) fn try_map_dtensors<B: DistributedBackend, M: Module<B>>(
    module: M,
    f: impl FnMut(&str, DTensor<B::Inner>) -> Result<DTensor<B::Inner>, Error>,
) -> Result<M, Error> {
    struct Each<F>(F);
    impl<B, F> TryParamMapper<B> for Each<F>
    where
        B: DistributedBackend,
        F: FnMut(&str, DTensor<B::Inner>) -> Result<DTensor<B::Inner>, Error>,
    {
        type Error = Error;

        fn try_map<const D: usize>(
            &mut self,
            at: &ModulePath,
            param: Param<Tensor<B, D>>,
        ) -> Mapped<B, D, Error> {
            map_value(param, |tensor| {
                let out = from_dtensor::<B, D>((self.0)(&at.name(), dtensor(tensor))?);
                Ok(if tensor.is_require_grad() {
                    out.require_grad()
                } else {
                    out
                })
            })
        }
    }
    try_map_params(module, &mut Each(f))
}

impl<B: Backend> DTensor<B> {
    /// Turn per-rank `Local` data on `axis` into `Replicate` by adopting group member 0's value
    /// (a broadcast): how a model initialised on every rank becomes one replicated model.
    pub fn adopt_from_first(self, axis: usize) -> Result<Self, Error> {
        if self.layout.get(axis) != Placement::Local {
            return Ok(self);
        }
        let local =
            crate::collectives::broadcast(&self.meta.device, Group::Axis(axis), self.local, 0)?;
        Ok(DTensor::new_shaped(
            local,
            self.meta.layout.clone().with(axis, Placement::Replicate),
            self.meta.shape.clone(),
            self.meta.device.clone(),
        ))
    }

    /// Member `root` of this rank's group along mesh axis `axis` sends its value, and every
    /// member returns it (one broadcast): an owner rank's result handed to its peers (Muon's
    /// owner-rank orthogonalisation). The value must not be split or partial on `axis`; the
    /// other members pass a value of the same layout, global shape and dtype, whose piece is
    /// only the receive buffer.
    pub fn broadcast_on(self, axis: usize, root: usize) -> Result<Self, Error> {
        if matches!(
            self.layout.get(axis),
            Placement::Shard(_) | Placement::Partial(_)
        ) {
            return Err(Error::Unsupported(format!(
                "a broadcast along axis {axis} of a value laid out {:?}",
                self.layout
            )));
        }
        let this = self.ready();
        let local =
            crate::collectives::broadcast(&this.meta.device, Group::Axis(axis), this.local, root)?;
        Ok(DTensor::new_shaped(
            local,
            this.meta.layout.clone(),
            this.meta.shape.clone(),
            this.meta.device.clone(),
        ))
    }
}

struct Replicator<'a> {
    mesh: &'a DeviceMesh,
}

impl<B: DistributedBackend> TryParamMapper<B> for Replicator<'_> {
    type Error = Error;

    fn try_map<const D: usize>(
        &mut self,
        _path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Mapped<B, D, Error> {
        map_value(param, |tensor| {
            let mut t = dtensor(tensor);
            if t.device().mesh() != self.mesh {
                return Err(Error::InvalidLayout {
                    shape: t.global_shape().to_vec().clone(),
                    mesh: self.mesh.to_string(),
                    reason: format!("the parameter lives on mesh {}", t.device().mesh()),
                });
            }
            for (a, axis) in self.mesh.axes().iter().enumerate() {
                if axis.kind == AxisKind::Data {
                    t = t.adopt_from_first(a)?;
                }
            }
            let out = from_dtensor::<B, D>(t);
            Ok(if tensor.is_require_grad() {
                out.require_grad()
            } else {
                out
            })
        })
    }
}

/// `module` with fresh autodiff leaves for its parameters: the same values (no copy), ids and
/// `require_grad`, new graph nodes. Build each micro-batch's graph on fresh leaves whenever
/// a graph outlives a backward pass that reached the parameters — recomputed regions, whose
/// passes run after the micro-batch's main backward, and pipeline micro-batches waiting for
/// theirs. Burn 0.21's autodiff forgets a parameter's leaf once a backward reached it, and a
/// later graph built on that leaf is stored apart from it, where the end-of-backward cleanup
/// of some other pass may free it (nondeterministically: it depends on hash order) — the
/// gradients that flow through it are then lost.
pub fn fresh_leaves<B: AutodiffBackend, M: AutodiffModule<B>>(module: M) -> M {
    module.map(&mut FreshLeaves)
}

struct FreshLeaves;

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // `detach` keeps `require_grad` and makes a new node.
        Param::from_mapped_value(id, tensor.detach(), mapper)
    }
}

/// Data parallelism (DDP): every parameter becomes `Replicate` on the data axes, with rank 0's
/// values broadcast to the others (so a model initialised independently on each rank starts
/// identical). Model-axis placements are kept. Call once, after the model is built.
pub fn replicate<B: DistributedBackend, M: Module<B>>(
    module: M,
    mesh: &DeviceMesh,
) -> Result<M, Error> {
    try_map_params(module, &mut Replicator { mesh })
}

/// What [`sync_gradients`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Parameters with a gradient.
    pub gradients: usize,
    /// Gradients that had to be reduced here (not where they were born).
    pub reduced: usize,
}

struct Syncer<'a> {
    grads: &'a mut GradientsParams,
    report: SyncReport,
    device_seen: Option<std::sync::Arc<crate::device::RankContext>>,
    /// Gradients put in a DDP bucket at the sync: each replaced by its reduced value once the
    /// buckets are done, so that what the caller gets back is in hand.
    in_buckets: Vec<ReadyLater>,
}

type ReadyLater = Box<dyn FnOnce(&mut GradientsParams)>;

impl<B, X> TryParamVisitor<B> for SyncerFor<'_, '_, X>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
{
    type Error = Error;

    fn try_visit<const D: usize>(
        &mut self,
        _path: &ModulePath,
        param: &Param<Tensor<B, D>>,
    ) -> Result<(), Error> {
        sync_one::<B, X, D>(self.0, param.id, &param.val())
    }
}

struct SyncerFor<'s, 'g, X>(&'s mut Syncer<'g>, std::marker::PhantomData<X>);

fn sync_one<B, X, const D: usize>(
    syncer: &mut Syncer<'_>,
    id: ParamId,
    value: &Tensor<B, D>,
) -> Result<(), Error>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
{
    let param = B::inner(value.clone().into_primitive().tensor());
    let Some(grad) = syncer.grads.remove::<Distributed<X>, D>(id) else {
        return Ok(());
    };
    syncer.report.gradients += 1;
    if syncer.device_seen.is_none() {
        // The step's backward is over: uses of its gradients from here on are the sync's own.
        crate::tensor::buckets::end_backward::<X>(param.device().context());
        syncer.device_seen = Some(param.device().context().clone());
    }
    let grad = grad.into_primitive().tensor();
    let mesh = param.device().mesh().clone();
    let unreduced = |reason: String| Error::UnreducedGradient {
        param: id.to_string(),
        shape: param.global_shape().to_vec().clone(),
        reason,
    };
    // The gradient's placements, read as the values they stand for: per-rank `Local` gradients on
    // a data axis are summands of the global gradient (averaged, like DDP).
    let mut source = grad.layout().clone();
    for (a, axis) in mesh.axes().iter().enumerate() {
        let target = param.layout().get(a);
        if source.get(a) != Placement::Local {
            continue;
        }
        if axis.kind == AxisKind::Data && axis.size > 1 {
            if target == Placement::Local {
                return Err(unreduced(format!(
                    "the parameter is per-rank (`Local`) on data axis '{}' of size {}: give the \
                     model a placement with `replicate` or `fully_shard` before training",
                    axis.name, axis.size
                )));
            }
            source.set(a, Placement::Partial(ReduceOp::Avg));
        } else {
            // A group of one: its only member's value is the value.
            source.set(a, target);
        }
    }
    let before = grad.layout().clone();
    let shape = grad.global_shape().clone();
    let grad = DTensor::new_shaped(
        grad.into_local(),
        source.clone(),
        shape,
        param.device().clone(),
    );
    // Model axes: the parameter's placement. Data axes: the rank's sharding policy (the
    // parameter's own placement under DDP and FSDP; sharded gradients of replicated parameters
    // under ZeRO-2).
    let plan = param
        .device()
        .context()
        .grad_layout(param.global_shape(), param.layout());
    let mut target = param.layout().clone();
    for (a, axis) in mesh.axes().iter().enumerate() {
        if axis.kind == AxisKind::Data && target.get(a) != Placement::Local {
            target.set(a, plan.get(a));
        }
    }
    if before != target {
        syncer.report.reduced += usize::from(source.is_distributed());
    }
    let grad = match crate::tensor::buckets::limit(param.device().context()) {
        // DDP buckets: the gradients kept out of them in backward join the last one.
        Some(limit) if crate::tensor::buckets::fits(&grad, &target) => {
            syncer
                .in_buckets
                .push(Box::new(move |grads: &mut GradientsParams| {
                    if let Some(grad) = grads.remove::<Distributed<X>, D>(id) {
                        let grad = grad.into_primitive().tensor().ready();
                        grads.register::<Distributed<X>, D>(
                            id,
                            from_dtensor::<Distributed<X>, D>(grad),
                        );
                    }
                }));
            crate::tensor::buckets::add_at_sync(grad, &target, limit)
        }
        _ => grad.reduce_gradient(&target)?,
    };
    syncer
        .grads
        .register::<Distributed<X>, D>(id, from_dtensor::<Distributed<X>, D>(grad));
    Ok(())
}

/// Reduce every gradient to its parameter's placement, for those not reduced during backward
/// (biases and norm scales in a stock model; weight gradients are reduced where they are born).
///
/// Call it between `GradientsParams::from_grads` and the optimizer step. It refuses, with a typed
/// error, a gradient whose parameter has no placement on a data axis of size > 1; and the next
/// forward pass refuses to start if a backward pass on a data-parallel mesh was not followed by
/// this call.
pub fn sync_gradients<B, X, M>(model: &M, grads: &mut GradientsParams) -> Result<SyncReport, Error>
where
    B: AutodiffBackend<InnerBackend = Distributed<X>>,
    X: Backend,
    M: AutodiffModule<B>,
{
    let mut syncer = Syncer {
        grads,
        report: SyncReport::default(),
        device_seen: None,
        in_buckets: Vec::new(),
    };
    try_visit_params(
        model,
        &mut SyncerFor::<X>(&mut syncer, std::marker::PhantomData),
    )?;
    let ctx = match syncer.device_seen {
        Some(ctx) => ctx,
        None => crate::device::current_device::<X>().context().clone(),
    };
    // Asynchronous reductions not yet waited for (a gradient no parameter took): their errors
    // surface here. The last DDP bucket is issued first.
    crate::tensor::buckets::flush::<X>(&ctx)?;
    ctx.resolve_outstanding()?;
    for ready in std::mem::take(&mut syncer.in_buckets) {
        ready(&mut *syncer.grads);
    }
    // Burn 0.21's autodiff ends every backward pass by locking the graphs of every thread
    // (`GraphCleaner::cleanup_orphaned_entries`). A rank that raced ahead into its next backward
    // would hold its graph's lock while waiting in a collective for a rank still in that cleanup:
    // a deadlock. One barrier per step, after backward, keeps the ranks' backward passes apart.
    if ctx.world_size() > 1 {
        ctx.comm().barrier(Group::World)?;
    }
    crate::backend::gradients_synced(&ctx);
    crate::tensor::prefetch::end_step::<X>(&ctx);
    Ok(syncer.report)
}
