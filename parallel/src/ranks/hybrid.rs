//! Ranks as threads of the processes of an MPI job (feature `mpi`).

use std::sync::Arc;

use mpi::topology::Communicator as _;
use mpi::topology::SimpleCommunicator;

use crate::comm::{Communicator, Error, HybridWorld};
use crate::device::{DistDevice, set_current_device};
use crate::error::take_raised;
use crate::launch::{LaunchOptions, panic_message};
use crate::mesh::DeviceMesh;

/// Run `f` on this process's `threads` ranks of `mesh` (one thread each, with a
/// [`DistDevice`](DistDevice) over `inner(local_thread)`), the processes of the
/// MPI job holding the rest: `mpirun -np P` with `mesh.world_size() = P · threads`. Returns this
/// process's results in rank order; a failing rank aborts the whole job.
pub fn launch_ranks_hybrid<B, T, F, I>(
    mesh: &DeviceMesh,
    threads: usize,
    inner: I,
    options: &LaunchOptions,
    f: F,
) -> Result<Vec<T>, Error>
where
    B: burn_backend::Backend,
    T: Send,
    F: Fn(DistDevice<B>) -> T + Sync,
    I: Fn(usize) -> B::Device + Sync,
{
    let world = HybridWorld::init(mesh.clone(), threads, options.timeout)?;
    let world_ref = &world;
    let (f, inner) = (&f, &inner);
    let outcomes: Vec<Result<T, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let comm: Arc<dyn Communicator> = Arc::new(world_ref.communicator(t));
                std::thread::Builder::new()
                    .name(format!("rank-{}", comm.rank()))
                    .spawn_scoped(scope, move || {
                        // The rank runs on a worker of a pool of its own, its share of the
                        // process's cores (see `launch`); its thread-local device and raised
                        // error live on that worker.
                        let rank = comm.rank();
                        let pool = crate::launch::rank_pool(rank, threads);
                        let body = move || {
                            let device = DistDevice::<B>::new(inner(t), comm);
                            let current = set_current_device(&device);
                            match crate::error::catch_raised(|| f(device)) {
                                Ok(out) => {
                                    // The rank's context goes now, not at the thread's exit.
                                    drop(current);
                                    Ok(out)
                                }
                                Err(payload) => {
                                    let message = match take_raised() {
                                        Some(e) => e.to_string(),
                                        None => panic_message(payload.as_ref()),
                                    };
                                    // The peers may wait on this rank: stop the job now.
                                    eprintln!(
                                        "wildfire: rank {rank} failed: {message}; aborting the \
                                         MPI job"
                                    );
                                    SimpleCommunicator::world().abort(2)
                                }
                            }
                        };
                        match &pool {
                            Some(pool) => pool.install(body),
                            None => body(),
                        }
                    })
                    .expect("start a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    });
    let mut results = Vec::with_capacity(threads);
    for outcome in outcomes {
        match outcome {
            Ok(t) => results.push(t),
            Err(message) => {
                eprintln!("wildfire: {message}; aborting the MPI job");
                SimpleCommunicator::world().abort(2)
            }
        }
    }
    drop(world);
    Ok(results)
}
