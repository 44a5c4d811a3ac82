//! Bootstrapping a collective library: hand each group of the mesh one id made by its first
//! member (NCCL's `ncclUniqueId`), over a channel that already exists.
//!
//! Two channels: any host [`Communicator`] (MPI under `mpirun`/`srun`, or ranks as threads),
//! and, without MPI, a TCP rendezvous at `MASTER_ADDR:MASTER_PORT` as torchrun sets it
//! ([`TcpRendezvous`]): rank 0 listens, the others connect, and one all-gather of small blobs
//! hands every rank every id.
//!
//! **Who may join.** The rendezvous is authenticated by a per-job secret, `WILDFIRE_RDZV_TOKEN`
//! (set for every process by the user or the launcher), with an HMAC-SHA-256 challenge in both
//! directions: rank 0 greets each connection with a fresh 32-byte nonce, the peer answers with its
//! own nonce, its hello (rank, world, blob) and the MAC of both nonces and the hello under the
//! token; rank 0 answers the peers it accepted with every blob and the MAC of the peer's nonce and
//! the answer. The token never crosses the wire, a recorded exchange cannot be replayed (the
//! nonces are new each time), and a peer cannot be answered by anyone but a holder of the token.
//! A connection that fails the challenge, speaks something else, sends a length over 1 MiB or
//! says nothing within [`HANDSHAKE`] is refused and dropped, and rank 0 keeps waiting for the
//! ranks it lacks; an authenticated peer that disagrees on the world is the job's error. Without
//! a token the key is empty and only a loopback `MASTER_ADDR` is accepted (with a warning): on a
//! network the token is required.

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
#[derive(Clone)]
pub struct TcpRendezvous {
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// The per-job secret (`WILDFIRE_RDZV_TOKEN`); `None`: the empty key, loopback only.
    token: Option<Vec<u8>>,
}

impl std::fmt::Debug for TcpRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRendezvous")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

const MAGIC: &[u8; 8] = b"WFRDZv2\n";
/// The variable that holds the rendezvous's per-job secret.
pub const TOKEN_VAR: &str = "WILDFIRE_RDZV_TOKEN";
/// How long rank 0 gives a connection to complete the challenge (a peer answers at once).
pub const HANDSHAKE: Duration = Duration::from_secs(5);
const NONCE: usize = 32;
const MAC: usize = 32;
/// A failure frame's tags: rank 0 timed out, gave up, or refused this peer.
const TIMED_OUT: u64 = 1;
const GAVE_UP: u64 = 2;
const REFUSED: u64 = 3;
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
            token: None,
        })
    }

    /// This rendezvous authenticated by `token`, the secret every process of the job shares (an
    /// empty one counts as none).
    pub fn with_token(mut self, token: Option<impl AsRef<[u8]>>) -> Self {
        self.token = token.map(|t| t.as_ref().to_vec()).filter(|t| !t.is_empty());
        self
    }

    /// Refused without a token unless the address is a loopback one.
    fn check_token(&self) -> Result<(), Error> {
        if self.token.is_some() || is_loopback(&self.addr) {
            return Ok(());
        }
        Err(Error::RendezvousEnv {
            var: TOKEN_VAR,
            reason: format!(
                "not set, and the rendezvous address {} is not a loopback one: on a network \
                 every process of the job needs the same secret (any string) in {TOKEN_VAR}, \
                 or anyone who reaches the address could join",
                self.addr
            ),
        })
    }

    /// HMAC-SHA-256 under the token, fed `parts` in order.
    fn hmac(&self, parts: &[&[u8]]) -> hmac::Hmac<sha2::Sha256> {
        use hmac::{Mac, digest::KeyInit};
        let key = self.token.as_deref().unwrap_or_default();
        let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key)
            .expect("HMAC takes a key of any length");
        for part in parts {
            mac.update(part);
        }
        mac
    }

    /// The MAC of `parts`, concatenated.
    fn mac(&self, parts: &[&[u8]]) -> [u8; MAC] {
        hmac::Mac::finalize(self.hmac(parts)).into_bytes().into()
    }

    /// Whether `tag` is the MAC of `parts` (compared in constant time).
    fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        hmac::Mac::verify_slice(self.hmac(parts), tag).is_ok()
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
        let boot =
            Self::new(format!("{host}:{port}"), rank, world, timeout)?.with_token(var(TOKEN_VAR));
        boot.check_token()?;
        if boot.token.is_none() {
            tracing::warn!(
                addr = boot.addr,
                "{TOKEN_VAR} is not set: the rendezvous on loopback accepts any local process \
                 that speaks its protocol"
            );
        }
        Ok(boot)
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
        let mut peers: Vec<Peer> = Vec::new();
        let result = self.collect(&listener, mine, start, &mut peers);
        // Tell the peers that came why there is no answer, so they fail with rank 0's reason
        // rather than a closed socket.
        if let Err(e) = &result {
            let (tag, missing) = match e {
                Error::RendezvousTimeout { missing, .. } => (TIMED_OUT, missing.clone()),
                _ => (GAVE_UP, Vec::new()),
            };
            let frame = failure_frame(tag, &missing, &e.to_string());
            for peer in &mut peers {
                let _ = peer.stream.write_all(&frame);
            }
        }
        result
    }

    /// Rank 0's side of the challenge on a new connection: the peer's hello, authenticated, or
    /// why it is refused.
    fn challenge(&self, stream: &mut TcpStream, start: Instant) -> std::io::Result<Peer> {
        let left = self.remaining(start).unwrap_or_default().min(HANDSHAKE);
        let left = left.max(Duration::from_millis(1));
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(left))?;
        stream.set_write_timeout(Some(left))?;
        let mut nonce = [0u8; NONCE];
        getrandom::fill(&mut nonce).map_err(std::io::Error::other)?;
        let mut greeting = MAGIC.to_vec();
        greeting.extend_from_slice(&nonce);
        stream.write_all(&greeting)?;
        expect_magic(stream)?;
        let peer_nonce: [u8; NONCE] = read_array(stream)?;
        let header: [u8; 24] = read_array(stream)?;
        let word = |i: usize| u64::from_le_bytes(header[8 * i..8 * i + 8].try_into().unwrap());
        let blob = read_exact_vec(stream, word(2) as usize)?;
        let tag: [u8; MAC] = read_array(stream)?;
        if !self.verify(&[b"join", &nonce, &peer_nonce, &header, &blob], &tag) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("its proof does not match this job's token ({TOKEN_VAR})"),
            ));
        }
        stream.set_write_timeout(None)?;
        Ok(Peer {
            rank: word(0) as usize,
            world: word(1) as usize,
            blob,
            nonce: peer_nonce,
            stream: stream.try_clone()?,
        })
    }

    fn collect(
        &self,
        listener: &TcpListener,
        mine: &[u8],
        start: Instant,
        peers: &mut Vec<Peer>,
    ) -> Result<Vec<Vec<u8>>, Error> {
        let mut blobs: Vec<Option<Vec<u8>>> = vec![None; self.world_size];
        blobs[0] = Some(mine.to_vec());
        while blobs.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((mut stream, from)) => {
                    if self.remaining(start).is_none() {
                        return Err(self.timeout_error(start, missing(&blobs)));
                    }
                    let peer = match self.challenge(&mut stream, start) {
                        Ok(peer) => peer,
                        Err(e) => {
                            // A stranger, garbage or a wrong token: refused, and the ranks
                            // still missing are waited for.
                            tracing::warn!(addr = self.addr, %from, "rendezvous refused a peer: {e}");
                            let frame = failure_frame(REFUSED, &[], &e.to_string());
                            let _ = stream.write_all(&frame);
                            continue;
                        }
                    };
                    let (rank, world) = (peer.rank, peer.world);
                    // Kept before checking, so a refused peer hears why.
                    peers.push(peer);
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
                    blobs[rank] = Some(std::mem::take(&mut peers.last_mut().unwrap().blob));
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
        let mut body = Vec::new();
        body.extend_from_slice(&(blobs.len() as u64).to_le_bytes());
        for blob in &blobs {
            body.extend_from_slice(&(blob.len() as u64).to_le_bytes());
            body.extend_from_slice(blob);
        }
        for peer in peers.iter_mut() {
            // Each answer proves rank 0 holds the token: the MAC of the peer's own nonce.
            let mut reply = MAGIC.to_vec();
            reply.extend_from_slice(&body);
            reply.extend_from_slice(&self.mac(&[b"answer", &peer.nonce, &body]));
            peer.stream.write_all(&reply).map_err(|e| self.io(e))?;
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
        // Rank 0's challenge, then this rank's hello and its proof.
        let left = self.remaining(start).unwrap_or_default() + ANSWER_GRACE;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| self.io(e))?;
        let nonce: [u8; NONCE] = expect_magic(&mut stream)
            .and_then(|()| read_array(&mut stream))
            .map_err(|e| self.io(e))?;
        let mut own = [0u8; NONCE];
        getrandom::fill(&mut own).map_err(|e| self.io(std::io::Error::other(e)))?;
        let mut header = Vec::new();
        for word in [self.rank, self.world_size, mine.len()] {
            header.extend_from_slice(&(word as u64).to_le_bytes());
        }
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&own);
        hello.extend_from_slice(&header);
        hello.extend_from_slice(mine);
        hello.extend_from_slice(&self.mac(&[b"join", &nonce, &own, &header, mine]));
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
                return Ok(Err(match tag {
                    TIMED_OUT => self.timeout_error(start, missing),
                    REFUSED => self.protocol(format!(
                        "rank 0 refused this rank: {text} (is {TOKEN_VAR} the same everywhere?)"
                    )),
                    _ => self.protocol(format!("rank 0 gave up: {text}")),
                }));
            }
            if n != self.world_size as u64 {
                return Ok(Err(self.protocol(format!(
                    "rank 0 answered with {n} blobs for a world of {}",
                    self.world_size
                ))));
            }
            let mut body = n.to_le_bytes().to_vec();
            let mut blobs = Vec::new();
            for _ in 0..n {
                let len = read_u64(stream)?;
                let blob = read_exact_vec(stream, len as usize)?;
                body.extend_from_slice(&len.to_le_bytes());
                body.extend_from_slice(&blob);
                blobs.push(blob);
            }
            let tag: [u8; MAC] = read_array(stream)?;
            if !self.verify(&[b"answer", &own, &body], &tag) {
                return Ok(Err(self.protocol(format!(
                    "the answer does not prove this job's token ({TOKEN_VAR}): not rank 0"
                ))));
            }
            Ok(Ok(blobs))
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
        self.check_token()?;
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

fn read_array<const N: usize>(stream: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    stream.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// A peer that passed rank 0's challenge: its hello, its nonce and its connection.
struct Peer {
    rank: usize,
    world: usize,
    blob: Vec<u8>,
    nonce: [u8; NONCE],
    stream: TcpStream,
}

/// Rank 0's failure frame: `tag`, the ranks missing, the reason.
fn failure_frame(tag: u64, missing: &[usize], text: &str) -> Vec<u8> {
    let mut frame = MAGIC.to_vec();
    frame.extend_from_slice(&u64::MAX.to_le_bytes());
    frame.extend_from_slice(&tag.to_le_bytes());
    frame.extend_from_slice(&(missing.len() as u64).to_le_bytes());
    for &r in missing {
        frame.extend_from_slice(&(r as u64).to_le_bytes());
    }
    frame.extend_from_slice(&(text.len() as u64).to_le_bytes());
    frame.extend_from_slice(text.as_bytes());
    frame
}

/// Whether `addr` (`host:port`) names a loopback host.
fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
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
            ("WILDFIRE_RDZV_TOKEN", "s3cret"),
        ];
        let ok = TcpRendezvous::from_vars(vars(good), t).unwrap();
        assert_eq!(
            (ok.addr(), Bootstrap::rank(&ok), ok.world_size),
            ("node0:29500", 1, 4)
        );
    }

    /// `rank`'s rendezvous at `addr` in a world of `world`, authenticated by `token`.
    fn member(addr: &str, rank: usize, world: usize, token: &str) -> TcpRendezvous {
        TcpRendezvous::new(addr, rank, world, Duration::from_secs(20))
            .unwrap()
            .with_token(Some(token))
    }

    /// A raw connection to rank 0's rendezvous (retried while it starts), its greeting read.
    fn stranger(addr: &str) -> TcpStream {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut stream = loop {
            match TcpStream::connect(addr) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() > deadline => panic!("rank 0 never listened: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let greeting: [u8; 8 + NONCE] = read_array(&mut stream).unwrap();
        assert_eq!(&greeting[..8], MAGIC);
        stream
    }

    /// What rank 0 said to a refused connection: its reason.
    fn refusal(stream: &mut TcpStream) -> String {
        expect_magic(stream).unwrap();
        assert_eq!(read_u64(stream).unwrap(), u64::MAX, "a failure frame");
        assert_eq!(read_u64(stream).unwrap(), REFUSED);
        assert_eq!(read_u64(stream).unwrap(), 0, "no missing ranks");
        let len = read_u64(stream).unwrap() as usize;
        String::from_utf8(read_exact_vec(stream, len).unwrap()).unwrap()
    }

    /// A rank with another job's token is refused (and told so), and rank 0 keeps waiting: the
    /// rank with the right token joins afterwards and both get every blob.
    #[test]
    fn a_wrong_token_is_refused_and_the_right_rank_still_joins() {
        let addr = format!("127.0.0.1:{}", free_port());
        std::thread::scope(|s| {
            let root = s.spawn(|| member(&addr, 0, 2, "job-a").all_gather_bytes(b"zero"));
            let impostor = member(&addr, 1, 2, "job-b").all_gather_bytes(b"evil");
            let Err(Error::RendezvousProtocol { reason, .. }) = &impostor else {
                panic!("{impostor:?}");
            };
            assert!(
                reason.contains("refused") && reason.contains(TOKEN_VAR),
                "{reason}"
            );
            let joined = member(&addr, 1, 2, "job-a")
                .all_gather_bytes(b"one")
                .unwrap();
            let expected = vec![b"zero".to_vec(), b"one".to_vec()];
            assert_eq!(joined, expected);
            assert_eq!(root.join().unwrap().unwrap(), expected);
        });
    }

    /// Connections that are not ranks — garbage after the greeting, a hello claiming a
    /// 2⁶⁴-byte blob, a hello whose proof is wrong — are each refused without a crash and without
    /// ending the rendezvous; the real rank joins afterwards.
    #[test]
    fn garbage_and_huge_lengths_are_refused_without_stopping_the_rendezvous() {
        let addr = format!("127.0.0.1:{}", free_port());
        std::thread::scope(|s| {
            let root = s.spawn(|| member(&addr, 0, 2, "t").all_gather_bytes(b"zero"));
            let mut garbage = stranger(&addr);
            garbage
                .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            assert!(refusal(&mut garbage).contains("not a Wildfire rendezvous peer"));
            let mut huge = stranger(&addr);
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&[7; NONCE]);
            for word in [1u64, 2, u64::MAX] {
                hello.extend_from_slice(&word.to_le_bytes());
            }
            huge.write_all(&hello).unwrap();
            assert!(refusal(&mut huge).contains("at most 1 MiB"));
            let mut forged = stranger(&addr);
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&[7; NONCE]);
            for word in [1u64, 2, 3] {
                hello.extend_from_slice(&word.to_le_bytes());
            }
            hello.extend_from_slice(b"one");
            hello.extend_from_slice(&[0; MAC]);
            forged.write_all(&hello).unwrap();
            assert!(refusal(&mut forged).contains(TOKEN_VAR));
            let joined = member(&addr, 1, 2, "t").all_gather_bytes(b"one").unwrap();
            assert_eq!(joined, vec![b"zero".to_vec(), b"one".to_vec()]);
            assert_eq!(root.join().unwrap().unwrap(), joined);
        });
    }

    /// A listener that answers a rank's hello in the protocol's shape but without the token's
    /// proof is not taken for rank 0.
    #[test]
    fn an_answer_without_the_tokens_proof_is_not_rank_zeros() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::scope(|s| {
            s.spawn(|| {
                let (mut stream, _) = listener.accept().unwrap();
                let mut greeting = MAGIC.to_vec();
                greeting.extend_from_slice(&[1; NONCE]);
                stream.write_all(&greeting).unwrap();
                let _hello: [u8; 8 + NONCE + 24 + 3 + MAC] = read_array(&mut stream).unwrap();
                let mut answer = MAGIC.to_vec();
                answer.extend_from_slice(&2u64.to_le_bytes());
                for blob in [&b"fake"[..], b"one"] {
                    answer.extend_from_slice(&(blob.len() as u64).to_le_bytes());
                    answer.extend_from_slice(blob);
                }
                answer.extend_from_slice(&[0; MAC]);
                stream.write_all(&answer).unwrap();
            });
            let result = member(&addr, 1, 2, "t").all_gather_bytes(b"one");
            let Err(Error::RendezvousProtocol { reason, .. }) = &result else {
                panic!("{result:?}");
            };
            assert!(reason.contains("not rank 0"), "{reason}");
        });
    }

    /// Without `WILDFIRE_RDZV_TOKEN` only a loopback address is accepted; on any other the
    /// error names the variable, before any connection.
    #[test]
    fn without_a_token_only_loopback_is_accepted() {
        let t = Duration::from_secs(1);
        let vars = |host: &'static str, token: Option<&'static str>| {
            move |name: &str| match name {
                "MASTER_ADDR" => Some(host.to_string()),
                "MASTER_PORT" => Some("29500".into()),
                "RANK" => Some("1".into()),
                "WORLD_SIZE" => Some("2".into()),
                TOKEN_VAR => token.map(str::to_string),
                _ => None,
            }
        };
        for host in ["node0", "10.1.2.3", "[fe80::1]"] {
            let err = TcpRendezvous::from_vars(vars(host, None), t).unwrap_err();
            assert!(
                matches!(err, Error::RendezvousEnv { var: TOKEN_VAR, .. }),
                "{host}: {err}"
            );
            assert!(TcpRendezvous::from_vars(vars(host, Some("x")), t).is_ok());
            // An empty token is none.
            assert!(TcpRendezvous::from_vars(vars(host, Some("")), t).is_err());
        }
        for host in ["127.0.0.1", "localhost", "[::1]", "127.3.0.9"] {
            assert!(
                TcpRendezvous::from_vars(vars(host, None), t).is_ok(),
                "{host}"
            );
        }
        let off_loopback = TcpRendezvous::new("10.1.2.3:29500", 1, 2, t).unwrap();
        let err = off_loopback.all_gather_bytes(b"x").unwrap_err();
        assert!(
            matches!(err, Error::RendezvousEnv { var: TOKEN_VAR, .. }),
            "{err}"
        );
    }
}
