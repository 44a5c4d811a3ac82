//! Ranks as processes: the [`Communicator`] over MPI (feature `mpi`; Open MPI or MPICH through
//! rsmpi), launched by `mpirun -np N …` or `srun …`.
//!
//! **Same results as the in-process world, bit for bit.** Every reduction combines the members'
//! buffers in group order `0, 1, …, n−1`, with the same host arithmetic ([`super::buffer`]): an
//! all-reduce is a reduce-scatter (an all-to-all of element ranges, each member reducing its own
//! range in group order) followed by an all-gather of the reduced ranges — `2(n−1)/n · S` bytes
//! per member, what a ring all-reduce moves, and deterministic, unlike `MPI_Allreduce`, whose
//! summation order is the library's.
//!
//! **Checked calls.** Before any data moves, the members of a group exchange a small header —
//! the group's call sequence number, the collective, its reduce op, dim, root, dtype and shape —
//! so a member that calls a different collective, passes an incompatible buffer or skipped a
//! call makes the round fail with [`Error::Mismatch`] on every member at that call, instead
//! of a hang or a silently wrong sum.
//!
//! **Failures.** A call still waiting after the timeout (a peer that never comes) prints which
//! call on which group and aborts the MPI job (`MPI_Abort`), so every process stops within the
//! timeout; a rank that dies makes `mpirun` stop the others. [`launch_ranks_mpi`] aborts the job
//! when its rank fails with an error or a panic.

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::{Shape, TensorData};
use mpi::datatype::{Partition, PartitionMut};
use mpi::request::{Request, StaticScope};
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use super::buffer::{chunk_bytes, element_size, gathered, reduce};
use super::call::{Operand, Round};
use super::header::{
    self, HEADER, Header, OPERAND, Sequence, decode_operand, encode_operand, from_bytes, to_bytes,
};
use super::{Call, CollectiveKind, Communicator, Error, Group, Member, PointToPoint, Splits, lock};
use crate::mesh::DeviceMesh;

/// An MPI communicator handle usable from the rank's threads.
///
/// SAFETY: MPI is initialised with `MPI_THREAD_MULTIPLE` (checked in [`MpiWorld::init`]), so
/// any thread may call into it; each handle is used under its own mutex (one call at a time),
/// and it is never freed (`ManuallyDrop`: `MPI_Finalize` releases it when the world ends).
pub(super) struct Handle(pub(super) ManuallyDrop<SimpleCommunicator>);
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// MPI in this process: initialised by [`MpiWorld::init`], finalised when dropped (after every
/// collective of the process is done).
pub struct MpiWorld {
    universe: ManuallyDrop<mpi::environment::Universe>,
    comm: Arc<MpiCommunicator>,
}

impl MpiWorld {
    /// Initialise MPI and build this process's communicator over `mesh` (its world size must be
    /// the number of MPI processes; this process is rank `MPI_COMM_WORLD` rank). One
    /// sub-communicator per mesh axis is split off, members ordered by their coordinate.
    pub fn init(mesh: DeviceMesh, timeout: Duration) -> Result<Self, Error> {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or(Error::MpiAlreadyInitialised)?;
        if level != mpi::Threading::Multiple {
            return Err(Error::MpiThreading(format!("{level:?}")));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if size != mesh.world_size() {
            return Err(Error::MpiWorldSize {
                mesh: mesh.to_string(),
                mesh_size: mesh.world_size(),
                world: size,
            });
        }
        let axes = (0..mesh.axes().len())
            .map(|a| {
                let members = Group::Axis(a).ranks(&mesh, rank).expect("the axis exists");
                let index = Group::Axis(a).index(&mesh, rank).expect("a member");
                // One color per group (its first member), ordered by the coordinate on the axis.
                let sub = world
                    .split_by_color_with_key(Color::with_value(members[0] as i32), index as i32)
                    .expect("every rank has a color");
                Mutex::new(Handle(ManuallyDrop::new(sub)))
            })
            .collect();
        let p2p = Mutex::new(Handle(ManuallyDrop::new(world.duplicate())));
        let comm = Arc::new(MpiCommunicator {
            member: Member::new(rank, mesh),
            world: Mutex::new(Handle(ManuallyDrop::new(world))),
            axes,
            p2p,
            in_flight: Mutex::default(),
            sequence: Sequence::default(),
            watchdog: Arc::new(Watchdog {
                timeout,
                pending: Mutex::new(None),
                stop: AtomicBool::new(false),
            }),
        });
        let watchdog = comm.watchdog.clone();
        thread::Builder::new()
            .name(format!("mpi-watchdog-{rank}"))
            .spawn(move || watchdog.watch(rank))
            .expect("start the MPI watchdog thread");
        Ok(Self {
            universe: ManuallyDrop::new(universe),
            comm,
        })
    }

    /// This process's communicator.
    pub fn communicator(&self) -> Arc<MpiCommunicator> {
        self.comm.clone()
    }

    /// Stop the job: every process exits (`MPI_Abort`) with `code`.
    pub fn abort(&self, code: i32) -> ! {
        abort_job(code)
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        self.comm.watchdog.stop.store(true, Ordering::Relaxed);
        // SAFETY: dropped once, here; MPI_Finalize after every call of this process returned.
        unsafe { ManuallyDrop::drop(&mut self.universe) };
    }
}

fn abort_job(code: i32) -> ! {
    SimpleCommunicator::world().abort(code)
}

/// Aborts the job when a call waits longer than the timeout.
struct Watchdog {
    timeout: Duration,
    /// The call in flight: when it started and what it is.
    pending: Mutex<Option<(Instant, String)>>,
    stop: AtomicBool,
}

impl Watchdog {
    fn watch(&self, rank: usize) {
        let tick = (self.timeout / 20).clamp(Duration::from_millis(10), Duration::from_millis(500));
        while !self.stop.load(Ordering::Relaxed) {
            thread::sleep(tick);
            let stuck = lock(&self.pending)
                .as_ref()
                .filter(|(start, _)| start.elapsed() > self.timeout)
                .map(|(start, what)| (start.elapsed(), what.clone()));
            if let Some((waited, what)) = stuck {
                eprintln!(
                    "wildfire: rank {rank}: {what} timed out after {waited:.1?}: a peer rank died, \
                     hangs, or skipped this call; aborting the MPI job"
                );
                abort_job(3);
            }
        }
    }

    fn start(&self, what: String) -> Pending<'_> {
        *lock(&self.pending) = Some((Instant::now(), what));
        Pending(self)
    }
}

/// Clears the watchdog's call when the call returns.
struct Pending<'w>(&'w Watchdog);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        *lock(&self.0.pending) = None;
    }
}

/// One rank's endpoint of the MPI world.
pub struct MpiCommunicator {
    member: Member,
    world: Mutex<Handle>,
    axes: Vec<Mutex<Handle>>,
    /// Point-to-point messages, on their own communicator (a duplicate of the world).
    p2p: Mutex<Handle>,
    /// Sends started and not yet known to be complete (see [`InFlight`]).
    in_flight: Mutex<InFlight>,
    /// Calls made so far per group (the header's sequence number).
    sequence: Sequence,
    watchdog: Arc<Watchdog>,
}

/// Immediate sends in flight, each with its message, which MPI reads until the send completes.
/// A standard-mode send of a message above the transport's eager limit waits for the matching
/// receive; pipeline ranks that both send before they receive (1F1B's steady state) would wait
/// on each other, so `send` starts the send and returns ([`PointToPoint::send`]'s contract),
/// and completed sends are reaped on each later call and waited for when the communicator goes.
#[derive(Default)]
struct InFlight(Vec<(SendRequest, *mut [u8])>);

/// An immediate send whose buffer lives until it completes.
type SendRequest = Request<'static, [u8], StaticScope>;

// The requests and buffers are only touched under the communicator's mutex; MPI is initialised
// with `Threading::Multiple`.
unsafe impl Send for InFlight {}

impl InFlight {
    /// Start sending `message` to `to` on `comm`.
    fn start(&mut self, comm: &SimpleCommunicator, to: i32, message: Vec<u8>) {
        let raw: *mut [u8] = Box::into_raw(message.into_boxed_slice());
        // SAFETY: `raw` stays allocated, and is neither read nor written here, until the request
        // completes (`reap`, `drop`): for MPI the buffer lives as long as `'static` asks.
        let buffer: &'static [u8] = unsafe { &*raw };
        let request = comm.process_at_rank(to).immediate_send(StaticScope, buffer);
        self.0.push((request, raw));
    }

    /// Free the messages of the sends that have completed.
    fn reap(&mut self) {
        let pending = std::mem::take(&mut self.0);
        for (request, raw) in pending {
            match request.test() {
                // SAFETY: the send completed; MPI no longer reads the buffer, which
                // `Box::into_raw` made and nothing else frees.
                Ok(_) => drop(unsafe { Box::from_raw(raw) }),
                Err(request) => self.0.push((request, raw)),
            }
        }
    }
}

impl InFlight {
    /// Wait for every send in flight, and free its message.
    fn wait_all(&mut self) {
        for (request, raw) in self.0.drain(..) {
            request.wait();
            // SAFETY: as in `reap`.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            // The process is ending and MPI may not be called again: a request cannot be
            // completed, and dropping one uncompleted panics; its message stays allocated.
            for (request, _) in self.0.drain(..) {
                std::mem::forget(request);
            }
        } else {
            self.wait_all();
        }
    }
}

impl fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.member.debug_as("MpiCommunicator", f)
    }
}

/// Byte counts and displacements for `counts` (bytes), as MPI's `int` counts.
fn partition(counts: &[usize]) -> Result<(Vec<i32>, Vec<i32>), Error> {
    let mut displs = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &c in counts {
        displs.push(at);
        at += c;
    }
    let fits = |v: usize| {
        i32::try_from(v).map_err(|_| {
            Error::Unsupported(format!(
                "a message of {at} bytes (MPI counts are 32-bit: split it below 2 GiB)"
            ))
        })
    };
    Ok((
        counts.iter().map(|&c| fits(c)).collect::<Result<_, _>>()?,
        displs.into_iter().map(fits).collect::<Result<_, _>>()?,
    ))
}

/// The element range of member `j` when `elements` are split into `n` contiguous ranges.
fn range(elements: usize, n: usize, j: usize) -> std::ops::Range<usize> {
    elements * j / n..elements * (j + 1) / n
}

impl MpiCommunicator {
    fn handle(&self, group: Group) -> &Mutex<Handle> {
        match group {
            Group::World => &self.world,
            Group::Axis(a) => &self.axes[a],
        }
    }

    /// One checked round of `call`: exchange the members' headers, check them, then let `body`
    /// move the data (with the group's handle, the members' calls and this member's index).
    fn exchange<R>(
        &self,
        call: &Call,
        body: impl FnOnce(&SimpleCommunicator, &Round<'_>, usize) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let (mesh, rank) = (self.mesh(), self.rank());
        let group = call.group();
        let label = group.label(mesh)?.to_owned();
        let n = group.size(mesh)?;
        let index = group.index(mesh, rank)?;
        let (seq, mine) = self.sequence.header(call)?;
        let handle = lock(self.handle(group));
        let comm: &SimpleCommunicator = &handle.0;
        let _pending = self
            .watchdog
            .start(format!("{} on {label} (call #{seq})", call.kind()));
        let mut all = vec![0i64; n * HEADER];
        if n > 1 {
            comm.all_gather_into(&mine[..], &mut all[..]);
        } else {
            all.copy_from_slice(&mine);
        }
        let headers: Vec<Header> = all
            .chunks_exact(HEADER)
            .map(|c| c.try_into().expect("HEADER words"))
            .collect();
        let round = header::round(mesh, rank, call, &headers)?;
        body(comm, &round, index)
    }

    /// Each member sends piece `j` of `send` (byte ranges `send_counts`) to member `j` and
    /// receives one piece of `recv_count` bytes from every member, in group order.
    fn all_to_all(
        comm: &SimpleCommunicator,
        send: &[u8],
        send_counts: &[usize],
        recv_count: usize,
    ) -> Result<Vec<u8>, Error> {
        let n = send_counts.len();
        let (sc, sd) = partition(send_counts)?;
        let (rc, rd) = partition(&vec![recv_count; n])?;
        let mut recv = vec![0u8; recv_count * n];
        comm.all_to_all_varcount_into(
            &Partition::new(send, sc, sd),
            &mut PartitionMut::new(&mut recv[..], rc, rd),
        );
        Ok(recv)
    }

    fn all_gather_bytes(
        comm: &SimpleCommunicator,
        mine: &[u8],
        counts: &[usize],
    ) -> Result<Vec<u8>, Error> {
        let (c, d) = partition(counts)?;
        let mut recv = vec![0u8; counts.iter().sum()];
        comm.all_gather_varcount_into(mine, &mut PartitionMut::new(&mut recv[..], c, d));
        Ok(recv)
    }
}

impl MpiCommunicator {
    /// The library's own `MPI_Allreduce` (sum) of `data` in place on `group`, summed in whatever
    /// order the library picks (not bitwise reproducible across meshes, not checked, not counted
    /// in the statistics): the baseline the bandwidth benchmark compares the deterministic
    /// all-reduce with.
    pub fn native_all_reduce_sum(&self, group: Group, data: &mut [f32]) {
        let handle = lock(self.handle(group));
        let send = data.to_vec();
        handle
            .0
            .all_reduce_into(&send[..], data, mpi::collective::SystemOperation::sum());
    }
}

impl MpiCommunicator {
    /// A deterministic all-reduce: a reduce-scatter of element ranges (each member reducing its
    /// own range in group order), then an all-gather of the reduced ranges.
    fn all_reduce(
        comm: &SimpleCommunicator,
        call: &Call,
        data: &TensorData,
        n: usize,
        index: usize,
    ) -> Result<TensorData, Error> {
        let op = call.reduce_op();
        let size = element_size(data)?;
        let elements = data.shape.num_elements();
        if elements < n {
            // Tiny buffers (a loss, a norm): gather them whole and reduce in group order
            // (MPI refuses some zero-length pieces of the range split).
            let all = Self::all_gather_bytes(comm, data.as_bytes(), &vec![data.bytes.len(); n])?;
            let raw: Vec<&[u8]> = all.chunks_exact(data.bytes.len().max(1)).collect();
            return Ok(if elements == 0 {
                data.clone()
            } else {
                reduce(&raw, data.dtype, data.shape.clone(), op)
            });
        }
        // Reduce-scatter of element ranges (each member reduces its range in group order)…
        let counts: Vec<usize> = (0..n).map(|j| range(elements, n, j).len() * size).collect();
        let own = range(elements, n, index);
        let pieces = Self::all_to_all(comm, data.as_bytes(), &counts, own.len() * size)?;
        let reduced = if own.is_empty() {
            Vec::new()
        } else {
            let raw: Vec<&[u8]> = pieces.chunks_exact(own.len() * size).collect();
            reduce(&raw, data.dtype, Shape::from(vec![own.len()]), op)
                .bytes
                .to_vec()
        };
        // …then an all-gather of the reduced ranges.
        let whole = Self::all_gather_bytes(comm, &reduced, &counts)?;
        Ok(TensorData::from_bytes_vec(
            whole,
            data.shape.clone(),
            data.dtype,
        ))
    }

    /// The members' buffers, concatenated along the call's dim.
    fn all_gather(
        comm: &SimpleCommunicator,
        round: &Round<'_>,
        data: &TensorData,
        dim: usize,
    ) -> Result<TensorData, Error> {
        let size = element_size(data)?;
        let shapes: Vec<Vec<usize>> = round
            .calls()
            .iter()
            .map(|call| call.buffer().expect("checked").shape().to_vec())
            .collect();
        let counts: Vec<usize> = shapes
            .iter()
            .map(|s| s.iter().product::<usize>() * size)
            .collect();
        let all = Self::all_gather_bytes(comm, data.as_bytes(), &counts)?;
        gathered(all, &shapes, dim, data.dtype)
    }

    /// Each member's chunk of every buffer to that member (an all-to-all), reduced in group
    /// order.
    fn reduce_scatter(
        comm: &SimpleCommunicator,
        call: &Call,
        data: &TensorData,
        n: usize,
    ) -> Result<TensorData, Error> {
        let mut send = Vec::with_capacity(data.bytes.len());
        let mut chunk_shape = None;
        for j in 0..n {
            let (chunk, shape) = chunk_bytes(data, call.dim(), n, j)?;
            send.extend_from_slice(&chunk);
            chunk_shape = Some(shape);
        }
        let piece = send.len() / n;
        let pieces = Self::all_to_all(comm, &send, &vec![piece; n], piece)?;
        let raw: Vec<&[u8]> = if piece == 0 {
            vec![&[][..]; n]
        } else {
            pieces.chunks_exact(piece).collect()
        };
        Ok(reduce(
            &raw,
            data.dtype,
            chunk_shape.expect("a group has members"),
            call.reduce_op(),
        ))
    }

    /// An all-to-all of rows: the members' splits all-gathered and checked (every member sees
    /// the same splits, so a disagreement fails on all of them), then `MPI_Alltoallv`.
    fn all_to_all_rows(
        &self,
        comm: &SimpleCommunicator,
        round: &Round<'_>,
        call: &Call,
        data: &TensorData,
    ) -> Result<TensorData, Error> {
        let n = round.calls().len();
        let mine = call
            .splits()
            .expect("an all-to-all carries its splits")
            .words(n);
        let mut all = vec![0i64; 2 * n * n];
        if n > 1 {
            comm.all_gather_into(&mine[..], &mut all[..]);
        } else {
            all.copy_from_slice(&mine);
        }
        let splits: Vec<Splits> = all
            .chunks_exact(2 * n)
            .map(|w| Splits::from_words(w, n))
            .collect();
        let round = Round::new(
            self.mesh(),
            self.rank(),
            call.clone(),
            round.calls().to_vec(),
        )
        .with_splits(splits);
        round.check_buffers()?;
        if n == 1 {
            return Ok(data.clone());
        }
        let s = call.splits().expect("checked");
        let row = data.shape.as_slice()[1..].iter().product::<usize>() * element_size(data)?;
        let bytes = |rows: &[usize]| rows.iter().map(|r| r * row).collect::<Vec<_>>();
        let (sc, sd) = partition(&bytes(&s.send))?;
        let (rc, rd) = partition(&bytes(&s.recv))?;
        let rows: usize = s.recv.iter().sum();
        let mut recv = vec![0u8; rows * row];
        comm.all_to_all_varcount_into(
            &Partition::new(data.as_bytes(), sc, sd),
            &mut PartitionMut::new(&mut recv[..], rc, rd),
        );
        let mut shape = data.shape.to_vec();
        shape[0] = rows;
        Ok(TensorData::from_bytes_vec(recv, shape, data.dtype))
    }

    /// The root's buffer, on every member.
    fn broadcast(
        comm: &SimpleCommunicator,
        round: &Round<'_>,
        data: Option<&TensorData>,
        root: usize,
    ) -> Result<TensorData, Error> {
        let source = round.root_buffer()?;
        let mut buffer = match data {
            Some(d) => d.as_bytes().to_vec(),
            None => vec![0u8; source.bytes()],
        };
        if round.calls().len() > 1 {
            comm.process_at_rank(root as i32)
                .broadcast_into(&mut buffer[..]);
        }
        Ok(TensorData::from_bytes_vec(
            buffer,
            source.shape().to_vec(),
            source.dtype(),
        ))
    }
}

impl Communicator for MpiCommunicator {
    fn member(&self) -> &Member {
        &self.member
    }

    /// The members' headers, checked (see the module), then the data over MPI's collectives,
    /// each member reducing in group order.
    fn run(&self, call: &Call, data: Option<TensorData>) -> Result<Option<TensorData>, Error> {
        call.check_root(self.mesh())?;
        // For a barrier, the header exchange is the all-gather: nobody leaves before everybody
        // arrived.
        self.exchange(call, |comm, round, index| {
            let n = round.calls().len();
            let data = match (call.kind(), &data) {
                (CollectiveKind::Barrier, _) => return Ok(None),
                (CollectiveKind::Broadcast, data) => {
                    return Self::broadcast(comm, round, data.as_ref(), call.root()).map(Some);
                }
                (_, data) => data.as_ref().expect("this call carries a buffer"),
            };
            if call.kind() == CollectiveKind::AllToAll {
                return self.all_to_all_rows(comm, round, call, data).map(Some);
            }
            round.check_buffers()?;
            if n == 1 {
                return Ok(Some(data.clone()));
            }
            Ok(Some(match call.kind() {
                CollectiveKind::AllReduce => Self::all_reduce(comm, call, data, n, index)?,
                CollectiveKind::AllGather => Self::all_gather(comm, round, data, call.dim())?,
                _ => Self::reduce_scatter(comm, call, data, n)?,
            }))
        })
    }

    fn point_to_point(&self) -> Result<&dyn PointToPoint, Error> {
        Ok(self)
    }
}

impl PointToPoint for MpiCommunicator {
    /// Blocking MPI send: returns once the buffer is handed over, which for messages above the
    /// library's eager limit means once `to` has started receiving it.
    fn send(&self, to: usize, data: TensorData) -> Result<(), Error> {
        self.member.check_peer(to)?;
        element_size(&data)?;
        let words = encode_operand(CollectiveKind::Send, Some(&Operand::of(&data)))?;
        let mut message = to_bytes(&words);
        message.extend_from_slice(data.as_bytes());
        let handle = lock(&self.p2p);
        let mut in_flight = lock(&self.in_flight);
        in_flight.reap();
        in_flight.start(&handle.0, to as i32, message);
        self.member
            .record_p2p(CollectiveKind::Send, data.bytes.len());
        Ok(())
    }

    fn flush(&self) -> Result<(), Error> {
        let _handle = lock(&self.p2p);
        let _pending = self.watchdog.start("sends to complete".to_string());
        lock(&self.in_flight).wait_all();
        Ok(())
    }

    fn recv(&self, from: usize) -> Result<TensorData, Error> {
        self.member.check_peer(from)?;
        let handle = lock(&self.p2p);
        lock(&self.in_flight).reap();
        let _pending = self.watchdog.start(format!("recv from rank {from}"));
        let (message, _status) = handle.0.process_at_rank(from as i32).receive_vec::<u8>();
        let words = from_bytes::<OPERAND>(&message);
        let buffer = decode_operand(&words)?.expect("a message carries a buffer");
        let data = TensorData::from_bytes_vec(
            message[OPERAND * 8..].to_vec(),
            buffer.shape().to_vec(),
            buffer.dtype(),
        );
        self.member
            .record_p2p(CollectiveKind::Recv, data.bytes.len());
        Ok(data)
    }
}
