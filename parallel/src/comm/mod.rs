//! Collective communication between the ranks of a [`DeviceMesh`].
//!
//! Burn 0.21 offers an all-reduce only; the [`Communicator`] trait adds every collective the
//! sharding rules need, over host buffers ([`TensorData`]). Which implementation runs is chosen
//! at launch: [`InProcessWorld`] runs the ranks as threads of one process (tests, CPU).
//! Each call is described once, as a [`Call`], which every communicator checks, counts and
//! dispatches on. Point-to-point messages are a trait of their own ([`PointToPoint`]), offered
//! by the communicators that can send them.
//!
//! Every collective is paired with its conjugate in backward (Megatron's `mappings.py`):
//! all-gather ↔ reduce-scatter, all-reduce ↔ identity, broadcast ↔ reduce to the root.
//!
//! Reductions are computed in group order `0, 1, …, n-1` on every member, so all members get
//! bitwise identical results and a run is reproducible.

mod bootstrap;
mod buffer;
mod call;
mod device;
#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
mod header;
#[cfg(feature = "mpi")]
mod hybrid;
mod in_process;
#[cfg(feature = "mpi")]
mod mpi_comm;
#[cfg(feature = "cuda")]
mod nccl;
mod stats;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use burn::tensor::TensorData;
use serde::{Deserialize, Serialize};

use crate::mesh::DeviceMesh;

pub use bootstrap::{
    Bootstrap, RendezvousError, TcpRendezvous, bootstrap_groups, exchange_group_ids,
};
pub(crate) use buffer::{check_dim, check_divisible};
pub use call::{Call, Operand};
#[cfg(test)]
pub(crate) use device::read;
pub(crate) use device::stage;
pub use device::{DeviceCollectives, HostStaged};
#[cfg(feature = "mpi")]
pub use hybrid::{HybridCommunicator, HybridWorld};
pub use in_process::{DEFAULT_TIMEOUT, InProcessCommunicator, InProcessWorld};
#[cfg(feature = "mpi")]
pub use mpi_comm::{MpiCommunicator, MpiError, MpiWorld};
#[cfg(feature = "cuda")]
pub use nccl::{NcclCommunicator, NcclInitError, NcclOptions};
pub use stats::{CommCount, CommStats};

/// How the members' buffers are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum (integers wrap on overflow).
    Sum,
    /// Element-wise sum divided by the number of members (integers: truncated toward zero).
    Avg,
    /// Element-wise maximum (a NaN on any member gives NaN).
    Max,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// Which ranks take part in a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Group {
    /// Every rank of the mesh, in rank order.
    World,
    /// The caller's sub-group along mesh axis `i`: the ranks that share every other coordinate
    /// with the caller, ordered by their coordinate on axis `i` (see [`DeviceMesh::group_ranks`]).
    Axis(usize),
}

impl Group {
    /// The label statistics and errors use: the axis name, or `world`.
    pub fn label(self, mesh: &DeviceMesh) -> Result<&str, CommError> {
        match self {
            Group::World => Ok("world"),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(&mesh.axis(axis).name)
            }
        }
    }

    /// The global ranks of `rank`'s group, in group order.
    pub fn ranks(self, mesh: &DeviceMesh, rank: usize) -> Result<Vec<usize>, CommError> {
        check_rank(rank, mesh.world_size(), "the world")?;
        match self {
            Group::World => Ok((0..mesh.world_size()).collect()),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(mesh.group_ranks(rank, axis))
            }
        }
    }

    /// The number of ranks in the group.
    pub fn size(self, mesh: &DeviceMesh) -> Result<usize, CommError> {
        match self {
            Group::World => Ok(mesh.world_size()),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(mesh.axis_size(axis))
            }
        }
    }

    /// `rank`'s index inside its group.
    pub fn index(self, mesh: &DeviceMesh, rank: usize) -> Result<usize, CommError> {
        check_rank(rank, mesh.world_size(), "the world")?;
        match self {
            Group::World => Ok(rank),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(mesh.group_index(rank, axis))
            }
        }
    }

    fn check(self, mesh: &DeviceMesh) -> Result<(), CommError> {
        match self {
            Group::Axis(axis) if axis >= mesh.axes().len() => Err(CommError::NoSuchAxis {
                axis,
                mesh: mesh.to_string(),
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Group::World => f.write_str("world"),
            Group::Axis(axis) => write!(f, "axis {axis}"),
        }
    }
}

/// The kind of a communication call, as statistics and errors name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// [`Communicator::all_reduce`].
    AllReduce,
    /// [`Communicator::all_gather`].
    AllGather,
    /// [`Communicator::reduce_scatter`].
    ReduceScatter,
    /// [`Communicator::broadcast`].
    Broadcast,
    /// [`Communicator::barrier`].
    Barrier,
    /// [`PointToPoint::send`].
    Send,
    /// [`PointToPoint::recv`].
    Recv,
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
        })
    }
}

/// A failed communication call.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum CommError {
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
    Indivisible {
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
    /// A [`Group::Axis`] that the mesh does not have.
    #[error("mesh {mesh} has no axis {axis}; name axes through DeviceMesh::axis_index")]
    NoSuchAxis {
        /// The axis index given.
        axis: usize,
        /// The mesh.
        mesh: String,
    },
}

fn missing_note(missing: &[usize]) -> String {
    match missing {
        [] => String::new(),
        [rank] => format!(" (rank {rank} never arrived)"),
        ranks => format!(" (ranks {ranks:?} never arrived)"),
    }
}

fn check_rank(rank: usize, size: usize, context: &str) -> Result<(), CommError> {
    if rank < size {
        Ok(())
    } else {
        Err(CommError::InvalidRank {
            rank,
            size,
            context: context.to_owned(),
        })
    }
}

/// Locks `mutex`, ignoring poisoning: what the communicators guard is bookkeeping that stays
/// consistent, and failures are reported as errors instead.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Collective communication for one rank of a mesh.
///
/// Every member of a group must make the same sequence of collective calls on that group (SPMD);
/// a member that calls a different collective, or passes incompatible buffers, makes the round
/// fail with [`CommError::Mismatch`] on every member. Collectives on a group of one rank return
/// at once, with the input unchanged.
///
/// Statistics count every call that succeeds; see [`CommStats`] for what `bytes` means.
///
/// Implementations provide [`Communicator::collective`], which runs any call the other methods
/// describe; callers use the other methods.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, in `0..mesh().world_size()`.
    fn rank(&self) -> usize;

    /// The mesh the ranks are arranged in.
    fn mesh(&self) -> &DeviceMesh;

    /// Runs one collective: `call` describes it, as the methods below build it, and `data` is
    /// the buffer it describes (`None` for a barrier, and on a broadcast's members other than
    /// the root). Returns this member's result, `None` for a barrier.
    fn collective(
        &self,
        call: Call,
        data: Option<TensorData>,
    ) -> Result<Option<TensorData>, CommError>;

    /// Every member gets the element-wise reduction of all members' buffers, computed in group
    /// order `0, 1, …, n-1` (deterministic, bitwise identical on every member). `Avg` is the sum
    /// divided by `n`; f16 and bf16 accumulate in f32 and round once at the end.
    fn all_reduce(
        &self,
        group: Group,
        data: TensorData,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        let call = Call::all_reduce(group, Operand::of(&data), op);
        self.collective(call, Some(data)).map(returned)
    }

    /// The concatenation of every member's buffer along `dim`, in group order. Members' shapes
    /// must agree except on `dim`. Conjugate of [`Communicator::reduce_scatter`].
    fn all_gather(
        &self,
        group: Group,
        data: TensorData,
        dim: usize,
    ) -> Result<TensorData, CommError> {
        let call = Call::all_gather(group, Operand::of(&data), dim);
        self.collective(call, Some(data)).map(returned)
    }

    /// Reduce (in group order), then return this member's chunk along `dim`: member `i` gets
    /// `[i·c, (i+1)·c)` with `c = size / n`. A size not divisible by `n` is
    /// [`CommError::Indivisible`]. Conjugate of [`Communicator::all_gather`].
    fn reduce_scatter(
        &self,
        group: Group,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        let call = Call::reduce_scatter(group, Operand::of(&data), dim, op);
        self.collective(call, Some(data)).map(returned)
    }

    /// Every member gets the buffer of the member at group index `root`. The root passes
    /// `Some(data)`; the others pass `None` (a `Some` is ignored).
    fn broadcast(
        &self,
        group: Group,
        data: Option<TensorData>,
        root: usize,
    ) -> Result<TensorData, CommError> {
        // Only the root's buffer travels; whatever the others pass is ignored.
        let is_root = group.index(self.mesh(), self.rank())? == root;
        let data = data.filter(|_| is_root);
        let call = Call::broadcast(group, data.as_ref().map(Operand::of), root);
        self.collective(call, data).map(returned)
    }

    /// Returns once every member of the group has called it.
    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.collective(Call::barrier(group), None).map(drop)
    }

    /// This communicator's point-to-point messages, where it offers them (the in-process and
    /// MPI communicators do); elsewhere [`CommError::Unsupported`].
    fn point_to_point(&self) -> Result<&dyn PointToPoint, CommError> {
        Err(CommError::Unsupported(format!(
            "point-to-point (send/recv) on {self:?}; use the in-process communicator (ranks as \
             threads) or MpiCommunicator (one rank per process)"
        )))
    }

    /// This rank's statistics so far.
    fn stats(&self) -> CommStats;

    /// Forgets this rank's statistics.
    fn reset_stats(&self);
}

/// The buffer a collective other than a barrier returns.
fn returned(result: Option<TensorData>) -> TensorData {
    result.expect("a collective other than a barrier returns a buffer")
}

/// Point-to-point messages between ranks of the world, on the communicators that offer them.
/// Statistics count them under the group label `p2p`.
pub trait PointToPoint: Communicator {
    /// Sends `data` to global rank `to`, without waiting for it to be received. Messages between
    /// one pair of ranks arrive in the order they were sent.
    fn send(&self, to: usize, data: TensorData) -> Result<(), CommError>;

    /// Receives the next message global rank `from` sent to this rank, waiting for it.
    fn recv(&self, from: usize) -> Result<TensorData, CommError>;
}
