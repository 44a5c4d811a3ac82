//! One training step of a pipeline-parallel model on `Autodiff<Distributed<X>>`: the rank's part
//! of the schedule ([`wildfire_parallel::pipeline::run_step_with`]: forwards and backwards of
//! the micro-batches, activations and gradients sent between the stages), then per model chunk
//! the data-parallel gradient synchronisation, the tied parameters' gradients summed between
//! the first and the last stage, unscale + overflow check + global norm in one all-reduce over
//! the whole mesh (the pipeline axis included, each parameter counted once), clipping, and the
//! optimizer step of every chunk (or a skip on every rank).
//!
//! The micro-batches' gradients stay unreduced over the data axes until the schedule ends
//! (`no_sync`): no collective runs inside a backward pass, where Burn 0.21 holds its graph's
//! lock, so ranks as threads cannot deadlock on another rank's end-of-backward cleanup.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use burn::module::{AutodiffModule, Param, ParamId};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use wildfire_kernels::FusedOps;
use wildfire_parallel::pipeline::{
    Pieces, Placed, Schedule, StageGroup, StepOptions, run_step_custom,
};
use wildfire_parallel::{
    DistDevice, Distributed, Group, ModulePath, PIPELINE_AXIS, RankContext, TryParamVisitor,
    dtensor, from_dtensor, sync_gradients, try_visit_params,
};

use crate::Error;
use crate::grad_check::check_models;
use crate::recompute::{Recompute, Recomputer};
use crate::scaler::DynamicLossScaler;
use crate::step::{Ad, StepRecord, StepRunner};
use wildfire_kernels::hooks::Auxiliary;

/// Each (stage, micro-batch)'s recomputer whose regions its backward action runs again.
type Recomputers<X> = RefCell<HashMap<(usize, usize), Recomputer<'static, Ad<X>>>>;

/// What a pipeline step did, besides [`StepRecord`] (whose loss is the mean over every
/// micro-batch of every data-parallel rank, the same on every rank).
#[derive(Clone, Debug)]
pub struct PipelineRecord {
    /// The step.
    pub step: StepRecord,
    /// Point-to-point messages this rank sent and received (activations and gradients).
    pub sends: usize,
    /// See `sends`.
    pub recvs: usize,
    /// The most micro-batches whose activations this rank held at once.
    pub peak_held: usize,
    /// This rank's actions as they ran, in seconds from `started`.
    pub timeline: Vec<Placed>,
    /// When the schedule began.
    pub started: std::time::Instant,
}

/// Per (micro-batch, block): its auxiliary loss and routing.
type ByMicroBatch<X> = BTreeMap<(usize, usize), Auxiliary<Ad<X>>>;

impl StepRunner {
    /// One pipeline step of `schedule` on `device`'s mesh, whose `pp` axis is the pipeline:
    /// `chunks[c]` is this rank's stage `c·p + r` and `optims[c]` its optimizer;
    /// `forward(chunk, stage, micro-batch, input, ckpt)` runs a stage through `ckpt` (`input` is
    /// `None` on the first stage, which reads its micro-batch itself) and `loss(micro-batch,
    /// output)` is the last stage's mean loss of a micro-batch.
    ///
    /// `ckpt` is the micro-batch's [`Recomputer`], seeded with `seeds[micro-batch]` (vary it per
    /// step, micro-batch and data-parallel rank): the run's recomputation policy applies inside
    /// each stage — the selective policy's attention core, every-N's block regions (run again by
    /// the micro-batch's backward action) — and `Recompute::Full` re-materialises each stage
    /// whole (only its input kept; `ckpt` then recomputes nothing).
    ///
    /// `tied(chunk)` names a chunk's parameters that are copies of one parameter held by both
    /// the first and the last stage (the GPT's token table), in the same order on both: their
    /// gradients are summed, so both copies take the same update; the norm counts the first
    /// stage's. Returns the updated chunks.
    #[allow(clippy::too_many_arguments)]
    pub fn run_pipeline<X, M, O>(
        &mut self,
        device: &DistDevice<X>,
        schedule: &Schedule,
        chunks: Vec<M>,
        optims: &mut [O],
        lr: f64,
        seeds: &[u64],
        tied: impl Fn(&M) -> Vec<ParamId>,
        forward: impl Fn(
            &M,
            usize,
            usize,
            Option<Tensor<Ad<X>, 3>>,
            &Recomputer<'static, Ad<X>>,
        ) -> Tensor<Ad<X>, 3>,
        loss: impl Fn(usize, Tensor<Ad<X>, 3>) -> Tensor<Ad<X>, 1>,
    ) -> Result<(Vec<M>, PipelineRecord), Error>
    where
        X: FusedOps,
        M: AutodiffModule<Ad<X>> + 'static,
        O: Optimizer<M, Ad<X>>,
    {
        let ctx = device.context().clone();
        let mesh = device.mesh();
        let axis = mesh.axis_index(PIPELINE_AXIS)?;
        if seeds.len() != schedule.microbatches() {
            return Err(Error::Parallel(wildfire_parallel::Error::InvalidSchedule(
                format!(
                    "{} seeds for {} micro-batches",
                    seeds.len(),
                    schedule.microbatches()
                ),
            )));
        }
        if optims.len() != chunks.len() {
            return Err(Error::Parallel(wildfire_parallel::Error::InvalidSchedule(
                format!(
                    "{} model chunks with {} optimizers",
                    chunks.len(),
                    optims.len()
                ),
            )));
        }
        let scale = self.scaler.as_ref().map_or(1.0, DynamicLossScaler::scale);
        // Recomputation inside the stages: `Full` re-materialises each stage in the runner;
        // other policies go through each micro-batch's `Recomputer`, whose recorded regions
        // its backward action runs again. The passes of one backward keep the stage group
        // together (Burn 0.21's end-of-backward cleanup, see `turns`).
        let rematerialize = self.config.recompute == Recompute::Full;
        let policy = if rematerialize {
            Recompute::None
        } else {
            self.config.recompute
        };
        let fence = StageGroup::of(&ctx, axis)?.map(|group| {
            let ctx = ctx.clone();
            Arc::new(move || group.barrier(ctx.comm()))
        });
        let recomputers: Recomputers<X> = RefCell::default();
        // Each micro-batch's auxiliary losses and routing, by block (a rematerialised stage
        // writes the same again).
        let auxiliary: RefCell<ByMicroBatch<X>> = RefCell::default();
        // Backward starts from the loss over the micro-batches times the loss scale; the
        // stages' auxiliary losses get the same weight.
        let weight = scale as f64 / schedule.microbatches() as f64;
        let run_forward = |chunk: &M, stage: usize, mb: usize, input| {
            let mut ckpt =
                Recomputer::<Ad<X>>::new(policy, seeds[mb]).with_objective_weight(weight);
            if let Some(fence) = &fence {
                let fence = fence.clone();
                ckpt = ckpt.with_fence(move || fence());
            }
            let out = forward(chunk, stage, mb, input, &ckpt);
            for (layer, a) in ckpt.auxiliary() {
                auxiliary.borrow_mut().insert((mb, layer), a);
            }
            if ckpt.regions() > 0 {
                recomputers.borrow_mut().insert((stage, mb), ckpt);
            }
            out
        };
        let run_backward = |chunk: &M,
                            stage: usize,
                            mb: usize,
                            root: Tensor<Ad<X>, 1>,
                            input: Option<&Tensor<Ad<X>, 3>>| {
            let ckpt = recomputers.borrow_mut().remove(&(stage, mb));
            match ckpt {
                None => Ok(root.backward()),
                Some(ckpt) => {
                    let inputs: Vec<_> = input.into_iter().cloned().collect();
                    ckpt.backward_with_inputs(root, chunk, &inputs)
                }
            }
        };
        // The schedule, with every data-parallel reduction deferred to its end.
        ctx.set_no_sync(true);
        ctx.start_phase();
        let out = run_step_custom(
            schedule,
            ctx.comm(),
            axis,
            &chunks,
            StepOptions {
                loss_scale: scale,
                ctx: Some(&ctx),
                rematerialize,
            },
            run_forward,
            loss,
            run_backward,
            &Pieces,
        );
        ctx.set_no_sync(false);
        let schedule_peak = ctx.phase_peak_bytes();
        ctx.start_phase();
        let out = out?;
        let mut grads = out.grads;
        for (chunk, grads) in chunks.iter().zip(grads.iter_mut()) {
            sync_gradients(chunk, grads)?;
        }
        // The tied parameters: this rank's chunks of the first and of the last stage.
        let (p, stages) = (schedule.ranks(), schedule.stages());
        let rank = Group::Axis(axis).index(mesh, device.rank())?;
        let first = (schedule.rank_of(0) == rank).then_some(0);
        let last = (schedule.rank_of(stages - 1) == rank).then_some((stages - 1) / p);
        let mut skip = Vec::new();
        match (first, last) {
            (Some(f), Some(l)) if f == l => {}
            (Some(f), Some(l)) => {
                let (mine, theirs) = (tied(&chunks[f]), tied(&chunks[l]));
                let sent = local_pieces::<X, M>(&chunks[l], &mut grads[l], &theirs)?;
                add_pieces::<X, M>(&chunks[f], &mut grads[f], &mine, sent.clone())?;
                let kept = local_pieces::<X, M>(&chunks[f], &mut grads[f], &mine)?;
                replace_pieces::<X, M>(&chunks[l], &mut grads[l], &theirs, kept)?;
                skip = theirs;
            }
            (Some(f), None) => {
                let ids = tied(&chunks[f]);
                let peer =
                    Group::Axis(axis).ranks(mesh, device.rank())?[schedule.rank_of(stages - 1)];
                exchange::<X, M>(&ctx, peer, true, &chunks[f], &mut grads[f], &ids)?;
            }
            (None, Some(l)) => {
                let ids = tied(&chunks[l]);
                let peer = Group::Axis(axis).ranks(mesh, device.rank())?[schedule.rank_of(0)];
                exchange::<X, M>(&ctx, peer, false, &chunks[l], &mut grads[l], &ids)?;
                skip = ids;
            }
            (None, None) => {}
        }
        // Unscale + check + norm over the whole mesh, clip.
        let loss_sum: f64 = out.losses.iter().map(|&l| f64::from(l)).sum();
        let check = check_models(
            &chunks,
            &mut grads,
            1.0 / scale,
            self.config.clip,
            !loss_sum.is_finite(),
            &skip,
            Some(ctx.clone()),
        )?;
        // The loss over the last stages, and the weight gradients deferred over every rank.
        let (loss, deferred) = crate::metrics::mean_where_held_and_total(
            &ctx,
            loss_sum,
            out.losses.len(),
            out.deferred as f64,
        )?;
        let sync_peak = ctx.phase_peak_bytes();
        let (chunks, mut step) =
            self.conclude(device, chunks, grads, optims, lr, check, scale, loss)?;
        step.phases = crate::PhasePeaks {
            forward: 0,
            backward: schedule_peak,
            recomputed: 0,
            sync: sync_peak,
            optimizer: step.phases.optimizer,
        };
        let mut routers = crate::step::Routers::<X>::default();
        let microbatches = schedule.microbatches();
        let auxiliary = auxiliary.into_inner().into_iter();
        routers.add(
            auxiliary.map(|((_, layer), a)| (layer, a)).collect(),
            microbatches,
        );
        step.router = routers.record()?;
        step.deferred_weight_grads = deferred as usize;
        Ok((
            chunks,
            PipelineRecord {
                step,
                sends: out.sends,
                recvs: out.recvs,
                peak_held: out.peak_held,
                timeline: out.timeline,
                started: out.started,
            },
        ))
    }
}

/// Visits the gradients of the parameters `ids` of a module, in `ids`' order.
struct Tied<'a, X: Backend> {
    ids: &'a [ParamId],
    grads: &'a mut GradientsParams,
    /// Per id: its gradient's local piece, read or (when `put` holds it) replaced.
    pieces: Vec<Option<TensorData>>,
    put: Option<Vec<TensorData>>,
    add: bool,
    _x: std::marker::PhantomData<X>,
}

impl<X: Backend> TryParamVisitor<Ad<X>> for Tied<'_, X> {
    type Error = String;

    fn try_visit<const D: usize>(
        &mut self,
        _path: &ModulePath,
        param: &Param<Tensor<Ad<X>, D>>,
    ) -> Result<(), String> {
        let Some(i) = self.ids.iter().position(|id| *id == param.id) else {
            return Ok(());
        };
        let Some(grad) = self.grads.remove::<Distributed<X>, D>(param.id) else {
            return Err(format!("tied parameter {} has no gradient", param.id));
        };
        let t = dtensor(&grad);
        let local = Tensor::<X, D>::from_primitive(TensorPrimitive::Float(t.local().clone()));
        let grad = match &self.put {
            None => {
                self.pieces[i] = Some(local.into_data());
                grad
            }
            Some(put) => {
                let data = put[i].clone();
                if data.shape.to_vec() != local.dims().to_vec() {
                    self.grads.register::<Distributed<X>, D>(param.id, grad);
                    return Err(format!(
                        "tied parameter {}: a gradient piece of shape {:?} for one of {:?}",
                        param.id,
                        data.shape,
                        local.dims()
                    ));
                } else {
                    let other = Tensor::<X, D>::from_data(data, &local.device());
                    let new = if self.add { local + other } else { other };
                    from_dtensor::<Distributed<X>, D>(t.with_local(new.into_primitive().tensor()))
                }
            }
        };
        self.grads.register::<Distributed<X>, D>(param.id, grad);
        Ok(())
    }
}

fn visit_tied<X: Backend, M: AutodiffModule<Ad<X>>>(
    chunk: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
    put: Option<Vec<TensorData>>,
    add: bool,
) -> Result<Vec<Option<TensorData>>, Error> {
    if let Some(put) = &put
        && put.len() != ids.len()
    {
        return Err(tied_error(format!(
            "{} tied parameters here, {} on the other stage",
            ids.len(),
            put.len()
        )));
    }
    let mut v = Tied::<X> {
        ids,
        grads,
        pieces: vec![None; ids.len()],
        put,
        add,
        _x: std::marker::PhantomData,
    };
    try_visit_params(chunk, &mut v).map_err(tied_error)?;
    Ok(v.pieces)
}

fn tied_error(detail: String) -> Error {
    Error::Parallel(wildfire_parallel::Error::Mismatch {
        op: wildfire_parallel::CollectiveKind::Recv,
        group: PIPELINE_AXIS.into(),
        detail,
    })
}

/// The local pieces of the gradients of `ids`, in order.
fn local_pieces<X: Backend, M: AutodiffModule<Ad<X>>>(
    chunk: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
) -> Result<Vec<TensorData>, Error> {
    visit_tied::<X, M>(chunk, grads, ids, None, false)?
        .into_iter()
        .enumerate()
        .map(|(i, d)| d.ok_or_else(|| tied_error(format!("tied parameter {} not found", ids[i]))))
        .collect()
}

fn add_pieces<X: Backend, M: AutodiffModule<Ad<X>>>(
    chunk: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
    pieces: Vec<TensorData>,
) -> Result<(), Error> {
    visit_tied::<X, M>(chunk, grads, ids, Some(pieces), true).map(|_| ())
}

fn replace_pieces<X: Backend, M: AutodiffModule<Ad<X>>>(
    chunk: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
    pieces: Vec<TensorData>,
) -> Result<(), Error> {
    visit_tied::<X, M>(chunk, grads, ids, Some(pieces), false).map(|_| ())
}

/// Sum the tied gradients with the stage on `peer` (the first stage sends first, the last
/// receives first, so blocking sends cannot wait on each other): both end with the same sum.
fn exchange<X: Backend, M: AutodiffModule<Ad<X>>>(
    ctx: &Arc<RankContext>,
    peer: usize,
    sends_first: bool,
    chunk: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
) -> Result<(), Error> {
    let p2p = ctx.comm().point_to_point()?;
    let mine = local_pieces::<X, M>(chunk, grads, ids)?;
    let count = TensorData::new(vec![ids.len() as i64], [1]);
    let mut theirs = Vec::with_capacity(ids.len());
    let receive = |theirs: &mut Vec<TensorData>| -> Result<(), Error> {
        let n = p2p
            .recv(peer)?
            .to_vec::<i64>()
            .map_err(|e| tied_error(format!("a tied-gradient count that is not one: {e:?}")))?[0]
            as usize;
        for _ in 0..n {
            theirs.push(p2p.recv(peer)?);
        }
        Ok(())
    };
    if !sends_first {
        receive(&mut theirs)?;
    }
    p2p.send(peer, count)?;
    for piece in mine {
        p2p.send(peer, piece)?;
    }
    if sends_first {
        receive(&mut theirs)?;
    }
    add_pieces::<X, M>(chunk, grads, ids, theirs)
}
