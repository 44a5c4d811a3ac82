//! A rank's collectives on its own device tensors: on the installed
//! [`DeviceCollectives`](crate::comm::DeviceCollectives) (NCCL on CUDA), else staged through the
//! host [`Communicator`]. The redistributions of `DTensor` call these.

use burn::tensor::TensorData;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use crate::comm::{
    Call, CollectiveKind, Communicator, DeviceCollectives, DeviceIssued, DeviceOp, Error, Group,
    Operand, ReduceOp, check_dim, check_divisible, stage,
};
use crate::device::DistDevice;

/// Runs one collective of this rank: `on_device` on the installed device collectives, else
/// `on_host` through the host communicator (staged through host memory).
fn dispatch<B, D, H>(
    device: &DistDevice<B>,
    tensor: FloatTensor<B>,
    on_device: D,
    on_host: H,
) -> Result<FloatTensor<B>, Error>
where
    B: Backend,
    D: FnOnce(&dyn DeviceCollectives<B>, FloatTensor<B>) -> Result<FloatTensor<B>, Error>,
    H: FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, Error>,
{
    let ctx = device.context();
    match ctx.device_collectives::<B>() {
        Some(dc) => on_device(&*dc, tensor),
        None => stage::<B>(ctx.comm(), device.inner(), tensor, on_host),
    }
}

/// `first` (a device collective along dim 0) applied along `dim`: the dimension is moved to the
/// front with a stride permutation (no copy) and back.
fn along<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    first: impl FnOnce(FloatTensor<B>) -> Result<FloatTensor<B>, Error>,
) -> Result<FloatTensor<B>, Error> {
    if dim == 0 {
        return first(tensor);
    }
    let moved = first(B::float_swap_dims(tensor, 0, dim))?;
    Ok(B::float_swap_dims(moved, 0, dim))
}

/// All-reduce of this rank's tensor on `group`: on the installed device collectives, else
/// through the host communicator.
pub(crate) fn all_reduce<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    op: ReduceOp,
) -> Result<FloatTensor<B>, Error> {
    dispatch(
        device,
        tensor,
        |dc, t| dc.all_reduce(group, t, op),
        |c, d| c.all_reduce(group, d, op),
    )
}

/// All-gather along `dim` (see [`Communicator::all_gather`]).
pub(crate) fn all_gather<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
) -> Result<FloatTensor<B>, Error> {
    dispatch(
        device,
        tensor,
        |dc, t| {
            check_dim(CollectiveKind::AllGather, t.shape().num_dims(), dim)?;
            along::<B>(t, dim, |t| dc.all_gather_first(group, t))
        },
        |c, d| c.all_gather(group, d, dim),
    )
}

/// Rows (dim 0) `send[j]` to each member `j` of `group`, the rows each member sends back
/// concatenated in group order (see [`Communicator::all_to_all`]).
pub(crate) fn all_to_all<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    send: &[usize],
    recv: &[usize],
) -> Result<FloatTensor<B>, Error> {
    dispatch(
        device,
        tensor,
        |dc, t| dc.all_to_all_first(group, t, send, recv),
        |c, d| c.all_to_all(group, d, send, recv),
    )
}

/// A collective issued on the rank's queue ([`crate::comm::CommQueue`]), or already done (on
/// installed device collectives, which run in order on their own stream).
pub(crate) enum PendingTensor<B: Backend> {
    Done(Result<FloatTensor<B>, Error>),
    /// Issued on the installed device collectives.
    Device(DeviceIssued<B>),
    /// Issued on the rank's communication queue; the result uploaded to the device there.
    Queued(crate::comm::Pending<FloatTensor<B>>),
    /// The result cast to this dtype (a reduction run in a lower precision, cast back).
    Cast(Box<PendingTensor<B>>, burn_backend::FloatDType),
    /// A receive from global rank `from` on the installed device collectives, posted when
    /// waited for.
    Recv {
        from: usize,
        shape: burn::tensor::Shape,
        dtype: burn::tensor::DType,
        device: DistDevice<B>,
    },
}

impl<B: Backend> PendingTensor<B> {
    /// The result, waited for.
    pub(crate) fn wait(self) -> Result<FloatTensor<B>, Error> {
        match self {
            Self::Done(result) => result,
            Self::Device(issued) => issued.wait(),
            Self::Queued(pending) => pending.wait(),
            Self::Cast(pending, dtype) => Ok(B::float_cast(pending.wait()?, dtype)),
            Self::Recv {
                from,
                shape,
                dtype,
                device,
            } => recv(&device, from, shape, dtype),
        }
    }
}

/// `op` along `dim` issued on the installed device collectives (`dim` moved to the front with
/// a stride permutation and back, as [`along`] does).
fn issue_on_device<B: Backend>(
    dc: std::sync::Arc<dyn DeviceCollectives<B>>,
    group: Group,
    op: DeviceOp,
    tensor: FloatTensor<B>,
    dim: usize,
) -> DeviceIssued<B> {
    if dim == 0 {
        return dc.issue(group, op, tensor);
    }
    dc.issue(group, op, B::float_swap_dims(tensor, 0, dim))
        .then(move |t| Ok(B::float_swap_dims(t, 0, dim)))
}

/// One step of a reduction: on mesh axis `axis`, an all-reduce (`dim` `None`) or a
/// reduce-scatter along `dim` (which divides by the axis size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReduceStep {
    pub(crate) axis: usize,
    pub(crate) op: ReduceOp,
    pub(crate) dim: Option<usize>,
}

/// One reduction step, blocking.
fn run_step<B: Backend>(
    device: &DistDevice<B>,
    tensor: FloatTensor<B>,
    step: &ReduceStep,
) -> Result<FloatTensor<B>, Error> {
    let group = Group::Axis(step.axis);
    match step.dim {
        Some(d) => reduce_scatter(device, group, tensor, d, step.op),
        None => all_reduce(device, group, tensor, step.op),
    }
}

/// Fails unless `tensor` can be reduce-scattered along `dim` on `group` (the dim exists and
/// divides by the group's size).
fn check_scatter<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: &FloatTensor<B>,
    dim: usize,
) -> Result<(), Error> {
    let shape = tensor.shape();
    check_dim(CollectiveKind::ReduceScatter, shape.num_dims(), dim)?;
    check_divisible(shape[dim], dim, group.size(device.context().mesh())?)
}

/// `steps` applied in order to `tensor`, issued now as one chain on the rank's communication
/// queue (each call takes the previous one's result) and waited for later; on installed device
/// collectives, the first call issued there and the rest run when it is waited for.
pub(crate) fn issue_reduction<B: Backend>(
    device: &DistDevice<B>,
    tensor: FloatTensor<B>,
    steps: &[ReduceStep],
) -> PendingTensor<B> {
    let ctx = device.context();
    if let Some(dc) = ctx.device_collectives::<B>() {
        // The first call is issued; the rest of a chain (HSDP's all-reduce across replicas)
        // runs when it is waited for.
        let Some((first, rest)) = steps.split_first() else {
            return PendingTensor::Done(Ok(tensor));
        };
        let group = Group::Axis(first.axis);
        let (op, dim) = match first.dim {
            Some(d) => (DeviceOp::ReduceScatterFirst(first.op), d),
            None => (DeviceOp::AllReduce(first.op), 0),
        };
        if first.dim.is_some()
            && let Err(e) = check_scatter::<B>(device, group, &tensor, dim)
        {
            return PendingTensor::Done(Err(e));
        }
        let (device, rest) = (device.clone(), rest.to_vec());
        let issued = issue_on_device(dc, group, op, tensor, dim);
        return PendingTensor::Device(
            issued.then(move |t| rest.iter().try_fold(t, |t, s| run_step(&device, t, s))),
        );
    }
    let data = crate::comm::read::<B>(tensor);
    let mut operand = Operand::of(&data);
    let calls = steps
        .iter()
        .map(|s| {
            let group = Group::Axis(s.axis);
            match s.dim {
                Some(d) => {
                    let call = Call::reduce_scatter(group, operand.clone(), d, s.op);
                    let mut shape = operand.shape().to_vec();
                    shape[d] /= device.mesh().axis_size(s.axis);
                    operand = Operand::new(operand.dtype(), &shape);
                    call
                }
                None => Call::all_reduce(group, operand.clone(), s.op),
            }
        })
        .collect();
    let upload = upload_on_comm(device);
    PendingTensor::Queued(ctx.queue().issue_chain_then(calls, Some(data), upload))
}

/// The finishing step of a call queued on the rank's communication thread: its result uploaded
/// to the rank's device there, beside the compute (counted in
/// [`OpCounters::comm_uploads`](crate::OpCounters::comm_uploads)), not when it is waited for.
/// The queue runs it under the stream of the thread that issued the call
/// ([`crate::comm::on_callers_stream`]), so it is ordered with that thread's kernels; it goes
/// through pinned staging memory where the backend has it ([`crate::comm::upload`]).
fn upload_on_comm<B: Backend>(
    device: &DistDevice<B>,
) -> impl FnOnce(TensorData) -> FloatTensor<B> + Send + 'static {
    let (ctx, device) = (device.context().clone(), device.inner().clone());
    move |data| {
        ctx.count_comm_upload();
        crate::comm::upload::<B>(data, &device)
    }
}

/// [`all_gather`], issued now and waited for later: on the installed device collectives, else
/// read to the host and issued on the rank's communication queue.
pub(crate) fn issue_all_gather<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
) -> PendingTensor<B> {
    let ctx = device.context();
    if let Some(dc) = ctx.device_collectives::<B>() {
        if let Err(e) = check_dim(CollectiveKind::AllGather, tensor.shape().num_dims(), dim) {
            return PendingTensor::Done(Err(e));
        }
        return PendingTensor::Device(issue_on_device(
            dc,
            group,
            DeviceOp::AllGatherFirst,
            tensor,
            dim,
        ));
    }
    issue_all_gather_from_host(device, group, crate::comm::read::<B>(tensor), dim)
        .expect("the host path takes a host buffer")
}

/// [`issue_all_gather`] of a piece already in host memory (an offloaded parameter shard): on
/// the host path the buffer goes to the communication queue as it is, and the gathered result
/// is uploaded on the communication thread, so the compute thread makes no transfer; device
/// collectives that take host buffers ([`DeviceCollectives::issue_all_gather_from_host`]) do
/// the same. Otherwise the buffer is handed back (`Err`) for the caller to upload.
pub(crate) fn issue_all_gather_from_host<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    data: TensorData,
    dim: usize,
) -> Result<PendingTensor<B>, TensorData> {
    let ctx = device.context();
    let upload = upload_on_comm(device);
    let call = Call::all_gather(group, Operand::of(&data), dim);
    if let Some(dc) = ctx.device_collectives::<B>() {
        let upload = Box::new(upload);
        let gather = crate::comm::HostGather { call, data, upload };
        return dc
            .issue_all_gather_from_host(gather)
            .map(PendingTensor::Device);
    }
    let pending = ctx.queue().issue_then(call, Some(data), upload);
    Ok(PendingTensor::Queued(pending))
}

/// Reduce-scatter along `dim` (see [`Communicator::reduce_scatter`]).
pub(crate) fn reduce_scatter<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
    op: ReduceOp,
) -> Result<FloatTensor<B>, Error> {
    dispatch(
        device,
        tensor,
        |dc, t| {
            check_scatter::<B>(device, group, &t, dim)?;
            along::<B>(t, dim, |t| dc.reduce_scatter_first(group, t, op))
        },
        |c, d| c.reduce_scatter(group, d, dim, op),
    )
}

/// Broadcast from group index `root`; every member passes its own tensor (the root's is sent,
/// the others' shape and dtype are the receive buffer's).
pub(crate) fn broadcast<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    root: usize,
) -> Result<FloatTensor<B>, Error> {
    dispatch(
        device,
        tensor,
        |dc, t| dc.broadcast(group, t, root),
        |c, d| c.broadcast(group, Some(d), root),
    )
}

/// Sends this rank's tensor to global rank `to` (a pipeline stage's activation or gradient):
/// on the installed device collectives, else as a host point-to-point message.
pub(crate) fn send<B: Backend>(
    device: &DistDevice<B>,
    to: usize,
    tensor: FloatTensor<B>,
) -> Result<(), Error> {
    let ctx = device.context();
    match ctx.device_collectives::<B>() {
        Some(dc) => dc.send(to, tensor),
        None => crate::comm::host_send::<B>(ctx.comm(), to, tensor),
    }
}

/// Receives the next tensor global rank `from` sent ([`send`]), of `shape` and `dtype`.
pub(crate) fn recv<B: Backend>(
    device: &DistDevice<B>,
    from: usize,
    shape: burn::tensor::Shape,
    dtype: burn::tensor::DType,
) -> Result<FloatTensor<B>, Error> {
    let ctx = device.context();
    match ctx.device_collectives::<B>() {
        Some(dc) => dc.recv(from, shape, dtype, device.inner()),
        None => crate::comm::host_recv::<B>(ctx.comm(), from, shape, dtype, device.inner()),
    }
}

/// `tensor` sent to global rank `to`, and the next tensor global rank `from` sends received
/// (of the same shape and dtype: a ring's step), issued now and waited for later: on the host
/// communicator, as one exchange on the rank's communication queue
/// ([`CommQueue::issue_exchange`](crate::comm::CommQueue::issue_exchange)), which runs while
/// the caller computes; on installed device collectives the send is enqueued at once (NCCL's
/// channel stream) and the receive when waited for.
pub(crate) fn issue_exchange<B: Backend>(
    device: &DistDevice<B>,
    to: usize,
    tensor: FloatTensor<B>,
    from: usize,
) -> PendingTensor<B> {
    let ctx = device.context();
    if let Some(dc) = ctx.device_collectives::<B>() {
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        if let Err(e) = dc.send(to, tensor) {
            return PendingTensor::Done(Err(e));
        }
        return PendingTensor::Recv {
            from,
            shape,
            dtype,
            device: device.clone(),
        };
    }
    let data = crate::comm::read::<B>(tensor);
    let upload = upload_on_comm(device);
    PendingTensor::Queued(ctx.queue().issue_exchange_then(to, data, from, upload))
}

/// Waits until every tensor this rank sent ([`send`]) on the installed device collectives has
/// left it (host messages: [`PointToPoint::flush`](crate::comm::PointToPoint::flush)).
pub(crate) fn flush<B: Backend>(device: &DistDevice<B>) -> Result<(), Error> {
    match device.context().device_collectives::<B>() {
        Some(dc) => dc.flush(),
        None => Ok(()),
    }
}
