//! The runner: one rank's part of a pipeline step, its [`Schedule`]'s actions executed in order
//! on the rank's model chunks, activations and their gradients moved between ranks by
//! point-to-point messages on the rank's communicator.
//!
//! A forward of a stage that is not the first takes the previous stage's activation (received,
//! or handed over on the same rank) as a leaf that requires its gradient; the last stage turns
//! its output into the micro-batch's loss, divided by the micro-batch count so the summed
//! gradients are those of the mean loss. A backward runs Burn's autodiff on that micro-batch's
//! graph — from the loss on the last stage, from `Σ output ⊙ received gradient` elsewhere — and
//! sends the input leaf's gradient back. Each chunk's parameter gradients are summed over the
//! micro-batches in the order the schedule runs their backwards (a plain gradient
//! accumulation), so a pipeline step gives the gradients one device would get from the same
//! micro-batches.
//!
//! Messages carry a small header (what, which stage, which micro-batch) before the tensor (a
//! [`Transport`] moves them: [`Whole`] tensors as host messages, or on the `Distributed`
//! backend [`Pieces`], each rank's piece, on the device collectives when installed), and a
//! rank keeps what arrives before it is needed: one pair of ranks carries activations and
//! gradients of several stages (interleaved schedules), and their orders need not agree. A
//! received tensor whose shape differs from the one the stage gave before fails with
//! [`Error::Mismatch`]; a peer that never sends fails the receive after the communicator's
//! timeout (a dead stage is an error on every rank, not a hang).
//!
//! Zero-bubble schedules split a backward into `I` (the input gradient, sent on at once) and `W`
//! (the weight gradients, run later in a bubble): on the `Distributed` backend the `I` defers
//! every linear layer's weight-gradient matmul (the bulk of a backward's weight work: norms,
//! biases and embeddings stay in `I`), the `W` runs them. Elsewhere such schedules are refused
//! with [`Error::InvalidSchedule`].

use std::collections::HashMap;
use std::time::Instant;

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_backend::TensorMetadata;

use super::schedule::{Placed, Schedule, Work};
use super::turns::StageGroup;
use crate::comm::{CollectiveKind, Communicator, Group};
use crate::data_parallel::{DistributedBackend, dtensor, fresh_leaves, from_dtensor};
use crate::device::{DeferredWeights, RankContext};
use crate::error::Error;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;

/// How activations and their gradients travel between stages. `send` sends a tensor leaving
/// this rank to global rank `to` — first one host message of header words (the runner's
/// `head`, then whatever the transport adds), then the tensor — and `recv`, on the receiving
/// rank (the same position on every mesh axis but `pp`), takes the next message from `from`
/// and turns it back into the tensor. A pair's messages arrive in the order they were sent.
pub trait Transport<B: Backend> {
    /// Sends `tensor` to global rank `to` over `comm`, after the header words `head`.
    fn send(
        &self,
        comm: &dyn Communicator,
        to: usize,
        head: Vec<i64>,
        tensor: Tensor<B, 3>,
    ) -> Result<(), Error>;

    /// The next message global rank `from` sent: its first `head` header words (the sender's
    /// `head`) and its tensor, on `device`.
    fn recv(
        &self,
        comm: &dyn Communicator,
        from: usize,
        head: usize,
        device: &B::Device,
    ) -> Result<(Vec<i64>, Tensor<B, 3>), Error>;

    /// Waits until every message this rank sent has left it (MPI: its immediate sends
    /// completed; NCCL: its sends' kernels done).
    fn flush(&self, comm: &dyn Communicator, device: &B::Device) -> Result<(), Error> {
        let _ = device;
        comm.point_to_point()?.flush()
    }
}

/// Sends a message's header words to global rank `to`, as one host message.
fn send_header(comm: &dyn Communicator, to: usize, words: Vec<i64>) -> Result<(), Error> {
    let n = words.len();
    comm.point_to_point()?.send(to, TensorData::new(words, [n]))
}

/// The header words of the next message from global rank `from` ([`send_header`]), checked to
/// be at least `len`.
fn recv_header(comm: &dyn Communicator, from: usize, len: usize) -> Result<Vec<i64>, Error> {
    let data = comm.point_to_point()?.recv(from)?;
    let words = data.to_vec::<i64>().map_err(|e| Error::Mismatch {
        op: CollectiveKind::Recv,
        group: "pp".into(),
        detail: format!("a pipeline message header that is not one: {e:?}"),
    })?;
    if words.len() < len {
        return Err(Error::Mismatch {
            op: CollectiveKind::Recv,
            group: "pp".into(),
            detail: format!("a pipeline message header of {} words", words.len()),
        });
    }
    Ok(words)
}

/// The whole tensor (`into_data`, `from_data`) as a host message: any backend. On the
/// `Distributed` backend that gathers a sharded activation first; [`Pieces`] sends each rank's
/// piece instead.
#[derive(Clone, Copy, Debug, Default)]
pub struct Whole;

impl<B: Backend> Transport<B> for Whole {
    fn send(
        &self,
        comm: &dyn Communicator,
        to: usize,
        head: Vec<i64>,
        tensor: Tensor<B, 3>,
    ) -> Result<(), Error> {
        send_header(comm, to, head)?;
        comm.point_to_point()?.send(to, tensor.into_data())
    }

    fn recv(
        &self,
        comm: &dyn Communicator,
        from: usize,
        head: usize,
        device: &B::Device,
    ) -> Result<(Vec<i64>, Tensor<B, 3>), Error> {
        let mut words = recv_header(comm, from, head)?;
        words.truncate(head);
        let data = comm.point_to_point()?.recv(from)?;
        Ok((words, Tensor::from_data(data, device)))
    }
}

/// On the `Distributed` backend: each rank sends its own piece with its layout, and the
/// receiver (which sits at the same coordinates of every other axis) wraps it in that layout.
/// Under sequence parallelism an activation travels as each tensor-parallel rank's sequence
/// shard — 1/tp of the bytes, no gather (Megatron's `scatter_gather_tensors_in_pipeline`); a
/// `Partial` value is reduced first and a padded one gathered. The piece itself goes on the
/// rank's device collectives when installed ([`DeviceCollectives::send`]: NCCL send/recv on
/// CUDA, no host copy), else as a host message; its layout, shape and dtype go ahead of it in
/// the header.
///
/// [`DeviceCollectives::send`]: crate::comm::DeviceCollectives::send
#[derive(Clone, Copy, Debug, Default)]
pub struct Pieces;

const REPLICATE: i64 = -1;
const LOCAL: i64 = -2;

impl<B: DistributedBackend> Transport<B> for Pieces {
    fn send(
        &self,
        comm: &dyn Communicator,
        to: usize,
        mut head: Vec<i64>,
        tensor: Tensor<B, 3>,
    ) -> Result<(), Error> {
        let device = B::dist_device(&tensor.device());
        let t = dtensor(&tensor).ready();
        let t = if t.is_padded() {
            let target = t.layout().unsharded();
            t.redistribute(&target)?
        } else if t.layout().has_partial() {
            let target = t.layout().reduced();
            t.redistribute(&target)?
        } else {
            t
        };
        head.extend(t.layout().placements().iter().map(|p| match p {
            Placement::Replicate => REPLICATE,
            Placement::Local => LOCAL,
            Placement::Shard(d) => *d as i64,
            Placement::Partial(_) => unreachable!("reduced above"),
        }));
        let local = t.into_local();
        head.extend(
            local
                .shape()
                .iter()
                .map(|&d| d as i64)
                .chain([crate::comm::dtype_code(local.dtype())?]),
        );
        send_header(comm, to, head)?;
        crate::collectives::send(&device, to, local)
    }

    fn recv(
        &self,
        comm: &dyn Communicator,
        from: usize,
        head: usize,
        device: &B::Device,
    ) -> Result<(Vec<i64>, Tensor<B, 3>), Error> {
        let device = B::dist_device(device);
        let axes = device.mesh().axes().len();
        let mut words = recv_header(comm, from, head)?;
        if words.len() != head + axes + 4 {
            return Err(Error::Mismatch {
                op: CollectiveKind::Recv,
                group: "pp".into(),
                detail: format!(
                    "a pipeline message laid out over {} mesh axes, on a mesh of {axes}",
                    words.len().saturating_sub(head + 4)
                ),
            });
        }
        let extra = words.split_off(head);
        let (codes, rest) = extra.split_at(axes);
        let layout = Layout::new(codes.iter().map(|&code| match code {
            REPLICATE => Placement::Replicate,
            LOCAL => Placement::Local,
            d => Placement::Shard(d as usize),
        }));
        let shape: Vec<usize> = rest[..3].iter().map(|&d| d as usize).collect();
        let dtype = crate::comm::dtype_of(rest[3])?;
        let local = crate::collectives::recv(&device, from, shape.into(), dtype)?;
        let t = DTensor::from_local(local, layout, &device)?;
        Ok((words, from_dtensor::<B, 3>(t)))
    }

    fn flush(&self, comm: &dyn Communicator, device: &B::Device) -> Result<(), Error> {
        crate::collectives::flush(&B::dist_device(device))?;
        comm.point_to_point()?.flush()
    }
}

/// The last stage's loss as its backward starts from it: divided by the micro-batch count `m`
/// (the summed gradients are those of the mean loss), times the loss scale.
fn scaled<B: AutodiffBackend>(value: Tensor<B, 1>, m: usize, loss_scale: f32) -> Output<B> {
    let value = value.div_scalar(m as f64);
    Output::Loss(if loss_scale == 1.0 {
        value
    } else {
        value.mul_scalar(loss_scale)
    })
}

/// What one rank's part of a pipeline step gave ([`run_step`]).
#[derive(Debug)]
pub struct PipelineStep {
    /// Per chunk of the rank (its stages `c·p + r` for `c = 0, 1, …`), its parameters'
    /// gradients summed over the micro-batches.
    pub grads: Vec<GradientsParams>,
    /// On the rank of the last stage, each micro-batch's loss (not divided by the count), in
    /// micro-batch order; empty elsewhere.
    pub losses: Vec<f32>,
    /// Point-to-point messages this rank sent and received (activations and gradients, headers
    /// not counted).
    pub sends: usize,
    /// See `sends`.
    pub recvs: usize,
    /// The most micro-batches whose activations the rank held at once (forward done, backward
    /// not), counted per stage.
    pub peak_held: usize,
    /// Each action as it ran: from when its input was in hand to its end, in seconds from
    /// `started`, the instant the step began (time spent waiting for a message is idle).
    pub timeline: Vec<Placed>,
    /// When the step began (to put several ranks' timelines on one time axis).
    pub started: Instant,
    /// Weight gradients the `I` actions deferred and the `W` actions computed (zero-bubble
    /// schedules; 0 otherwise).
    pub deferred: usize,
}

/// The module with its parameters' values as untracked tensors: a forward on it builds no graph
/// (re-materialisation's first forward).
struct Untracked;

impl<B: AutodiffBackend> ModuleMapper<B> for Untracked {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // (`detach` keeps `require_grad` in Burn: the forward would still record its graph.)
        Param::from_mapped_value(id, Tensor::from_inner(tensor.inner()), mapper)
    }
}

/// A micro-batch's forward state, kept until its backward.
struct Held<B: AutodiffBackend, M> {
    /// The chunk with this micro-batch's leaves ([`fresh_leaves`]); none under
    /// re-materialisation.
    chunk: Option<M>,
    /// The received activation, a leaf whose gradient goes back (`None` on the first stage;
    /// not yet a leaf under re-materialisation).
    input: Option<Tensor<B, 3>>,
    /// The stage's output, or on the last stage the scaled loss.
    output: Output<B>,
}

enum Output<B: AutodiffBackend> {
    Activation(Tensor<B, 3>),
    Loss(Tensor<B, 1>),
    /// Re-materialisation: nothing kept but the input; the backward runs the forward again.
    Again,
}

const ACTIVATION: i64 = 0;
const GRADIENT: i64 = 1;
/// The runner's header words: what, which stage, which micro-batch.
const HEAD: usize = 3;

/// Messages on the pipeline's channels, by (what, stage, micro-batch), and the shapes seen.
struct Mailbox<'a, B: AutodiffBackend> {
    comm: &'a dyn Communicator,
    transport: &'a dyn Transport<B>,
    device: B::Device,
    /// Global ranks of the pipeline group, by pipeline index.
    members: Vec<usize>,
    early: HashMap<(i64, usize, usize), Tensor<B, 3>>,
    /// Handed over between two stages of this rank.
    local: HashMap<(i64, usize, usize), Tensor<B, 3>>,
    shapes: HashMap<(i64, usize), [usize; 3]>,
    sends: usize,
    recvs: usize,
}

impl<B: AutodiffBackend> Mailbox<'_, B> {
    /// Sends `tensor` as `(what, stage, mb)` to pipeline rank `to` (handed over untracked when
    /// that is this rank).
    fn send(
        &mut self,
        to: usize,
        what: i64,
        stage: usize,
        mb: usize,
        tensor: Tensor<B, 3>,
    ) -> Result<(), Error> {
        if self.members[to] == self.comm.rank() {
            self.local
                .insert((what, stage, mb), Tensor::from_inner(tensor.inner()));
            return Ok(());
        }
        let head = vec![what, stage as i64, mb as i64];
        self.transport
            .send(self.comm, self.members[to], head, tensor)?;
        self.sends += 1;
        Ok(())
    }

    /// The message `(what, stage, mb)` from pipeline rank `from`, its shape checked against the
    /// ones this kind of message had before for that stage.
    fn recv(
        &mut self,
        from: usize,
        what: i64,
        stage: usize,
        mb: usize,
    ) -> Result<Tensor<B, 3>, Error> {
        let key = (what, stage, mb);
        let tensor = if let Some(t) = self.local.remove(&key) {
            t
        } else if let Some(t) = self.early.remove(&key) {
            t
        } else {
            loop {
                let (head, t) =
                    self.transport
                        .recv(self.comm, self.members[from], HEAD, &self.device)?;
                let got = (head[0], head[1] as usize, head[2] as usize);
                self.recvs += 1;
                if got == key {
                    break t;
                }
                self.early.insert(got, t);
            }
        };
        let shape = tensor.dims();
        match self.shapes.get(&(what, stage)) {
            Some(seen) if *seen != shape => Err(Error::Mismatch {
                op: CollectiveKind::Recv,
                group: "pp".into(),
                detail: format!(
                    "stage {stage} received a {} of shape {shape:?} for micro-batch {mb}, \
                     where earlier ones were {seen:?}",
                    if what == ACTIVATION {
                        "activation"
                    } else {
                        "gradient"
                    }
                ),
            }),
            _ => {
                self.shapes.insert((what, stage), shape);
                Ok(tensor)
            }
        }
    }
}

/// The pipeline group on mesh axis `axis` (its members' global ranks, in axis order) and this
/// rank's index in it, refused when the axis is not as long as `schedule` has ranks.
pub(super) fn pipeline_group(
    comm: &dyn Communicator,
    axis: usize,
    schedule: &Schedule,
) -> Result<(Vec<usize>, usize), Error> {
    let group = Group::Axis(axis);
    let members = group.ranks(comm.mesh(), comm.rank())?;
    if members.len() != schedule.ranks() {
        return Err(Error::InvalidSchedule(format!(
            "a schedule for {} pipeline ranks on an axis of {}",
            schedule.ranks(),
            members.len()
        )));
    }
    Ok((members, group.index(comm.mesh(), comm.rank())?))
}

/// Refused unless pipeline rank `rank` has one chunk per stage `schedule` gives each rank.
pub(super) fn check_chunks(schedule: &Schedule, rank: usize, chunks: usize) -> Result<(), Error> {
    let v = schedule.stages() / schedule.ranks();
    if chunks != v {
        return Err(Error::InvalidSchedule(format!(
            "pipeline rank {rank} has {chunks} model chunks for {v} stages per rank"
        )));
    }
    Ok(())
}

/// Runs rank `comm.rank()`'s part of one step of `schedule` over the mesh axis `axis` (the
/// pipeline group: its members, in axis order, are the pipeline ranks): `chunks[c]` is the
/// rank's stage `c·p + r`; `forward(chunk, stage, micro-batch, input)` runs a stage (`input`
/// `None` on the first stage, which reads its micro-batch itself) and `loss(micro-batch,
/// output)` turns the last stage's output into the micro-batch's loss (a one-element tensor).
pub fn run_step<B, M>(
    schedule: &Schedule,
    comm: &dyn Communicator,
    axis: usize,
    chunks: &[M],
    forward: impl Fn(&M, usize, usize, Option<Tensor<B, 3>>) -> Tensor<B, 3>,
    loss: impl Fn(usize, Tensor<B, 3>) -> Tensor<B, 1>,
) -> Result<PipelineStep, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    run_step_with(
        schedule,
        comm,
        axis,
        chunks,
        StepOptions::default(),
        forward,
        loss,
    )
}

/// How [`run_step_with`] runs a step, beyond the schedule.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions<'a> {
    /// Each micro-batch's loss is multiplied by this before its backward (dynamic loss
    /// scaling; the losses reported are not scaled).
    pub loss_scale: f32,
    /// The rank's context on the `Distributed` backend: zero-bubble schedules' split backward
    /// (an `I` runs the backward with the linear layers' weight gradients deferred,
    /// [`RankContext::begin_deferring_weight_gradients`], gradients kept unreduced,
    /// [`RankContext::set_no_sync`]; its `W` computes them), and backward passes that
    /// communicate taking turns within the process (see the `turns` module).
    pub ctx: Option<&'a RankContext>,
    /// Re-materialisation (GPipe's): a stage keeps only its input per micro-batch (its forward
    /// runs on untracked parameters and builds no backward graph), and runs the forward again,
    /// with its graph, in the backward — bitwise the same step. The first stage keeps nothing
    /// (it reads its micro-batch itself): under GPipe a stage holds M inputs instead of M
    /// graphs.
    pub rematerialize: bool,
}

impl Default for StepOptions<'_> {
    fn default() -> Self {
        Self {
            loss_scale: 1.0,
            ctx: None,
            rematerialize: false,
        }
    }
}

/// [`run_step`] with [`StepOptions`].
pub fn run_step_with<B, M>(
    schedule: &Schedule,
    comm: &dyn Communicator,
    axis: usize,
    chunks: &[M],
    options: StepOptions<'_>,
    forward: impl Fn(&M, usize, usize, Option<Tensor<B, 3>>) -> Tensor<B, 3>,
    loss: impl Fn(usize, Tensor<B, 3>) -> Tensor<B, 1>,
) -> Result<PipelineStep, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    run_step_custom(
        schedule,
        comm,
        axis,
        chunks,
        options,
        forward,
        loss,
        |_, _, _, root: Tensor<B, 1>, _| Ok(root.backward()),
        &Whole,
    )
}

/// [`run_step_with`] with the backward of a micro-batch given: `backward(chunk, stage,
/// micro-batch, root, input)` computes the gradients from the root of that micro-batch's graph
/// (the scaled loss on the last stage, `Σ output ⊙ received gradient` elsewhere) on `chunk`,
/// the chunk the forward ran on, including the gradient of `input`, the received activation
/// (none on the first stage) — `root.backward()`, or a recomputing backward that runs the
/// regions the forward recorded again (`wildfire_engine::Recomputer::backward`). It runs inside
/// the stage group's turn when backward passes communicate; several passes in one backward must
/// keep the group's members together between passes (a barrier over
/// [`StageGroup`]). `transport` encodes what travels between the stages
/// ([`Whole`] or, on the `Distributed` backend, [`Pieces`]).
#[allow(clippy::too_many_arguments)]
pub fn run_step_custom<B, M>(
    schedule: &Schedule,
    comm: &dyn Communicator,
    axis: usize,
    chunks: &[M],
    options: StepOptions<'_>,
    forward: impl Fn(&M, usize, usize, Option<Tensor<B, 3>>) -> Tensor<B, 3>,
    loss: impl Fn(usize, Tensor<B, 3>) -> Tensor<B, 1>,
    backward: impl Fn(
        &M,
        usize,
        usize,
        Tensor<B, 1>,
        Option<&Tensor<B, 3>>,
    ) -> Result<B::Gradients, Error>,
    transport: &dyn Transport<B>,
) -> Result<PipelineStep, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let StepOptions {
        loss_scale,
        ctx: split,
        rematerialize,
    } = options;
    // Refused on every rank before anything runs (no rank is left waiting for another).
    let has_split = (0..schedule.ranks()).any(|r| {
        schedule
            .actions(r)
            .iter()
            .any(|a| matches!(a.work, Work::BackwardInput | Work::BackwardWeight))
    });
    if has_split && split.is_none() {
        return Err(Error::InvalidSchedule(format!(
            "{:?}: splitting backwards into input and weight gradients needs the Distributed \
             backend's deferred weight gradients (pass the rank's context)",
            schedule.kind()
        )));
    }
    // Backward passes that communicate take turns (see `turns`).
    let turns = match split {
        Some(ctx) => StageGroup::of(ctx, axis)?,
        None => None,
    };
    let (members, rank) = pipeline_group(comm, axis, schedule)?;
    check_chunks(schedule, rank, chunks.len())?;
    let (p, v) = (schedule.ranks(), schedule.stages() / schedule.ranks());
    let device = chunks[0]
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| Error::Unsupported("a pipeline stage with no parameters".into()))?;
    let last = schedule.stages() - 1;
    let m = schedule.microbatches();
    let mut mail = Mailbox {
        comm,
        transport,
        device: device.clone(),
        members,
        early: HashMap::new(),
        local: HashMap::new(),
        shapes: HashMap::new(),
        sends: 0,
        recvs: 0,
    };
    let mut held: HashMap<(usize, usize), Held<B, M>> = HashMap::new();
    let mut accumulators: Vec<GradientsAccumulator<M>> =
        (0..v).map(|_| GradientsAccumulator::new()).collect();
    let mut losses = vec![f32::NAN; if schedule.rank_of(last) == rank { m } else { 0 }];
    let mut peak_held = 0;
    // After an `I`, until its `W`: the micro-batch's gradients and its deferred weight gradients.
    let mut waiting: HashMap<(usize, usize), (GradientsParams, DeferredWeights)> = HashMap::new();
    let mut deferred_count = 0;
    let started = Instant::now();
    let mut timeline = Vec::with_capacity(schedule.actions(rank).len());
    for action in schedule.actions(rank) {
        let (stage, mb) = (action.stage, action.microbatch);
        // Reset once the action's input has arrived: waiting is idle time, not the action's.
        let mut start = started.elapsed().as_secs_f64();
        let chunk = &chunks[stage / p];
        match action.work {
            Work::Forward => {
                let input = if stage == 0 {
                    None
                } else {
                    let x = mail.recv(schedule.rank_of(stage - 1), ACTIVATION, stage, mb)?;
                    Some(if rematerialize { x } else { x.require_grad() })
                };
                start = started.elapsed().as_secs_f64();
                let leaves = if rematerialize {
                    chunk.clone().map(&mut Untracked)
                } else {
                    fresh_leaves(chunk.clone())
                };
                let out = forward(&leaves, stage, mb, input.clone());
                let output = if stage == last {
                    let value = loss(mb, out);
                    losses[mb] = value.clone().into_scalar().elem::<f32>();
                    scaled(value, m, loss_scale)
                } else {
                    mail.send(
                        schedule.rank_of(stage + 1),
                        ACTIVATION,
                        stage + 1,
                        mb,
                        out.clone(),
                    )?;
                    Output::Activation(out)
                };
                let output = if rematerialize { Output::Again } else { output };
                held.insert(
                    (stage, mb),
                    Held {
                        chunk: (!rematerialize).then_some(leaves),
                        input,
                        output,
                    },
                );
                peak_held = peak_held.max(held.len());
            }
            Work::Backward | Work::BackwardInput => {
                let Held {
                    chunk: leaves,
                    input,
                    output,
                } = held.remove(&(stage, mb)).ok_or_else(|| {
                    Error::InvalidSchedule(format!("backward of {action} before its forward"))
                })?;
                // Re-materialisation: the forward again, now with its graph.
                let (leaves, input, output) = match output {
                    Output::Again => {
                        let leaves = fresh_leaves(chunk.clone());
                        let input = input.map(Tensor::require_grad);
                        let out = forward(&leaves, stage, mb, input.clone());
                        let output = if stage == last {
                            scaled(loss(mb, out), m, loss_scale)
                        } else {
                            Output::Activation(out)
                        };
                        (leaves, input, output)
                    }
                    output => (
                        leaves.expect("a chunk is held unless re-materialised"),
                        input,
                        output,
                    ),
                };
                // The root of the micro-batch's backward: its loss on the last stage,
                // `Σ output ⊙ received gradient` elsewhere.
                let root = match output {
                    Output::Again => unreachable!("run again above"),
                    Output::Loss(value) => value,
                    Output::Activation(out) => {
                        let g = mail.recv(schedule.rank_of(stage + 1), GRADIENT, stage, mb)?;
                        if g.dims() != out.dims() {
                            return Err(Error::Mismatch {
                                op: CollectiveKind::Recv,
                                group: "pp".into(),
                                detail: format!(
                                    "stage {stage}'s output is {:?}, its gradient {:?}",
                                    out.dims(),
                                    g.dims()
                                ),
                            });
                        }
                        start = started.elapsed().as_secs_f64();
                        (out * g).sum().reshape([1])
                    }
                };
                let pass = || {
                    // A zero-bubble `I`: the linear layers' weight gradients wait for the `W`.
                    let defer = match (action.work, split) {
                        (Work::BackwardInput, Some(ctx)) => {
                            ctx.begin_deferring_weight_gradients();
                            Some(ctx)
                        }
                        _ => None,
                    };
                    let grads = backward(&leaves, stage, mb, root, input.as_ref());
                    let deferred = defer.map(RankContext::end_deferring_weight_gradients);
                    grads.map(|grads| (grads, deferred))
                };
                let (grads, deferred) = match &turns {
                    Some(group) => group.in_turn(comm, pass)??,
                    None => pass()?,
                };
                if let Some(input) = input {
                    let grad = input.grad(&grads).ok_or_else(|| {
                        Error::Unsupported(format!(
                            "stage {stage}'s output does not depend on its input"
                        ))
                    })?;
                    mail.send(
                        schedule.rank_of(stage - 1),
                        GRADIENT,
                        stage - 1,
                        mb,
                        Tensor::from_inner(grad),
                    )?;
                }
                let grads = GradientsParams::from_grads(grads, &leaves);
                match deferred {
                    Some(deferred) => {
                        waiting.insert((stage, mb), (grads, deferred));
                    }
                    None => accumulators[stage / p].accumulate(chunk, grads),
                }
            }
            Work::BackwardWeight => {
                let (grads, deferred) = waiting.remove(&(stage, mb)).ok_or_else(|| {
                    Error::InvalidSchedule(format!("{action} before its input gradient"))
                })?;
                deferred_count += deferred.run()?;
                accumulators[stage / p].accumulate(chunk, grads);
            }
        }
        timeline.push(Placed {
            action: *action,
            start,
            end: started.elapsed().as_secs_f64(),
        });
    }
    // The step's last messages have left this rank (MPI: its immediate sends are complete;
    // NCCL: its sends' kernels are done).
    if mail.sends > 0 {
        transport.flush(comm, &device)?;
    }
    Ok(PipelineStep {
        grads: accumulators.into_iter().map(|mut a| a.grads()).collect(),
        losses,
        sends: mail.sends,
        recvs: mail.recvs,
        peak_held,
        timeline,
        started,
        deferred: deferred_count,
    })
}
