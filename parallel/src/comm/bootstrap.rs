//! Bootstrapping a collective library: hand each group of the mesh one id made by its first
//! member (NCCL's `ncclUniqueId`), over a channel that already exists.
//!
//! Two channels: any host [`Communicator`] (MPI under `mpirun`/`srun`, or ranks as threads),
//! and, without MPI, a TCP rendezvous at `MASTER_ADDR:MASTER_PORT` as torchrun sets it
//! ([`TcpRendezvous`]): rank 0 listens, the others connect, and one all-gather of small blobs
//! hands every rank every id.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use super::{Communicator, Error, Group};
use crate::mesh::DeviceMesh;

/// Exchanges one byte blob per rank among all ranks: every rank gets every rank's blob, in rank
/// order.
pub trait Bootstrap {
    /// This rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Every rank's `mine`, in rank order.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error>;
}

/// Any host communicator bootstraps over its world group.
impl<C: Communicator + ?Sized> Bootstrap for C {
    fn rank(&self) -> usize {
        Communicator::rank(self)
    }

    fn world_size(&self) -> usize {
        self.mesh().world_size()
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        // Blobs may differ in length: gather the lengths, then the padded blobs.
        let len = TensorData::new(vec![mine.len() as i64], [1]);
        let lens = self.all_gather(Group::World, len, 0)?;
        let lens: Vec<usize> = lens
            .to_vec::<i64>()
            .map_err(|e| Error::UnsupportedDType(format!("{e:?}")))?
            .into_iter()
            .map(|l| l as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = mine.to_vec();
        padded.resize(max, 0);
        let all = self.all_gather(Group::World, TensorData::new(padded, [1, max]), 0)?;
        let bytes = all.as_bytes();
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &l)| bytes[r * max..r * max + l].to_vec())
            .collect())
    }
}

/// A one-shot rendezvous over TCP: rank 0 listens at the address, every other rank connects
/// (retrying until the timeout while rank 0 starts), and each call of
/// [`Bootstrap::all_gather_bytes`] is one round. No MPI needed: the `MASTER_ADDR:MASTER_PORT`
/// launch of torchrun and of most schedulers' examples.
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

const MAGIC: &[u8; 8] = b"WFRDZv1\n";
/// How long a joining rank waits for rank 0's answer past the common deadline.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

impl TcpRendezvous {
    /// A rendezvous at `addr` (`host:port`) for `rank` of `world_size`, giving up after
    /// `timeout`.
    pub fn new(
        addr: impl Into<String>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let addr = addr.into();
        if world_size == 0 || rank >= world_size {
            return Err(Error::RendezvousProtocol {
                addr,
                reason: format!("rank {rank} is not in a world of {world_size}"),
            });
        }
        Ok(Self {
            addr,
            rank,
            world_size,
            timeout,
        })
    }

    /// The rendezvous torchrun describes: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`.
    pub fn from_env(timeout: Duration) -> Result<Self, Error> {
        Self::from_vars(|var| std::env::var(var).ok(), timeout)
    }

    /// [`TcpRendezvous::from_env`] over any variable lookup.
    pub fn from_vars(
        var: impl Fn(&str) -> Option<String>,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let get = |name: &'static str| {
            var(name).ok_or(Error::RendezvousEnv {
                var: name,
                reason: "not set".into(),
            })
        };
        let number = |name: &'static str| -> Result<usize, Error> {
            get(name)?.trim().parse().map_err(|e| Error::RendezvousEnv {
                var: name,
                reason: format!("not a number ({e})"),
            })
        };
        let host = get("MASTER_ADDR")?;
        let port = number("MASTER_PORT")?;
        if port == 0 || port > u16::MAX as usize {
            return Err(Error::RendezvousEnv {
                var: "MASTER_PORT",
                reason: format!("{port} is not a port"),
            });
        }
        let (rank, world) = (number("RANK")?, number("WORLD_SIZE")?);
        if rank >= world {
            return Err(Error::RendezvousEnv {
                var: "RANK",
                reason: format!("{rank} is not below WORLD_SIZE {world}"),
            });
        }
        Self::new(format!("{host}:{port}"), rank, world, timeout)
    }

    /// The address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn io(&self, source: std::io::Error) -> Error {
        Error::RendezvousIo {
            addr: self.addr.clone(),
            rank: self.rank,
            kind: source.kind(),
            message: source.to_string(),
        }
    }

    fn protocol(&self, reason: String) -> Error {
        Error::RendezvousProtocol {
            addr: self.addr.clone(),
            reason,
        }
    }

    fn timeout_error(&self, start: Instant, missing: Vec<usize>) -> Error {
        Error::RendezvousTimeout {
            addr: self.addr.clone(),
            rank: self.rank,
            waited: start.elapsed(),
            missing,
        }
    }

    fn resolve(&self) -> Result<SocketAddr, Error> {
        self.addr
            .to_socket_addrs()
            .map_err(|e| self.io(e))?
            .next()
            .ok_or_else(|| self.protocol("the address resolves to nothing".into()))
    }

    fn remaining(&self, start: Instant) -> Option<Duration> {
        self.timeout
            .checked_sub(start.elapsed())
            .filter(|d| !d.is_zero())
    }

    fn serve(&self, mine: &[u8], start: Instant) -> Result<Vec<Vec<u8>>, Error> {
        let listener = TcpListener::bind(self.resolve()?).map_err(|e| self.io(e))?;
        listener.set_nonblocking(true).map_err(|e| self.io(e))?;
        let mut peers: Vec<(usize, TcpStream)> = Vec::new();
        let result = self.collect(&listener, mine, start, &mut peers);
        // Tell the peers that came why there is no answer, so they fail with rank 0's reason
        // rather than a closed socket.
        if let Err(e) = &result {
            let (tag, missing) = match e {
                Error::RendezvousTimeout { missing, .. } => (1u64, missing.clone()),
                _ => (2u64, Vec::new()),
            };
            let mut frame = Vec::new();
            frame.extend_from_slice(MAGIC);
            frame.extend_from_slice(&u64::MAX.to_le_bytes());
            frame.extend_from_slice(&tag.to_le_bytes());
            frame.extend_from_slice(&(missing.len() as u64).to_le_bytes());
            for r in missing {
                frame.extend_from_slice(&(r as u64).to_le_bytes());
            }
            let text = e.to_string();
            frame.extend_from_slice(&(text.len() as u64).to_le_bytes());
            frame.extend_from_slice(text.as_bytes());
            for (_, stream) in &mut peers {
                let _ = stream.write_all(&frame);
            }
        }
        result
    }

    fn collect(
        &self,
        listener: &TcpListener,
        mine: &[u8],
        start: Instant,
        peers: &mut Vec<(usize, TcpStream)>,
    ) -> Result<Vec<Vec<u8>>, Error> {
        let mut blobs: Vec<Option<Vec<u8>>> = vec![None; self.world_size];
        blobs[0] = Some(mine.to_vec());
        while blobs.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).map_err(|e| self.io(e))?;
                    let left = self
                        .remaining(start)
                        .ok_or_else(|| self.timeout_error(start, missing(&blobs)))?;
                    stream
                        .set_read_timeout(Some(left))
                        .map_err(|e| self.io(e))?;
                    let (rank, world, blob) = read_hello(&mut stream).map_err(|e| self.io(e))?;
                    // Kept before checking, so a refused peer hears why.
                    peers.push((rank, stream));
                    if world != self.world_size {
                        return Err(self.protocol(format!(
                            "rank {rank} says the world has {world} ranks, rank 0 says {}",
                            self.world_size
                        )));
                    }
                    if rank == 0 || rank >= world || blobs[rank].is_some() {
                        return Err(self.protocol(format!(
                            "a peer claims rank {rank}, which is taken or out of range"
                        )));
                    }
                    blobs[rank] = Some(blob);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if self.remaining(start).is_none() {
                        return Err(self.timeout_error(start, missing(&blobs)));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(self.io(e)),
            }
        }
        let blobs: Vec<Vec<u8>> = blobs.into_iter().map(Option::unwrap_or_default).collect();
        let mut reply = Vec::new();
        reply.extend_from_slice(MAGIC);
        reply.extend_from_slice(&(blobs.len() as u64).to_le_bytes());
        for blob in &blobs {
            reply.extend_from_slice(&(blob.len() as u64).to_le_bytes());
            reply.extend_from_slice(blob);
        }
        for (_, stream) in peers.iter_mut() {
            stream.write_all(&reply).map_err(|e| self.io(e))?;
        }
        Ok(blobs)
    }

    fn join(&self, mine: &[u8], start: Instant) -> Result<Vec<Vec<u8>>, Error> {
        let addr = self.resolve()?;
        let mut stream = loop {
            let Some(left) = self.remaining(start) else {
                return Err(self.timeout_error(start, vec![0]));
            };
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
                Ok(stream) => break stream,
                // Rank 0 is not listening yet.
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut hello = Vec::new();
        hello.extend_from_slice(MAGIC);
        for word in [self.rank, self.world_size, mine.len()] {
            hello.extend_from_slice(&(word as u64).to_le_bytes());
        }
        hello.extend_from_slice(mine);
        stream.write_all(&hello).map_err(|e| self.io(e))?;
        // Rank 0 decides: it answers with every blob, or, at its own deadline, with the ranks
        // that never came. Wait a grace period past that deadline so its verdict (which names
        // them) arrives before this rank's own timeout.
        let left = self.remaining(start).unwrap_or_default() + ANSWER_GRACE;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| self.io(e))?;
        // Ok(Ok(blobs)), or Ok(Err(rank 0's failure)).
        let read = |stream: &mut TcpStream| -> std::io::Result<Result<Vec<Vec<u8>>, Error>> {
            expect_magic(stream)?;
            let n = read_u64(stream)?;
            if n == u64::MAX {
                let tag = read_u64(stream)?;
                let count = read_u64(stream)?.min(1 << 16);
                let missing = (0..count)
                    .map(|_| read_u64(stream).map(|r| r as usize))
                    .collect::<std::io::Result<Vec<_>>>()?;
                let len = read_u64(stream)? as usize;
                let text = String::from_utf8_lossy(&read_exact_vec(stream, len)?).into_owned();
                return Ok(Err(if tag == 1 {
                    self.timeout_error(start, missing)
                } else {
                    self.protocol(format!("rank 0 gave up: {text}"))
                }));
            }
            (0..n)
                .map(|_| {
                    let len = read_u64(stream)? as usize;
                    read_exact_vec(stream, len)
                })
                .collect::<std::io::Result<Vec<_>>>()
                .map(Ok)
        };
        match read(&mut stream) {
            Ok(Err(e)) => Err(e),
            Ok(Ok(blobs)) if blobs.len() == self.world_size => Ok(blobs),
            Ok(Ok(blobs)) => Err(self.protocol(format!(
                "rank 0 answered with {} blobs for a world of {}",
                blobs.len(),
                self.world_size
            ))),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // Rank 0 took this rank's hello but never answered, even past its deadline.
                Err(self.timeout_error(start, vec![0]))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(self.protocol("rank 0 closed the connection without an answer".into()))
            }
            Err(e) => Err(self.io(e)),
        }
    }
}

impl Bootstrap for TcpRendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let start = Instant::now();
        if self.world_size == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        if self.rank == 0 {
            self.serve(mine, start)
        } else {
            self.join(mine, start)
        }
    }
}

fn missing(blobs: &[Option<Vec<u8>>]) -> Vec<usize> {
    (0..blobs.len()).filter(|&r| blobs[r].is_none()).collect()
}

fn read_u64(stream: &mut impl Read) -> std::io::Result<u64> {
    let mut word = [0u8; 8];
    stream.read_exact(&mut word)?;
    Ok(u64::from_le_bytes(word))
}

fn read_exact_vec(stream: &mut impl Read, len: usize) -> std::io::Result<Vec<u8>> {
    if len > 1 << 20 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a rendezvous blob of {len} bytes (at most 1 MiB)"),
        ));
    }
    let mut blob = vec![0u8; len];
    stream.read_exact(&mut blob)?;
    Ok(blob)
}

fn expect_magic(stream: &mut impl Read) -> std::io::Result<()> {
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a Wildfire rendezvous peer",
        ));
    }
    Ok(())
}

fn read_hello(stream: &mut impl Read) -> std::io::Result<(usize, usize, Vec<u8>)> {
    expect_magic(stream)?;
    let rank = read_u64(stream)? as usize;
    let world = read_u64(stream)? as usize;
    let len = read_u64(stream)? as usize;
    Ok((rank, world, read_exact_vec(stream, len)?))
}

/// The groups a rank belongs to, in a fixed order every rank agrees on: each mesh axis's group,
/// then the world.
pub fn bootstrap_groups(mesh: &DeviceMesh) -> Vec<Group> {
    (0..mesh.axes().len())
        .map(Group::Axis)
        .chain([Group::World])
        .collect()
}

/// Refused unless `boot` launched as many ranks as `mesh` has.
fn check_world(mesh: &DeviceMesh, boot: &(impl Bootstrap + ?Sized)) -> Result<(), Error> {
    if boot.world_size() == mesh.world_size() {
        return Ok(());
    }
    Err(Error::RendezvousProtocol {
        addr: String::new(),
        reason: format!(
            "the launch has {} ranks, the mesh {mesh} has {}",
            boot.world_size(),
            mesh.world_size()
        ),
    })
}

/// Appends `id` to a blob of ids as `[len u32][bytes]`.
fn push_id(blob: &mut Vec<u8>, id: &[u8]) {
    blob.extend_from_slice(&(id.len() as u32).to_le_bytes());
    blob.extend_from_slice(id);
}

/// The `index`-th id of a blob [`push_id`] wrote.
fn nth_id(blob: &[u8], index: usize) -> Option<&[u8]> {
    let mut at = 0;
    for i in 0..=index {
        let len = u32::from_le_bytes(blob.get(at..at + 4)?.try_into().ok()?) as usize;
        let id = blob.get(at + 4..at + 4 + len)?;
        if i == index {
            return Some(id);
        }
        at += 4 + len;
    }
    None
}

/// One id per group of this rank ([`bootstrap_groups`] order), each made by the group's first
/// member with `new_id` and shared with the group's other members over `boot`: one all-gather
/// of `(axes + 1) × id` bytes per rank.
pub fn exchange_group_ids(
    mesh: &DeviceMesh,
    boot: &(impl Bootstrap + ?Sized),
    mut new_id: impl FnMut() -> Result<Vec<u8>, Error>,
) -> Result<Vec<Vec<u8>>, Error> {
    let rank = boot.rank();
    check_world(mesh, boot)?;
    let groups = bootstrap_groups(mesh);
    let leader = |rank: usize, group: Group| match group {
        Group::World => 0,
        Group::Axis(a) => mesh.group_ranks(rank, a)[0],
    };
    // One id per group: this rank's, or an empty one where another member makes it.
    let mut mine = Vec::new();
    for &group in &groups {
        let id = if leader(rank, group) == rank {
            new_id()?
        } else {
            Vec::new()
        };
        push_id(&mut mine, &id);
    }
    let all = boot.all_gather_bytes(&mine)?;
    groups
        .iter()
        .enumerate()
        .map(|(i, &group)| {
            let from = leader(rank, group);
            let id = nth_id(&all[from], i).filter(|id| !id.is_empty());
            id.map(<[u8]>::to_vec)
                .ok_or_else(|| Error::RendezvousProtocol {
                    addr: String::new(),
                    reason: format!("rank {from} sent no id for its group {group:?}"),
                })
        })
        .collect()
}

/// A point-to-point channel of a rank: to or from `peer` (a global rank), between
/// neighbouring pipeline stages or context-parallel ranks. NCCL gives each its own two-rank communicator and stream, so
/// a send waiting for its receiver never holds up another channel (a rank's sends and
/// receives on one NCCL stream could wait on each other across two ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Channel {
    /// The rank at the other end.
    pub peer: usize,
    /// Whether this rank sends on it (else it receives).
    pub sends: bool,
}

/// The channels of `rank` on `mesh`'s ring axes — the pipeline axis
/// ([`PIPELINE_AXIS`](crate::mesh::PIPELINE_AXIS)) and the context axis
/// ([`CONTEXT_AXIS`](crate::mesh::CONTEXT_AXIS), ring attention): sends to the next and to the
/// previous member on each, then receives from them, on a ring (interleaved schedules send
/// from the last pipeline rank to the first). Deduplicated (two members are each other's next
/// and previous); none without such an axis of 2 or more.
pub fn p2p_channels(mesh: &DeviceMesh, rank: usize) -> Vec<Channel> {
    let mut neighbours = Vec::new();
    let rings = mesh
        .axes()
        .iter()
        .enumerate()
        .filter(|(_, a)| a.is_pipeline() || a.name == crate::mesh::CONTEXT_AXIS);
    for (axis, _) in rings {
        let members = mesh.group_ranks(rank, axis);
        let p = members.len();
        if p >= 2 {
            let a = mesh.group_index(rank, axis);
            neighbours.extend([members[(a + 1) % p], members[(a + p - 1) % p]]);
        }
    }
    let mut channels = Vec::new();
    for sends in [true, false] {
        for &peer in &neighbours {
            let channel = Channel { peer, sends };
            if !channels.contains(&channel) {
                channels.push(channel);
            }
        }
    }
    channels
}

/// One id per channel of this rank ([`p2p_channels`] order), each made by the channel's sender
/// with `new_id` and handed to its receiver over `boot`: one all-gather. Every rank of the
/// mesh calls it (none when the mesh has no pipeline axis of 2 or more).
pub fn exchange_channel_ids(
    mesh: &DeviceMesh,
    boot: &(impl Bootstrap + ?Sized),
    mut new_id: impl FnMut() -> Result<Vec<u8>, Error>,
) -> Result<Vec<(Channel, Vec<u8>)>, Error> {
    let rank = boot.rank();
    check_world(mesh, boot)?;
    let channels = p2p_channels(mesh, rank);
    if p2p_channels(mesh, 0).is_empty() {
        return Ok(Vec::new());
    }
    // One id per send channel, in order.
    let mut mine = Vec::new();
    let mut ids = Vec::new();
    for channel in channels.iter().filter(|c| c.sends) {
        let id = new_id()?;
        push_id(&mut mine, &id);
        ids.push((*channel, id));
    }
    let all = boot.all_gather_bytes(&mine)?;
    for channel in channels.iter().filter(|c| !c.sends) {
        let sender = channel.peer;
        let index = p2p_channels(mesh, sender)
            .iter()
            .filter(|c| c.sends)
            .position(|c| c.peer == rank);
        let id = index.and_then(|i| nth_id(&all[sender], i));
        let id = id.ok_or_else(|| Error::RendezvousProtocol {
            addr: String::new(),
            reason: format!("rank {sender} sent no id for its channel to rank {rank}"),
        })?;
        ids.push((*channel, id.to_vec()));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessWorld;
    use std::sync::Arc;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// `f` of each input, each on a thread of its own; the results in input order.
    fn on_threads<I: Send, T: Send>(
        inputs: impl IntoIterator<Item = I>,
        f: impl Fn(I) -> T + Sync,
    ) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = (inputs.into_iter())
                .map(|input| s.spawn(move || f(input)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn fake_id(rank: usize, counter: &mut u8) -> Vec<u8> {
        *counter += 1;
        let mut id = vec![rank as u8; 128];
        id[0] = *counter;
        id
    }

    /// Every member of each group holds the id its first member made, and different groups hold
    /// different ids: over TCP and over a host communicator alike.
    fn check_ids(mesh: &DeviceMesh, ids: &[Vec<Vec<u8>>]) {
        for (rank, mine) in ids.iter().enumerate() {
            assert_eq!(mine.len(), mesh.axes().len() + 1);
            for a in 0..mesh.axes().len() {
                let first = mesh.group_ranks(rank, a)[0];
                assert_eq!(mine[a][1], first as u8, "rank {rank} axis {a}");
                for &other in &mesh.group_ranks(rank, a) {
                    assert_eq!(ids[other][a], mine[a]);
                }
            }
            assert_eq!(mine[mesh.axes().len()], ids[0][mesh.axes().len()]);
        }
        let mut distinct: Vec<&Vec<u8>> = ids.iter().flatten().collect();
        distinct.sort();
        distinct.dedup();
        // Groups: per axis, world/size groups; plus the world.
        let groups: usize = mesh
            .axes()
            .iter()
            .map(|a| mesh.world_size() / a.size)
            .sum::<usize>()
            + 1;
        assert_eq!(distinct.len(), groups);
    }

    #[test]
    fn tcp_rendezvous_hands_each_group_its_leaders_id() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let ids = on_threads(0..4, |rank| {
            let boot = TcpRendezvous::new(addr.clone(), rank, 4, Duration::from_secs(20)).unwrap();
            let mut counter = 0;
            exchange_group_ids(&mesh, &boot, || Ok(fake_id(rank, &mut counter))).unwrap()
        });
        check_ids(&mesh, &ids);
    }

    #[test]
    fn host_communicator_bootstraps_the_same_way() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        let world = InProcessWorld::new(mesh.clone(), Duration::from_secs(20));
        let ids = on_threads(0..4, |rank| {
            let comm: Arc<dyn Communicator> = Arc::new(world.communicator(rank));
            let mut counter = 0;
            exchange_group_ids(&mesh, &*comm, || Ok(fake_id(rank, &mut counter))).unwrap()
        });
        check_ids(&mesh, &ids);
    }

    /// Pipeline and context-parallel ranks send to their ring neighbours and receive from them;
    /// the receiver of each channel holds the id its sender made; no channels without such an
    /// axis.
    #[test]
    fn pipeline_channels_pair_each_sender_with_its_receiver() {
        let ch = |peer, sends| Channel { peer, sends };
        let two = DeviceMesh::new([("dp", 2), ("pp", 2)]).unwrap();
        // Rank 1 is dp 0, pp 1: its one neighbour is rank 0.
        assert_eq!(p2p_channels(&two, 1), [ch(0, true), ch(0, false)]);
        let four = DeviceMesh::new([("pp", 4)]).unwrap();
        assert_eq!(
            p2p_channels(&four, 0),
            [ch(1, true), ch(3, true), ch(1, false), ch(3, false)]
        );
        assert!(p2p_channels(&DeviceMesh::new([("dp", 4)]).unwrap(), 0).is_empty());
        assert!(p2p_channels(&DeviceMesh::new([("pp", 1), ("dp", 2)]).unwrap(), 1).is_empty());
        // Ring attention's neighbours on the context axis, after the pipeline's: rank 0 of
        // pp 2 × cp 4 (its pipeline peer is rank 4, its context ring 1 and 3).
        let both = DeviceMesh::new([("pp", 2), ("cp", 4), ("tp", 1)]).unwrap();
        assert_eq!(
            p2p_channels(&both, 0),
            [
                ch(4, true),
                ch(1, true),
                ch(3, true),
                ch(4, false),
                ch(1, false),
                ch(3, false)
            ]
        );
        for mesh in [two, four, both] {
            let n = mesh.world_size();
            let world = InProcessWorld::new(mesh.clone(), Duration::from_secs(20));
            let ids = on_threads(0..n, |rank| {
                let comm: Arc<dyn Communicator> = Arc::new(world.communicator(rank));
                let mut counter = 0;
                exchange_channel_ids(&mesh, &*comm, || Ok(fake_id(rank, &mut counter))).unwrap()
            });
            for (rank, mine) in ids.iter().enumerate() {
                assert_eq!(
                    mine.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
                    p2p_channels(&mesh, rank)
                );
                for (channel, id) in mine {
                    // The sender's id (its rank in every byte but the first)…
                    let sender = if channel.sends { rank } else { channel.peer };
                    assert_eq!(id[1], sender as u8);
                    // …and the same at the other end.
                    let theirs = ids[channel.peer]
                        .iter()
                        .find(|(c, _)| c.peer == rank && c.sends != channel.sends)
                        .unwrap();
                    assert_eq!(&theirs.1, id);
                }
            }
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number() {
        let addr = format!("127.0.0.1:{}", free_port());
        // World of 3, rank 2 never starts.
        let results = on_threads(0..2, |rank| {
            TcpRendezvous::new(addr.clone(), rank, 3, Duration::from_millis(1500))
                .unwrap()
                .all_gather_bytes(&[rank as u8])
        });
        match &results[0] {
            Err(Error::RendezvousTimeout { missing, rank, .. }) => {
                assert_eq!((missing.as_slice(), *rank), (&[2][..], 0));
            }
            other => panic!("rank 0: {other:?}"),
        }
        // Rank 1 learns from rank 0 which rank is missing.
        match &results[1] {
            Err(Error::RendezvousTimeout { missing, rank, .. }) => {
                assert_eq!((missing.as_slice(), *rank), (&[2][..], 1));
            }
            other => panic!("rank 1: {other:?}"),
        }
    }

    #[test]
    fn disagreeing_world_sizes_and_bad_variables_are_typed_errors() {
        let addr = format!("127.0.0.1:{}", free_port());
        let results = on_threads([(0, 2), (1, 3)], |(rank, world)| {
            TcpRendezvous::new(addr.clone(), rank, world, Duration::from_secs(2))
                .unwrap()
                .all_gather_bytes(b"x")
        });
        let Err(Error::RendezvousProtocol { reason, .. }) = &results[0] else {
            panic!("{:?}", results[0]);
        };
        assert!(reason.contains("3 ranks"), "{reason}");
        let Err(Error::RendezvousProtocol { reason, .. }) = &results[1] else {
            panic!("{:?}", results[1]);
        };
        assert!(reason.contains("rank 0 gave up"), "{reason}");

        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let t = Duration::from_secs(1);
        let err = TcpRendezvous::from_vars(vars(&[("MASTER_ADDR", "h")]), t).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RendezvousEnv {
                    var: "MASTER_PORT",
                    ..
                }
            ),
            "{err}"
        );
        let bad = &[
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
        ];
        let err = TcpRendezvous::from_vars(vars(bad), t).unwrap_err();
        assert!(
            matches!(err, Error::RendezvousEnv { var: "RANK", .. }),
            "{err}"
        );
        let good = &[
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
        ];
        let ok = TcpRendezvous::from_vars(vars(good), t).unwrap();
        assert_eq!(
            (ok.addr(), Bootstrap::rank(&ok), ok.world_size),
            ("node0:29500", 1, 4)
        );
    }
}
