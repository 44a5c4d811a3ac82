//! The one error type of the parallel crate.
//!
//! Every fallible function of `wildfire_parallel` returns [`Error`]; backend ops (which cannot
//! return a `Result` in Burn's API) [`raise`] it, and the launcher hands it back typed. It sits at
//! the bottom of the crate's layers, so it names only plain data (placements and axis kinds as
//! text).

use std::fmt;
use std::time::Duration;

/// The kind of a communication call, as statistics and errors name it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum CollectiveKind {
    /// [`crate::Communicator::all_reduce`].
    AllReduce,
    /// [`crate::Communicator::all_gather`].
    AllGather,
    /// [`crate::Communicator::reduce_scatter`].
    ReduceScatter,
    /// [`crate::Communicator::broadcast`].
    Broadcast,
    /// [`crate::Communicator::barrier`].
    Barrier,
    /// [`crate::comm::PointToPoint::send`].
    Send,
    /// [`crate::comm::PointToPoint::recv`].
    Recv,
    /// [`crate::Communicator::all_to_all`].
    AllToAll,
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
            CollectiveKind::AllToAll => "all_to_all",
        })
    }
}

/// What can go wrong in the parallel layer: describing a mesh, communicating, placing and
/// redistributing tensors, planning tensor parallelism, launching ranks and processes.
///
/// Public functions return it; backend ops (which cannot return a `Result` in Burn's API) panic
/// with it as the message, and the launcher ([`crate::launch_ranks`]) turns that back into this
/// value ([`Error::OnRank`]), so a test or a binary always sees the typed error.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum Error {
    // ---- the device mesh
    /// The mesh has no axis at all.
    #[error("a device mesh needs at least one axis; use (\"dp\", 1) for a single rank")]
    EmptyMesh,
    /// An axis name that is not one of the accepted names.
    #[error("unknown mesh axis \"{name}\"; accepted axis names are {}", accepted)]
    UnknownAxis {
        /// The rejected name.
        name: String,
        /// The accepted names, by kind.
        accepted: String,
    },
    /// An axis of size 0.
    #[error("mesh axis \"{name}\" has size 0; every axis needs size 1 or more (1 disables it)")]
    ZeroSize {
        /// The axis name.
        name: String,
    },
    /// The same axis name given twice.
    #[error("mesh axis \"{name}\" is given twice; give every axis once, with its full size")]
    DuplicateAxis {
        /// The repeated name.
        name: String,
    },
    /// The product of the axis sizes differs from the number of ranks.
    #[error(
        "mesh {mesh} = {product} ranks does not match the world size {world}; \
         choose axis sizes whose product is {world}"
    )]
    WorldMismatch {
        /// Every factor, e.g. `dp=3 × tp=2`.
        mesh: String,
        /// The product of the axis sizes.
        product: usize,
        /// The number of ranks actually present.
        world: usize,
    },
    /// The product of the axis sizes does not fit in a `usize`.
    #[error("mesh {mesh} has more ranks than fit in a usize; check the axis sizes")]
    MeshTooLarge {
        /// Every factor.
        mesh: String,
    },
    /// A lookup by name of an axis the mesh does not have.
    #[error("mesh {mesh} has no axis \"{name}\"; its axes are {axes}")]
    NoSuchAxis {
        /// The name looked up.
        name: String,
        /// The mesh, e.g. `dp=2 × tp=2`.
        mesh: String,
        /// The mesh's axis names, comma separated.
        axes: String,
    },
    /// Parallel degrees that do not fit together ([`crate::ParallelDims::validate`]).
    #[error("parallel degrees: {reason}")]
    InvalidDims {
        /// What does not fit, and what to choose.
        reason: String,
    },
    /// A deserialised axis whose recorded kind contradicts its name.
    #[error("mesh axis \"{name}\" is recorded as {kind}, but that name is a {expected} axis")]
    WrongKind {
        /// The axis name.
        name: String,
        /// The recorded kind.
        kind: String,
        /// The kind the name implies.
        expected: String,
    },
    // ---- communication
    /// Not every member of the group arrived (or no message came) within the timeout.
    #[error(
        "{op} on {group} timed out on rank {rank} after {waited:?}{}; a rank that skips a \
         collective or calls collectives in a different order leaves the others waiting",
        missing_note(.missing)
    )]
    Timeout {
        /// The call that timed out.
        op: CollectiveKind,
        /// The group label (an axis name, `world`, or `p2p`).
        group: String,
        /// The rank that gave up waiting.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The global ranks that never arrived, when known.
        missing: Vec<usize>,
    },
    /// Another rank aborted the world (it panicked or gave up); every pending and later call fails.
    #[error("rank {rank} failed and aborted the world: {reason}")]
    PeerFailed {
        /// The rank that aborted.
        rank: usize,
        /// Why it aborted.
        reason: String,
    },
    /// The members of a group called different collectives, or passed incompatible arguments
    /// (shapes, dtypes, dims, roots), in the same round.
    #[error("mismatched {op} on {group}: {detail}")]
    Mismatch {
        /// The call this rank made.
        op: CollectiveKind,
        /// The group label.
        group: String,
        /// What differed, member by member.
        detail: String,
    },
    /// A dimension cannot be split into equal parts, one per member.
    #[error(
        "cannot split dimension {dim} of size {size} into {parts} equal parts; \
         make its size a multiple of {parts} (pad it, or change the mesh)"
    )]
    Unsplittable {
        /// The tensor dimension.
        dim: usize,
        /// Its size.
        size: usize,
        /// The number of members.
        parts: usize,
    },
    /// A tensor dimension that the buffer does not have.
    #[error("{op} along dimension {dim} of a tensor with {ndims} dimensions")]
    InvalidDim {
        /// The call.
        op: CollectiveKind,
        /// The requested dimension.
        dim: usize,
        /// The number of dimensions of the buffer.
        ndims: usize,
    },
    /// A dtype the operation cannot handle.
    #[error(
        "dtype {0} is not supported here; reductions take f32, f64, f16, bf16, i32 and i64, \
         and splitting needs whole-byte elements"
    )]
    UnsupportedDType(String),
    /// A call this communicator cannot make (e.g. point-to-point on NCCL or a hybrid world, a
    /// message over MPI's 32-bit counts), with what to do instead.
    #[error("not supported here: {0}")]
    Unsupported(String),
    /// A rank (or group index) out of range.
    #[error("rank {rank} is out of range for {context} of {size} ranks")]
    InvalidRank {
        /// The rank or group index given.
        rank: usize,
        /// The number of ranks it must be below.
        size: usize,
        /// What it indexes, e.g. `the world` or `group dp`.
        context: String,
    },
    /// A collective library (NCCL, CUDA) failed.
    #[error("{library} {call} failed: {reason}")]
    Library {
        /// The library.
        library: &'static str,
        /// The call.
        call: String,
        /// What it reported.
        reason: String,
    },
    /// A [`crate::Group::Axis`] that the mesh does not have.
    #[error("mesh {mesh} has no axis {axis}; name axes through DeviceMesh::axis_index")]
    NoSuchAxisIndex {
        /// The axis index given.
        axis: usize,
        /// The mesh.
        mesh: String,
    },
    // ---- placement and redistribution
    /// A tensor dimension does not divide by the number of shards.
    #[error(
        "cannot shard {what}: dimension {dim} has size {size}, which does not divide into {shards} \
         shards; choose a mesh axis size that divides it (uneven shards are not supported: FSDP pads \
         flat parameters instead)"
    )]
    Indivisible {
        /// What was being sharded.
        what: String,
        /// The tensor dimension.
        dim: usize,
        /// Its global size.
        size: usize,
        /// The number of shards asked for.
        shards: usize,
    },
    /// A layout that does not fit the tensor or the mesh.
    #[error("invalid layout for a tensor of shape {shape:?} on mesh {mesh}: {reason}")]
    InvalidLayout {
        /// The tensor's global shape.
        shape: Vec<usize>,
        /// The mesh.
        mesh: String,
        /// What is wrong.
        reason: String,
    },
    /// A redistribution that has no meaning (e.g. from per-rank `Local` data to a global layout).
    #[error("cannot redistribute on mesh axis '{axis}' from {from} to {to}: {reason}")]
    InvalidRedistribution {
        /// The mesh axis.
        axis: String,
        /// The current placement (as `Debug` writes it).
        from: String,
        /// The requested placement (as `Debug` writes it).
        to: String,
        /// Why not.
        reason: String,
    },
    /// A parameter is used as per-rank data on a data-parallel axis of size > 1: the model was not
    /// given a placement (`replicate` / `fully_shard`) after it was built.
    #[error(
        "{op}: a parameter of shape {shape:?} is per-rank (`Local`) on data axis '{axis}' of size \
         {size}; call `wildfire_parallel::replicate(model, &mesh)` (or `fully_shard`) after building \
         the model"
    )]
    UnplacedParameter {
        /// The op that received it.
        op: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The data axis.
        axis: String,
        /// The axis size.
        size: usize,
    },
    /// A forward pass started after a backward pass whose gradients were never synchronised.
    #[error(
        "{op}: the gradients of the previous backward pass were not synchronised across the \
         data-parallel axes; call `wildfire_parallel::sync_gradients(&model, &mut grads)` between \
         `backward()` and the optimizer step"
    )]
    GradientsNotSynced {
        /// The op that noticed.
        op: &'static str,
    },
    /// A rank's tensors outgrew its memory budget (`RankPolicy::memory_budget`).
    #[error(
        "rank {rank} needs {bytes} bytes of tensors, over its budget of {budget} bytes: shard more \
         (--fsdp full), use more ranks, or recompute activations (--recompute full)"
    )]
    MemoryBudget {
        /// The rank.
        rank: usize,
        /// Its live bytes when the budget was crossed.
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// A gradient could not be reduced to its parameter's placement.
    #[error("parameter {param} (shape {shape:?}): {reason}")]
    UnreducedGradient {
        /// The parameter id.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Why.
        reason: String,
    },
    // ---- tensor-parallel plans
    /// The mesh has no `tp` axis.
    #[error("the mesh {0} has no 'tp' axis; build it with a (\"tp\", N) axis")]
    NoTpAxis(String),
    /// A pattern matched no `Linear`.
    #[error(
        "tensor-parallel plan: pattern '{0}' matches no Linear layer of the model; check the module path (e.g. encoder.layers.*.mha.query)"
    )]
    PlanNoMatch(String),
    /// Two rules for one layer.
    #[error(
        "tensor-parallel plan: {module} is matched by '{first}' and '{second}'; give each layer one style"
    )]
    PlanConflict {
        /// The module path.
        module: String,
        /// The first pattern.
        first: String,
        /// The second pattern.
        second: String,
    },
    /// A split that does not divide.
    #[error(
        "tensor-parallel plan: {param} has shape {shape:?}; dimension {dim} ({size}) does not divide by tp = {tp}"
    )]
    PlanIndivisible {
        /// The parameter path.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The split dimension.
        dim: usize,
        /// Its size.
        size: usize,
        /// The tensor-parallel degree.
        tp: usize,
    },
    /// An attention module whose head count does not divide by the tp degree.
    #[error(
        "tensor-parallel plan: {module} has {heads} attention heads, which do not divide by tp = {tp}; choose a tp that divides the head count"
    )]
    PlanHeads {
        /// The module path.
        module: String,
        /// Its head count.
        heads: usize,
        /// The tensor-parallel degree.
        tp: usize,
    },
    // ---- pipeline parallelism
    /// A pipeline schedule that cannot be built or does not hold every stage's work once.
    #[error("invalid pipeline schedule: {0}")]
    InvalidSchedule(String),

    /// A split of a model's blocks into pipeline stages that the plan does not allow.
    #[error("invalid pipeline stage plan: {0}")]
    InvalidStagePlan(String),

    /// A pipeline schedule whose ranks wait for each other forever.
    #[error("the pipeline schedule deadlocks: no rank can go on ({0})")]
    ScheduleDeadlock(String),

    // ---- launching ranks
    /// A rank panicked. When several did, this is the root cause: the first rank that failed,
    /// not the ones that failed because it aborted the world.
    #[error("rank {rank} failed: {message}")]
    RankFailed {
        /// The failing rank.
        rank: usize,
        /// Its panic message.
        message: String,
    },
    /// A rank's thread could not be started.
    #[error("could not start the rank threads: {0}")]
    Spawn(String),
    /// A rank raised a typed error inside a distributed op (see [`crate::launch_ranks`]).
    #[error("{}", on_rank(*rank, error))]
    OnRank {
        /// The failing rank.
        rank: usize,
        /// What went wrong.
        error: Box<Error>,
    },
    /// A launcher variable that is set but unusable.
    #[error("{var}={value}: {reason}")]
    LaunchEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    // ---- rendezvous
    /// A launcher variable is missing or malformed.
    #[error(
        "{var}: {reason} (torchrun-style launch sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)"
    )]
    RendezvousEnv {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A socket error.
    #[error("rendezvous at {addr}, rank {rank}: {message}")]
    RendezvousIo {
        /// The rendezvous address.
        addr: String,
        /// This rank.
        rank: usize,
        /// The kind of I/O error.
        kind: std::io::ErrorKind,
        /// What the operating system said.
        message: String,
    },
    /// Not every rank arrived in time.
    #[error(
        "rendezvous at {addr}: rank {rank} waited {waited:?}; ranks {missing:?} never arrived \
         (is WORLD_SIZE the same everywhere, and is every rank started?)"
    )]
    RendezvousTimeout {
        /// The rendezvous address.
        addr: String,
        /// This rank.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks that never arrived: rank 0 knows and tells the ranks that came; `[0]` when
        /// rank 0 itself never answered.
        missing: Vec<usize>,
    },
    /// A peer spoke something else, or disagreed on the world.
    #[error("rendezvous at {addr}: {reason}")]
    RendezvousProtocol {
        /// The rendezvous address.
        addr: String,
        /// What was wrong.
        reason: String,
    },
    // ---- MPI and NCCL
    /// MPI was initialised before (MPI can be initialised once per process).
    #[error("MPI is already initialised in this process (one MpiWorld per process)")]
    MpiAlreadyInitialised,
    /// The library does not offer `MPI_THREAD_MULTIPLE`.
    #[error(
        "the MPI library provides thread level {0:?}, wildfire needs Multiple (the watchdog aborts the job from its own thread); use an MPI built with thread support (Open MPI 4: the default)"
    )]
    MpiThreading(String),
    /// A mesh whose groups cannot be laid over the processes.
    #[error("hybrid mesh: {0}")]
    HybridLayout(String),
    /// The mesh does not match the processes `mpirun` started.
    #[error(
        "the mesh {mesh} has {mesh_size} ranks but MPI started {world} processes; run mpirun -np {mesh_size} (or change the mesh)"
    )]
    MpiWorldSize {
        /// The mesh.
        mesh: String,
        /// Its rank count.
        mesh_size: usize,
        /// The MPI world size.
        world: usize,
    },
    /// The CUDA driver failed (no device, no driver).
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An NCCL call failed while creating the communicators (no libnccl, a peer with another
    /// NCCL version, …).
    #[error("NCCL {call}: {reason}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// NCCL's result code.
        reason: String,
    },
}

/// `rank r: error`, or the error alone where its message begins by naming rank `r`.
fn on_rank(rank: usize, error: &Error) -> String {
    let message = error.to_string();
    if message.starts_with(&format!("rank {rank} ")) {
        message
    } else {
        format!("rank {rank}: {message}")
    }
}

fn missing_note(missing: &[usize]) -> String {
    match missing {
        [] => String::new(),
        [rank] => format!(" (rank {rank} never arrived)"),
        ranks => format!(" (ranks {ranks:?} never arrived)"),
    }
}

thread_local! {
    static RAISED: std::cell::RefCell<Option<Error>> = const { std::cell::RefCell::new(None) };
    /// This thread is unwinding from [`raise`] (read and cleared by the panic hook).
    static RAISING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Launchers on this thread's stack that catch a raised error and hand it on
    /// ([`catch_raised`]).
    static CATCHING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Raise an [`Error`] from inside a backend op (which cannot return a `Result`): a panic whose
/// message is the error, with the typed value kept for [`crate::launch_ranks`] to return.
///
/// Under a launcher the error is reported once, by whoever receives it, not also by the panic
/// hook as a thread's panic (with a backtrace under `RUST_BACKTRACE`).
#[track_caller]
pub fn raise(error: impl Into<Error>) -> ! {
    let error = error.into();
    RAISED.with(|r| *r.borrow_mut() = Some(error.clone()));
    if CATCHING.get() > 0 {
        quiet_raised_panics();
        RAISING.set(true);
    }
    panic!("{error}")
}

/// `f`, its panic caught: a rank's body under a launcher, which returns a raised error typed
/// ([`Error::OnRank`]) or reports it. While it runs, an error [`raise`]d on this thread is left
/// out of the panic hook's report (logged at debug level instead); any other panic — a bug,
/// or a raise outside every launcher — is reported by the hook installed before, as always.
pub(crate) fn catch_raised<R>(f: impl FnOnce() -> R) -> std::thread::Result<R> {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            CATCHING.set(CATCHING.get() - 1);
        }
    }
    CATCHING.set(CATCHING.get() + 1);
    let _leave = Leave;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
}

/// Install, once per process, the panic hook of [`catch_raised`] in front of the one in place.
fn quiet_raised_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if RAISING.replace(false) {
                tracing::debug!("raised on a rank: {info}");
            } else {
                previous(info)
            }
        }));
    });
}

/// The error this thread raised last, if any.
pub(crate) fn take_raised() -> Option<Error> {
    RAISED.with(|r| r.borrow_mut().take())
}
