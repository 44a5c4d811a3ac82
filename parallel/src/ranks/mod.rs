//! Run one closure per rank, each with its `Distributed` device.

#[cfg(feature = "mpi")]
mod hybrid;
mod job;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda")]
mod nccl;

#[cfg(feature = "mpi")]
pub use hybrid::launch_ranks_hybrid;
#[cfg(feature = "cuda")]
pub use job::NcclLaunch;
pub use job::{
    Collectives, DeviceLaunch, HostLaunch, JobSpec, Launch, Launched, check_job, launch_job,
    rank_device,
};
#[cfg(feature = "mpi")]
pub use mpi::launch_ranks_mpi;
#[cfg(feature = "cuda")]
pub use nccl::launch_ranks_rendezvous;

use crate::device::{DistDevice, set_current_device};
use crate::error::{Error, take_raised};
use crate::launch::{LaunchOptions, launch};
use crate::mesh::DeviceMesh;
use burn_backend::Backend;
use std::panic::resume_unwind;
use std::sync::Mutex;

/// Run `f` on one thread per rank of `mesh`, each with a [`DistDevice`] over `inner` (ranks as
/// threads share the inner device: right for CPU backends and tests). Returns the results in rank
/// order. A panic on any rank ends every rank (their collectives fail at once instead of
/// hanging); a typed [`Error`] raised inside a backend op comes back as
/// [`Error::OnRank`], any other panic as [`Error::RankFailed`].
pub fn launch_ranks<B, T, F>(
    mesh: &DeviceMesh,
    inner: &B::Device,
    options: &LaunchOptions,
    f: F,
) -> Result<Vec<T>, Error>
where
    B: Backend,
    T: Send,
    F: Fn(DistDevice<B>) -> T + Sync,
{
    launch_ranks_on(mesh, |_| inner.clone(), options, f)
}

/// [`launch_ranks`] with one inner device per rank (e.g. one GPU each): `inner(rank)`.
pub fn launch_ranks_on<B, T, F, I>(
    mesh: &DeviceMesh,
    inner: I,
    options: &LaunchOptions,
    f: F,
) -> Result<Vec<T>, Error>
where
    B: Backend,
    T: Send,
    F: Fn(DistDevice<B>) -> T + Sync,
    I: Fn(usize) -> B::Device + Sync,
{
    let raised: Mutex<Vec<Option<Error>>> = Mutex::new(vec![None; mesh.world_size()]);
    let result = launch(mesh, options, |comm| {
        let rank = comm.rank();
        let device = DistDevice::<B>::new(inner(rank), comm);
        let current = set_current_device(&device);
        let out = match crate::error::catch_raised(|| f(device)) {
            Ok(out) => out,
            Err(payload) => {
                raised.lock().unwrap()[rank] = take_raised();
                resume_unwind(payload)
            }
        };
        // The rank's context goes now, on this thread: a lone rank's thread is a pool worker
        // that would otherwise keep it until it exits.
        drop(current);
        out
    });
    match result {
        Err(Error::RankFailed { rank, message }) => match raised.lock().unwrap()[rank].take() {
            Some(error) => Err(Error::OnRank {
                rank,
                error: Box::new(error),
            }),
            None => Err(Error::RankFailed { rank, message }),
        },
        other => other,
    }
}
