//! NCCL between CUDA devices (feature `cuda`): one communicator per mesh group, bootstrapped
//! over MPI, a host communicator, or a `MASTER_ADDR:MASTER_PORT` rendezvous
//! ([`Bootstrap`]), and collectives on the device buffers of Burn's CUDA backend with no host
//! copy ([`DeviceCollectives`] for `CubeBackend<CudaRuntime, …>`).
//!
//! How a call runs: the rank's compute stream is synchronised (the input's producers are done),
//! the collective is enqueued on this rank's own NCCL stream over the raw device pointers of the
//! CubeCL handles (`ComputeClient::get_resource`), and the stream is polled until it completes
//! or the timeout passes, in which case every NCCL communicator of the rank is aborted
//! (`ncclCommAbort`) and the call fails with [`CommError::Timeout`] instead of hanging. The
//! outputs are fresh buffers (Burn tensors are immutable values).
//!
//! Every call is checked first (unless [`NcclOptions::check_calls`] is off): the members
//! all-gather a small header (call number, collective, op, dtype, shape) over NCCL, and a
//! member that diverges makes every member fail with [`CommError::Mismatch`] at that call.
//!
//! Reductions are NCCL's: fast, not in group order, so not bitwise equal to ranks as threads
//! (the host communicators are). Point-to-point is not offered ([`CommError::Unsupported`]).
//!
//! Not run here: this workspace's CI has no GPU. It compiles in CI (`cargo check --features
//! cuda`); the pure parts (bootstrap, header checks, the dim handling) are tested on CPU.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Shape, TensorData};
use burn_backend::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::Runtime;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::bootstrap::{Bootstrap, RendezvousError, bootstrap_groups, exchange_group_ids};
use super::buffer::{check_dim, check_divisible, check_reducible, chunk_bytes, gathered};
use super::call::{Operand, Round};
use super::header::{self, HEADER, Header, Sequence};
use super::stats::StatsCell;
use super::{
    Call, CollectiveKind, CommError, CommStats, Communicator, DeviceCollectives, Group, ReduceOp,
    lock,
};
use crate::mesh::DeviceMesh;

/// How an [`NcclCommunicator`] behaves.
#[derive(Clone, Debug)]
pub struct NcclOptions {
    /// How long a collective may wait before the rank aborts NCCL and fails.
    pub timeout: Duration,
    /// Exchange and compare a call header before every collective (one tiny extra all-gather
    /// per call): divergent ranks fail at the first divergent call rather than hanging.
    pub check_calls: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        Self {
            timeout: super::DEFAULT_TIMEOUT,
            check_calls: true,
        }
    }
}

/// Creating an [`NcclCommunicator`] failed.
#[derive(Debug, thiserror::Error)]
pub enum NcclInitError {
    /// The ids could not be handed out.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// A CUDA driver call failed (no device, no driver).
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An NCCL call failed (no libnccl, a peer with another NCCL version, …).
    #[error("NCCL {call}: {reason}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// NCCL's result code.
        reason: String,
    },
}

/// An NCCL communicator handle. SAFETY: used only under the owner's call lock (NCCL
/// communicators are not thread-safe), destroyed once in `Drop`.
struct CommHandle(nccl_sys::ncclComm_t);
unsafe impl Send for CommHandle {}
unsafe impl Sync for CommHandle {}

/// One rank's NCCL communicators (one per mesh group it belongs to) on its CUDA device.
pub struct NcclCommunicator {
    rank: usize,
    mesh: DeviceMesh,
    device: CudaDevice,
    client: ComputeClient<CudaRuntime>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// In [`bootstrap_groups`] order: each axis, then the world.
    comms: Vec<CommHandle>,
    options: NcclOptions,
    sequence: Sequence,
    stats: StatsCell,
    /// One NCCL call at a time on this rank.
    calls: Mutex<()>,
    aborted: AtomicBool,
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclCommunicator(rank {} of {}, {:?})",
            self.rank, self.mesh, self.device
        )
    }
}

fn nccl_dtype(dtype: DType) -> Result<nccl_sys::ncclDataType_t, CommError> {
    use nccl_sys::ncclDataType_t as T;
    Ok(match dtype {
        DType::F64 => T::ncclFloat64,
        DType::F32 => T::ncclFloat32,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I64 => T::ncclInt64,
        DType::I32 => T::ncclInt32,
        DType::I8 => T::ncclInt8,
        DType::U64 => T::ncclUint64,
        DType::U32 => T::ncclUint32,
        DType::U8 => T::ncclUint8,
        other => return Err(CommError::UnsupportedDType(other.name().to_owned())),
    })
}

fn nccl_op(op: ReduceOp) -> nccl_sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl_sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nccl_sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl_sys::ncclRedOp_t::ncclMax,
    }
}

impl NcclCommunicator {
    /// Rank `rank` of `mesh` on CUDA device `device`: makes one NCCL communicator per group of
    /// the rank (every axis, then the world), with ids handed out over `boot` (an MPI or other
    /// host communicator, or a [`TcpRendezvous`](super::TcpRendezvous)). Every rank of the mesh
    /// must call this at the same time (NCCL's initialisation is collective).
    pub fn new(
        mesh: DeviceMesh,
        rank: usize,
        device: CudaDevice,
        boot: &(impl Bootstrap + ?Sized),
        options: NcclOptions,
    ) -> Result<Self, NcclInitError> {
        // cudarc loads the libraries at first use and panics when one is missing: ask first.
        // SAFETY: only tries to open the shared libraries.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(NcclInitError::Cuda(
                "libcuda was not found: NCCL needs an NVIDIA driver".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(NcclInitError::Nccl {
                call: "loading libnccl",
                reason: "libnccl.so was not found: install NCCL (e.g. Debian/Ubuntu libnccl2) \
                         or put it on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        let cuda = |e: cudarc::driver::DriverError| NcclInitError::Cuda(format!("{e:?}"));
        let ctx = CudaContext::new(device.index).map_err(cuda)?;
        ctx.bind_to_thread().map_err(cuda)?;
        let stream = ctx.new_stream().map_err(cuda)?;
        let client = CudaRuntime::client(&device);
        let ids = exchange_group_ids(&mesh, boot, || {
            let id = nccl::get_uniqueid().map_err(|e| RendezvousError::Protocol {
                addr: String::new(),
                reason: format!("ncclGetUniqueId: {:?}", e.0),
            })?;
            Ok(id.internal.iter().map(|&c| c as u8).collect())
        })?;
        let mut comms = Vec::new();
        for (group, id) in bootstrap_groups(&mesh).into_iter().zip(ids) {
            let n = group.size(&mesh).expect("a bootstrap group");
            let index = group.index(&mesh, rank).expect("a bootstrap group");
            let mut unique = nccl_sys::ncclUniqueId { internal: [0; 128] };
            for (slot, byte) in unique.internal.iter_mut().zip(&id) {
                *slot = *byte as _;
            }
            let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a valid out-pointer; every member of the group makes the same
            // call with the same id (handed out above), in the same group order.
            unsafe { nccl::comm_init_rank(&mut comm, n as i32, unique, index as i32) }.map_err(
                |e| NcclInitError::Nccl {
                    call: "ncclCommInitRank",
                    reason: format!("{:?}", e.0),
                },
            )?;
            comms.push(CommHandle(comm));
        }
        tracing::info!(rank, groups = comms.len(), "NCCL communicators ready");
        Ok(Self {
            rank,
            mesh,
            device,
            client,
            ctx,
            stream,
            comms,
            options,
            sequence: Sequence::default(),
            stats: StatsCell::default(),
            calls: Mutex::new(()),
            aborted: AtomicBool::new(false),
        })
    }

    /// Make this rank's NCCL communicators on its inner CUDA device, bootstrapped over its host
    /// communicator (ranks as threads, or MPI), and install them as the rank's
    /// [`DeviceCollectives`]: from then on every redistribution of `Distributed<Cuda>` runs on
    /// NCCL. Every rank calls it at the same time. Host-side calls stay on the host
    /// communicator; the NCCL calls are counted in the returned communicator's statistics and in
    /// [`RankContext::comm_stats`](crate::RankContext::comm_stats).
    pub fn install<F: FloatElement, I: IntElement, BT: BoolElement>(
        device: &crate::DistDevice<CubeBackend<CudaRuntime, F, I, BT>>,
        options: NcclOptions,
    ) -> Result<Arc<Self>, NcclInitError> {
        let ctx = device.context();
        let host = ctx.comm_arc();
        let nccl = Arc::new(Self::new(
            ctx.mesh().clone(),
            ctx.rank(),
            device.inner().clone(),
            &*host,
            options,
        )?);
        ctx.set_device_collectives::<CubeBackend<CudaRuntime, F, I, BT>>(nccl.clone());
        Ok(nccl)
    }

    /// The CUDA device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    fn comm(&self, group: Group) -> Result<nccl_sys::ncclComm_t, CommError> {
        let slot = match group {
            Group::World => self.comms.len() - 1,
            Group::Axis(a) => {
                group.size(&self.mesh)?;
                a
            }
        };
        Ok(self.comms[slot].0)
    }

    fn library(&self, call: &str, reason: impl fmt::Debug) -> CommError {
        CommError::Library {
            library: "NCCL",
            call: call.to_owned(),
            reason: format!("{reason:?}"),
        }
    }

    /// Waits for this rank's NCCL stream, aborting every communicator past the timeout.
    fn wait(&self, call: &Call) -> Result<(), CommError> {
        let start = Instant::now();
        let stream = self.stream.cu_stream();
        loop {
            // SAFETY: `stream` is this rank's live stream.
            let status = unsafe { cudarc::driver::sys::cuStreamQuery(stream) };
            match status {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.library("cuStreamQuery", other)),
            }
            if start.elapsed() > self.options.timeout {
                self.abort();
                return Err(CommError::Timeout {
                    op: call.kind(),
                    group: call.group().label(&self.mesh).unwrap_or("?").to_owned(),
                    rank: self.rank,
                    waited: start.elapsed(),
                    missing: Vec::new(),
                });
            }
            std::thread::yield_now();
        }
    }

    /// Aborts every NCCL communicator of this rank (after a timeout): later calls fail at once.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            for comm in &self.comms {
                // SAFETY: a live communicator, aborted once (guarded by `aborted`).
                let _ = unsafe { nccl::comm_abort(comm.0) };
            }
            tracing::error!(rank = self.rank, "NCCL timed out: communicators aborted");
        }
    }

    fn check_alive(&self) -> Result<(), CommError> {
        if self.aborted.load(Ordering::SeqCst) {
            Err(CommError::Unsupported(
                "this rank's NCCL communicators were aborted after a timeout".into(),
            ))
        } else {
            Ok(())
        }
    }

    /// `call` as one NCCL call on raw CubeCL handles of `dtype`: `count` elements in and out
    /// (all-reduce, broadcast), `count` in and `n × count` out (all-gather), `n × count` in and
    /// `count` out (reduce-scatter).
    fn raw(
        &self,
        call: &Call,
        dtype: DType,
        count: usize,
        send: &Handle,
        recv: &Handle,
    ) -> Result<(), CommError> {
        self.check_alive()?;
        let comm = self.comm(call.group())?;
        let kind = call.kind();
        let datatype = nccl_dtype(dtype)?;
        let cuda = |e: cudarc::driver::DriverError| self.library("CUDA context", e);
        self.ctx.bind_to_thread().map_err(cuda)?;
        // The input's producers run on the compute stream: let them finish first.
        cubecl::future::block_on(self.client.sync()).map_err(|e| self.library("CubeCL sync", e))?;
        let server = |e| self.library("CubeCL get_resource", e);
        // Kept alive until the call has completed.
        let send_res = self.client.get_resource(send.clone()).map_err(server)?;
        let recv_res = self.client.get_resource(recv.clone()).map_err(server)?;
        let (src, dst) = (
            send_res.resource().ptr as *const std::ffi::c_void,
            recv_res.resource().ptr as *mut std::ffi::c_void,
        );
        let stream = self.stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: `src`/`dst` are live device allocations of the sizes `count` implies (the
        // callers size them); `comm` is this rank's communicator for `group`, used under the
        // call lock; `stream` belongs to the same context.
        let result = unsafe {
            match kind {
                CollectiveKind::AllReduce => {
                    let op = nccl_op(call.reduce_op());
                    nccl::all_reduce(src, dst, count, datatype, op, comm, stream)
                }
                CollectiveKind::AllGather => {
                    nccl::all_gather(src, dst, count, datatype, comm, stream)
                }
                CollectiveKind::ReduceScatter => {
                    let op = nccl_op(call.reduce_op());
                    nccl::reduce_scatter(src, dst, count, datatype, op, comm, stream)
                }
                CollectiveKind::Broadcast => {
                    let root = call.root() as i32;
                    nccl::broadcast(src, dst, count, datatype, root, comm, stream)
                }
                other => {
                    return Err(CommError::Unsupported(format!("{other} as one NCCL call")));
                }
            }
        };
        result.map_err(|e| self.library(&kind.to_string(), e.0))?;
        self.wait(call)
    }

    fn upload(&self, bytes: &[u8]) -> Handle {
        self.client.create_from_slice(bytes)
    }

    /// The first `len` bytes of a device buffer.
    fn download_bytes(&self, handle: Handle, len: usize) -> Result<Vec<u8>, CommError> {
        let bytes = self
            .client
            .read_one(handle)
            .map_err(|e| self.library("CubeCL read", e))?;
        Ok(bytes[..len].to_vec())
    }

    fn download(
        &self,
        handle: Handle,
        shape: Shape,
        dtype: DType,
    ) -> Result<TensorData, CommError> {
        let len = shape.num_elements() * dtype.size();
        Ok(TensorData::from_bytes_vec(
            self.download_bytes(handle, len)?,
            shape,
            dtype,
        ))
    }

    /// The round of `call`: the members' calls, exchanged as headers and checked to be the
    /// same call on every member, or only this member's when checks are off (a broadcast always
    /// exchanges them: the root's tells the others what to receive).
    fn round(&self, call: &Call) -> Result<Round<'_>, CommError> {
        let (_, mine) = self.sequence.header(call)?;
        if !self.options.check_calls && call.kind() != CollectiveKind::Broadcast {
            return Ok(Round::new(
                &self.mesh,
                self.rank,
                call.clone(),
                vec![call.clone()],
            ));
        }
        let n = call.group().size(&self.mesh)?;
        let bytes = header::to_bytes(&mine);
        let send = self.upload(&bytes);
        let recv = self.client.empty(bytes.len() * n);
        let exchange = Call::all_gather(call.group(), Operand::new(DType::I64, &[HEADER]), 0);
        self.raw(&exchange, DType::I64, HEADER, &send, &recv)?;
        let all = self.download_bytes(recv, bytes.len() * n)?;
        let headers: Vec<Header> = all
            .chunks_exact(bytes.len())
            .map(header::from_bytes)
            .collect();
        header::round(&self.mesh, self.rank, call, &headers)
    }

    /// A host all-reduce, not recorded (the barrier is made of one).
    fn host_all_reduce(&self, call: &Call, data: TensorData) -> Result<TensorData, CommError> {
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
    fn host_all_gather(&self, call: &Call, data: TensorData) -> Result<TensorData, CommError> {
        let dim = call.dim();
        check_dim(CollectiveKind::AllGather, data.shape.num_dims(), dim)?;
        let members = call.group().size(&self.mesh)?;
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
    fn host_reduce_scatter(&self, call: &Call, data: TensorData) -> Result<TensorData, CommError> {
        let dim = call.dim();
        check_dim(CollectiveKind::ReduceScatter, data.shape.num_dims(), dim)?;
        check_reducible(data.dtype)?;
        let members = call.group().size(&self.mesh)?;
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

    /// The host broadcast: the root's header tells the others what to receive.
    fn host_broadcast(
        &self,
        call: &Call,
        data: Option<TensorData>,
    ) -> Result<TensorData, CommError> {
        let (group, root) = (call.group(), call.root());
        let index = group.index(&self.mesh, self.rank)?;
        call.check_root(&self.mesh)?;
        if index == root && data.is_none() {
            return Err(CommError::Unsupported(
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

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        for comm in &self.comms {
            // SAFETY: each communicator is live and destroyed once, after its last call.
            let _ = unsafe { nccl::comm_destroy(comm.0) };
        }
    }
}

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
    ) -> Result<CubeTensor<CudaRuntime>, CommError> {
        call.check_root(&self.mesh)?;
        let t = contiguous(tensor);
        let shape = t.shape();
        let members = call.group().size(&self.mesh)?;
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
        self.stats.record(&self.mesh, &call, None);
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
        self.stats.snapshot()
    }

    fn all_reduce(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<CubeTensor<CudaRuntime>, CommError> {
        self.on_device(Call::all_reduce(group, operand(&tensor), op), tensor)
    }

    fn all_gather_first(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, CommError> {
        self.on_device(Call::all_gather(group, operand(&tensor), 0), tensor)
    }

    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<CubeTensor<CudaRuntime>, CommError> {
        let call = Call::reduce_scatter(group, operand(&tensor), 0, op);
        self.on_device(call, tensor)
    }

    fn broadcast(
        &self,
        group: Group,
        tensor: CubeTensor<CudaRuntime>,
        root: usize,
    ) -> Result<CubeTensor<CudaRuntime>, CommError> {
        let call = Call::broadcast(group, Some(operand(&tensor)), root);
        self.on_device(call, tensor)
    }
}

/// The host API over NCCL: each buffer is uploaded, moved by NCCL and read back. For the
/// host-side calls of a run (scalars, barriers, checkpoint gathers); the training tensors take
/// the device path ([`DeviceCollectives`]).
impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    fn collective(
        &self,
        call: Call,
        data: Option<TensorData>,
    ) -> Result<Option<TensorData>, CommError> {
        let result = match call.kind() {
            CollectiveKind::Barrier => {
                let scalar = TensorData::new(vec![0f32], [1]);
                let sum = Call::all_reduce(call.group(), Operand::of(&scalar), ReduceOp::Sum);
                self.host_all_reduce(&sum, scalar)?;
                None
            }
            CollectiveKind::Broadcast => Some(self.host_broadcast(&call, data)?),
            kind => {
                let data = data.expect("this call carries a buffer");
                Some(match kind {
                    CollectiveKind::AllReduce => self.host_all_reduce(&call, data)?,
                    CollectiveKind::AllGather => self.host_all_gather(&call, data)?,
                    _ => self.host_reduce_scatter(&call, data)?,
                })
            }
        };
        self.stats.record(&self.mesh, &call, result.as_ref());
        Ok(result)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn reset_stats(&self) {
        self.stats.reset();
    }
}

/// Run `f` as this process's rank of `mesh` in a torchrun-style launch, without MPI:
/// `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` give the rendezvous
/// ([`TcpRendezvous`](super::TcpRendezvous)), `LOCAL_RANK` the GPU (default 0). NCCL carries
/// every collective, host-side ones included (uploaded and read back).
///
/// A rank whose `f` fails (a typed [`DistError`](crate::DistError) raised inside an op, or any
/// panic) prints the error, aborts its NCCL communicators and exits the process with status 2;
/// its peers' next collective then fails after [`NcclOptions::timeout`] instead of hanging.
pub fn launch_ranks_rendezvous<F, I, BT, T, Body>(
    mesh: &DeviceMesh,
    options: &NcclOptions,
    f: Body,
) -> Result<T, NcclInitError>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    Body: FnOnce(crate::DistDevice<CubeBackend<CudaRuntime, F, I, BT>>) -> T,
{
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let boot = super::TcpRendezvous::from_env(options.timeout)?;
    let local = match std::env::var("LOCAL_RANK") {
        Ok(v) => v.trim().parse().map_err(|e| RendezvousError::Env {
            var: "LOCAL_RANK",
            reason: format!("not a number ({e})"),
        })?,
        Err(_) => 0usize,
    };
    let rank = Bootstrap::rank(&boot);
    let device = CudaDevice::new(local);
    let nccl = Arc::new(NcclCommunicator::new(
        mesh.clone(),
        rank,
        device.clone(),
        &boot,
        options.clone(),
    )?);
    let dist = crate::DistDevice::<CubeBackend<CudaRuntime, F, I, BT>>::new(device, nccl.clone());
    dist.context()
        .set_device_collectives::<CubeBackend<CudaRuntime, F, I, BT>>(nccl.clone());
    crate::device::set_current_device(&dist);
    match catch_unwind(AssertUnwindSafe(|| f(dist))) {
        Ok(out) => Ok(out),
        Err(payload) => {
            let message = match crate::error::take_raised() {
                Some(error) => error.to_string(),
                None => crate::launch::panic_message(payload.as_ref()),
            };
            eprintln!("wildfire: rank {rank} failed: {message}; aborting NCCL");
            nccl.abort();
            std::process::exit(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessWorld;
    use burn::tensor::ops::FloatTensorOps;

    type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;

    fn host(t: CubeTensor<CudaRuntime>) -> TensorData {
        burn_backend::read_sync(Cuda::float_into_data(t)).expect("read back")
    }

    /// On a machine with CUDA and NCCL: a world of one on GPU 0, where every collective still
    /// runs through NCCL — the device path on contiguous and strided tensors and the host API,
    /// each equal to its input (a group of one), counted in the statistics. Without them:
    /// a typed error, not cudarc's panic on a missing library.
    #[test]
    fn nccl_world_of_one_or_a_typed_error() {
        let mesh = DeviceMesh::single();
        let world = InProcessWorld::new(mesh.clone(), Duration::from_secs(30));
        let boot = world.communicator(0);
        let options = NcclOptions::default();
        let nccl = match NcclCommunicator::new(mesh, 0, CudaDevice::new(0), &boot, options) {
            Ok(nccl) => nccl,
            Err(NcclInitError::Cuda(reason)) => {
                // SAFETY: only tries to open the library.
                assert!(
                    !unsafe { cudarc::driver::sys::is_culib_present() },
                    "{reason}"
                );
                assert!(reason.contains("libcuda"), "{reason}");
                return;
            }
            Err(NcclInitError::Nccl { call, reason }) => {
                // SAFETY: only tries to open the library.
                assert!(!unsafe { nccl_sys::is_culib_present() }, "{call}: {reason}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let device = CudaDevice::new(0);
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let data = TensorData::new(values, [2, 3, 4]);
        let tensor = || Cuda::float_from_data(data.clone(), &device);
        let dc: &dyn DeviceCollectives<Cuda> = &nccl;
        let strided = Cuda::float_swap_dims(tensor(), 0, 2);
        let expected_strided = host(Cuda::float_swap_dims(tensor(), 0, 2));
        for (name, out, expected) in [
            (
                "all_reduce",
                dc.all_reduce(Group::World, tensor(), ReduceOp::Sum),
                &data,
            ),
            (
                "all_gather",
                dc.all_gather_first(Group::World, tensor()),
                &data,
            ),
            (
                "reduce_scatter",
                dc.reduce_scatter_first(Group::World, tensor(), ReduceOp::Avg),
                &data,
            ),
            ("broadcast", dc.broadcast(Group::World, tensor(), 0), &data),
            (
                "all_reduce strided",
                dc.all_reduce(Group::World, strided, ReduceOp::Max),
                &expected_strided,
            ),
        ] {
            let out = host(out.unwrap_or_else(|e| panic!("{name}: {e}")));
            assert_eq!(&out, expected, "{name}");
        }
        let stats = DeviceCollectives::<Cuda>::stats(&nccl);
        assert_eq!(stats.count(CollectiveKind::AllReduce), 2);
        assert_eq!(stats.count(CollectiveKind::Broadcast), 1);
        // The host API, through NCCL too.
        let gathered = Communicator::all_gather(&nccl, Group::World, data.clone(), 1).unwrap();
        assert_eq!(gathered, data);
        let reduced =
            Communicator::all_reduce(&nccl, Group::World, data.clone(), ReduceOp::Sum).unwrap();
        assert_eq!(reduced, data);
        Communicator::barrier(&nccl, Group::World).unwrap();
        let sent = Communicator::broadcast(&nccl, Group::World, Some(data.clone()), 0).unwrap();
        assert_eq!(sent, data);
    }
}
