//! Asynchronous collectives: issue now, wait later.
//!
//! [`CommQueue`] wraps a rank's communicator. [`CommQueue::issue`] hands a collective to the
//! rank's communication thread and returns a [`Pending`] at once; the thread runs the calls one
//! at a time in the order they were issued, so every rank still issues the same sequence on
//! each group (the contract every communicator relies on), and results and reduction order are
//! exactly those of the blocking calls. A blocking call made while issued calls are in flight
//! queues behind them (issue and wait); with none in flight it runs on the caller's thread, as
//! before. Like NCCL's communication stream: one ordered queue per rank, beside the compute.
//!
//! Over MPI (initialised `MPI_THREAD_MULTIPLE`) the thread makes the MPI calls, as PyTorch's
//! `ProcessGroupMPI` runs its collectives on one worker thread; MPI's own non-blocking
//! collectives (`MPI_Iallreduce`) are not used because the reductions here are the host's
//! deterministic rounds, not MPI's ops. On CUDA the calls go to NCCL's stream instead
//! ([`super::DeviceCollectives::issue`]).
//!
//! The thread is started at the first issue. It records each call in the rank's statistics and
//! trace when the call completes, so a trace shows the call from its issue to its completion,
//! beside the compute regions of the rank's own thread. With a modelled link
//! ([`super::InProcessWorld::set_links`]) the link's time is spent on this thread too: that is
//! what compute hides.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::tensor::TensorData;

use super::{Call, Communicator, Error, Member, PointToPoint};

/// What a job does.
enum Work {
    /// A chain of calls, each taking the previous one's result.
    Calls(Vec<Call>),
    /// A point-to-point exchange: the job's buffer sent to global rank `to`, then the next
    /// message from global rank `from` received (a ring's step: pass yours on, take the
    /// previous member's).
    Exchange { to: usize, from: usize },
}

/// Where a job's result goes: run on the communication thread once the calls completed (a
/// [`CommQueue::issue_then`] job's finishing step first, then the send to the waiter).
type Done = Box<dyn FnOnce(Result<Option<TensorData>, Error>) + Send>;

/// One issued job and where its result goes.
struct Job {
    work: Work,
    data: Option<TensorData>,
    issued: Instant,
    done: Done,
}

/// A rank's communicator with a queue of issued collectives (see the module docs).
pub struct CommQueue {
    inner: Arc<dyn Communicator>,
    /// The communication thread's inbox (started at the first issue).
    jobs: Mutex<Option<Sender<Job>>>,
    /// Calls issued and not yet completed.
    in_flight: Arc<AtomicUsize>,
}

/// A collective issued on a [`CommQueue`]: [`Pending::wait`] for its result (this member's
/// buffer, or what [`CommQueue::issue_then`]'s finishing step made of it).
#[must_use = "a pending collective's result is only had by waiting for it"]
pub struct Pending<T = Option<TensorData>> {
    result: Receiver<Result<T, Error>>,
}

impl<T> Pending<T> {
    /// Wait for the call to complete: this member's result (`None` for a barrier).
    pub fn wait(self) -> Result<T, Error> {
        self.result.recv().unwrap_or_else(|_| {
            Err(Error::Unsupported(
                "the communication thread stopped before the call completed".into(),
            ))
        })
    }
}

impl Pending {
    /// Wait for a call that returns a buffer (any but a barrier).
    pub fn wait_data(self) -> Result<TensorData, Error> {
        self.wait().map(super::returned)
    }
}

impl CommQueue {
    /// A queue in front of `inner` (no thread until the first issue).
    pub fn new(inner: Arc<dyn Communicator>) -> Self {
        Self {
            inner,
            jobs: Mutex::new(None),
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The communicator the calls run on.
    pub fn inner(&self) -> &Arc<dyn Communicator> {
        &self.inner
    }

    /// Calls issued and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Issue `call` on the communication thread; its result comes with [`Pending::wait`]. Calls
    /// run in the order they are issued (blocking calls made meanwhile included).
    pub fn issue(&self, call: Call, data: Option<TensorData>) -> Pending {
        self.issue_chain(vec![call], data)
    }

    /// Issue `calls` as one job: the first gets `data`, each next one the previous one's result
    /// (so `calls` must describe those buffers), and the last one's result comes with
    /// [`Pending::wait`]. A hybrid-sharded gradient's reduce-scatter then all-reduce is one
    /// chain. The first failing call ends the chain with its error.
    pub fn issue_chain(&self, calls: Vec<Call>, data: Option<TensorData>) -> Pending {
        self.issue_work(Work::Calls(calls), data)
    }

    /// Issue a point-to-point exchange: `data` sent to global rank `to`, then the next message
    /// from global rank `from` received, on the communication thread (behind the calls issued
    /// before it); [`Pending::wait`] gives the received buffer. Ring attention's step: the
    /// transfer runs while the caller computes on what it holds. Both messages are counted as
    /// the communicator counts them, and the exchange is one span of the trace (`SendRecv`).
    pub fn issue_exchange(&self, to: usize, data: TensorData, from: usize) -> Pending {
        self.issue_work(Work::Exchange { to, from }, Some(data))
    }

    /// Issue `call` as [`CommQueue::issue`] does, and run `then` on its result (a buffer) on
    /// the communication thread before the waiter gets it: the upload of a gathered or reduced
    /// buffer to the device, which then overlaps the caller's compute as the call itself does.
    /// It runs under the device stream of the thread that issues the call
    /// ([`on_callers_stream`]), so what it uploads is ordered with that thread's kernels.
    pub fn issue_then<T: Send + 'static>(
        &self,
        call: Call,
        data: Option<TensorData>,
        then: impl FnOnce(TensorData) -> T + Send + 'static,
    ) -> Pending<T> {
        self.issue_chain_then(vec![call], data, then)
    }

    /// [`CommQueue::issue_chain`] with a finishing step on the communication thread (see
    /// [`CommQueue::issue_then`]).
    pub fn issue_chain_then<T: Send + 'static>(
        &self,
        calls: Vec<Call>,
        data: Option<TensorData>,
        then: impl FnOnce(TensorData) -> T + Send + 'static,
    ) -> Pending<T> {
        self.issue_job(Work::Calls(calls), data, finishing(then))
    }

    /// [`CommQueue::issue_exchange`] with a finishing step on the communication thread (see
    /// [`CommQueue::issue_then`]): ring attention's received block uploaded while the caller
    /// computes on the one it holds.
    pub fn issue_exchange_then<T: Send + 'static>(
        &self,
        to: usize,
        data: TensorData,
        from: usize,
        then: impl FnOnce(TensorData) -> T + Send + 'static,
    ) -> Pending<T> {
        self.issue_job(Work::Exchange { to, from }, Some(data), finishing(then))
    }

    fn issue_work(&self, work: Work, data: Option<TensorData>) -> Pending {
        self.issue_job(work, data, |r| r)
    }

    fn issue_job<T: Send + 'static>(
        &self,
        work: Work,
        data: Option<TensorData>,
        finish: impl FnOnce(Result<Option<TensorData>, Error>) -> Result<T, Error> + Send + 'static,
    ) -> Pending<T> {
        let (sender, result) = mpsc::channel();
        // Every finishing step on the issuing thread's stream: an upload on the communication
        // thread's own would race the compute stream's kernels (see `on_callers_stream`).
        let finish = on_callers_stream(finish);
        let done: Done = Box::new(move |r| {
            // The waiter may have given up on it (a prefetch never used).
            let _ = sender.send(finish(r));
        });
        let job = Job {
            work,
            data,
            issued: Instant::now(),
            done,
        };
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let sender = jobs.get_or_insert_with(|| self.start());
        if let Err(mpsc::SendError(job)) = sender.send(job) {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            (job.done)(Err(Error::Unsupported(
                "the communication thread has stopped".into(),
            )));
        }
        Pending { result }
    }

    /// Issue an all-gather (see [`Communicator::all_gather`]).
    pub fn issue_all_gather(&self, group: super::Group, data: TensorData, dim: usize) -> Pending {
        let call = Call::all_gather(group, super::Operand::of(&data), dim);
        self.issue(call, Some(data))
    }

    fn start(&self) -> Sender<Job> {
        let (sender, jobs) = mpsc::channel::<Job>();
        let inner = self.inner.clone();
        let in_flight = self.in_flight.clone();
        std::thread::Builder::new()
            .name(format!("wildfire-comm-{}", inner.rank()))
            .spawn(move || {
                for job in jobs {
                    let mut result = Ok(job.data);
                    match &job.work {
                        Work::Calls(calls) => {
                            for call in calls {
                                let Ok(data) = result else { break };
                                let started = Instant::now();
                                result = inner.run(call, data);
                                if let Ok(out) = &result {
                                    let member = inner.member();
                                    let times = member.tracing().then_some((job.issued, started));
                                    member.record(call, out.as_ref(), times);
                                }
                            }
                        }
                        &Work::Exchange { to, from } => {
                            let started = Instant::now();
                            let data = result.ok().flatten();
                            result = exchange(&*inner, to, data, from).map(Some);
                            if let Ok(Some(received)) = &result {
                                let bytes = received.bytes.len() as u64;
                                inner.member().trace_exchange(job.issued, started, bytes);
                            }
                        }
                    }
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                    (job.done)(result);
                }
            })
            .expect("spawning a communication thread");
        sender
    }
}

/// `f`, to be run on another thread (every [`CommQueue::issue_then`] job's finishing step; the
/// offloaded AdamW's host step), run there under the device stream of the thread that calls
/// this: what it allocates and copies
/// on a CubeCL device is ordered with that thread's kernels, as if that thread had made it.
///
/// CubeCL gives every OS thread a stream of its own (`StreamId::current`), with its own
/// memory pool. A buffer made on the communication thread's stream is read safely by the
/// compute stream (CubeCL synchronises a read across streams), but freeing it is not: when the
/// compute thread drops its last handle, the slice is at once reusable in the *communication*
/// stream's pool, and the next upload there can overwrite it before the compute stream's
/// pending kernels have read it (on Wgpu a `write_buffer` runs ahead of recorded, unsubmitted
/// commands) — results then depend on thread timing (the first overlapped upload, reverted in
/// `84ad167`, made Wgpu runs nondeterministic so). Under the caller's stream id the buffer
/// comes from the compute stream's pool and its copy is queued in the compute stream's order:
/// the host's work (the gather, the staging of the bytes, the allocation) leaves the compute
/// thread, and every run computes the same bits. The copy itself is not overlapped with the
/// kernels on the device (that needs a stream of its own and a release ordered after the last
/// use: `docs/architecture.md` §26). Backends without streams (Flex) ignore the id.
pub fn on_callers_stream<A, T>(f: impl FnOnce(A) -> T + Send) -> impl FnOnce(A) -> T + Send {
    let stream = burn_backend::StreamId::current();
    move |a| stream.executes(|| f(a))
}

/// A job's finishing step: `then` on its buffer (a call that returns one).
fn finishing<T>(
    then: impl FnOnce(TensorData) -> T + Send + 'static,
) -> impl FnOnce(Result<Option<TensorData>, Error>) -> Result<T, Error> + Send + 'static {
    move |r| r.map(super::returned).map(then)
}

/// `data` sent to `to`, then the next message from `from`.
fn exchange(
    comm: &dyn Communicator,
    to: usize,
    data: Option<TensorData>,
    from: usize,
) -> Result<TensorData, Error> {
    let p2p = comm.point_to_point()?;
    let data = data.expect("an exchange carries its buffer");
    p2p.send(to, data)?;
    p2p.recv(from)
}

impl fmt::Debug for CommQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommQueue({:?})", self.inner)
    }
}

impl Communicator for CommQueue {
    fn member(&self) -> &Member {
        self.inner.member()
    }

    fn run(&self, call: &Call, data: Option<TensorData>) -> Result<Option<TensorData>, Error> {
        self.inner.run(call, data)
    }

    /// Runs on the caller's thread when nothing is in flight, else queued behind the issued
    /// calls (and recorded by the communication thread).
    fn collective(
        &self,
        call: Call,
        data: Option<TensorData>,
    ) -> Result<Option<TensorData>, Error> {
        if self.in_flight() == 0 {
            return self.inner.collective(call, data);
        }
        self.issue(call, data).wait()
    }

    fn point_to_point(&self) -> Result<&dyn PointToPoint, Error> {
        self.inner.point_to_point()
    }

    fn fail(&self, reason: String) {
        self.inner.fail(reason);
    }

    fn aborted(&self) -> Option<(usize, String)> {
        self.inner.aborted()
    }
}
