//! Collectives over the inner backend's own device buffers, beside the host [`Communicator`].
//!
//! The [`Communicator`] trait moves host buffers ([`TensorData`]): right for ranks as threads
//! and for MPI between CPU processes, but on GPUs every collective would cost a device → host →
//! device round trip. A rank can therefore install [`DeviceCollectives`] for its inner backend
//! ([`RankContext::set_device_collectives`](crate::RankContext::set_device_collectives)): the
//! redistributions of `Distributed<B>` (FSDP gathers, gradient reductions, tensor-parallel
//! partial sums, broadcasts) then hand the backend's tensors to it as they are, and only the
//! host-side calls (a norm's scalar, a barrier, checkpoint gathers) keep using the host
//! communicator. NCCL on CUDA ([`NcclCommunicator`](super::NcclCommunicator), feature `cuda`) is
//! the implementation this exists for.
//!
//! Implementations only see dim 0: [`all_gather`] and [`reduce_scatter`] move the requested
//! dimension to the front with a stride permutation (`swap_dims`, no copy) and back, so a
//! collective library's flat buffer semantics (NCCL's) serve every dimension.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Shape, TensorData};
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

use super::{CollectiveKind, CommQueue, CommStats, Communicator, Error, Group, ReduceOp};

/// Collectives on `B`'s device tensors, with the semantics of [`Communicator`] restricted to
/// dim 0. Every member of the group calls the same sequence (SPMD). Implementations count
/// their calls with [`CommStats`]' byte conventions, in their own [`DeviceCollectives::stats`]
/// or in the host communicator's; [`RankContext::comm_stats`](crate::RankContext::comm_stats)
/// reads both.
pub trait DeviceCollectives<B: Backend>: Send + Sync + fmt::Debug {
    /// The calls counted here rather than by the host communicator (default: none).
    fn stats(&self) -> CommStats {
        CommStats::default()
    }

    /// Every member gets the element-wise reduction of all members' tensors (same shape).
    fn all_reduce(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, Error>;

    /// The concatenation along dim 0 of every member's tensor, in group order. Members' shapes
    /// agree except on dim 0.
    fn all_gather_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
    ) -> Result<FloatTensor<B>, Error>;

    /// Reduce, then this member's chunk along dim 0 (the caller checked divisibility).
    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, Error>;

    /// Every member gets the tensor of the member at group index `root`; the others pass a
    /// tensor of the same shape and dtype as the receive buffer.
    fn broadcast(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        root: usize,
    ) -> Result<FloatTensor<B>, Error>;

    /// The rows of `tensor` (dim 0) `send[j]` to each member `j`, the rows each member sends
    /// back concatenated in group order (`recv[i]` from member `i`): see
    /// [`Communicator::all_to_all`]. Default: [`Error::Unsupported`].
    fn all_to_all_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        send: &[usize],
        recv: &[usize],
    ) -> Result<FloatTensor<B>, Error> {
        let _ = (group, tensor, send, recv);
        Err(unsupported("all-to-all", format!("{self:?}")))
    }

    /// Sends `tensor` to global rank `to` without waiting for it to be received: pipeline
    /// stages' activations and gradients. A pair's messages arrive in the order they were
    /// sent. Default: [`Error::Unsupported`].
    fn send(&self, to: usize, tensor: FloatTensor<B>) -> Result<(), Error> {
        let _ = (to, tensor);
        Err(unsupported("point-to-point sends", format!("{self:?}")))
    }

    /// Receives the next tensor global rank `from` sent to this rank, of `shape` and `dtype`
    /// (which the sender told the receiver beforehand, over the host communicator), onto
    /// `device`, waiting for it (within the timeout). Default: [`Error::Unsupported`].
    fn recv(
        &self,
        from: usize,
        shape: Shape,
        dtype: DType,
        device: &B::Device,
    ) -> Result<FloatTensor<B>, Error> {
        let _ = (from, shape, dtype, device);
        Err(unsupported("point-to-point receives", format!("{self:?}")))
    }

    /// Waits until every tensor this rank sent has left it (within the timeout). Default:
    /// nothing to wait for.
    fn flush(&self) -> Result<(), Error> {
        Ok(())
    }

    /// An all-gather of a buffer in host memory (an offloaded parameter shard), issued now:
    /// collectives that can take a host buffer send it as it is and give the gathered result
    /// through [`HostGather::upload`]. Default: the buffer handed back (`Err`), for the caller
    /// to upload and [`DeviceCollectives::issue`].
    fn issue_all_gather_from_host(
        self: Arc<Self>,
        gather: HostGather<B>,
    ) -> Result<DeviceIssued<B>, TensorData> {
        Err(gather.data)
    }

    /// `op` issued now and waited for later ([`DeviceIssued::wait`]): FSDP's prefetched
    /// gathers and the gradient reductions issued where gradients are born. The calls of a
    /// rank run in the order they are issued, blocking ones included. Default: run now (the
    /// result is in hand when this returns). NCCL enqueues the call on its stream and returns.
    fn issue(
        self: Arc<Self>,
        group: Group,
        op: DeviceOp,
        tensor: FloatTensor<B>,
    ) -> DeviceIssued<B> {
        run_now(&*self, group, op, tensor)
    }
}

/// An all-gather of a buffer in host memory ([`DeviceCollectives::issue_all_gather_from_host`]).
pub struct HostGather<B: Backend> {
    /// The all-gather: its group, the buffer's description and the dim.
    pub call: super::Call,
    /// This member's buffer.
    pub data: TensorData,
    /// How the gathered buffer becomes a device tensor (it counts the upload): call it where
    /// the transfer overlaps the caller's compute — on the issuing thread, or as the finishing
    /// step of a call on its [`super::CommQueue`] (which runs it on the issuing thread's device
    /// stream); anywhere else, wrap it in [`super::on_callers_stream`] on the issuing thread.
    pub upload: Box<dyn FnOnce(TensorData) -> FloatTensor<B> + Send>,
}

/// `what` is not offered by the device collectives `on`.
fn unsupported(what: &str, on: String) -> Error {
    Error::Unsupported(format!("{what} on the device collectives {on}"))
}

/// `op` run now, as an issued call already done.
pub fn run_now<B: Backend>(
    collectives: &(impl DeviceCollectives<B> + ?Sized),
    group: Group,
    op: DeviceOp,
    tensor: FloatTensor<B>,
) -> DeviceIssued<B> {
    DeviceIssued::done(match op {
        DeviceOp::AllReduce(op) => collectives.all_reduce(group, tensor, op),
        DeviceOp::AllGatherFirst => collectives.all_gather_first(group, tensor),
        DeviceOp::ReduceScatterFirst(op) => collectives.reduce_scatter_first(group, tensor, op),
    })
}

/// A collective [`DeviceCollectives::issue`] can issue ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceOp {
    /// [`DeviceCollectives::all_reduce`].
    AllReduce(ReduceOp),
    /// [`DeviceCollectives::all_gather_first`].
    AllGatherFirst,
    /// [`DeviceCollectives::reduce_scatter_first`].
    ReduceScatterFirst(ReduceOp),
}

/// A device collective issued and not yet waited for ([`DeviceCollectives::issue`]).
#[must_use = "an issued collective's result is only had by waiting for it"]
pub struct DeviceIssued<B: Backend> {
    wait: Box<dyn FnOnce() -> Result<FloatTensor<B>, Error> + Send>,
}

impl<B: Backend> DeviceIssued<B> {
    /// A call whose result `wait` gives, waiting for it.
    pub fn new(wait: impl FnOnce() -> Result<FloatTensor<B>, Error> + Send + 'static) -> Self {
        Self {
            wait: Box::new(wait),
        }
    }

    /// A call already done.
    pub fn done(result: Result<FloatTensor<B>, Error>) -> Self {
        Self::new(move || result)
    }

    /// Wait for the call: its result.
    pub fn wait(self) -> Result<FloatTensor<B>, Error> {
        (self.wait)()
    }

    /// `f` applied to the result, once waited for.
    pub(crate) fn then(
        self,
        f: impl FnOnce(FloatTensor<B>) -> Result<FloatTensor<B>, Error> + Send + 'static,
    ) -> Self {
        Self::new(move || (self.wait)().and_then(f))
    }
}

impl<B: Backend> fmt::Debug for DeviceIssued<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeviceIssued")
    }
}

/// The host path written as [`DeviceCollectives`]: read the tensor, call the host communicator
/// (which counts the call in its statistics), upload the result. It is what runs when nothing
/// is installed; installed explicitly it lets a test check the device path's dispatch and
/// dimension handling on any backend (CPU included), and it counts the calls it was given
/// ([`HostStaged::calls`]).
pub struct HostStaged {
    comm: Arc<dyn Communicator>,
    /// Where issued calls go ([`HostStaged::queued`]); without one they run when issued.
    queue: Option<Arc<CommQueue>>,
    calls: Mutex<BTreeMap<CollectiveKind, u64>>,
}

impl HostStaged {
    /// Collectives through `comm`, staged through host memory.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            queue: None,
            calls: Mutex::default(),
        }
    }

    /// Collectives through a rank's queue ([`RankContext::queue_arc`](crate::RankContext::queue_arc)),
    /// staged through host memory; [`DeviceCollectives::issue`] issues them on its
    /// communication thread, as NCCL issues on its stream: the device path's asynchronous
    /// dispatch, on any backend.
    pub fn queued(queue: Arc<CommQueue>) -> Self {
        Self {
            comm: queue.clone(),
            queue: Some(queue),
            calls: Mutex::default(),
        }
    }

    fn count(&self, kind: CollectiveKind) {
        *self
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(kind)
            .or_default() += 1;
    }

    /// How many calls of each kind went through these collectives.
    pub fn calls(&self) -> BTreeMap<CollectiveKind, u64> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn staged<B: Backend>(
        &self,
        kind: CollectiveKind,
        tensor: FloatTensor<B>,
        call: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, Error>,
    ) -> Result<FloatTensor<B>, Error> {
        self.count(kind);
        let device = B::float_device(&tensor);
        stage::<B>(&*self.comm, &device, tensor, call)
    }
}

impl fmt::Debug for HostStaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostStaged(rank {})", self.comm.rank())
    }
}

/// Sends a local tensor to global rank `to` as a host point-to-point message on `comm`.
pub(crate) fn host_send<B: Backend>(
    comm: &dyn Communicator,
    to: usize,
    tensor: FloatTensor<B>,
) -> Result<(), Error> {
    comm.point_to_point()?.send(to, read::<B>(tensor))
}

/// The next host point-to-point message from global rank `from` on `comm`, onto `device`; one
/// of another `shape` or `dtype` than announced fails with [`Error::Mismatch`].
pub(crate) fn host_recv<B: Backend>(
    comm: &dyn Communicator,
    from: usize,
    shape: Shape,
    dtype: DType,
    device: &B::Device,
) -> Result<FloatTensor<B>, Error> {
    let data = comm.point_to_point()?.recv(from)?;
    if data.shape != shape || data.dtype != dtype {
        return Err(Error::Mismatch {
            op: CollectiveKind::Recv,
            group: "p2p".into(),
            detail: format!(
                "rank {from} sent {:?} {:?} where {dtype:?} {shape:?} was announced",
                data.dtype, data.shape
            ),
        });
    }
    Ok(upload::<B>(data, device))
}

/// `data` made a tensor on `device`, copied first into the backend's pinned staging memory
/// where it has one (`Backend::staging`: CubeCL's CUDA runtime; a no-op on Flex and Wgpu). From
/// pageable memory CUDA's asynchronous copy may wait for the stream to drain before it returns
/// (the driver stages the bytes itself); from pinned memory it is queued and returns at once. So
/// the calling thread pays one host copy, the one the driver would have made, instead of a wait
/// for the device. For buffers made to be uploaded once (a collective's result, a received
/// message, a shard handed back by a gather); a kept host piece uploaded at each use would pay
/// two copies (a clone, then the staging).
pub fn upload<B: Backend>(mut data: TensorData, device: &B::Device) -> FloatTensor<B> {
    B::staging(std::iter::once(&mut data), device);
    B::float_from_data(data, device)
}

/// A local tensor's values on the host, in one copy at most on Flex (`copied_flex`): what the
/// host-staged collectives, an offloaded piece and a checkpoint snapshot read.
pub fn read<B: Backend>(t: FloatTensor<B>) -> TensorData {
    if let Some(data) = copied_flex(&t) {
        return data;
    }
    burn_backend::read_sync(B::float_into_data(t)).expect("reading a local tensor failed")
}

/// A Flex f32 tensor's values in one copy, where Flex's `into_data` would make two: a buffer
/// shared with another tensor (an FSDP shard the parameter holds, staged for its all-gather; a
/// piece offloaded or snapshotted while its value lives on) or larger than the view is copied into a `Vec<u8>`, which `Bytes::from_bytes_vec` copies
/// again to realign (a `Vec<u8>`'s declared alignment is 1). `None` where `into_data` moves the
/// buffer without a copy (the tensor owns exactly its elements), and for any other tensor.
fn copied_flex<T: 'static>(t: &T) -> Option<TensorData> {
    let t = (t as &dyn std::any::Any).downcast_ref::<burn::backend::flex::FlexTensor>()?;
    let values = t.as_slice::<f32>()?;
    if t.is_unique() && t.bytes().len() == std::mem::size_of_val(values) {
        return None;
    }
    Some(TensorData::new(values.to_vec(), t.layout().shape().clone()))
}

/// Read `tensor`, run `call` on the host communicator, upload the result to `device`.
pub(crate) fn stage<B: Backend>(
    comm: &dyn Communicator,
    device: &B::Device,
    tensor: FloatTensor<B>,
    call: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, Error>,
) -> Result<FloatTensor<B>, Error> {
    let data = call(comm, read::<B>(tensor))?;
    Ok(upload::<B>(data, device))
}

impl<B: Backend> DeviceCollectives<B> for HostStaged {
    fn all_reduce(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, Error> {
        self.staged::<B>(CollectiveKind::AllReduce, tensor, |c, d| {
            c.all_reduce(group, d, op)
        })
    }

    fn all_gather_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
    ) -> Result<FloatTensor<B>, Error> {
        self.staged::<B>(CollectiveKind::AllGather, tensor, |c, d| {
            c.all_gather(group, d, 0)
        })
    }

    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, Error> {
        self.staged::<B>(CollectiveKind::ReduceScatter, tensor, |c, d| {
            c.reduce_scatter(group, d, 0, op)
        })
    }

    fn broadcast(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        root: usize,
    ) -> Result<FloatTensor<B>, Error> {
        self.staged::<B>(CollectiveKind::Broadcast, tensor, |c, d| {
            c.broadcast(group, Some(d), root)
        })
    }

    fn all_to_all_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        send: &[usize],
        recv: &[usize],
    ) -> Result<FloatTensor<B>, Error> {
        self.staged::<B>(CollectiveKind::AllToAll, tensor, |c, d| {
            c.all_to_all(group, d, send, recv)
        })
    }

    /// Through the host communicator's point-to-point messages.
    fn send(&self, to: usize, tensor: FloatTensor<B>) -> Result<(), Error> {
        self.count(CollectiveKind::Send);
        host_send::<B>(&*self.comm, to, tensor)
    }

    /// Through the host communicator's point-to-point messages; a message of another shape or
    /// dtype than announced fails with [`Error::Mismatch`].
    fn recv(
        &self,
        from: usize,
        shape: Shape,
        dtype: DType,
        device: &B::Device,
    ) -> Result<FloatTensor<B>, Error> {
        self.count(CollectiveKind::Recv);
        host_recv::<B>(&*self.comm, from, shape, dtype, device)
    }

    fn flush(&self) -> Result<(), Error> {
        self.comm.point_to_point()?.flush()
    }

    /// Queued: the host buffer goes to the communication thread as it is, the result is
    /// uploaded there. Not queued: the call runs now on the host buffer.
    fn issue_all_gather_from_host(
        self: Arc<Self>,
        gather: HostGather<B>,
    ) -> Result<DeviceIssued<B>, TensorData> {
        let HostGather { call, data, upload } = gather;
        self.count(call.kind());
        let Some(queue) = &self.queue else {
            let result = self.comm.collective(call, Some(data));
            return Ok(DeviceIssued::done(
                result.map(|r| upload(super::returned(r))),
            ));
        };
        let pending = queue.issue_then(call, Some(data), upload);
        Ok(DeviceIssued::new(move || pending.wait()))
    }

    fn issue(
        self: Arc<Self>,
        group: Group,
        op: DeviceOp,
        tensor: FloatTensor<B>,
    ) -> DeviceIssued<B> {
        let Some(queue) = &self.queue else {
            return run_now::<B>(&*self, group, op, tensor);
        };
        let device = B::float_device(&tensor);
        let data = read::<B>(tensor);
        let operand = super::Operand::of(&data);
        let call = match op {
            DeviceOp::AllReduce(op) => super::Call::all_reduce(group, operand, op),
            DeviceOp::AllGatherFirst => super::Call::all_gather(group, operand, 0),
            DeviceOp::ReduceScatterFirst(op) => super::Call::reduce_scatter(group, operand, 0, op),
        };
        self.count(call.kind());
        // The result uploaded on the communication thread (on this thread's stream).
        let pending = queue.issue_then(call, Some(data), move |data| upload::<B>(data, &device));
        DeviceIssued::new(move || pending.wait())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;

    /// A shared or narrowed Flex tensor is read in one copy with its values; one that owns
    /// exactly its elements is left to `into_data`, which moves its buffer.
    #[test]
    fn flex_tensors_are_read_with_at_most_one_copy() {
        let values: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let data = TensorData::new(values.clone(), [2, 5]);
        let t = FlexTensor::from_data(data.clone());
        assert!(
            copied_flex(&t).is_none(),
            "an owned tensor moves its buffer"
        );
        let shared = t.clone();
        assert!(
            copied_flex(&shared).is_some(),
            "a shared one is copied here"
        );
        assert_eq!(read::<Flex>(shared), data);
        let row = t.narrow(0, 1, 1);
        assert_eq!(
            read::<Flex>(row).to_vec::<f32>().unwrap(),
            values[5..].to_vec()
        );
        // A non-contiguous view goes through `into_data`.
        let column = t.narrow(1, 2, 1);
        assert!(copied_flex(&column).is_none());
        assert_eq!(
            read::<Flex>(column).to_vec::<f32>().unwrap(),
            vec![2.0, 7.0]
        );
        assert_eq!(read::<Flex>(t), data);
    }
}
