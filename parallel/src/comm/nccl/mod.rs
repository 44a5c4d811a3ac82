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
//! (the host communicators are).
//!
//! Point-to-point between neighbouring pipeline stages (`DeviceCollectives::send`/`recv`, which
//! the pipeline's `Pieces` transport uses for activations and their gradients) runs on
//! channels: one two-rank communicator and one stream per directed pair of neighbours on the
//! `pp` axis, made with the others (`p2p.rs`). A send is enqueued and returns; a receive waits
//! (with the timeout); a rank's sends and receives never share a stream, so a send waiting for
//! its receiver cannot hold up a receive the other rank is waiting on. The host messages of
//! [`Communicator::point_to_point`](super::Communicator::point_to_point) are not offered
//! ([`Error::Unsupported`](super::Error::Unsupported)): headers go over the launcher's host
//! communicator.
//!
//! Not run here: this workspace's CI has no GPU. It compiles in CI (`cargo check --features
//! cuda`); the pure parts (bootstrap, header checks, the dim handling) are tested on CPU.
//!
//! The files: `communicator.rs` makes the communicators, `calls.rs` runs one NCCL call (and the
//! call check before it), `device_collectives.rs` and `host.rs` are the two APIs over it,
//! `p2p.rs` the point-to-point channels.

mod calls;
mod communicator;
mod device_collectives;
mod host;
mod p2p;
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

/// Whether the CUDA driver (libcuda) can be loaded, as a typed error when it cannot: cudarc
/// loads it at first use and panics when it is missing, so whatever first touches a CUDA
/// device (Burn's CUDA backend, NCCL) asks here first.
pub fn check_libcuda() -> Result<(), Error> {
    // SAFETY: only tries to open the shared library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Cuda(
            "libcuda was not found: CUDA and NCCL need an NVIDIA driver".into(),
        ))
    }
}

/// A fresh NCCL unique id, as the bytes the bootstrap hands out.
fn new_unique_id() -> Result<Vec<u8>, Error> {
    let id = nccl::get_uniqueid().map_err(|e| Error::RendezvousProtocol {
        addr: String::new(),
        reason: format!("ncclGetUniqueId: {:?}", e.0),
    })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// The NCCL unique id [`new_unique_id`] gave as bytes.
fn unique_id(bytes: &[u8]) -> nccl_sys::ncclUniqueId {
    let mut unique = nccl_sys::ncclUniqueId { internal: [0; 128] };
    for (slot, byte) in unique.internal.iter_mut().zip(bytes) {
        *slot = *byte as _;
    }
    unique
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
    /// Point-to-point channels to and from the neighbouring pipeline ranks.
    channels: Vec<p2p::P2pChannel>,
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

impl NcclCommunicator {
    /// Every NCCL communicator of this rank: its groups', then its channels'.
    fn all_comms(&self) -> impl Iterator<Item = &CommHandle> {
        self.comms
            .iter()
            .chain(self.channels.iter().map(|c| &c.comm))
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        for comm in self.all_comms() {
            // SAFETY: each communicator is live and destroyed once, after its last call.
            let _ = unsafe { nccl::comm_destroy(comm.0) };
        }
    }
}
