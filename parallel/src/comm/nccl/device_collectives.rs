//! Collectives on Burn's CUDA tensors ([`DeviceCollectives`]), on the device: no host copy.

use burn::tensor::{DType, Shape};
use burn_backend::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;

use super::NcclCommunicator;
use super::calls::Enqueued;
use crate::comm::buffer::check_reducible;
use crate::comm::call::Operand;
use crate::comm::{
    Call, CollectiveKind, CommStats, Communicator, DeviceCollectives, DeviceIssued, DeviceOp,
    Error, Group, ReduceOp, lock,
};
use std::sync::Arc;
use std::time::Instant;

pub(super) fn contiguous(tensor: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
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
    /// tensor, recorded with the input's bytes (and traced, from its start to its end).
    fn on_device(
        &self,
        call: Call,
        tensor: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        let started = Instant::now();
        let (out, enqueued) = self.enqueue_on_device(&call, tensor)?;
        self.wait_enqueued(&call, enqueued)?;
        let times = self.member.tracing().then_some((started, started));
        self.member.record(&call, None, times);
        Ok(out)
    }

    /// [`Self::on_device`] up to the call enqueued on the NCCL stream: the tensor it will
    /// fill, and the call to wait for.
    fn enqueue_on_device(
        &self,
        call: &Call,
        tensor: CubeTensor<CudaRuntime>,
    ) -> Result<(CubeTensor<CudaRuntime>, Enqueued), Error> {
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
        self.round(call)?.check_layouts(None)?;
        let recv = self.client.empty(out_elems * t.dtype.size());
        let enqueued = self.enqueue(call, t.dtype, count, &t.handle, &recv)?;
        Ok((fresh(&t, Shape::from(dims), recv), enqueued))
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

    /// Grouped `ncclSend`/`ncclRecv` on the device, the splits checked across the members.
    fn all_to_all_first(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        send: &[usize],
        recv: &[usize],
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        let started = Instant::now();
        let t = contiguous(tensor);
        let splits = crate::comm::Splits {
            send: send.to_vec(),
            recv: recv.to_vec(),
        };
        let call = Call::all_to_all(group, operand(&t), splits);
        let shape = t.shape();
        let row = shape.as_slice()[1..].iter().product::<usize>();
        let rows: usize = recv.iter().sum();
        let out = {
            let _calls = lock(&self.calls);
            self.check_all_to_all(&call)?;
            let out = self.client.empty((rows * row * t.dtype.size()).max(1));
            let enqueued = self.enqueue_all_to_all(&call, t.dtype, row, &t.handle, &out)?;
            self.wait_enqueued(&call, enqueued)?;
            out
        };
        let mut dims = shape.to_vec();
        dims[0] = rows;
        let times = self.member.tracing().then_some((started, started));
        self.member.record(&call, None, times);
        Ok(fresh(&t, Shape::from(dims), out))
    }

    /// On the channel to `to` (a neighbouring pipeline rank): enqueued, not waited for.
    fn send(&self, to: usize, tensor: CubeTensor<CudaRuntime>) -> Result<(), Error> {
        self.p2p_send(to, tensor)
    }

    /// On the channel from `from`, waited for.
    fn recv(
        &self,
        from: usize,
        shape: Shape,
        dtype: DType,
        device: &CudaDevice,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        self.p2p_recv(from, shape, dtype, device)
    }

    fn flush(&self) -> Result<(), Error> {
        self.p2p_flush()
    }

    /// Enqueued on this rank's NCCL stream and returned at once: the compute enqueued after it
    /// runs beside it; waiting polls its event (with the timeout). With call checks on
    /// ([`NcclOptions::check_calls`](super::NcclOptions::check_calls)) each call's header
    /// exchange waits for the calls before it on the stream, so one call at a time overlaps.
    fn issue(
        self: Arc<Self>,
        group: Group,
        op: DeviceOp,
        tensor: CubeTensor<CudaRuntime>,
    ) -> DeviceIssued<CubeBackend<CudaRuntime, F, I, BT>> {
        let call = match op {
            DeviceOp::AllReduce(op) => Call::all_reduce(group, operand(&tensor), op),
            DeviceOp::AllGatherFirst => Call::all_gather(group, operand(&tensor), 0),
            DeviceOp::ReduceScatterFirst(op) => {
                Call::reduce_scatter(group, operand(&tensor), 0, op)
            }
        };
        let issued = Instant::now();
        match self.enqueue_on_device(&call, tensor) {
            Ok((out, enqueued)) => DeviceIssued::new(move || {
                self.wait_enqueued(&call, enqueued)?;
                let times = self.member.tracing().then_some((issued, issued));
                self.member.record(&call, None, times);
                Ok(out)
            }),
            Err(e) => DeviceIssued::done(Err(e)),
        }
    }
}
