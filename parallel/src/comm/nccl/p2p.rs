//! Point-to-point between neighbouring pipeline stages on CUDA tensors: one channel per
//! directed pair of neighbours on the `pp` axis
//! ([`p2p_channels`](crate::comm::p2p_channels)), each a two-rank NCCL communicator (the
//! sender rank 0, the receiver rank 1) with a stream of its own on both ends.
//!
//! Why channels: NCCL matches a pair's sends and receives in order on one communicator, and a
//! stream runs its calls in order. With one stream per rank, rank A's send of an activation
//! followed by its receive of a gradient, and rank B's send of that gradient followed by its
//! receive of the activation, would each wait for the other's second call (Megatron pairs such
//! calls in `ncclGroupStart`/`End`; the runner here executes one action at a time). On its own
//! channel each message has one sender and one receiver, which the host header in front of it
//! (sent first, in the same order) tells what to receive: the calls on a channel match in the
//! order they are made, and no call waits behind a call of another channel.
//!
//! A send synchronises the compute stream (the tensor's producers are done), enqueues
//! `ncclSend` on the channel's stream and returns, keeping the buffer alive until its event
//! completes ([`DeviceCollectives::flush`](crate::comm::DeviceCollectives::flush) waits for
//! them all, within the timeout). A receive enqueues `ncclRecv` into a fresh buffer and waits
//! for its event (within the timeout: past it every communicator of the rank is aborted and the
//! call fails with [`Error::Timeout`]).

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Shape};
use burn_backend::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use burn::tensor::TensorData;
use cubecl::server::Handle;

use super::calls::{Enqueued, nccl_dtype};
use super::{CommHandle, NcclCommunicator};
use crate::comm::bootstrap::{Bootstrap, Channel, exchange_channel_ids};
use crate::comm::call::Operand;
use crate::comm::header::{OPERAND, decode_operand, encode_operand, from_bytes, to_bytes};
use crate::comm::{CollectiveKind, Communicator, Error, PointToPoint, lock};
use crate::mesh::DeviceMesh;

/// One end of a channel.
pub(super) struct P2pChannel {
    pub(super) channel: Channel,
    pub(super) comm: CommHandle,
    stream: Arc<CudaStream>,
    /// Sends enqueued and not yet seen complete, their buffers kept alive. Also the lock under
    /// which the channel's communicator is used.
    pending: Mutex<Vec<Enqueued>>,
}

impl P2pChannel {
    /// The channels of this rank of `mesh` (none without a pipeline axis), their ids handed
    /// out over `boot`. Every rank of the mesh calls this at the same time.
    pub(super) fn make(
        mesh: &DeviceMesh,
        boot: &(impl Bootstrap + ?Sized),
        ctx: &Arc<CudaContext>,
    ) -> Result<Vec<Self>, Error> {
        let ids = exchange_channel_ids(mesh, boot, super::new_unique_id)?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let failed = |call: &'static str| {
            move |e: nccl::NcclError| Error::Nccl {
                call,
                reason: format!("{:?}", e.0),
            }
        };
        let mut channels = Vec::with_capacity(ids.len());
        // One group: a rank's channel initialisations would otherwise wait on each other
        // across ranks (each blocks until its peer makes the same call).
        nccl::group_start().map_err(failed("ncclGroupStart"))?;
        for (channel, id) in ids {
            let unique = super::unique_id(&id);
            let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
            let index = if channel.sends { 0 } else { 1 };
            // SAFETY: `comm` is a valid out-pointer; the channel's two ranks make this call
            // with the id its sender made, the sender as rank 0.
            unsafe { nccl::comm_init_rank(&mut comm, 2, unique, index) }
                .map_err(failed("ncclCommInitRank"))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| Error::Cuda(format!("{e:?}")))?;
            channels.push(Self {
                channel,
                comm: CommHandle(comm),
                stream,
                pending: Mutex::new(Vec::new()),
            });
        }
        nccl::group_end().map_err(failed("ncclGroupEnd"))?;
        Ok(channels)
    }
}

impl NcclCommunicator {
    /// The channel to (`sends`) or from `peer`.
    fn channel(&self, peer: usize, sends: bool) -> Result<&P2pChannel, Error> {
        self.channels
            .iter()
            .find(|c| c.channel == Channel { peer, sends })
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "NCCL point-to-point {} rank {peer}: rank {} has channels only to and from \
                     its neighbouring pipeline ranks",
                    if sends { "to" } else { "from" },
                    Communicator::rank(self)
                ))
            })
    }

    /// `count` elements of `datatype` at `handle` sent to (`sends`) or received from `peer` on
    /// their channel, enqueued on its stream after the compute stream's work so far (the
    /// buffer's producers, or its memory's earlier users): the call, its buffer kept alive, and
    /// an event after it.
    fn enqueue_p2p(
        &self,
        peer: usize,
        sends: bool,
        handle: &Handle,
        count: usize,
        datatype: nccl_sys::ncclDataType_t,
    ) -> Result<(&P2pChannel, Enqueued), Error> {
        self.check_alive()?;
        let channel = self.channel(peer, sends)?;
        let cuda = |e: cudarc::driver::DriverError| self.library("CUDA context", e);
        self.ctx.bind_to_thread().map_err(cuda)?;
        cubecl::future::block_on(self.client.sync()).map_err(|e| self.library("CubeCL sync", e))?;
        let resource = self
            .client
            .get_resource(handle.clone())
            .map_err(|e| self.library("CubeCL get_resource", e))?;
        let ptr = resource.resource().ptr as *mut std::ffi::c_void;
        let _comm = lock(&channel.pending);
        let stream = channel.stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: `ptr` is a live device allocation of `count` elements of `datatype`, kept
        // alive with the returned call until it completes; the channel's communicator is used
        // under its lock, on its own stream of the same context; the sender is its rank 0, the
        // receiver its rank 1.
        let called = unsafe {
            if sends {
                nccl::send(ptr, count, datatype, 1, channel.comm.0, stream)
            } else {
                nccl::recv(ptr, count, datatype, 0, channel.comm.0, stream)
            }
        };
        called.map_err(|e| self.library(if sends { "ncclSend" } else { "ncclRecv" }, e.0))?;
        let event = channel
            .stream
            .record_event(None)
            .map_err(|e| self.library("cuEventRecord", e))?;
        let enqueued = Enqueued {
            _buffers: Box::new(resource),
            event,
        };
        Ok((channel, enqueued))
    }

    /// `count` elements of `datatype` at `handle` sent to `to` on their channel: enqueued, not
    /// waited for (the buffer is kept alive until done).
    fn enqueue_send(
        &self,
        to: usize,
        handle: &Handle,
        count: usize,
        datatype: nccl_sys::ncclDataType_t,
    ) -> Result<(), Error> {
        let (channel, send) = self.enqueue_p2p(to, true, handle, count, datatype)?;
        let mut pending = lock(&channel.pending);
        // Forget the sends already done.
        pending.retain(|p| !matches!(p.event.try_is_complete(), Ok(true)));
        pending.push(send);
        Ok(())
    }

    /// `count` elements of `datatype` received from `from` on their channel into `handle`,
    /// waited for (within the timeout).
    fn recv_into(
        &self,
        from: usize,
        handle: &Handle,
        count: usize,
        datatype: nccl_sys::ncclDataType_t,
    ) -> Result<(), Error> {
        let (_, recv) = self.enqueue_p2p(from, false, handle, count, datatype)?;
        self.wait_event(CollectiveKind::Recv, "p2p".into(), recv)
    }

    /// Sends `tensor` to `to` on their channel: enqueued, not waited for.
    pub(super) fn p2p_send(&self, to: usize, tensor: CubeTensor<CudaRuntime>) -> Result<(), Error> {
        let t = super::device_collectives::contiguous(tensor);
        let count = t.shape().num_elements();
        self.enqueue_send(to, &t.handle, count, nccl_dtype(t.dtype)?)?;
        self.member
            .record_p2p(CollectiveKind::Send, count * t.dtype.size());
        Ok(())
    }

    /// Receives the next tensor `from` sent on their channel, of `shape` and `dtype`, waiting
    /// for it (within the timeout).
    pub(super) fn p2p_recv(
        &self,
        from: usize,
        shape: Shape,
        dtype: DType,
        device: &CudaDevice,
    ) -> Result<CubeTensor<CudaRuntime>, Error> {
        let count = shape.num_elements();
        let handle = self.client.empty(count * dtype.size());
        self.recv_into(from, &handle, count, nccl_dtype(dtype)?)?;
        self.member
            .record_p2p(CollectiveKind::Recv, count * dtype.size());
        Ok(CubeTensor::new_contiguous(
            self.client.clone(),
            device.clone(),
            shape,
            handle,
            dtype,
        ))
    }

    /// Waits for every send of this rank to complete (within the timeout).
    pub(super) fn p2p_flush(&self) -> Result<(), Error> {
        for channel in self.channels.iter().filter(|c| c.channel.sends) {
            let sends = std::mem::take(&mut *lock(&channel.pending));
            for send in sends {
                self.wait_event(CollectiveKind::Send, "p2p".into(), send)?;
            }
        }
        Ok(())
    }
}

/// Host messages between neighbouring pipeline ranks (the pipeline's headers when NCCL is the
/// only communicator, torchrun-style): each buffer uploaded and sent on the channel after a
/// fixed-size description of it (dtype and shape), which tells the receiver what follows.
impl PointToPoint for NcclCommunicator {
    fn send(&self, to: usize, data: TensorData) -> Result<(), Error> {
        self.member.check_peer(to)?;
        let words = encode_operand(CollectiveKind::Send, Some(&Operand::of(&data)))?;
        let described = self.upload(&to_bytes(&words));
        self.enqueue_send(
            to,
            &described,
            OPERAND * 8,
            nccl_sys::ncclDataType_t::ncclUint8,
        )?;
        if !data.bytes.is_empty() {
            let body = self.upload(data.as_bytes());
            self.enqueue_send(
                to,
                &body,
                data.bytes.len(),
                nccl_sys::ncclDataType_t::ncclUint8,
            )?;
        }
        self.member
            .record_p2p(CollectiveKind::Send, data.bytes.len());
        Ok(())
    }

    fn recv(&self, from: usize) -> Result<TensorData, Error> {
        self.member.check_peer(from)?;
        let described = self.client.empty(OPERAND * 8);
        self.recv_into(
            from,
            &described,
            OPERAND * 8,
            nccl_sys::ncclDataType_t::ncclUint8,
        )?;
        let words = from_bytes::<OPERAND>(&self.download_bytes(described, OPERAND * 8)?);
        let buffer = decode_operand(&words)?.ok_or_else(|| Error::Mismatch {
            op: CollectiveKind::Recv,
            group: "p2p".into(),
            detail: format!("rank {from} described no buffer"),
        })?;
        let len = buffer.shape().iter().product::<usize>() * buffer.dtype().size();
        let bytes = if len == 0 {
            Vec::new()
        } else {
            let body = self.client.empty(len);
            self.recv_into(from, &body, len, nccl_sys::ncclDataType_t::ncclUint8)?;
            self.download_bytes(body, len)?
        };
        self.member.record_p2p(CollectiveKind::Recv, len);
        Ok(TensorData::from_bytes_vec(
            bytes,
            buffer.shape().to_vec(),
            buffer.dtype(),
        ))
    }

    fn flush(&self) -> Result<(), Error> {
        self.p2p_flush()
    }
}
