//! The host API over NCCL ([`Communicator`]): each buffer is uploaded, moved by NCCL and read
//! back.

use burn::tensor::{Shape, TensorData};

use super::NcclCommunicator;
use crate::comm::buffer::{check_dim, check_divisible, check_reducible, chunk_bytes, gathered};
use crate::comm::call::Operand;
use crate::comm::{Call, CollectiveKind, Communicator, Error, Member, ReduceOp, lock};

impl NcclCommunicator {
    /// A host all-reduce, not recorded (the barrier is made of one).
    fn host_all_reduce(&self, call: &Call, data: TensorData) -> Result<TensorData, Error> {
        check_reducible(data.dtype)?;
        let _calls = lock(&self.calls);
        self.round(call)?.check_layouts(None)?;
        let n = data.shape.num_elements();
        let send = self.upload(data.as_bytes());
        let recv = self.client.empty(data.bytes.len());
        self.raw(call, data.dtype, n, &send, &recv)?;
        self.download(recv, data.shape.clone(), data.dtype)
    }

    /// The host all-gather: NCCL gathers equal pieces, one after the other.
    fn host_all_gather(&self, call: &Call, data: TensorData) -> Result<TensorData, Error> {
        let dim = call.dim();
        check_dim(CollectiveKind::AllGather, data.shape.num_dims(), dim)?;
        let members = call.group().size(self.mesh())?;
        let _calls = lock(&self.calls);
        // Members whose pieces differ along `dim` are refused (the host communicators accept
        // them).
        self.round(call)?.check_layouts(None)?;
        let n = data.shape.num_elements();
        let send = self.upload(data.as_bytes());
        let recv = self.client.empty(data.bytes.len() * members);
        self.raw(call, data.dtype, n, &send, &recv)?;
        // The gathered pieces lie one after the other; concatenate them along `dim`.
        let flat = self.download_bytes(recv, data.bytes.len() * members)?;
        let shapes = vec![data.shape.to_vec(); members];
        gathered(flat, &shapes, dim, data.dtype)
    }

    /// The host reduce-scatter: the chunks laid out along `dim` one after the other, as NCCL
    /// scatters them.
    fn host_reduce_scatter(&self, call: &Call, data: TensorData) -> Result<TensorData, Error> {
        let dim = call.dim();
        check_dim(CollectiveKind::ReduceScatter, data.shape.num_dims(), dim)?;
        check_reducible(data.dtype)?;
        let members = call.group().size(self.mesh())?;
        check_divisible(data.shape[dim], dim, members)?;
        let _calls = lock(&self.calls);
        self.round(call)?.check_layouts(None)?;
        let mut bytes = Vec::with_capacity(data.bytes.len());
        let mut chunk_shape = data.shape.clone();
        for m in 0..members {
            let (chunk, shape) = chunk_bytes(&data, dim, members, m)?;
            bytes.extend_from_slice(&chunk);
            chunk_shape = shape;
        }
        let count = chunk_shape.num_elements();
        let send = self.upload(&bytes);
        let recv = self.client.empty(count * data.dtype.size());
        self.raw(call, data.dtype, count, &send, &recv)?;
        self.download(recv, chunk_shape, data.dtype)
    }

    /// The host all-to-all: the splits checked across the members, then grouped send/recv.
    fn host_all_to_all(&self, call: &Call, data: TensorData) -> Result<TensorData, Error> {
        check_dim(CollectiveKind::AllToAll, data.shape.num_dims(), 0)?;
        let _calls = lock(&self.calls);
        self.check_all_to_all(call)?;
        let splits = call.splits().expect("checked");
        let row = data.shape.as_slice()[1..].iter().product::<usize>();
        let rows: usize = splits.recv.iter().sum();
        let send = self.upload(data.as_bytes());
        let recv = self.client.empty((rows * row * data.dtype.size()).max(1));
        let enqueued = self.enqueue_all_to_all(call, data.dtype, row, &send, &recv)?;
        self.wait_enqueued(call, enqueued)?;
        let mut shape = data.shape.to_vec();
        shape[0] = rows;
        self.download(recv, Shape::from(shape), data.dtype)
    }

    /// The host broadcast: the root's header tells the others what to receive.
    fn host_broadcast(&self, call: &Call, data: Option<TensorData>) -> Result<TensorData, Error> {
        let (group, root) = (call.group(), call.root());
        let index = group.index(self.mesh(), self.rank())?;
        call.check_root(self.mesh())?;
        if index == root && data.is_none() {
            return Err(Error::Unsupported(
                "the broadcast root must pass its buffer".into(),
            ));
        }
        let _calls = lock(&self.calls);
        let round = self.round(call)?;
        let source = round.root_buffer()?;
        let (dtype, n) = (source.dtype(), source.shape().iter().product::<usize>());
        let send = match &data {
            Some(d) => self.upload(d.as_bytes()),
            None => self.client.empty(n * dtype.size()),
        };
        let recv = self.client.empty(n * dtype.size());
        self.raw(call, dtype, n, &send, &recv)?;
        self.download(recv, Shape::from(source.shape()), dtype)
    }
}

/// The host API over NCCL: each buffer is uploaded, moved by NCCL and read back. For the
/// host-side calls of a run (scalars, barriers, checkpoint gathers); the training tensors take
/// the device path ([`DeviceCollectives`](crate::comm::DeviceCollectives)).
impl Communicator for NcclCommunicator {
    /// Host messages between neighbouring pipeline ranks, on their NCCL channels.
    fn point_to_point(&self) -> Result<&dyn crate::comm::PointToPoint, Error> {
        Ok(self)
    }

    fn member(&self) -> &Member {
        &self.member
    }

    fn run(&self, call: &Call, data: Option<TensorData>) -> Result<Option<TensorData>, Error> {
        Ok(match call.kind() {
            CollectiveKind::Barrier => {
                let scalar = TensorData::new(vec![0f32], [1]);
                let sum = Call::all_reduce(call.group(), Operand::of(&scalar), ReduceOp::Sum);
                self.host_all_reduce(&sum, scalar)?;
                None
            }
            CollectiveKind::Broadcast => Some(self.host_broadcast(call, data)?),
            kind => {
                let data = data.expect("this call carries a buffer");
                Some(match kind {
                    CollectiveKind::AllReduce => self.host_all_reduce(call, data)?,
                    CollectiveKind::AllGather => self.host_all_gather(call, data)?,
                    CollectiveKind::AllToAll => self.host_all_to_all(call, data)?,
                    _ => self.host_reduce_scatter(call, data)?,
                })
            }
        })
    }
}
