//! A rank's collectives on its own device tensors: on the installed
//! [`DeviceCollectives`](crate::comm::DeviceCollectives) (NCCL on CUDA), else staged through the
//! host [`Communicator`]. The redistributions of `DTensor` call these.

use burn::tensor::TensorData;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use crate::comm::{
    CollectiveKind, Communicator, Error, Group, ReduceOp, check_dim, check_divisible, stage,
};
use crate::device::DistDevice;

/// The host path of a rank: through its host communicator.
fn host<B: Backend>(
    device: &DistDevice<B>,
    tensor: FloatTensor<B>,
    call: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, Error>,
) -> Result<FloatTensor<B>, Error> {
    stage::<B>(device.context().comm(), device.inner(), tensor, call)
}

/// All-reduce of this rank's tensor on `group`: on the installed device collectives, else
/// through the host communicator.
pub(crate) fn all_reduce<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    op: ReduceOp,
) -> Result<FloatTensor<B>, Error> {
    match device.context().device_collectives::<B>() {
        Some(dc) => dc.all_reduce(group, tensor, op),
        None => host(device, tensor, |c, d| c.all_reduce(group, d, op)),
    }
}

/// All-gather along `dim` (see [`Communicator::all_gather`]).
pub(crate) fn all_gather<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
) -> Result<FloatTensor<B>, Error> {
    match device.context().device_collectives::<B>() {
        Some(dc) => {
            check_dim(CollectiveKind::AllGather, tensor.shape().num_dims(), dim)?;
            if dim == 0 {
                return dc.all_gather_first(group, tensor);
            }
            let gathered = dc.all_gather_first(group, B::float_swap_dims(tensor, 0, dim))?;
            Ok(B::float_swap_dims(gathered, 0, dim))
        }
        None => host(device, tensor, |c, d| c.all_gather(group, d, dim)),
    }
}

/// Reduce-scatter along `dim` (see [`Communicator::reduce_scatter`]).
pub(crate) fn reduce_scatter<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
    op: ReduceOp,
) -> Result<FloatTensor<B>, Error> {
    let ctx = device.context();
    match ctx.device_collectives::<B>() {
        Some(dc) => {
            let shape = tensor.shape();
            check_dim(CollectiveKind::ReduceScatter, shape.num_dims(), dim)?;
            let n = group.size(ctx.mesh())?;
            check_divisible(shape[dim], dim, n)?;
            if dim == 0 {
                return dc.reduce_scatter_first(group, tensor, op);
            }
            let chunk = dc.reduce_scatter_first(group, B::float_swap_dims(tensor, 0, dim), op)?;
            Ok(B::float_swap_dims(chunk, 0, dim))
        }
        None => host(device, tensor, |c, d| c.reduce_scatter(group, d, dim, op)),
    }
}

/// Broadcast from group index `root`; every member passes its own tensor (the root's is sent,
/// the others' shape and dtype are the receive buffer's).
pub(crate) fn broadcast<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    root: usize,
) -> Result<FloatTensor<B>, Error> {
    match device.context().device_collectives::<B>() {
        Some(dc) => dc.broadcast(group, tensor, root),
        None => host(device, tensor, |c, d| c.broadcast(group, Some(d), root)),
    }
}
