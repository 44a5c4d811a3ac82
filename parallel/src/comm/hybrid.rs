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

use super::buffer::{all_to_all_rows, chunk_bytes, concat, reduce};
use super::call::{Operand, Round};
use super::header::{self, HEADER, Header, Sequence, from_bytes, to_bytes};
use super::mpi_comm::Handle;
use super::{Call, CollectiveKind, Communicator, Error, Group, Member, Splits};
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
    slots: Mutex<HashMap<(Vec<usize>, i64), Slot>>,
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
    pub fn init(mesh: DeviceMesh, threads: usize, timeout: Duration) -> Result<Self, super::Error> {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or(super::Error::MpiAlreadyInitialised)?;
        if level != mpi::Threading::Multiple {
            return Err(super::Error::MpiThreading(format!("{level:?}")));
        }
        let world = universe.world();
        let (process, processes) = (world.rank() as usize, world.size() as usize);
        if processes * threads != mesh.world_size() {
            return Err(super::Error::MpiWorldSize {
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
                    return Err(super::Error::HybridLayout(format!(
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
            member: Member::new(self.process * self.threads + t, self.mesh.clone()),
            threads: self.threads,
            exchange: self.exchange.clone(),
            comms: self.comms[t].clone(),
            sequence: Sequence::default(),
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
    member: Member,
    threads: usize,
    exchange: Arc<LocalExchange>,
    comms: Vec<Option<Arc<Mutex<Handle>>>>,
    sequence: Sequence,
    timeout: Duration,
}

impl std::fmt::Debug for HybridCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.member.debug_as("HybridCommunicator", f)
    }
}

impl HybridCommunicator {
    fn comm(&self, group: Group) -> Option<&Arc<Mutex<Handle>>> {
        let index = match group {
            Group::World => 0,
            Group::Axis(a) => a + 1,
        };
        self.comms[index].as_ref()
    }

    /// Every member's call and buffer bytes, in group order, after checking the calls agree.
    fn gather(
        &self,
        call: &Call,
        data: Option<&TensorData>,
    ) -> Result<(Round<'_>, Vec<Vec<u8>>), Error> {
        let (mesh, rank) = (self.mesh(), self.rank());
        let group = call.group();
        let label = group.label(mesh)?.to_owned();
        let members = group.ranks(mesh, rank)?;
        let (seq, header) = self.sequence.header(call)?;
        let mut mine = to_bytes(&header);
        // An all-to-all's splits travel between the header and the buffer.
        if let Some(splits) = call.splits() {
            mine.extend_from_slice(&to_bytes(&splits.words(members.len())));
        }
        if let Some(d) = data {
            mine.extend_from_slice(d.as_bytes());
        }
        let process = rank / self.threads;
        let local: Vec<usize> = members
            .iter()
            .copied()
            .filter(|r| r / self.threads == process)
            .collect();
        // Shared memory: the local members' messages, in group order.
        let local_parts = self.local_exchange(&local, seq, mine, call.kind(), &label)?;
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
        let (headers, payloads): (Vec<Header>, Vec<Vec<u8>>) = all
            .into_iter()
            .map(|m| (from_bytes::<HEADER>(&m), m[HEADER * 8..].to_vec()))
            .unzip();
        let round = header::round(mesh, rank, call, &headers)?;
        Ok((round, payloads))
    }

    fn local_exchange(
        &self,
        local: &[usize],
        seq: i64,
        mine: Vec<u8>,
        kind: CollectiveKind,
        label: &str,
    ) -> Result<Vec<Vec<u8>>, Error> {
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
            .insert(self.rank(), mine);
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
                return Err(Error::Timeout {
                    op: kind,
                    group: label.to_owned(),
                    rank: self.rank(),
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
}

/// The buffer `bytes` of a member whose call passed `buffer`.
fn data_of(buffer: &Operand, bytes: Vec<u8>) -> TensorData {
    TensorData::from_bytes_vec(bytes, buffer.shape().to_vec(), buffer.dtype())
}

impl Communicator for HybridCommunicator {
    fn member(&self) -> &Member {
        &self.member
    }

    /// Every member's buffer on every member (see the module), then this member's result,
    /// computed from them in group order.
    fn run(&self, call: &Call, data: Option<TensorData>) -> Result<Option<TensorData>, Error> {
        call.check_root(self.mesh())?;
        let (round, mut payloads) = self.gather(call, data.as_ref())?;
        if call.kind() == CollectiveKind::AllToAll {
            // Every member holds every buffer: this member's rows from each.
            let n = payloads.len();
            let splits: Vec<Splits> = payloads
                .iter()
                .map(|p| Splits::from_words(&header::words(&p[..16 * n]), n))
                .collect();
            let round = round.with_splits(splits.clone());
            round.check_buffers()?;
            let buffers: Vec<TensorData> = (round.calls().iter().zip(payloads))
                .map(|(c, p)| data_of(c.buffer().expect("checked"), p[16 * n..].to_vec()))
                .collect();
            let index = call.group().index(self.mesh(), self.rank())?;
            let pieces: Vec<(usize, usize)> = splits.iter().map(|s| s.rows_to(index)).collect();
            return all_to_all_rows(&buffers.iter().collect::<Vec<_>>(), &pieces).map(Some);
        }
        let buffers = |payloads: Vec<Vec<u8>>| -> Vec<TensorData> {
            (round.calls().iter().zip(payloads))
                .map(|(c, bytes)| data_of(c.buffer().expect("checked"), bytes))
                .collect()
        };
        Ok(match call.kind() {
            CollectiveKind::Barrier => None,
            CollectiveKind::Broadcast => {
                let source = round.root_buffer()?;
                Some(data_of(source, payloads.swap_remove(call.root())))
            }
            kind => {
                round.check_buffers()?;
                let data = data.expect("this call carries a buffer");
                let n = payloads.len();
                Some(match kind {
                    CollectiveKind::AllReduce if n == 1 => data,
                    CollectiveKind::AllReduce => {
                        let raw: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
                        reduce(&raw, data.dtype, data.shape.clone(), call.reduce_op())
                    }
                    CollectiveKind::AllGather => {
                        concat(&buffers(payloads).iter().collect::<Vec<_>>(), call.dim())?
                    }
                    _ => {
                        let index = call.group().index(self.mesh(), self.rank())?;
                        let mut chunks = Vec::with_capacity(n);
                        let mut shape = Shape::from(vec![0]);
                        for part in buffers(payloads) {
                            let (c, s) = chunk_bytes(&part, call.dim(), n, index)?;
                            chunks.push(c.into_owned());
                            shape = s;
                        }
                        let raw: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
                        reduce(&raw, data.dtype, shape, call.reduce_op())
                    }
                })
            }
        })
    }
}
