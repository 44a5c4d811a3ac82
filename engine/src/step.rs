//! One training step on `Autodiff<Distributed<X>>`, top to bottom: accumulate the micro-batches
//! (recomputation per the policy, gradients kept as unreduced summands until the last), scale,
//! backward, synchronise, unscale + overflow check + global norm in one all-reduce, clip, step
//! (or skip on every rank), update the loss scale.

use crate::Error;
use crate::grad_check::{GradCheck, check_with_loss};
use crate::recompute::{Recompute, Recomputer};
use crate::scaler::{DynamicLossScaler, StepDecision};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::module::Param;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use std::time::Instant;
use wildfire_kernels::hooks::Auxiliary;
use wildfire_parallel::{
    DistDevice, Distributed, Group, ModulePath, ParamVisitor, ReduceOp, dtensor, gradient_bytes,
    sync_gradients, visit_params,
};

/// What a step does besides the optimizer update.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRunnerConfig {
    /// Clip the global gradient norm to this value (`None`: no clipping).
    pub clip: Option<f32>,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Stop with [`Error::NonFinite`] after this many steps in a row whose loss or gradients were
    /// not finite (each is skipped on every rank). A loss scaler's calibration skips a few steps
    /// at the start (from its initial 2¹⁶ it halves per overflow, at most 16 in a row before it
    /// reaches 1), so the default leaves room for it.
    #[serde(default = "default_max_skipped")]
    pub max_skipped_in_a_row: usize,
}

fn default_max_skipped() -> usize {
    20
}

impl Default for StepRunnerConfig {
    fn default() -> Self {
        Self {
            clip: Some(1.0),
            recompute: Recompute::None,
            max_skipped_in_a_row: default_max_skipped(),
        }
    }
}

/// What one step did (this rank's view; the norm and the decision agree on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// This rank's loss, the mean over its micro-batches.
    pub loss: f32,
    /// Global gradient norm before clipping (unscaled; not finite on overflow).
    pub grad_norm: f32,
    /// The loss scale the step used (1 without a scaler).
    pub loss_scale: f32,
    /// The step was skipped (a non-finite loss or gradient on some rank).
    pub skipped: bool,
    /// This rank's gradient bytes after synchronisation (its shards).
    pub grad_bytes: u64,
    /// What the mixture-of-experts routers did on this rank (`None` for a dense model).
    pub router: Option<RouterRecord>,
    /// The peak of this rank's live bytes in each phase of the step.
    pub phases: PhasePeaks,
    /// Weight gradients the zero-bubble schedule deferred from a backward (`I`) to a weight
    /// pass (`W`) and computed there, over every rank of the mesh (0 under other schedules and
    /// without a pipeline).
    pub deferred_weight_grads: usize,
}

/// The peak of a rank's live device bytes (the decorator's accounting) in each phase of a step;
/// the step's peak is the largest. Each grows with the model's depth in its own way (the
/// backward's holds the kept activations, the optimizer's every gradient), so the memory planner
/// extrapolates them one by one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PhasePeaks {
    /// The forward passes and losses of the micro-batches (0 under a pipeline schedule, whose
    /// forwards and backwards interleave: see `backward`).
    pub forward: u64,
    /// The loss's backward passes: the head, and every part of the model not recomputed (under
    /// a pipeline schedule, the whole schedule).
    pub backward: u64,
    /// The recomputed regions' backward passes (0 without recomputation). Apart from the loss's
    /// because they peak elsewhere: the loss's pass with the head's widest tensors and no
    /// block's gradient yet, the regions' with every block's gradient.
    #[serde(default)]
    pub recomputed: u64,
    /// Synchronising the gradients, the overflow check, the norm and the clip.
    pub sync: u64,
    /// The optimizer step (0 when the step is skipped).
    pub optimizer: u64,
}

impl PhasePeaks {
    /// The largest: the step's peak.
    pub fn max(&self) -> u64 {
        self.forward
            .max(self.backward)
            .max(self.recomputed)
            .max(self.sync)
            .max(self.optimizer)
    }
}

/// What a step's mixture-of-experts routers did on one rank: the auxiliary losses and, per
/// block, the counts of its routing, over the step's micro-batches.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouterRecord {
    /// The blocks' auxiliary losses (times their coefficients) summed, the mean over the
    /// micro-batches.
    pub aux_loss: f32,
    /// Per mixture-of-experts block (by index in the model), its counts summed over the
    /// micro-batches.
    pub layers: Vec<(usize, wildfire_kernels::hooks::Routing)>,
}

/// The training step (see the module docs). Holds the loss scaler, whose state belongs in
/// checkpoints ([`StepRunner::scaler`]).
#[derive(Clone, Debug)]
pub struct StepRunner {
    pub(crate) config: StepRunnerConfig,
    pub(crate) scaler: Option<DynamicLossScaler>,
    /// The step the next call runs (for errors).
    pub(crate) step: usize,
    /// Steps skipped in a row so far.
    pub(crate) skipped_in_a_row: usize,
}

pub(crate) type Ad<X> = Autodiff<Distributed<X>>;

impl StepRunner {
    /// A step with `config`, and a dynamic loss scaler for f16 compute (`None` for f32/bf16).
    pub fn new(config: StepRunnerConfig, scaler: Option<DynamicLossScaler>) -> Self {
        Self {
            config,
            scaler,
            step: 0,
            skipped_in_a_row: 0,
        }
    }

    /// Number the steps from `step` (a resumed run), as errors name them.
    pub fn starting_at(mut self, step: usize) -> Self {
        self.step = step;
        self
    }

    /// The loss scaler, if any (save it with the checkpoint).
    pub fn scaler(&self) -> Option<&DynamicLossScaler> {
        self.scaler.as_ref()
    }

    /// One step on `device` over `seeds.len()` micro-batches: `loss(model, i, ckpt)` is
    /// micro-batch `i`'s mean loss, computed through `ckpt` (seeded with `seeds[i]`: vary it per
    /// step, micro-batch and data-parallel rank). Returns the updated model and the record.
    ///
    /// With `tail`, the fused optimizer tail: one unscale + `Σg²` + overflow kernel pass per
    /// gradient, and `optim` a [`crate::FusedAdamW`] (alone or inside `FsdpOptimizer`) whose
    /// inputs `tail` is (the clipping coefficient and skip flag are written there, on the
    /// device). Without, the unscale, check and clip on the host ([`crate::unscale_check_clip`]).
    #[allow(clippy::too_many_arguments)]
    pub fn run<X, M, O, L>(
        &mut self,
        device: &DistDevice<X>,
        model: M,
        optim: &mut O,
        tail: Option<&crate::TailInputs<X>>,
        lr: f64,
        seeds: &[u64],
        loss: L,
    ) -> Result<(M, StepRecord), Error>
    where
        X: wildfire_kernels::FusedOps,
        M: AutodiffModule<Ad<X>>,
        O: Optimizer<M, Ad<X>>,
        L: for<'a> Fn(&'a M, usize, &Recomputer<'a, Ad<X>>) -> Tensor<Ad<X>, 1>,
    {
        let accum = seeds.len().max(1);
        let ctx = device.context().clone();
        // FSDP prefetch (when the policy asks for it): this step's parameters, so that their
        // gathers can be issued ahead, in the order the last step gathered them.
        wildfire_parallel::prefetch_parameters::<Ad<X>, X, M>(&model);
        // Accumulate: the micro-batches' gradients stay unreduced summands (no communication)
        // until `sync_gradients` after the last.
        ctx.set_no_sync(accum > 1);
        let scale = self.scaler.as_ref().map_or(1.0, DynamicLossScaler::scale);
        let mut accumulator = GradientsAccumulator::new();
        // The rank's loss stays on the device until the step's one host read (with the overflow
        // flag and Σg² on the fused tail): reading it per micro-batch would wait for each
        // forward before its backward is queued.
        let mut device_loss: Option<Tensor<Distributed<X>, 1>> = None;
        let mut routers = Routers::<X>::default();
        let phases = std::cell::Cell::new(PhasePeaks::default());
        for (i, &seed) in seeds.iter().enumerate() {
            // Each micro-batch's graph on leaves of its own: an earlier backward reached the
            // parameters, and the regions a micro-batch records outlive its main backward (see
            // `fresh_leaves`). The same values and ids: no copy.
            let leaves = wildfire_parallel::fresh_leaves(model.clone());
            let ckpt = Recomputer::<Ad<X>>::new(self.config.recompute, seed)
                .with_objective_weight(scale as f64 / accum as f64)
                .with_fence(|| {
                    // Keep the ranks' backward passes apart (see `sync_gradients`).
                    if ctx.world_size() > 1 {
                        ctx.comm().barrier(Group::World)?;
                    }
                    Ok(())
                })
                .with_after_loss_pass(|| {
                    let mut p = phases.get();
                    p.backward = p.backward.max(ctx.phase_peak_bytes());
                    phases.set(p);
                    ctx.start_phase();
                });
            // Scale, backward (with the recomputed regions). Regions go into the rank's trace
            // when it is on (`Member::set_tracing`).
            let started = Instant::now();
            ctx.start_phase();
            let micro = loss(&leaves, i, &ckpt).div_scalar(accum as f64);
            let value = micro.clone().inner();
            device_loss = Some(match device_loss.take() {
                Some(sum) => sum + value,
                None => value,
            });
            ctx.comm().member().trace_region("forward", started);
            let micro = if scale != 1.0 {
                micro.mul_scalar(scale)
            } else {
                micro
            };
            let mut p = phases.get();
            p.forward = p.forward.max(ctx.phase_peak_bytes());
            phases.set(p);
            let started = Instant::now();
            ctx.start_phase();
            let recomputes = ckpt.regions() > 0;
            let grads = ckpt.backward(micro, &leaves);
            routers.add(ckpt.auxiliary(), accum);
            drop(ckpt);
            if recomputes {
                let mut p = phases.get();
                p.recomputed = p.recomputed.max(ctx.phase_peak_bytes());
                phases.set(p);
            }
            ctx.comm().member().trace_region("backward", started);
            let grads = grads.inspect_err(|_| ctx.set_no_sync(false))?;
            accumulator.accumulate(&model, GradientsParams::from_grads(grads, &leaves));
        }
        ctx.set_no_sync(false);
        // Synchronise the rest, then unscale + check + norm (one all-reduce) and clip.
        let started = Instant::now();
        ctx.start_phase();
        let mut grads = accumulator.grads();
        sync_gradients(&model, &mut grads)?;
        let clip = self.config.clip;
        // The full value of the rank's loss (reduced over model axes if partial), still on the
        // device.
        let device_loss = device_loss.expect("a step has at least one micro-batch");
        let device_loss = dtensor(&device_loss).full()?;
        let (check, local_loss) = match tail {
            Some(inputs) => crate::fused_unscale_check(
                &model,
                &mut grads,
                1.0 / scale,
                clip,
                inputs,
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(device_loss)),
            )?,
            None => {
                ctx.count_host_read();
                let loss: f32 = Tensor::<X, 1>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(device_loss),
                )
                .into_scalar()
                .elem();
                let check =
                    check_with_loss(&model, &mut grads, 1.0 / scale, clip, !loss.is_finite())?;
                (check, loss)
            }
        };
        ctx.comm().member().trace_region("sync and check", started);
        let phases = PhasePeaks {
            sync: ctx.phase_peak_bytes(),
            ..phases.get()
        };
        let (mut models, mut record) = self.conclude(
            device,
            vec![model],
            vec![grads],
            std::slice::from_mut(optim),
            lr,
            check,
            scale,
            local_loss,
        )?;
        // A batching backend's queued AdamW steps run now, not at the next forward's first use.
        if let Some(inputs) = tail {
            inputs.finish();
        }
        record.router = routers.record()?;
        record.phases = PhasePeaks {
            optimizer: record.phases.optimizer,
            ..phases
        };
        Ok((models.pop().expect("one model"), record))
    }

    /// The end every step shares, once the gradients are synchronised and checked (its record's
    /// phases hold the optimizer's peak only): the loss scaler's decision, the count of steps skipped in a row (after too many, the error naming
    /// the first non-finite parameter), and the optimizer step of every model chunk (`grads[i]`
    /// and `optims[i]` are `chunks[i]`'s), or of none when the step is skipped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conclude<X, M, O>(
        &mut self,
        device: &DistDevice<X>,
        chunks: Vec<M>,
        grads: Vec<GradientsParams>,
        optims: &mut [O],
        lr: f64,
        check: GradCheck,
        scale: f32,
        loss: f32,
    ) -> Result<(Vec<M>, StepRecord), Error>
    where
        X: Backend,
        M: AutodiffModule<Ad<X>>,
        O: Optimizer<M, Ad<X>>,
    {
        let skipped = match self.scaler.as_mut() {
            Some(s) => s.update(check.found_inf) == StepDecision::Skip,
            None => check.found_inf,
        };
        let grad_bytes = chunks
            .iter()
            .zip(&grads)
            .map(|(c, g)| gradient_bytes(c, g))
            .sum();
        let step = self.step;
        self.step += 1;
        let mut optimizer = 0;
        let chunks = if skipped {
            self.skipped_in_a_row += 1;
            tracing::warn!(step, scale, "non-finite loss or gradients: step skipped");
            if self.skipped_in_a_row >= self.config.max_skipped_in_a_row.max(1) {
                let mut parameter = None;
                for (chunk, grads) in chunks.iter().zip(&grads) {
                    // Every rank runs each chunk's search (it takes an all-reduce).
                    let found = first_non_finite(device, chunk, grads)?;
                    parameter = parameter.or(found);
                }
                return Err(Error::NonFinite {
                    step,
                    in_a_row: self.skipped_in_a_row,
                    parameter,
                });
            }
            chunks
        } else {
            self.skipped_in_a_row = 0;
            let started = Instant::now();
            device.context().start_phase();
            let chunks = chunks
                .into_iter()
                .zip(grads)
                .zip(optims.iter_mut())
                .map(|((chunk, grads), optim)| optim.step(lr, chunk, grads))
                .collect();
            device
                .context()
                .comm()
                .member()
                .trace_region("optimizer", started);
            optimizer = device.context().phase_peak_bytes();
            chunks
        };
        Ok((
            chunks,
            StepRecord {
                loss,
                grad_norm: check.norm,
                loss_scale: scale,
                skipped,
                grad_bytes,
                router: None,
                phases: PhasePeaks {
                    optimizer,
                    ..PhasePeaks::default()
                },
                deferred_weight_grads: 0,
            },
        ))
    }
}

/// A step's auxiliary losses (on the device until the step's end) and routing counts, over its
/// micro-batches.
pub(crate) struct Routers<X: Backend> {
    aux: Option<Tensor<Distributed<X>, 1>>,
    layers: std::collections::BTreeMap<usize, wildfire_kernels::hooks::Routing>,
}

impl<X: Backend> Default for Routers<X> {
    fn default() -> Self {
        Self {
            aux: None,
            layers: Default::default(),
        }
    }
}

impl<X: wildfire_kernels::FusedOps> Routers<X> {
    /// One micro-batch's (of `accum`).
    pub(crate) fn add(&mut self, auxiliary: Vec<(usize, Auxiliary<Ad<X>>)>, accum: usize) {
        for (layer, a) in auxiliary {
            let loss = a.loss.inner().div_scalar(accum as f64);
            self.aux = Some(match self.aux.take() {
                Some(sum) => sum + loss,
                None => loss,
            });
            self.layers.entry(layer).or_default().add(&a.routing);
        }
    }

    /// The record (one host read of the summed loss), `None` for a dense model.
    pub(crate) fn record(self) -> Result<Option<RouterRecord>, Error> {
        let Some(aux) = self.aux else {
            return Ok(None);
        };
        let full = dtensor(&aux).full()?;
        let aux_loss: f32 =
            Tensor::<X, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(full))
                .into_scalar()
                .elem();
        Ok(Some(RouterRecord {
            aux_loss,
            layers: self.layers.into_iter().collect(),
        }))
    }
}

/// The path of the first parameter (in visiting order) whose gradient holds a NaN or an infinity
/// on any rank's shard: each rank finds its first, one all-reduce picks the earliest.
fn first_non_finite<X, M>(
    device: &DistDevice<X>,
    model: &M,
    grads: &GradientsParams,
) -> Result<Option<String>, Error>
where
    X: Backend,
    M: AutodiffModule<Ad<X>>,
{
    struct Find<'a> {
        grads: &'a GradientsParams,
        paths: Vec<String>,
        first: Option<usize>,
    }
    impl<B> ParamVisitor<B> for Find<'_>
    where
        B: AutodiffBackend,
        B::InnerBackend: wildfire_parallel::DistributedBackend,
    {
        fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
            let index = self.paths.len();
            self.paths.push(path.name());
            if self.first.is_some() {
                return;
            }
            let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
                return;
            };
            // This rank's piece only: x − x is NaN exactly where x is NaN or infinite.
            let local = dtensor(&grad).local().clone();
            let local = Tensor::<
                <B::InnerBackend as wildfire_parallel::DistributedBackend>::Inner,
                D,
            >::from_primitive(burn::tensor::TensorPrimitive::Float(local));
            let bad = (local.clone() - local).is_nan().any().into_data();
            if bad.iter::<bool>().next().unwrap_or(false) {
                self.first = Some(index);
            }
        }
    }
    let mut find = Find {
        grads,
        paths: Vec::new(),
        first: None,
    };
    visit_params(model, &mut find);
    let n = find.paths.len();
    // The earliest index over the ranks, as a maximum of n − index (0: none here).
    let mine = find.first.map_or(0.0, |i| (n - i) as f64);
    let ctx = device.context();
    let best = if ctx.world_size() > 1 {
        let data = burn::tensor::TensorData::new(vec![mine], [1]);
        ctx.comm()
            .all_reduce(Group::World, data, ReduceOp::Max)?
            .to_vec::<f64>()
            .expect("f64")[0]
    } else {
        mine
    };
    Ok((best > 0.0).then(|| find.paths[n - best as usize].clone()))
}
