//! A rank as a process of an MPI job (`mpirun` / `srun`, feature `mpi`).

use crate::comm::{Communicator, Error, MpiWorld};
use crate::device::{DistDevice, set_current_device};
use crate::error::take_raised;
use crate::launch::{LaunchEnv, LaunchOptions, panic_message};
use crate::mesh::DeviceMesh;

/// Run `f` as this process's rank of `mesh` under `mpirun` / `srun` (one rank per process),
/// with a [`DistDevice`](DistDevice) over `inner(local_rank)` (e.g. the GPU of that index
/// on the node). Returns this rank's result; MPI is finalised before returning.
///
/// A rank whose `f` fails — a typed [`Error`](crate::Error) raised inside an op, or any
/// panic — prints the error and aborts the MPI job, so its peers never wait on it.
pub fn launch_ranks_mpi<B, T, F, I>(
    mesh: &DeviceMesh,
    inner: I,
    options: &LaunchOptions,
    f: F,
) -> Result<T, Error>
where
    B: burn_backend::Backend,
    F: FnOnce(DistDevice<B>) -> T,
    I: FnOnce(usize) -> B::Device,
{
    let world = MpiWorld::init(mesh.clone(), options.timeout)?;
    let comm = world.communicator();
    let rank = comm.rank();
    let device = DistDevice::<B>::new(inner(LaunchEnv::local_rank_or_zero()), comm);
    let current = set_current_device(&device);
    match crate::error::catch_raised(|| f(device)) {
        Ok(out) => {
            // The rank's context goes before MPI is finalised, not at the thread's exit.
            drop(current);
            drop(world);
            Ok(out)
        }
        Err(payload) => {
            let message = match take_raised() {
                Some(error) => error.to_string(),
                None => panic_message(payload.as_ref()),
            };
            eprintln!("wildfire: rank {rank} failed: {message}; aborting the MPI job");
            world.abort(2)
        }
    }
}
