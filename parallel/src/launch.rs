//! Launch an SPMD function on every rank of a mesh, each rank a thread of this process.
//!
//! ```
//! use wildfire_parallel::comm::{Group, ReduceOp};
//! use wildfire_parallel::launch::{LaunchOptions, launch};
//! use wildfire_parallel::mesh::DeviceMesh;
//! use burn::tensor::TensorData;
//!
//! let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
//! let sums = launch(&mesh, &LaunchOptions::default(), |comm| {
//!     let mine = TensorData::new(vec![comm.rank() as f32 + 1.0], [1]);
//!     comm.all_reduce(Group::World, mine, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap()
//! })
//! .unwrap();
//! assert_eq!(sums, vec![vec![3.0], vec![3.0]]);
//! ```

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

mod env;

pub use env::{LaunchEnv, Launcher};

use crate::comm::{Communicator, DEFAULT_TIMEOUT, InProcessWorld};
use crate::error::Error;
use crate::mesh::DeviceMesh;

/// How to run the ranks.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// How long a rank waits for its peers in a collective (or for a message) before failing
    /// with [`Error::Timeout`].
    pub timeout: Duration,
    /// Ranks as threads: the modelled links of the mesh's axes (none: memory speed).
    pub links: crate::comm::Links,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            timeout: DEFAULT_TIMEOUT,
            links: Default::default(),
        }
    }
}

/// Runs `f` once per rank of `mesh`, each on a worker of a rayon pool of its own (threads named
/// `rank-{r}-worker-{i}`, [`rank_threads`] of them), with that rank's in-process communicator,
/// and returns the results in rank order.
///
/// A panic on any rank aborts the world ([`InProcessWorld::abort`]), so the other ranks'
/// pending and later calls fail at once with
/// [`Error::PeerFailed`] instead of waiting for the
/// timeout; the launch then returns [`Error::RankFailed`] for the rank that failed first.
pub fn launch<T, F>(mesh: &DeviceMesh, options: &LaunchOptions, f: F) -> Result<Vec<T>, Error>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> T + Sync,
{
    let world = InProcessWorld::new(mesh.clone(), options.timeout);
    world.set_links(options.links.clone());
    launch_with_world(&world, f)
}

/// The threads of each rank's pool when `ranks` ranks share this process: its cores
/// (`RAYON_NUM_THREADS` when set, else the available parallelism) divided between them, at
/// least one each.
pub fn rank_threads(ranks: usize) -> usize {
    let cores = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()));
    (cores / ranks.max(1)).max(1)
}

/// Rank `rank`'s rayon pool, one of `ranks` in this process ([`rank_threads`] workers; `None` if
/// the pool cannot start, and the rank runs on its own thread with rayon's global pool).
pub(crate) fn rank_pool(rank: usize, ranks: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(rank_threads(ranks))
        .thread_name(move |i| format!("rank-{rank}-worker-{i}"))
        .build()
        .ok()
}

/// Like [`launch`], on an existing world (for example to inspect or abort it from outside).
pub fn launch_with_world<T, F>(world: &Arc<InProcessWorld>, f: F) -> Result<Vec<T>, Error>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> T + Sync,
{
    let size = world.mesh().world_size();
    let f = &f;
    let (outcomes, spawn_error) = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(size);
        let mut spawn_error = None;
        for rank in 0..size {
            let comm: Arc<dyn Communicator> = Arc::new(world.communicator(rank));
            let spawned = thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || {
                    // Each rank runs on a worker of a rayon pool of its own, which the CPU
                    // backend's parallel ops then use, with its share of the cores
                    // ([`rank_threads`]): on its own thread a rank would wait beside the workers
                    // for every parallel op and compete with them for the cores between ops
                    // (2 cores: 13k context switches a second), and ranks sharing rayon's global
                    // pool oversubscribe the cores (every rank's ops ask for all of them). The
                    // pools are the launch's own, so a worker waiting inside a parallel op never
                    // steals another rank (or a concurrent launch's) and runs it on this rank's
                    // stack, and a rank blocked in a collective holds no worker another needs.
                    let run = || match rank_pool(rank, size) {
                        Some(pool) => pool.install(|| f(comm)),
                        None => f(comm),
                    };
                    panic::catch_unwind(AssertUnwindSafe(run)).map_err(|payload| {
                        let message = panic_message(payload.as_ref());
                        world.abort(rank, format!("panicked: {message}"));
                        message
                    })
                });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(error) => {
                    let message = format!("rank {rank}: {error}");
                    // Release the ranks already started from waiting for this one.
                    world.abort(rank, format!("could not start: {error}"));
                    spawn_error = Some(message);
                    break;
                }
            }
        }
        let outcomes: Vec<Result<T, String>> = handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|payload| Err(panic_message(payload.as_ref())))
            })
            .collect();
        (outcomes, spawn_error)
    });
    if let Some(message) = spawn_error {
        return Err(Error::Spawn(message));
    }
    let failed = |rank: usize| outcomes.get(rank).is_some_and(Result::is_err);
    let root_cause = world
        .abort_reason()
        .map(|(rank, _)| rank)
        .filter(|&rank| failed(rank))
        .or_else(|| (0..size).find(|&rank| failed(rank)));
    if let Some(rank) = root_cause {
        let message = match &outcomes[rank] {
            Err(message) => message.clone(),
            Ok(_) => unreachable!("the root cause is a failed rank"),
        };
        return Err(Error::RankFailed { rank, message });
    }
    Ok(outcomes
        .into_iter()
        .map(|outcome| outcome.unwrap_or_else(|_| unreachable!("no rank failed")))
        .collect())
}

/// The message of a panic payload: the `&str` or `String` passed to `panic!`, or a generic
/// message for any other payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "panicked with a payload that is not a string".to_owned()
    }
}

/// How long a busy worker looks for work without finding any before it goes back to rayon's
/// sleep (the gaps between a step's parallel ops are microseconds; a longer pause is host work,
/// a collective or I/O, where a spinning core would only burn power).
const BUSY_IDLE_LIMIT: Duration = Duration::from_millis(20);

/// Workers in [`look_for_work`] now, and ever (for the tests).
static BUSY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static BUSY_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts a busy worker out, however its loop ends.
struct Leave;

impl Drop for Leave {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// While it lives, the other workers of the calling thread's rayon pool look for work instead of
/// sleeping ([`busy_workers`]).
#[must_use = "the workers stop looking for work when this is dropped"]
pub struct BusyWorkers {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for BusyWorkers {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Keep the other workers of the calling thread's rayon pool awake and looking for work, as an
/// OpenMP runtime's threads spin between parallel regions, until the guard is dropped (or they
/// find none for 20 ms).
///
/// Rayon parks a worker that finds no work within a few dozen yields, and every parallel op
/// after that pays a futex wake-up to hand it half the work. A small model's step is thousands
/// of such ops of tens of microseconds each: on nanoGPT's shakespeare-char shape (d 128, t 64)
/// the wake-ups took a fifth of the time, and two threads were no faster than one. A worker kept
/// busy here takes the next job by stealing, with no wake-up.
///
/// `None` (nothing to do) off a rayon pool's worker, in a pool of one thread, or with
/// `WILDFIRE_BUSY_WORKERS=0` in the environment. The workers spin, so use it around work that
/// runs parallel ops back to back on the pool (a training step on a CPU backend, where
/// `FusedOps::COMPUTES_ON_HOST_POOL` holds; not on a GPU, whose step leaves them nothing).
pub fn busy_workers() -> Option<BusyWorkers> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("WILDFIRE_BUSY_WORKERS").is_ok_and(|v| v == "0")) {
        return None;
    }
    let owner = rayon::current_thread_index()?;
    let threads = rayon::current_num_threads();
    if threads < 2 {
        return None;
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // One job per worker, delivered to each (a job spawned into the owner's own deque could be
    // popped back by the owner); the owner's returns at once.
    let flag = stop.clone();
    rayon::spawn_broadcast(move |_| look_for_work(owner, &flag));
    Some(BusyWorkers { stop })
}

/// [`busy_workers`] where the backend computes on the rank's pool
/// ([`FusedOps::COMPUTES_ON_HOST_POOL`](wildfire_kernels::FusedOps::COMPUTES_ON_HOST_POOL): Flex);
/// `None` on a device backend. There a step runs no parallel host op, so the pool's other workers
/// (all the machine's cores but one, with one rank a process) would spin 20 ms at every step's
/// start, beside the rank's thread and CubeCL's device thread, for nothing: on lavapipe (2 cores,
/// so one such worker; Wgpu, GPT-2's shape at width 64, 30 steps) the steps took 11.92 s with it
/// and 11.66 s with `WILDFIRE_BUSY_WORKERS=0` (medians of 4 alternating runs), and this build
/// 11.55 s against the one before's 11.64.
pub fn busy_workers_for<B: wildfire_kernels::FusedOps>() -> Option<BusyWorkers> {
    if B::COMPUTES_ON_HOST_POOL {
        busy_workers()
    } else {
        None
    }
}

/// A busy worker's loop: run the pool's pending jobs as they come, until `stop` or
/// [`BUSY_IDLE_LIMIT`] without any. The owner (the thread that asked) never loops here: it may
/// pop the job itself while it waits in a join, and must go on.
fn look_for_work(owner: usize, stop: &std::sync::atomic::AtomicBool) {
    use std::sync::atomic::Ordering::Relaxed;
    if rayon::current_thread_index() == Some(owner) {
        return;
    }
    BUSY_STARTED.fetch_add(1, Relaxed);
    BUSY.fetch_add(1, Relaxed);
    let _done = Leave;
    let mut idle_since = std::time::Instant::now();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle_since = std::time::Instant::now(),
            Some(rayon::Yield::Idle) if idle_since.elapsed() < BUSY_IDLE_LIMIT => {
                std::hint::spin_loop()
            }
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use burn::tensor::TensorData;

    use super::*;
    use crate::comm::{Error, Group, ReduceOp};

    #[test]
    fn results_come_back_in_rank_order_on_named_threads() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        let names = launch(&mesh, &LaunchOptions::default(), |comm| {
            (comm.rank(), thread::current().name().map(str::to_owned))
        })
        .unwrap();
        assert_eq!(names.len(), 4);
        for (i, (rank, name)) in names.into_iter().enumerate() {
            assert_eq!(rank, i);
            let name = name.expect("a named thread");
            assert!(name.starts_with(&format!("rank-{rank}-worker-")), "{name}");
        }
    }

    /// Each rank's parallel ops run on its own pool, with its share of the process's cores.
    #[test]
    fn each_rank_has_its_share_of_the_cores() {
        let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
        let threads = launch(&mesh, &LaunchOptions::default(), |_| {
            rayon::current_num_threads()
        })
        .unwrap();
        assert_eq!(threads, vec![rank_threads(2); 2]);
        let cores = thread::available_parallelism().map_or(1, |n| n.get());
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            assert_eq!(rank_threads(2), (cores / 2).max(1));
        }
        assert_eq!(rank_threads(usize::MAX), 1);
    }

    /// Busy workers look for work while the guard lives and stop when it is dropped; the owner
    /// is never held in their loop; nothing happens off a pool or in a pool of one thread.
    #[test]
    fn busy_workers_look_for_work_until_dropped() {
        use rayon::prelude::*;
        use std::sync::atomic::Ordering::Relaxed;
        let wait_for = |what: &str, done: &dyn Fn() -> bool| {
            let start = Instant::now();
            while !done() {
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "timed out: {what}"
                );
                thread::sleep(Duration::from_millis(1));
            }
        };
        assert!(busy_workers().is_none(), "off a pool");
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert!(one.install(busy_workers).is_none(), "a pool of one");
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let started = BUSY_STARTED.load(Relaxed);
        pool.install(|| {
            let guard = busy_workers().expect("a pool of three");
            // The two other workers enter the loop (the owner's job returns at once).
            wait_for("two busy workers", &|| {
                BUSY_STARTED.load(Relaxed) >= started + 2
            });
            // Parallel work runs, and right, while they look for it.
            for _ in 0..100 {
                let sum: u64 = (0..10_000u64).into_par_iter().map(|i| i * i).sum();
                assert_eq!(sum, (0..10_000u64).map(|i| i * i).sum::<u64>());
            }
            drop(guard);
            wait_for("the busy workers to stop", &|| BUSY.load(Relaxed) == 0);
        });
    }

    #[test]
    fn a_panicking_rank_aborts_the_others_and_is_reported() {
        // The default timeout of 60 s: only the abort can release the waiting ranks quickly.
        let mesh = DeviceMesh::new([("dp", 3)]).unwrap();
        let start = Instant::now();
        let seen = std::sync::Mutex::new(Vec::new());
        let result = launch(&mesh, &LaunchOptions::default(), |comm| {
            if comm.rank() == 1 {
                panic!("rank one gives up");
            }
            let outcome = comm.barrier(Group::World);
            seen.lock().unwrap().push(outcome.clone());
            // A rank that unwraps the PeerFailed error panics too; it is not the root cause.
            outcome.unwrap();
        });
        match result {
            Err(Error::RankFailed { rank, message }) => {
                assert_eq!(rank, 1);
                assert_eq!(message, "rank one gives up");
            }
            other => panic!("expected RankFailed, got {other:?}"),
        }
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 2);
        for outcome in seen {
            assert_eq!(
                outcome,
                Err(Error::PeerFailed {
                    rank: 1,
                    reason: "panicked: rank one gives up".into()
                })
            );
        }
        assert!(start.elapsed() < DEFAULT_TIMEOUT / 2);
    }

    /// A rank that stops with an error (no panic) and says so (`Communicator::fail`, here
    /// through the communication queue a training rank talks to) releases the others at once,
    /// naming it and its reason — one waiting in a collective, one waiting for a point-to-point
    /// message; a collective every rank reached before the failure still completes on every
    /// rank.
    #[test]
    fn a_failing_rank_releases_the_others_and_finished_calls_stand() {
        let mesh = DeviceMesh::new([("dp", 3)]).unwrap();
        let start = Instant::now();
        let results = launch(&mesh, &LaunchOptions::default(), |comm| {
            let queue = crate::comm::CommQueue::new(comm.clone());
            let sum = queue.all_reduce(
                Group::World,
                TensorData::new(vec![1.0f32], [1]),
                ReduceOp::Sum,
            );
            match queue.rank() {
                1 => {
                    queue.fail("rank one cannot build its stage".into());
                    (sum, Ok(()))
                }
                // Rank 1 never sends this message, nor reaches the barrier.
                2 => (sum, queue.point_to_point().unwrap().recv(1).map(|_| ())),
                _ => (sum, queue.barrier(Group::World)),
            }
        })
        .unwrap();
        for (rank, (sum, barrier)) in results.into_iter().enumerate() {
            assert_eq!(sum.unwrap().to_vec::<f32>().unwrap(), [3.0], "rank {rank}");
            if rank != 1 {
                assert_eq!(
                    barrier,
                    Err(Error::PeerFailed {
                        rank: 1,
                        reason: "rank one cannot build its stage".into()
                    })
                );
            }
        }
        assert!(start.elapsed() < DEFAULT_TIMEOUT / 2);
    }

    #[test]
    fn panic_messages_of_any_payload() {
        let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
        let result = launch(&mesh, &LaunchOptions::default(), |comm| {
            if comm.rank() == 0 {
                std::panic::panic_any(42u32);
            }
            comm.all_reduce(
                Group::World,
                TensorData::new(vec![1.0f32], [1]),
                ReduceOp::Sum,
            )
        });
        match result {
            Err(Error::RankFailed { rank, message }) => {
                assert_eq!(rank, 0);
                assert!(message.contains("not a string"), "{message}");
            }
            other => panic!("expected RankFailed, got {other:?}"),
        }
        let formatted = format!("rank {}", 7);
        let result = launch(&mesh, &LaunchOptions::default(), |comm| {
            if comm.rank() == 1 {
                panic!("{formatted} failed");
            }
        });
        assert_eq!(
            result.unwrap_err().to_string(),
            "rank 1 failed: rank 7 failed"
        );
    }
}
