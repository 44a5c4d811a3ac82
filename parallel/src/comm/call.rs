//! One description of a collective call, shared by every communicator.
//!
//! [`Communicator`](super::Communicator)'s methods build a [`Call`] once per call and hand it,
//! with the member's buffer, to [`Communicator::collective`](super::Communicator::collective).
//! Each communicator then uses that one value for everything a call needs described: the call
//! check across the members (in process the members compare their calls directly, across
//! processes they exchange it as a [header](super::header)), the mismatch report ([`Round`]),
//! the statistics (what [`CommStats`](super::CommStats) counts) and its dispatch.

use std::fmt;

use burn::tensor::{DType, TensorData};

use super::buffer::{check_dim, check_divisible, check_reducible, whole_elements};
use super::{CollectiveKind, Error, Group, ReduceOp, check_rank};
use crate::mesh::DeviceMesh;

/// The buffer a member passes to a collective: its dtype, shape and byte length.
#[derive(Clone, Debug)]
pub struct Operand {
    dtype: DType,
    shape: Vec<usize>,
    bytes: usize,
}

impl Operand {
    /// A buffer of `dtype` and `shape` (a device tensor's, say), `shape`'s elements long.
    pub(crate) fn new(dtype: DType, shape: &[usize]) -> Self {
        Self {
            dtype,
            shape: shape.to_vec(),
            bytes: shape.iter().product::<usize>() * dtype.size(),
        }
    }

    /// The buffer `data` is, with its actual byte length.
    pub(crate) fn of(data: &TensorData) -> Self {
        Self {
            dtype: data.dtype,
            shape: data.shape.to_vec(),
            bytes: data.bytes.len(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The sizes of the dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The byte length.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether `other` has the same dtype and the same sizes, except on `except`.
    pub(crate) fn agrees(&self, other: &Operand, except: Option<usize>) -> bool {
        self.dtype == other.dtype
            && self.shape.len() == other.shape.len()
            && (self.shape.iter().zip(&other.shape))
                .enumerate()
                .all(|(dim, (a, b))| a == b || Some(dim) == except)
    }

    /// Fails unless the buffer holds exactly its elements, whole bytes each (quantized and
    /// packed storage does not).
    pub(crate) fn check_element_size(&self) -> Result<usize, Error> {
        whole_elements(self.dtype, self.shape.iter().product(), self.bytes)
    }
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.dtype.name(), self.shape)
    }
}

/// One collective call as one member makes it: what it is, on which group, with which
/// arguments and which buffer. Every member of the group must make the same call (kind, op,
/// dim, root), with buffers that fit together.
///
/// Calls are built by [`Communicator`](super::Communicator)'s methods, one per call, each with
/// the buffer it describes; implementations read them.
#[derive(Clone, Debug)]
pub struct Call {
    pub(crate) kind: CollectiveKind,
    pub(crate) group: Group,
    pub(crate) op: Option<ReduceOp>,
    pub(crate) dim: usize,
    pub(crate) root: usize,
    pub(crate) buffer: Option<Operand>,
    /// An all-to-all's rows to and from each member.
    pub(crate) splits: Option<Splits>,
}

/// An all-to-all member's rows (along dim 0) to each member (`send`) and from each (`recv`), in
/// group order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Splits {
    /// Rows sent to each member.
    pub send: Vec<usize>,
    /// Rows received from each member.
    pub recv: Vec<usize>,
}

impl Splits {
    /// `[send…, recv…]` as `2·n` words for a group of `n` (what travels between processes);
    /// splits of another length as `-1`s, which [`Splits::from_words`] reads as none (the check
    /// then names them).
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn words(&self, n: usize) -> Vec<i64> {
        if self.send.len() != n || self.recv.len() != n {
            return vec![-1; 2 * n];
        }
        self.send
            .iter()
            .chain(&self.recv)
            .map(|&x| x as i64)
            .collect()
    }

    /// The splits of `n` members that [`Splits::words`] wrote.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn from_words(words: &[i64], n: usize) -> Self {
        if words.iter().any(|&w| w < 0) {
            return Self {
                send: Vec::new(),
                recv: Vec::new(),
            };
        }
        let rows = |w: &[i64]| w.iter().map(|&x| x as usize).collect();
        Self {
            send: rows(&words[..n]),
            recv: rows(&words[n..2 * n]),
        }
    }

    /// The rows sent to member `j`: `(first row, rows)` of the buffer.
    pub(crate) fn rows_to(&self, j: usize) -> (usize, usize) {
        (self.send[..j].iter().sum(), self.send[j])
    }
}

impl Call {
    fn new(kind: CollectiveKind, group: Group, buffer: Option<Operand>) -> Self {
        Self {
            kind,
            group,
            op: None,
            dim: 0,
            root: 0,
            buffer,
            splits: None,
        }
    }

    /// [`Communicator::all_to_all`](super::Communicator::all_to_all) of `buffer`'s rows.
    pub(crate) fn all_to_all(group: Group, buffer: Operand, splits: Splits) -> Self {
        Self {
            splits: Some(splits),
            ..Self::new(CollectiveKind::AllToAll, group, Some(buffer))
        }
    }

    /// An all-to-all's splits.
    pub fn splits(&self) -> Option<&Splits> {
        self.splits.as_ref()
    }

    /// [`Communicator::all_reduce`](super::Communicator::all_reduce) of `buffer` with `op`.
    pub(crate) fn all_reduce(group: Group, buffer: Operand, op: ReduceOp) -> Self {
        Self {
            op: Some(op),
            ..Self::new(CollectiveKind::AllReduce, group, Some(buffer))
        }
    }

    /// [`Communicator::all_gather`](super::Communicator::all_gather) of `buffer` along `dim`.
    pub(crate) fn all_gather(group: Group, buffer: Operand, dim: usize) -> Self {
        Self {
            dim,
            ..Self::new(CollectiveKind::AllGather, group, Some(buffer))
        }
    }

    /// [`Communicator::reduce_scatter`](super::Communicator::reduce_scatter) of `buffer` along
    /// `dim` with `op`.
    pub(crate) fn reduce_scatter(group: Group, buffer: Operand, dim: usize, op: ReduceOp) -> Self {
        Self {
            op: Some(op),
            dim,
            ..Self::new(CollectiveKind::ReduceScatter, group, Some(buffer))
        }
    }

    /// [`Communicator::broadcast`](super::Communicator::broadcast) from group index `root`;
    /// `buffer` is the member's buffer (the root's is sent; the others usually pass none).
    pub(crate) fn broadcast(group: Group, buffer: Option<Operand>, root: usize) -> Self {
        Self {
            root,
            ..Self::new(CollectiveKind::Broadcast, group, buffer)
        }
    }

    /// [`Communicator::barrier`](super::Communicator::barrier).
    pub(crate) fn barrier(group: Group) -> Self {
        Self::new(CollectiveKind::Barrier, group, None)
    }

    /// The collective.
    pub fn kind(&self) -> CollectiveKind {
        self.kind
    }

    /// The group it runs on.
    pub fn group(&self) -> Group {
        self.group
    }

    /// The reduction (all-reduce, reduce-scatter).
    pub fn op(&self) -> Option<ReduceOp> {
        self.op
    }

    /// The tensor dimension it gathers or scatters along (0 for the others).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The broadcast's root, a group index (0 for the others).
    pub fn root(&self) -> usize {
        self.root
    }

    /// The buffer this member passes: none for a barrier and, usually, a broadcast's non-root
    /// members.
    pub fn buffer(&self) -> Option<&Operand> {
        self.buffer.as_ref()
    }

    /// The bytes [`CommStats`](super::CommStats) counts for this call, given its result: the
    /// buffer passed in, except for a broadcast, where every member counts the broadcast buffer.
    pub fn counted_bytes(&self, result: Option<&TensorData>) -> usize {
        match (self.kind, result) {
            (CollectiveKind::Broadcast, Some(result)) => result.bytes.len(),
            _ => self.buffer.as_ref().map_or(0, Operand::bytes),
        }
    }

    /// The reduction; a reduce call always has one.
    pub(crate) fn reduce_op(&self) -> ReduceOp {
        self.op
            .expect("all-reduce and reduce-scatter calls carry their op")
    }

    /// Fails unless a broadcast's root is a group index of its group (other calls pass): what
    /// the communicators that move data as they go check before the round.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn check_root(&self, mesh: &DeviceMesh) -> Result<(), Error> {
        if self.kind != CollectiveKind::Broadcast {
            return Ok(());
        }
        let size = self.group.size(mesh)?;
        let context = format!("group {}", self.group.label(mesh)?);
        check_rank(self.root, size, &context)
    }

    /// Whether `other` is the same call (kind, group, op, dim, root), buffers aside.
    pub(crate) fn same_call(&self, other: &Call) -> bool {
        (self.kind, self.group, self.op, self.dim, self.root)
            == (other.kind, other.group, other.op, other.dim, other.root)
    }
}

impl fmt::Display for Call {
    /// `all_reduce(sum) of f32 [2, 3]`, `all_gather(dim 1) of …`, `broadcast(root 0)`, `barrier`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.kind;
        match (kind, self.op) {
            (CollectiveKind::AllReduce, Some(op)) => write!(f, "{kind}({op})")?,
            (CollectiveKind::AllGather, _) => write!(f, "{kind}(dim {})", self.dim)?,
            (CollectiveKind::ReduceScatter, Some(op)) => {
                write!(f, "{kind}(dim {}, {op})", self.dim)?
            }
            (CollectiveKind::Broadcast, _) => write!(f, "{kind}(root {})", self.root)?,
            (CollectiveKind::AllToAll, _) => match &self.splits {
                Some(s) => write!(f, "{kind}(send {:?}, recv {:?})", s.send, s.recv)?,
                None => write!(f, "{kind}")?,
            },
            _ => write!(f, "{kind}")?,
        }
        match &self.buffer {
            Some(buffer) => write!(f, " of {buffer}"),
            None => Ok(()),
        }
    }
}

/// Every member's call of one round on a group, in group order, as one member sees them: what
/// a communicator checks before (or instead of) moving data, and what a mismatch names.
pub(crate) struct Round<'m> {
    mesh: &'m DeviceMesh,
    rank: usize,
    mine: Call,
    calls: Vec<Call>,
    /// Each member's call number on the group, where the communicator exchanges one.
    numbers: Vec<i64>,
}

impl<'m> Round<'m> {
    /// The round of `rank`'s call `mine`, the members having made `calls` (in group order).
    pub(crate) fn new(mesh: &'m DeviceMesh, rank: usize, mine: Call, calls: Vec<Call>) -> Self {
        Self {
            mesh,
            rank,
            mine,
            calls,
            numbers: Vec::new(),
        }
    }

    /// The same, with each member's call number on the group (which must agree as well).
    pub(crate) fn numbered(mut self, numbers: Vec<i64>) -> Self {
        self.numbers = numbers;
        self
    }

    /// The members' calls, in group order.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// Fails unless every member made the same call (with the same call number).
    pub(crate) fn check_calls(&self) -> Result<(), Error> {
        let first = &self.calls[0];
        let number = self.numbers.first();
        let same = self.calls.iter().all(|call| call.same_call(first))
            && self.numbers.iter().all(|n| Some(n) == number);
        if same {
            return Ok(());
        }
        let calls = self
            .each(|call, i| {
                let number = self.numbers.get(i).map(|n| format!(" (call #{n})"));
                format!("called {call}{}", number.unwrap_or_default())
            })
            .join(", ");
        Err(self.mismatch(format!("members made different calls: {calls}")))
    }

    /// Fails unless every member's buffer has the same dtype and, when `except` is `None`, the
    /// same shape; with `Some(dim)`, the same rank and the same sizes on every dim but `dim`.
    pub(crate) fn check_layouts(&self, except: Option<usize>) -> Result<(), Error> {
        let first = self.calls[0].buffer();
        let agrees = |call: &Call| match (call.buffer(), first) {
            (Some(buffer), Some(first)) => buffer.agrees(first, except),
            _ => false,
        };
        if self.calls.iter().all(agrees) {
            return Ok(());
        }
        let layouts = self
            .each(|call, _| match call.buffer() {
                Some(buffer) => format!("passed {buffer}"),
                None => "passed no buffer".to_owned(),
            })
            .join(", ");
        let rule = match except {
            None => "the same dtype and shape".to_owned(),
            Some(dim) => format!("the same dtype and the same sizes except on dim {dim}"),
        };
        Err(self.mismatch(format!("members must pass {rule}: {layouts}")))
    }

    /// The checks of a host collective on its members' buffers, once the calls agree: layouts
    /// that fit (an all-gather's may differ along `dim`), a dim the buffers have, a dtype the
    /// reduction takes, whole-byte elements, and a scattered dim that splits evenly.
    pub(crate) fn check_buffers(&self) -> Result<(), Error> {
        let call = &self.mine;
        match call.kind {
            CollectiveKind::AllGather => self.check_layouts(Some(call.dim))?,
            CollectiveKind::AllToAll => {
                self.check_layouts(Some(0))?;
                let ndims = self.calls[0].buffer().map_or(0, |b| b.shape.len());
                check_dim(call.kind, ndims, 0)?;
                self.check_splits()?;
            }
            _ => self.check_layouts(None)?,
        }
        let first = self.calls[0]
            .buffer()
            .expect("checked: every member passes a buffer");
        if matches!(
            call.kind,
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter
        ) {
            check_dim(call.kind, first.shape.len(), call.dim)?;
        }
        if call.op.is_some() {
            check_reducible(first.dtype)?;
        }
        for call in &self.calls {
            call.buffer()
                .expect("checked: every member passes a buffer")
                .check_element_size()?;
        }
        if call.kind == CollectiveKind::ReduceScatter {
            check_divisible(first.shape[call.dim], call.dim, self.calls.len())?;
        }
        Ok(())
    }

    /// The members' calls with the splits each passed (exchanged after the headers, which do
    /// not carry them), in group order.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn with_splits(mut self, splits: Vec<Splits>) -> Self {
        for (call, s) in self.calls.iter_mut().zip(splits) {
            call.splits = Some(s);
        }
        self
    }

    /// An all-to-all's splits fit together: every member names each member once, sends the
    /// rows its buffer holds, and member `i`'s rows to `j` are those `j` expects from `i`;
    /// otherwise [`Error::Mismatch`] naming every member's splits (the same on every member).
    pub(crate) fn check_splits(&self) -> Result<(), Error> {
        let n = self.calls.len();
        let splits: Vec<Option<&Splits>> = self.calls.iter().map(Call::splits).collect();
        let fits = splits.iter().zip(&self.calls).all(|(s, call)| {
            s.is_some_and(|s| {
                s.send.len() == n
                    && s.recv.len() == n
                    && call
                        .buffer()
                        .is_some_and(|b| b.shape.first() == Some(&s.send.iter().sum()))
            })
        }) && (0..n).all(|i| {
            (0..n)
                .all(|j| splits[i].expect("checked").send[j] == splits[j].expect("checked").recv[i])
        });
        if fits {
            return Ok(());
        }
        let each = self
            .each(|call, _| match (call.splits(), call.buffer()) {
                (Some(s), Some(b)) => {
                    format!(
                        "sends {:?} and expects {:?} of {} rows",
                        s.send,
                        s.recv,
                        b.shape.first().copied().unwrap_or(0)
                    )
                }
                _ => "passed no splits".to_owned(),
            })
            .join(", ");
        Err(self.mismatch(format!(
            "the all-to-all's splits disagree (member i's rows to j must be those j expects \
             from i, and each member must send the rows it holds): {each}"
        )))
    }

    /// A broadcast's source: the root's buffer (the root being a valid group index).
    pub(crate) fn root_buffer(&self) -> Result<&Operand, Error> {
        let root = self.mine.root;
        let Some(source) = self.calls.get(root) else {
            return Err(Error::InvalidRank {
                rank: root,
                size: self.calls.len(),
                context: format!("group {}", self.label()),
            });
        };
        source.buffer().ok_or_else(|| {
            let members = self.members();
            let who = members
                .get(root)
                .map_or(String::from("?"), usize::to_string);
            self.mismatch(format!("the root, rank {who}, passed no buffer"))
        })
    }

    /// This round's [`Error::Mismatch`], with `detail`.
    fn mismatch(&self, detail: String) -> Error {
        Error::Mismatch {
            op: self.mine.kind,
            group: self.label().to_owned(),
            detail,
        }
    }

    fn label(&self) -> &str {
        self.mine.group.label(self.mesh).unwrap_or("?")
    }

    fn members(&self) -> Vec<usize> {
        self.mine
            .group
            .ranks(self.mesh, self.rank)
            .unwrap_or_default()
    }

    /// `rank {r} {what}` for every member.
    fn each(&self, what: impl Fn(&Call, usize) -> String) -> Vec<String> {
        let members = self.members();
        self.calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let rank = members.get(i).map_or(String::from("?"), usize::to_string);
                format!("rank {rank} {}", what(call, i))
            })
            .collect()
    }
}
