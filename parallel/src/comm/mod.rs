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
mod link;
mod member;
#[cfg(feature = "mpi")]
mod mpi_comm;
#[cfg(feature = "cuda")]
mod nccl;
mod queue;
mod stats;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use burn::tensor::TensorData;
use serde::{Deserialize, Serialize};

pub use crate::error::{CollectiveKind, Error};
use crate::mesh::DeviceMesh;

pub use bootstrap::{
    Bootstrap, Channel, TcpRendezvous, bootstrap_groups, exchange_channel_ids, exchange_group_ids,
    p2p_channels,
};
pub(crate) use buffer::{check_dim, check_divisible};
pub use call::{Call, Operand, Splits};
pub use device::{DeviceCollectives, DeviceIssued, DeviceOp, HostGather, HostStaged};
pub(crate) use device::{host_recv, host_send, stage};
#[doc(hidden)]
pub use device::{read, upload};
pub(crate) use header::{dtype_code, dtype_of};
#[cfg(feature = "mpi")]
pub use hybrid::{HybridCommunicator, HybridWorld};
pub use in_process::{DEFAULT_TIMEOUT, InProcessCommunicator, InProcessWorld};
pub use link::{LinkModel, Links};
pub use member::{Member, TraceEvent};
#[cfg(feature = "mpi")]
pub use mpi_comm::{MpiCommunicator, MpiWorld};
#[cfg(feature = "cuda")]
pub use nccl::{NcclCommunicator, NcclOptions, check_libcuda};
pub use queue::{CommQueue, Pending, on_callers_stream};
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
    pub fn label(self, mesh: &DeviceMesh) -> Result<&str, Error> {
        match self {
            Group::World => Ok("world"),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(&mesh.axis(axis).name)
            }
        }
    }

    /// The global ranks of `rank`'s group, in group order.
    pub fn ranks(self, mesh: &DeviceMesh, rank: usize) -> Result<Vec<usize>, Error> {
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
    pub fn size(self, mesh: &DeviceMesh) -> Result<usize, Error> {
        match self {
            Group::World => Ok(mesh.world_size()),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(mesh.axis_size(axis))
            }
        }
    }

    /// `rank`'s index inside its group.
    pub fn index(self, mesh: &DeviceMesh, rank: usize) -> Result<usize, Error> {
        check_rank(rank, mesh.world_size(), "the world")?;
        match self {
            Group::World => Ok(rank),
            Group::Axis(axis) => {
                self.check(mesh)?;
                Ok(mesh.group_index(rank, axis))
            }
        }
    }

    fn check(self, mesh: &DeviceMesh) -> Result<(), Error> {
        match self {
            Group::Axis(axis) if axis >= mesh.axes().len() => Err(Error::NoSuchAxisIndex {
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

fn check_rank(rank: usize, size: usize, context: &str) -> Result<(), Error> {
    if rank < size {
        Ok(())
    } else {
        Err(Error::InvalidRank {
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
/// fail with [`Error::Mismatch`] on every member. Collectives on a group of one rank return
/// at once, with the input unchanged.
///
/// Statistics count every call that succeeds; see [`CommStats`] for what `bytes` means.
///
/// Implementations provide [`Communicator::member`] (their rank, mesh and statistics) and
/// [`Communicator::run`], which moves the data of any call the other methods describe; callers
/// use the other methods, which count the calls.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank of the mesh, with the statistics of its calls.
    fn member(&self) -> &Member;

    /// Moves the data of one collective without recording it: `call` describes it, as the
    /// methods below build it, and `data` is the buffer it describes (`None` for a barrier, and
    /// on a broadcast's members other than the root). Returns this member's result, `None` for
    /// a barrier. [`Communicator::collective`] runs it and records the call.
    fn run(&self, call: &Call, data: Option<TensorData>) -> Result<Option<TensorData>, Error>;

    /// This rank, in `0..mesh().world_size()`.
    fn rank(&self) -> usize {
        self.member().rank()
    }

    /// The mesh the ranks are arranged in.
    fn mesh(&self) -> &DeviceMesh {
        self.member().mesh()
    }

    /// Runs one collective ([`Communicator::run`]) and, when it succeeds, records it in this
    /// rank's statistics. Returns this member's result, `None` for a barrier.
    fn collective(
        &self,
        call: Call,
        data: Option<TensorData>,
    ) -> Result<Option<TensorData>, Error> {
        let issued = self.member().tracing().then(std::time::Instant::now);
        let result = self.run(&call, data)?;
        self.member()
            .record(&call, result.as_ref(), issued.map(|t| (t, t)));
        Ok(result)
    }

    /// Every member gets the element-wise reduction of all members' buffers, computed in group
    /// order `0, 1, …, n-1` (deterministic, bitwise identical on every member). `Avg` is the sum
    /// divided by `n`; f16 and bf16 accumulate in f32 and round once at the end.
    fn all_reduce(
        &self,
        group: Group,
        data: TensorData,
        op: ReduceOp,
    ) -> Result<TensorData, Error> {
        let call = Call::all_reduce(group, Operand::of(&data), op);
        self.collective(call, Some(data)).map(returned)
    }

    /// The concatenation of every member's buffer along `dim`, in group order. Members' shapes
    /// must agree except on `dim`. Conjugate of [`Communicator::reduce_scatter`].
    fn all_gather(&self, group: Group, data: TensorData, dim: usize) -> Result<TensorData, Error> {
        let call = Call::all_gather(group, Operand::of(&data), dim);
        self.collective(call, Some(data)).map(returned)
    }

    /// Reduce (in group order), then return this member's chunk along `dim`: member `i` gets
    /// `[i·c, (i+1)·c)` with `c = size / n`. A size not divisible by `n` is
    /// [`Error::Unsplittable`]. Conjugate of [`Communicator::all_gather`].
    fn reduce_scatter(
        &self,
        group: Group,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, Error> {
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
    ) -> Result<TensorData, Error> {
        // Only the root's buffer travels; whatever the others pass is ignored.
        let is_root = group.index(self.mesh(), self.rank())? == root;
        let data = data.filter(|_| is_root);
        let call = Call::broadcast(group, data.as_ref().map(Operand::of), root);
        self.collective(call, data).map(returned)
    }

    /// Member `i` sends rows (along dim 0) `send[j]` to each member `j`, its buffer's rows in
    /// group order of their destination, and receives the rows each member sends it,
    /// concatenated in group order (`recv[i]` from member `i`): expert parallelism's dispatch
    /// and combine. Buffers agree except on dim 0. The splits must fit across the members —
    /// member `i`'s `send[j]` is member `j`'s `recv[i]`, and `send` sums to the buffer's rows —
    /// else every member fails with [`Error::Mismatch`]. Its conjugate is itself with `send`
    /// and `recv` swapped. Statistics count the buffer passed in.
    fn all_to_all(
        &self,
        group: Group,
        data: TensorData,
        send: &[usize],
        recv: &[usize],
    ) -> Result<TensorData, Error> {
        let splits = Splits {
            send: send.to_vec(),
            recv: recv.to_vec(),
        };
        let call = Call::all_to_all(group, Operand::of(&data), splits);
        self.collective(call, Some(data)).map(returned)
    }

    /// Returns once every member of the group has called it.
    fn barrier(&self, group: Group) -> Result<(), Error> {
        self.collective(Call::barrier(group), None).map(drop)
    }

    /// This rank failed (`reason`): where the communicator can, every pending and later call of
    /// the other ranks fails at once naming this rank and `reason` ([`Error::PeerFailed`]),
    /// instead of each waiting out its timeout. The in-process world does; elsewhere nothing
    /// happens (an MPI job's watchdog ends it after the timeout).
    fn fail(&self, reason: String) {
        let _ = reason;
    }

    /// The rank and reason of the world's abort ([`Communicator::fail`], a panic), if it was
    /// aborted and the communicator can tell (the in-process world can; elsewhere `None`).
    fn aborted(&self) -> Option<(usize, String)> {
        None
    }

    /// This communicator's point-to-point messages, where it offers them (the in-process and
    /// MPI communicators do); elsewhere [`Error::Unsupported`].
    fn point_to_point(&self) -> Result<&dyn PointToPoint, Error> {
        Err(Error::Unsupported(format!(
            "point-to-point (send/recv) on {self:?}; use the in-process communicator (ranks as \
             threads) or MpiCommunicator (one rank per process)"
        )))
    }

    /// This rank's statistics so far.
    fn stats(&self) -> CommStats {
        self.member().stats()
    }

    /// Forgets this rank's statistics.
    fn reset_stats(&self) {
        self.member().reset_stats();
    }
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
    fn send(&self, to: usize, data: TensorData) -> Result<(), Error>;

    /// Receives the next message global rank `from` sent to this rank, waiting for it.
    fn recv(&self, from: usize) -> Result<TensorData, Error>;

    /// Wait until every message this rank sent has left it (MPI: the immediate sends completed,
    /// their buffers freed). Call once nothing this rank waits for depends on its own later
    /// sends (the end of a pipeline step).
    fn flush(&self) -> Result<(), Error> {
        Ok(())
    }
}
