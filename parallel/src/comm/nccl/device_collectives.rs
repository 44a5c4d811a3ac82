//! Collectives on Burn's CUDA tensors ([`DeviceCollectives`]), on the device: no host copy.

use burn::tensor::Shape;
use burn_backend::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;
use cubecl::server::Handle;

use super::NcclCommunicator;
use crate::comm::buffer::check_reducible;
use crate::comm::call::Operand;
use crate::comm::{
    Call, CollectiveKind, CommStats, Communicator, DeviceCollectives, Error, Group, ReduceOp, lock,
};

fn contiguous(tensor: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
    if tensor.is_contiguous() {
        tensor
    } else {
        burn_cubecl::kernel::into_contiguous(tensor)
    }
}

fn fresh(like: &CubeTensor<CudaRuntime>, shape: Shape, handle: Handle) -> CubeTensor<CudaRuntime> {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        like.dtype,
    )
}

impl NcclCommunicator {
    /// One collective on a CUDA tensor, `call` describing it: its NCCL call into a fresh
    /// tensor, recorded with the input's bytes.
    fn on_device(
        &self,
        call: Call,
        tensor: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        call.check_root(self.mesh())?;
        let t = contiguous(tensor);
        let shape = t.shape();
        let members = call.group().size(self.mesh())?;
        let n = shape.num_elements();
        let mut dims = shape.to_vec();
        let (count, out_elems) = match call.kind() {
            CollectiveKind::AllGather => {
                dims[0] *= members;
                (n, n * members)
            }
            CollectiveKind::ReduceScatter => {
                dims[0] /= members;
                (n / members, n / members)
            }
            _ => (n, n),
        };
        if call.op().is_some() {
            check_reducible(t.dtype)?;
        }
        let _calls = lock(&self.calls);
        self.round(&call)?.check_layouts(None)?;
        let recv = self.client.empty(out_elems * t.dtype.size());
        self.raw(&call, t.dtype, count, &t.handle, &recv)?;
        self.member.record(&call, None, None);
        Ok(fresh(&t, Shape::from(dims), recv))
    }
}

/// The description of a collective on `tensor`.
fn operand(tensor: &CubeTensor<CudaRuntime>) -> Operand {
    Operand::new(tensor.dtype, tensor.shape().as_slice())
}

/// Collectives on Burn's CUDA tensors, on the device (no host copy).
impl<F: FloatElement, I: IntElement, BT: BoolElement>
    DeviceCollectives<CubeBackend<CudaRuntime, F, I, BT>> for NcclCommunicator
{
    fn stats(&self) -> CommStats {
        self.member.stats()
    }

    fn all_reduce(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        self.on_device(Call::all_reduce(group, operand(&tensor), op), tensor)
    }

    fn all_gather_first(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        self.on_device(Call::all_gather(group, operand(&tensor), 0), tensor)
    }

    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        let call = Call::reduce_scatter(group, operand(&tensor), 0, op);
        self.on_device(call, tensor)
    }

    fn broadcast(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        root: usize,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        let call = Call::broadcast(group, Some(operand(&tensor)), root);
        self.on_device(call, tensor)
    }
}
