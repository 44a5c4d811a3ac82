//! NCCL between CUDA devices (feature `cuda`): one communicator per mesh group, bootstrapped
//! over MPI, a host communicator, or a `MASTER_ADDR:MASTER_PORT` rendezvous
//! ([`Bootstrap`]), and collectives on the device buffers of Burn's CUDA backend with no host
//! copy ([`DeviceCollectives`](super::DeviceCollectives) for `CubeBackend<CudaRuntime, …>`).
//!
//! How a call runs: the rank's compute stream is synchronised (the input's producers are done),
//! the collective is enqueued on this rank's own NCCL stream over the raw device pointers of the
//! CubeCL handles (`ComputeClient::get_resource`), and an event is recorded after it. A blocking
//! call then polls the event until it completes or the timeout passes, in which case every NCCL
//! communicator of the rank is aborted (`ncclCommAbort`) and the call fails with
//! [`Error::Timeout`](super::Error::Timeout) instead of hanging. An issued call
//! ([`DeviceCollectives::issue`](super::DeviceCollectives::issue): FSDP's prefetched gathers,
//! gradients reduced where they are born) returns at once and polls when it is waited for, so
//! the compute enqueued meanwhile runs beside it — PyTorch's NCCL communication stream. The
//! outputs are fresh buffers (Burn tensors are immutable values), and every call is recorded in
//! the rank's statistics and trace when it is seen to complete.
//!
//! Every call is checked first (unless [`NcclOptions::check_calls`] is off): the members
//! all-gather a small header (call number, collective, op, dtype, shape) over NCCL, and a
//! member that diverges makes every member fail with
//! [`Error::Mismatch`](super::Error::Mismatch) at that call.
//!
//! Reductions are NCCL's: fast, not in group order, so not bitwise equal to ranks as threads
//! (the host communicators are). Point-to-point is not offered
//! ([`Communicator::point_to_point`](super::Communicator::point_to_point) answers
//! [`Error::Unsupported`](super::Error::Unsupported)).
//!
//! Not run here: this workspace's CI has no GPU. It compiles in CI (`cargo check --features
//! cuda`); the pure parts (bootstrap, header checks, the dim handling) are tested on CPU.
//!
//! The files: `communicator.rs` makes the communicators, `calls.rs` runs one NCCL call (and the
//! call check before it), `device_collectives.rs` and `host.rs` are the two APIs over it.

mod calls;
mod communicator;
mod device_collectives;
mod host;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::header::Sequence;
use super::{Communicator, Member};
use crate::error::Error;

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

/// An NCCL communicator handle. SAFETY: used only under the owner's call lock (NCCL
/// communicators are not thread-safe), destroyed once in `Drop`.
struct CommHandle(nccl_sys::ncclComm_t);
unsafe impl Send for CommHandle {}
unsafe impl Sync for CommHandle {}

/// One rank's NCCL communicators (one per mesh group it belongs to) on its CUDA device.
pub struct NcclCommunicator {
    member: Member,
    device: CudaDevice,
    client: ComputeClient<CudaRuntime>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// In [`bootstrap_groups`](super::bootstrap::bootstrap_groups) order: each axis, then the
    /// world.
    comms: Vec<CommHandle>,
    options: NcclOptions,
    sequence: Sequence,
    /// One NCCL call at a time on this rank.
    calls: Mutex<()>,
    aborted: AtomicBool,
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclCommunicator(rank {} of {}, {:?})",
            self.rank(),
            self.mesh(),
            self.device
        )
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
