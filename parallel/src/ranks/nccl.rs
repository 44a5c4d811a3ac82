//! NCCL on a rank's CUDA device (feature `cuda`): installed on a rank of any launch, or a
//! torchrun-style process where NCCL is the only communicator.

use std::sync::Arc;

use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::{CudaDevice, CudaRuntime};

use crate::comm::{Bootstrap, Error, NcclCommunicator, NcclOptions, TcpRendezvous};
use crate::device::{DistDevice, set_current_device};
use crate::error::take_raised;
use crate::launch::{LaunchEnv, panic_message};
use crate::mesh::DeviceMesh;

impl NcclCommunicator {
    /// Make this rank's NCCL communicators on its inner CUDA device, bootstrapped over its host
    /// communicator (ranks as threads, or MPI), and install them as the rank's
    /// [`DeviceCollectives`](crate::comm::DeviceCollectives): from then on every
    /// redistribution of `Distributed<Cuda>` runs on NCCL. Every rank calls it at the same time.
    /// Host-side calls stay on the host communicator; the NCCL calls are counted in the returned
    /// communicator's statistics and in
    /// [`RankContext::comm_stats`](crate::RankContext::comm_stats).
    pub fn install<F: FloatElement, I: IntElement, BT: BoolElement>(
        device: &DistDevice<CubeBackend<CudaRuntime, F, I, BT>>,
        options: NcclOptions,
    ) -> Result<Arc<Self>, Error> {
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
}

/// Run `f` as this process's rank of `mesh` in a torchrun-style launch, without MPI:
/// `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` give the rendezvous
/// ([`TcpRendezvous`](crate::comm::TcpRendezvous)), `LOCAL_RANK` the GPU (default 0). NCCL carries
/// every collective, host-side ones included (uploaded and read back).
///
/// A rank whose `f` fails (a typed [`Error`](crate::Error) raised inside an op, or any
/// panic) prints the error, aborts its NCCL communicators and exits the process with status 2;
/// its peers' next collective then fails after [`NcclOptions::timeout`] instead of hanging.
pub fn launch_ranks_rendezvous<F, I, BT, T, Body>(
    mesh: &DeviceMesh,
    options: &NcclOptions,
    f: Body,
) -> Result<T, Error>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    Body: FnOnce(DistDevice<CubeBackend<CudaRuntime, F, I, BT>>) -> T,
{
    let boot = TcpRendezvous::from_env(options.timeout)?;
    let local = LaunchEnv::detect()?.map_or(0, |env| env.local_rank);
    let rank = Bootstrap::rank(&boot);
    let device = CudaDevice::new(local);
    let nccl = Arc::new(NcclCommunicator::new(
        mesh.clone(),
        rank,
        device.clone(),
        &boot,
        options.clone(),
    )?);
    let dist = DistDevice::<CubeBackend<CudaRuntime, F, I, BT>>::new(device, nccl.clone());
    dist.context()
        .set_device_collectives::<CubeBackend<CudaRuntime, F, I, BT>>(nccl.clone());
    let current = set_current_device(&dist);
    match crate::error::catch_raised(|| f(dist)) {
        Ok(out) => {
            // NCCL is destroyed here, on this thread, not by a thread-local destructor at exit.
            drop(current);
            Ok(out)
        }
        Err(payload) => {
            let message = match take_raised() {
                Some(error) => error.to_string(),
                None => panic_message(payload.as_ref()),
            };
            eprintln!("wildfire: rank {rank} failed: {message}; aborting NCCL");
            nccl.abort();
            std::process::exit(2)
        }
    }
}
