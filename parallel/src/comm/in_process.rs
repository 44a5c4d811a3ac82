//! The in-process communicator: every rank is a thread of one process.
//!
//! Each group (identified by its member ranks) owns a rendezvous. A collective is one round of
//! it: every member deposits its buffer together with the call it made; once all have arrived,
//! every member receives shared access to all deposits and computes its own result locally, in
//! group order, so results are deterministic and bitwise identical across members. Each member
//! counts its own rounds, so a fast member may already deposit into the next round while slow
//! ones still collect the previous one; rounds never mix.
//!
//! Waiting uses a condition variable with a deadline (a missing peer gives
//! [`Error::Timeout`], never a hang) and watches the world's abort flag (a failed peer gives
//! [`Error::PeerFailed`] at once).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use super::buffer::{all_to_all_rows, chunk_bytes, concat, reduce};
use super::call::Round;
use super::{Call, CollectiveKind, Communicator, Error, Member, PointToPoint, lock};
use crate::mesh::DeviceMesh;

/// How long a rank waits for its peers (or a message) before giving up with
/// [`Error::Timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The state shared by the ranks of one in-process world.
pub struct InProcessWorld {
    mesh: DeviceMesh,
    timeout: Duration,
    /// Set once, by the first [`InProcessWorld::abort`]; `abort_reason` holds who and why.
    aborted: AtomicBool,
    abort_reason: Mutex<Option<(usize, String)>>,
    /// One rendezvous per group, keyed by its member ranks in group order.
    rendezvous: Mutex<HashMap<Vec<usize>, Arc<Rendezvous>>>,
    /// The modelled links of the mesh's axes: a collective takes at least their time.
    links: std::sync::RwLock<super::Links>,
    /// One FIFO per (from, to) pair.
    channels: Mutex<HashMap<(usize, usize), Arc<Channel>>>,
}

impl fmt::Debug for InProcessWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessWorld")
            .field("mesh", &self.mesh.to_string())
            .field("timeout", &self.timeout)
            .field("aborted", &self.abort_reason())
            .finish_non_exhaustive()
    }
}

impl InProcessWorld {
    /// A world of `mesh.world_size()` ranks whose waits give up after `timeout`.
    pub fn new(mesh: DeviceMesh, timeout: Duration) -> Arc<Self> {
        Arc::new(InProcessWorld {
            mesh,
            timeout,
            aborted: AtomicBool::new(false),
            abort_reason: Mutex::new(None),
            rendezvous: Mutex::new(HashMap::new()),
            links: Default::default(),
            channels: Mutex::new(HashMap::new()),
        })
    }

    /// The communicator of `rank`; create one per rank and hand it to that rank's thread.
    ///
    /// # Panics
    /// If `rank` is not below the world size.
    pub fn communicator(self: &Arc<Self>, rank: usize) -> InProcessCommunicator {
        assert!(
            rank < self.mesh.world_size(),
            "rank {rank} is out of range for mesh {} of {} ranks",
            self.mesh,
            self.mesh.world_size()
        );
        InProcessCommunicator {
            world: Arc::clone(self),
            member: Member::new(rank, self.mesh.clone()),
        }
    }

    /// Model the links of the mesh's axes ([`super::LinkModel`]): from now on every collective
    /// over an axis with a link takes at least the time it would take on it (the data still
    /// moves through memory; results and reduction order are unchanged).
    pub fn set_links(&self, links: super::Links) {
        *self.links.write().unwrap() = links;
    }

    /// The mesh the ranks are arranged in.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// How long a rank waits before giving up.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Makes every pending and future call of every rank fail with
    /// [`Error::PeerFailed`] naming `rank` and `reason`. Only the first abort is kept.
    pub fn abort(&self, rank: usize, reason: String) {
        {
            let mut slot = lock(&self.abort_reason);
            if slot.is_none() {
                *slot = Some((rank, reason));
            }
        }
        self.aborted.store(true, Ordering::SeqCst);
        // Wake every waiter. Taking each lock before notifying means a waiter is either still
        // before its flag check (and will see the flag) or already waiting (and gets woken).
        let rendezvous: Vec<_> = lock(&self.rendezvous).values().cloned().collect();
        for point in rendezvous {
            let _state = lock(&point.state);
            point.arrived.notify_all();
        }
        let channels: Vec<_> = lock(&self.channels).values().cloned().collect();
        for channel in channels {
            let _queue = lock(&channel.queue);
            channel.ready.notify_all();
        }
    }

    /// The rank and reason of the first abort, if the world was aborted.
    pub fn abort_reason(&self) -> Option<(usize, String)> {
        lock(&self.abort_reason).clone()
    }

    fn check_abort(&self) -> Result<(), Error> {
        if !self.aborted.load(Ordering::SeqCst) {
            return Ok(());
        }
        let (rank, reason) = self
            .abort_reason()
            .expect("the abort reason is set before the flag");
        Err(Error::PeerFailed { rank, reason })
    }

    fn rendezvous(&self, members: &[usize]) -> Arc<Rendezvous> {
        let mut map = lock(&self.rendezvous);
        if let Some(point) = map.get(members) {
            return Arc::clone(point);
        }
        let point = Arc::new(Rendezvous {
            state: Mutex::new(RendezvousState {
                next_round: vec![0; members.len()],
                rounds: HashMap::new(),
            }),
            arrived: Condvar::new(),
        });
        map.insert(members.to_vec(), Arc::clone(&point));
        point
    }

    fn channel(&self, from: usize, to: usize) -> Arc<Channel> {
        Arc::clone(lock(&self.channels).entry((from, to)).or_default())
    }

    /// Deposits `mine` into this member's next round of the group `members` and waits for
    /// everyone's deposits.
    fn exchange(&self, who: &Who<'_>, mine: Contribution) -> Result<Arc<[Contribution]>, Error> {
        let point = self.rendezvous(who.members);
        let size = who.members.len();
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut state = lock(&point.state);
        self.check_abort()?;
        let round_id = state.next_round[who.index];
        state.next_round[who.index] += 1;
        let round = state
            .rounds
            .entry(round_id)
            .or_insert_with(|| Deposit::new(size));
        round.slots[who.index] = Some(mine);
        round.arrived += 1;
        if round.arrived == size {
            let all: Vec<Contribution> = round
                .slots
                .iter_mut()
                .map(|slot| slot.take().expect("every member deposited"))
                .collect();
            round.complete = Some(all.into());
            point.arrived.notify_all();
        }
        loop {
            // A round every member reached completes even if the world was aborted since (a
            // rank that stops with an error right after a collective must not turn its peers'
            // finished call into a failure).
            let round = state
                .rounds
                .get_mut(&round_id)
                .expect("a round lives until every member took its result");
            if let Some(all) = &round.complete {
                let all = Arc::clone(all);
                round.taken += 1;
                if round.taken == size {
                    state.rounds.remove(&round_id);
                }
                return Ok(all);
            }
            self.check_abort()?;
            let now = Instant::now();
            if now >= deadline {
                let missing = round
                    .slots
                    .iter()
                    .zip(who.members)
                    .filter(|(slot, _)| slot.is_none())
                    .map(|(_, &rank)| rank)
                    .collect();
                return Err(Error::Timeout {
                    op: who.kind,
                    group: who.label.to_owned(),
                    rank: who.rank,
                    waited: now - start,
                    missing,
                });
            }
            state = point
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// The meeting point of one group.
struct Rendezvous {
    state: Mutex<RendezvousState>,
    arrived: Condvar,
}

struct RendezvousState {
    /// The next round of each member (by group index).
    next_round: Vec<u64>,
    /// Rounds that some member has entered and not every member has left.
    rounds: HashMap<u64, Deposit>,
}

/// One round of a rendezvous: the members' deposits as they arrive, then shared.
struct Deposit {
    slots: Vec<Option<Contribution>>,
    arrived: usize,
    complete: Option<Arc<[Contribution]>>,
    taken: usize,
}

impl Deposit {
    fn new(size: usize) -> Self {
        Deposit {
            slots: (0..size).map(|_| None).collect(),
            arrived: 0,
            complete: None,
            taken: 0,
        }
    }
}

/// The point-to-point queue of one (from, to) pair.
#[derive(Default)]
struct Channel {
    /// The messages in flight, each with the moment it was sent.
    queue: Mutex<std::collections::VecDeque<(TensorData, Instant)>>,
    ready: Condvar,
}

/// One member's deposit in a round.
#[derive(Debug)]
struct Contribution {
    call: Call,
    data: Option<TensorData>,
}

/// Everyone's deposits, as this member sees them.
enum Deposits {
    /// A group of one: the member's own deposit, still owned.
    Alone(Box<Contribution>),
    /// A group of several: shared access to every deposit, in group order.
    Shared(Arc<[Contribution]>),
}

impl Deposits {
    fn all(&self) -> &[Contribution] {
        match self {
            Deposits::Alone(mine) => std::slice::from_ref(&**mine),
            Deposits::Shared(all) => all,
        }
    }

    /// The buffers of every member, in group order.
    fn buffers(&self) -> Vec<&TensorData> {
        self.all()
            .iter()
            .map(|deposit| deposit.data.as_ref().expect("this call carries a buffer"))
            .collect()
    }
}

/// Who takes part in a call, from the calling member's point of view.
struct Who<'a> {
    kind: CollectiveKind,
    label: &'a str,
    members: &'a [usize],
    index: usize,
    rank: usize,
}

/// One rank's endpoint of an [`InProcessWorld`].
pub struct InProcessCommunicator {
    world: Arc<InProcessWorld>,
    member: Member,
}

impl fmt::Debug for InProcessCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.member.debug_as("InProcessCommunicator", f)
    }
}

impl InProcessCommunicator {
    /// The world this communicator belongs to.
    pub fn world(&self) -> &Arc<InProcessWorld> {
        &self.world
    }
}

/// This member's result of a collective (not a broadcast, not a barrier) from everyone's
/// buffers, in group order; the round checked them.
fn combine(call: &Call, index: usize, deposits: &Deposits) -> Result<TensorData, Error> {
    let buffers = &deposits.buffers()[..];
    let first = buffers[0];
    Ok(match call.kind() {
        CollectiveKind::AllReduce => {
            let raw: Vec<&[u8]> = buffers.iter().map(|data| data.as_bytes()).collect();
            reduce(&raw, first.dtype, first.shape.clone(), call.reduce_op())
        }
        CollectiveKind::AllGather => concat(buffers, call.dim())?,
        CollectiveKind::AllToAll => {
            let pieces: Vec<(usize, usize)> = deposits
                .all()
                .iter()
                .map(|d| d.call.splits().expect("the round checked the splits"))
                .map(|s| s.rows_to(index))
                .collect();
            all_to_all_rows(buffers, &pieces)?
        }
        _ => {
            let parts = buffers.len();
            let mut shape = None;
            let mut chunks = Vec::with_capacity(parts);
            for data in buffers {
                let (chunk, chunk_shape) = chunk_bytes(data, call.dim(), parts, index)?;
                chunks.push(chunk);
                shape = Some(chunk_shape);
            }
            let raw: Vec<&[u8]> = chunks.iter().map(|c| c.as_ref()).collect();
            let shape = shape.expect("a group has members");
            reduce(&raw, first.dtype, shape, call.reduce_op())
        }
    })
}

impl Communicator for InProcessCommunicator {
    fn member(&self) -> &Member {
        &self.member
    }

    fn fail(&self, reason: String) {
        self.world.abort(self.rank(), reason);
    }

    fn aborted(&self) -> Option<(usize, String)> {
        self.world.abort_reason()
    }

    /// One round of the group's rendezvous: deposits the call and `data`, checks that every
    /// member made the same call with buffers that fit, and computes this member's result from
    /// everyone's deposits.
    fn run(&self, call: &Call, data: Option<TensorData>) -> Result<Option<TensorData>, Error> {
        let started = std::time::Instant::now();
        self.world.check_abort()?;
        let (mesh, rank) = (self.mesh(), self.rank());
        let group = call.group();
        let label = group.label(mesh)?;
        let members = group.ranks(mesh, rank)?;
        let who = Who {
            kind: call.kind(),
            label,
            members: &members,
            index: group.index(mesh, rank)?,
            rank,
        };
        let mine = Contribution {
            call: call.clone(),
            data,
        };
        let deposits = if members.len() == 1 {
            Deposits::Alone(Box::new(mine))
        } else {
            Deposits::Shared(self.world.exchange(&who, mine)?)
        };
        let calls = deposits.all().iter().map(|d| d.call.clone()).collect();
        let round = Round::new(mesh, rank, call.clone(), calls);
        round.check_calls()?;
        let out = match call.kind() {
            CollectiveKind::Barrier => None,
            CollectiveKind::Broadcast => {
                let root = call.root();
                round.root_buffer()?;
                Some(match deposits {
                    Deposits::Alone(mine) => mine.data.expect("the root's buffer is present"),
                    Deposits::Shared(all) => all[root].data.clone().expect("checked above"),
                })
            }
            _ => {
                round.check_buffers()?;
                Some(match deposits {
                    // Unchanged, bit for bit (no widening, no division).
                    Deposits::Alone(mine) => mine.data.expect("this call carries a buffer"),
                    Deposits::Shared(_) => combine(call, who.index, &deposits)?,
                })
            }
        };
        // The modelled link: the call lasts at least as long as it would on it.
        let link = self.world.links.read().unwrap().for_group(label).copied();
        if let Some(link) = link {
            let bytes = call.counted_bytes(out.as_ref()) as u64;
            wait_until(started + link.collective_time(call.kind(), members.len(), bytes));
        }
        Ok(out)
    }

    fn point_to_point(&self) -> Result<&dyn PointToPoint, Error> {
        Ok(self)
    }
}

impl PointToPoint for InProcessCommunicator {
    fn send(&self, to: usize, data: TensorData) -> Result<(), Error> {
        self.world.check_abort()?;
        self.member.check_peer(to)?;
        let bytes = data.bytes.len();
        let channel = self.world.channel(self.rank(), to);
        lock(&channel.queue).push_back((data, Instant::now()));
        channel.ready.notify_all();
        self.member.record_p2p(CollectiveKind::Send, bytes);
        Ok(())
    }

    fn recv(&self, from: usize) -> Result<TensorData, Error> {
        self.world.check_abort()?;
        self.member.check_peer(from)?;
        let channel = self.world.channel(from, self.rank());
        let start = Instant::now();
        let deadline = start + self.world.timeout;
        let mut queue = lock(&channel.queue);
        let (data, sent) = loop {
            // A message already sent is received even if the world was aborted since.
            if let Some(message) = queue.pop_front() {
                break message;
            }
            self.world.check_abort()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: CollectiveKind::Recv,
                    group: "p2p".to_owned(),
                    rank: self.rank(),
                    waited: now - start,
                    missing: vec![from],
                });
            }
            queue = channel
                .ready
                .wait_timeout(queue, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        drop(queue);
        // The modelled link between the two ranks (the mesh axis they differ on): the message
        // arrives no sooner than it would over it.
        let link = {
            let links = self.world.links.read().unwrap();
            let mesh = self.member.mesh();
            let label = || {
                let (a, b) = (mesh.coords(from), mesh.coords(self.rank()));
                let axis = (0..a.len()).find(|&i| a[i] != b[i]);
                axis.map_or("p2p", |i| mesh.axis(i).name.as_str())
            };
            (!links.is_empty())
                .then(|| links.for_group(label()).copied())
                .flatten()
        };
        if let Some(link) = link {
            let bytes = data.bytes.len() as u64;
            wait_until(sent + link.collective_time(CollectiveKind::Recv, 2, bytes));
        }
        self.member
            .record_p2p(CollectiveKind::Recv, data.bytes.len());
        Ok(data)
    }
}

/// Returns at `deadline`: sleeps for the bulk, spins for the last stretch (a sleep overshoots by
/// ~0.1 ms, which would swamp a small message's microseconds).
fn wait_until(deadline: Instant) {
    const SPIN: std::time::Duration = std::time::Duration::from_micros(200);
    while let Some(rest) = deadline.checked_duration_since(Instant::now()) {
        if rest.is_zero() {
            break;
        }
        if rest > SPIN {
            std::thread::sleep(rest - SPIN);
        } else {
            std::hint::spin_loop();
        }
    }
}
