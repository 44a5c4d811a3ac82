//! A rank's collectives on its own device tensors: on the installed
//! [`DeviceCollectives`](crate::comm::DeviceCollectives) (NCCL on CUDA), else staged through the
//! host [`Communicator`]. The redistributions of `DTensor` call these.

use burn::tensor::TensorData;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use crate::comm::{
    Call, CollectiveKind, Communicator, DeviceCollectives, Error, Group, Operand, ReduceOp,
    check_dim, check_divisible, stage,
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

/// A collective issued on the rank's queue ([`crate::comm::CommQueue`]), or already done (on
/// installed device collectives, which run in order on their own stream).
pub(crate) enum PendingTensor<B: Backend> {
    Done(Result<FloatTensor<B>, Error>),
    Queued(crate::comm::Pending, B::Device),
}

impl<B: Backend> PendingTensor<B> {
    /// The result, waited for.
    pub(crate) fn wait(self) -> Result<FloatTensor<B>, Error> {
        match self {
            Self::Done(result) => result,
            Self::Queued(pending, device) => Ok(B::float_from_data(pending.wait_data()?, &device)),
        }
    }
}

/// One collective issued now and waited for later: on installed device collectives (which run
/// in order on their own stream) done now by `now`; else read to the host and issued on the
/// rank's communication queue as the call `call` describes.
fn issue<B: Backend>(
    device: &DistDevice<B>,
    tensor: FloatTensor<B>,
    now: impl FnOnce(FloatTensor<B>) -> Result<FloatTensor<B>, Error>,
    call: impl FnOnce(Operand) -> Call,
) -> PendingTensor<B> {
    let ctx = device.context();
    if ctx.device_collectives::<B>().is_some() {
        return PendingTensor::Done(now(tensor));
    }
    let data = crate::comm::read::<B>(tensor);
    let call = call(Operand::of(&data));
    PendingTensor::Queued(ctx.queue().issue(call, Some(data)), device.inner().clone())
}

/// [`all_gather`], issued now and waited for later (see [`issue`]).
pub(crate) fn issue_all_gather<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
) -> PendingTensor<B> {
    issue(
        device,
        tensor,
        |t| all_gather(device, group, t, dim),
        |operand| Call::all_gather(group, operand, dim),
    )
}

/// [`reduce_scatter`], issued now and waited for later (see [`issue`]).
pub(crate) fn issue_reduce_scatter<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
    op: ReduceOp,
) -> PendingTensor<B> {
    issue(
        device,
        tensor,
        |t| reduce_scatter(device, group, t, dim, op),
        |operand| Call::reduce_scatter(group, operand, dim, op),
    )
}

/// [`all_reduce`], issued now and waited for later (see [`issue`]).
pub(crate) fn issue_all_reduce<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    op: ReduceOp,
) -> PendingTensor<B> {
    issue(
        device,
        tensor,
        |t| all_reduce(device, group, t, op),
        |operand| Call::all_reduce(group, operand, op),
    )
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
            let shape = t.shape();
            check_dim(CollectiveKind::ReduceScatter, shape.num_dims(), dim)?;
            check_divisible(shape[dim], dim, group.size(device.context().mesh())?)?;
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
