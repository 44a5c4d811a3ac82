//! One mesh over threads and processes (feature `mpi`): each MPI process runs `T` consecutive
//! ranks as threads (one per local device), processes span machines — `mpirun -np P` with a
//! mesh of `P·T` ranks.
//!
//! Every collective is built on one primitive, an all-gather of the members' buffers: the
//! members inside this process exchange through shared memory, then, when the group spans
//! processes, local member `j` of each process exchanges its process's share with the `j`-th
//! members of the others over an MPI communicator made for that (group, `j`) at start-up. Every
//! member then holds every buffer and reduces in group order: results are bitwise equal to
//! ranks-as-threads, and each call is checked across the group (a header of the call travels
//! with the data). This moves `n·S` bytes per member for reductions — simple and exact; the
//! pure-MPI communicator ([`super::MpiCommunicator`]) is the bandwidth-optimal one.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{Shape, TensorData};
use mpi::datatype::PartitionMut;
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use super::buffer::{
    check_dim, check_divisible, check_reducible, chunk_bytes, concat, element_size, reduce,
};
use super::header::{DTYPES, HEADER, header, header_shape, layouts_agree, mismatch};
use super::mpi_comm::Handle;
use super::{CollectiveKind, CommError, CommStats, Communicator, Group, ReduceOp, check_rank};
use crate::mesh::DeviceMesh;

/// What the local members of one group deposit for one call.
#[derive(Default)]
struct Slot {
    parts: HashMap<usize, Vec<u8>>,
    taken: usize,
}

/// The shared-memory half: local members of a group meet here, keyed by (members, call number).
#[derive(Default)]
struct LocalExchange {
    slots: Mutex<HashMap<(Vec<usize>, u64), Slot>>,
    ready: Condvar,
}

/// This process's part of a hybrid world: MPI, and the rendezvous of its threads.
pub struct HybridWorld {
    universe: ManuallyDrop<mpi::environment::Universe>,
    mesh: DeviceMesh,
    threads: usize,
    process: usize,
    exchange: Arc<LocalExchange>,
    /// Per local thread, per group kind (world, then each axis): the MPI communicator joining
    /// the thread's counterparts in the other processes the group spans (None: all local).
    comms: Vec<Vec<Option<Arc<Mutex<Handle>>>>>,
    timeout: Duration,
}

impl HybridWorld {
    /// Initialise MPI for a mesh of `P × threads` ranks (`P` the MPI world size): this process
    /// runs ranks `p·threads .. (p+1)·threads`. Every group must have the same number of members
    /// in each process it spans (true when the axes inside a process are the innermost).
    pub fn init(
        mesh: DeviceMesh,
        threads: usize,
        timeout: Duration,
    ) -> Result<Self, super::MpiError> {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or(super::MpiError::AlreadyInitialised)?;
        if level != mpi::Threading::Multiple {
            return Err(super::MpiError::Threading(format!("{level:?}")));
        }
        let world = universe.world();
        let (process, processes) = (world.rank() as usize, world.size() as usize);
        if processes * threads != mesh.world_size() {
            return Err(super::MpiError::WorldSize {
                mesh: mesh.to_string(),
                mesh_size: mesh.world_size(),
                world: processes * threads,
            });
        }
        let groups: Vec<Group> = std::iter::once(Group::World)
            .chain((0..mesh.axes().len()).map(Group::Axis))
            .collect();
        let mut comms = vec![Vec::new(); threads];
        for group in &groups {
            for (t, per_thread) in comms.iter_mut().enumerate() {
                let rank = process * threads + t;
                let members = group.ranks(&mesh, rank).expect("a valid group");
                let local: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|r| r / threads == process)
                    .collect();
                let spans: Vec<usize> = {
                    let mut p: Vec<usize> = members.iter().map(|r| r / threads).collect();
                    p.dedup();
                    p
                };
                let j = local.iter().position(|&r| r == rank).expect("a member");
                let regular = spans
                    .iter()
                    .all(|&q| members.iter().filter(|r| *r / threads == q).count() == local.len());
                if !regular {
                    return Err(super::MpiError::Layout(format!(
                        "group {} of rank {rank} has {} ranks in process {process} but a different number in another; put the axes inside a process innermost",
                        group.label(&mesh).unwrap_or("?"),
                        local.len()
                    )));
                }
                // Every process takes part in each split; a color per (group, j).
                let color = (members[0] * threads + j) as i32;
                let sub = world
                    .split_by_color_with_key(Color::with_value(color), process as i32)
                    .expect("every rank has a color");
                per_thread.push(
                    (spans.len() > 1).then(|| Arc::new(Mutex::new(Handle(ManuallyDrop::new(sub))))),
                );
            }
        }
        Ok(Self {
            universe: ManuallyDrop::new(universe),
            mesh,
            threads,
            process,
            exchange: Arc::new(LocalExchange::default()),
            comms,
            timeout,
        })
    }

    /// The communicator of local thread `t` (global rank `process·threads + t`).
    pub fn communicator(&self, t: usize) -> HybridCommunicator {
        HybridCommunicator {
            rank: self.process * self.threads + t,
            threads: self.threads,
            mesh: self.mesh.clone(),
            exchange: self.exchange.clone(),
            comms: self.comms[t].clone(),
            sequence: Mutex::new(HashMap::new()),
            stats: Mutex::new(CommStats::default()),
            timeout: self.timeout,
        }
    }

    /// Ranks per process.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Drop for HybridWorld {
    fn drop(&mut self) {
        // SAFETY: dropped once; every thread's calls have returned (the launch joined them).
        unsafe { ManuallyDrop::drop(&mut self.universe) };
    }
}

/// One thread-rank's endpoint of a [`HybridWorld`].
pub struct HybridCommunicator {
    rank: usize,
    threads: usize,
    mesh: DeviceMesh,
    exchange: Arc<LocalExchange>,
    comms: Vec<Option<Arc<Mutex<Handle>>>>,
    sequence: Mutex<HashMap<Group, u64>>,
    stats: Mutex<CommStats>,
    timeout: Duration,
}

impl std::fmt::Debug for HybridCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridCommunicator")
            .field("rank", &self.rank)
            .field("mesh", &self.mesh.to_string())
            .finish_non_exhaustive()
    }
}

/// A member's message: the header of its call and its buffer's bytes.
type Message = ([i64; HEADER], Vec<u8>);

/// A call as the header describes it: kind, op, dim, root.
type CallSpec = (CollectiveKind, Option<ReduceOp>, usize, usize);

impl HybridCommunicator {
    fn comm(&self, group: Group) -> Option<&Arc<Mutex<Handle>>> {
        let index = match group {
            Group::World => 0,
            Group::Axis(a) => a + 1,
        };
        self.comms[index].as_ref()
    }

    /// Every member's `[header | payload]`, in group order, after checking the headers agree.
    fn gather(
        &self,
        group: Group,
        spec: CallSpec,
        data: Option<&TensorData>,
    ) -> Result<Vec<Message>, CommError> {
        let (kind, op, dim, root) = spec;
        let label = group.label(&self.mesh)?.to_owned();
        let members = group.ranks(&self.mesh, self.rank)?;
        let seq = {
            let mut s = self.sequence.lock().unwrap();
            let n = s.entry(group).or_insert(0);
            *n += 1;
            *n
        };
        let h = header(
            seq as i64,
            super::header::Call {
                kind,
                op,
                dim,
                root,
            },
            data,
        )?;
        let mut mine: Vec<u8> = h.iter().flat_map(|w| w.to_le_bytes()).collect();
        if let Some(d) = data {
            mine.extend_from_slice(d.as_bytes());
        }
        let process = self.rank / self.threads;
        let local: Vec<usize> = members
            .iter()
            .copied()
            .filter(|r| r / self.threads == process)
            .collect();
        // Shared memory: the local members' messages, in group order.
        let local_parts = self.local_exchange(&local, seq, mine, kind, &label)?;
        // Across processes: this process's share against the others'.
        let all: Vec<Vec<u8>> = match self.comm(group) {
            None => local_parts,
            Some(handle) => {
                let handle = handle.lock().unwrap();
                let comm: &SimpleCommunicator = &handle.0;
                let mut share = Vec::new();
                let lens: Vec<u64> = local_parts.iter().map(|p| p.len() as u64).collect();
                for p in &local_parts {
                    share.extend_from_slice(p);
                }
                let processes = comm.size() as usize;
                // The lengths first, then the bytes.
                let mut all_lens = vec![0u64; processes * lens.len()];
                comm.all_gather_into(&lens[..], &mut all_lens[..]);
                let totals: Vec<usize> = all_lens
                    .chunks(lens.len())
                    .map(|c| c.iter().sum::<u64>() as usize)
                    .collect();
                let counts: Vec<i32> = totals.iter().map(|&t| t as i32).collect();
                let displs: Vec<i32> = totals
                    .iter()
                    .scan(0usize, |at, &t| {
                        let d = *at;
                        *at += t;
                        Some(d as i32)
                    })
                    .collect();
                let mut recv = vec![0u8; totals.iter().sum()];
                comm.all_gather_varcount_into(
                    &share[..],
                    &mut PartitionMut::new(&mut recv[..], counts, displs),
                );
                let mut parts = Vec::with_capacity(all_lens.len());
                let mut at = 0;
                for len in all_lens {
                    parts.push(recv[at..at + len as usize].to_vec());
                    at += len as usize;
                }
                // Processes in rank order and ranks in order inside each: the group order for
                // groups whose order follows the global rank (every mesh axis does).
                parts
            }
        };
        let out: Vec<Message> = all
            .into_iter()
            .map(|m| {
                let words: Vec<i64> = m[..HEADER * 8]
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                (
                    words.try_into().expect("HEADER words"),
                    m[HEADER * 8..].to_vec(),
                )
            })
            .collect();
        if out.iter().any(|(o, _)| o[..5] != h[..5]) {
            let headers: Vec<[i64; HEADER]> = out.iter().map(|(o, _)| *o).collect();
            return Err(mismatch(&self.mesh, self.rank, group, kind, &headers));
        }
        Ok(out)
    }

    fn local_exchange(
        &self,
        local: &[usize],
        seq: u64,
        mine: Vec<u8>,
        kind: CollectiveKind,
        label: &str,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        if local.len() == 1 {
            return Ok(vec![mine]);
        }
        let key = (local.to_vec(), seq);
        let ex = &self.exchange;
        let mut slots = ex.slots.lock().unwrap();
        slots
            .entry(key.clone())
            .or_default()
            .parts
            .insert(self.rank, mine);
        ex.ready.notify_all();
        let start = Instant::now();
        loop {
            let slot = slots.get(&key).expect("the slot lives until all took it");
            if slot.parts.len() == local.len() {
                break;
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let missing = local
                    .iter()
                    .copied()
                    .filter(|r| !slot.parts.contains_key(r))
                    .collect();
                return Err(CommError::Timeout {
                    op: kind,
                    group: label.to_owned(),
                    rank: self.rank,
                    waited,
                    missing,
                });
            }
            slots = ex
                .ready
                .wait_timeout(slots, self.timeout - waited)
                .unwrap()
                .0;
        }
        let slot = slots.get_mut(&key).expect("present");
        let parts: Vec<Vec<u8>> = local.iter().map(|r| slot.parts[r].clone()).collect();
        slot.taken += 1;
        if slot.taken == local.len() {
            slots.remove(&key);
        }
        Ok(parts)
    }

    fn record(&self, kind: CollectiveKind, group: Group, bytes: usize) {
        let label = group.label(&self.mesh).unwrap_or("?");
        self.stats.lock().unwrap().record(kind, label, bytes as u64);
    }

    fn check_layout(
        &self,
        group: Group,
        kind: CollectiveKind,
        parts: &[Message],
        except: Option<usize>,
    ) -> Result<(), CommError> {
        if layouts_agree(parts.iter().map(|(h, _)| h), except) {
            return Ok(());
        }
        let headers: Vec<[i64; HEADER]> = parts.iter().map(|(h, _)| *h).collect();
        Err(mismatch(&self.mesh, self.rank, group, kind, &headers))
    }
}

fn data_of(h: &[i64; HEADER], bytes: Vec<u8>) -> TensorData {
    let shape = header_shape(h).expect("a buffer");
    TensorData::from_bytes_vec(bytes, shape, DTYPES[h[5] as usize])
}

impl Communicator for HybridCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    fn all_reduce(
        &self,
        group: Group,
        data: TensorData,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        let kind = CollectiveKind::AllReduce;
        let parts = self.gather(group, (kind, Some(op), 0, 0), Some(&data))?;
        self.check_layout(group, kind, &parts, None)?;
        check_reducible(data.dtype)?;
        element_size(&data)?;
        let result = if parts.len() == 1 {
            data.clone()
        } else {
            let raw: Vec<&[u8]> = parts.iter().map(|(_, b)| b.as_slice()).collect();
            reduce(&raw, data.dtype, data.shape.clone(), op)
        };
        self.record(kind, group, data.bytes.len());
        Ok(result)
    }

    fn all_gather(
        &self,
        group: Group,
        data: TensorData,
        dim: usize,
    ) -> Result<TensorData, CommError> {
        let kind = CollectiveKind::AllGather;
        let parts = self.gather(group, (kind, None, dim, 0), Some(&data))?;
        self.check_layout(group, kind, &parts, Some(dim))?;
        check_dim(kind, &data, dim)?;
        let bytes = data.bytes.len();
        let datas: Vec<TensorData> = parts.into_iter().map(|(h, b)| data_of(&h, b)).collect();
        let result = concat(&datas.iter().collect::<Vec<_>>(), dim)?;
        self.record(kind, group, bytes);
        Ok(result)
    }

    fn reduce_scatter(
        &self,
        group: Group,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> Result<TensorData, CommError> {
        let kind = CollectiveKind::ReduceScatter;
        let parts = self.gather(group, (kind, Some(op), dim, 0), Some(&data))?;
        self.check_layout(group, kind, &parts, None)?;
        check_dim(kind, &data, dim)?;
        check_reducible(data.dtype)?;
        let n = parts.len();
        check_divisible(&data, dim, n)?;
        let index = group.index(&self.mesh, self.rank)?;
        let mut chunks = Vec::with_capacity(n);
        let mut shape = Shape::from(vec![0]);
        for (h, b) in parts {
            let (c, s) = chunk_bytes(&data_of(&h, b), dim, n, index)?;
            chunks.push(c);
            shape = s;
        }
        let raw: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
        let result = reduce(&raw, data.dtype, shape, op);
        self.record(kind, group, data.bytes.len());
        Ok(result)
    }

    fn broadcast(
        &self,
        group: Group,
        data: Option<TensorData>,
        root: usize,
    ) -> Result<TensorData, CommError> {
        let kind = CollectiveKind::Broadcast;
        let n = group.size(&self.mesh)?;
        check_rank(root, n, &format!("group {}", group.label(&self.mesh)?))?;
        let data = if group.index(&self.mesh, self.rank)? == root {
            data
        } else {
            None
        };
        let mut parts = self.gather(group, (kind, None, 0, root), data.as_ref())?;
        let (h, b) = parts.swap_remove(root);
        if header_shape(&h).is_none() {
            return Err(CommError::Mismatch {
                op: kind,
                group: group.label(&self.mesh)?.to_owned(),
                detail: format!("the root (group index {root}) passed no buffer"),
            });
        }
        let result = data_of(&h, b);
        self.record(kind, group, result.bytes.len());
        Ok(result)
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.gather(group, (CollectiveKind::Barrier, None, 0, 0), None)?;
        self.record(CollectiveKind::Barrier, group, 0);
        Ok(())
    }

    /// Point-to-point messages are not offered across a hybrid world yet (no model parallelism
    /// here uses them): a typed error, never a hang.
    fn send(&self, to: usize, _data: TensorData) -> Result<(), CommError> {
        check_rank(to, self.mesh.world_size(), "the world")?;
        Err(CommError::Unsupported(
            "send/recv on a hybrid (threads × processes) world; use MpiCommunicator (one rank per process)".into(),
        ))
    }

    fn recv(&self, from: usize) -> Result<TensorData, CommError> {
        check_rank(from, self.mesh.world_size(), "the world")?;
        Err(CommError::Unsupported(
            "send/recv on a hybrid (threads × processes) world; use MpiCommunicator (one rank per process)".into(),
        ))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap().clone()
    }

    fn reset_stats(&self) {
        *self.stats.lock().unwrap() = CommStats::default();
    }
}

/// Run `f` on this process's `threads` ranks of `mesh` (one thread each, with a
/// [`DistDevice`](crate::device::DistDevice) over `inner(local_thread)`), the processes of the
/// MPI job holding the rest: `mpirun -np P` with `mesh.world_size() = P · threads`. Returns this
/// process's results in rank order; a failing rank aborts the whole job.
pub fn launch_ranks_hybrid<B, T, F, I>(
    mesh: &DeviceMesh,
    threads: usize,
    inner: I,
    options: &crate::launch::LaunchOptions,
    f: F,
) -> Result<Vec<T>, super::MpiError>
where
    B: burn_backend::Backend,
    T: Send,
    F: Fn(crate::device::DistDevice<B>) -> T + Sync,
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
                        let device = crate::device::DistDevice::<B>::new(inner(t), comm);
                        crate::device::set_current_device(&device);
                        let rank = device.rank();
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(device)))
                            .map_err(|payload| {
                                let message = match crate::error::take_raised() {
                                    Some(e) => e.to_string(),
                                    None => crate::launch::panic_message(payload.as_ref()),
                                };
                                // The peers may wait on this rank: stop the job now.
                                eprintln!(
                                    "wildfire: rank {rank} failed: {message}; aborting the MPI job"
                                );
                                SimpleCommunicator::world().abort(2)
                            })
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
