//! Backward passes that run collectives, one stage group at a time in a process.
//!
//! Burn 0.21's autodiff ends every backward pass by locking every graph of the process in turn
//! (`GraphCleaner::cleanup_orphaned_entries`), and a backward pass holds its own graph's lock
//! from start to end. With ranks as threads, a rank whose backward waits in a collective (a
//! tensor-parallel all-reduce, an FSDP parameter gather) holds its lock until its peer joins;
//! if that peer waits for a message from a third rank that is itself cleaning up — blocked on
//! the first rank's lock — no rank moves again. Outside a pipeline one world-wide barrier after
//! each backward keeps the passes apart; in a pipeline the stages' backwards interleave, so here
//! a stage group (the ranks of one stage: every mesh axis but `pp`) takes a process-wide turn
//! for each backward action: all its members ready (a barrier over the group), its leader takes
//! the turn, the members run the backward and its cleanup together, a barrier, the turn freed.
//! Inside a turn nothing waits on a rank outside it; outside turns no rank holds a graph lock
//! while it waits. Needed only when backward passes communicate (tensor parallelism inside a
//! stage, parameters sharded over a data axis, ring attention over a context axis, the
//! experts' all-to-alls over an expert axis); the serialisation costs the stages' backward
//! overlap within one process, not the results.

use std::sync::{Condvar, Mutex};

use crate::comm::{Communicator, Group};
use crate::device::RankContext;
use crate::error::Error;
use crate::mesh::{AxisKind, CONTEXT_AXIS, EXPERT_AXIS};

static HELD: Mutex<bool> = Mutex::new(false);
static FREED: Condvar = Condvar::new();

/// The process-wide turn, held while alive.
struct Turn;

impl Turn {
    fn take() -> Self {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        while *held {
            held = FREED.wait(held).unwrap_or_else(|e| e.into_inner());
        }
        *held = true;
        Turn
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        *HELD.lock().unwrap_or_else(|e| e.into_inner()) = false;
        FREED.notify_all();
    }
}

/// A rank's stage group, when its backward passes communicate.
#[derive(Clone, Debug)]
pub struct StageGroup {
    /// The mesh axes of the group (every axis but the pipeline's, of size above 1).
    axes: Vec<usize>,
    /// The member that takes the turn (coordinate 0 on every axis of the group).
    leader: bool,
}

impl StageGroup {
    /// `None` when the rank's backward passes run no collective: no model, context or expert
    /// axis besides the pipeline's has more than one rank, and no parameter rests sharded over a
    /// data axis.
    pub fn of(ctx: &RankContext, pipeline_axis: usize) -> Result<Option<Self>, Error> {
        let mesh = ctx.mesh();
        let axes: Vec<usize> = (0..mesh.axes().len())
            .filter(|&a| a != pipeline_axis && mesh.axis_size(a) > 1)
            .collect();
        // A model axis (tp), the context axis (the ring's key/value blocks and their
        // gradients travel in the attention's backward) and the expert axis (the dispatch's
        // and combine's all-to-alls run again, transposed) communicate in every backward.
        let communicating = axes.iter().any(|&a| {
            let axis = mesh.axis(a);
            axis.kind == AxisKind::Model || axis.name == CONTEXT_AXIS || axis.name == EXPERT_AXIS
        });
        let sharded = ctx.with_policy(|p| !p.sharding.param_shard_axes.is_empty());
        if !(communicating || sharded) {
            return Ok(None);
        }
        let mut leader = true;
        for &a in &axes {
            leader &= Group::Axis(a).index(mesh, ctx.rank())? == 0;
        }
        Ok(Some(Self { axes, leader }))
    }

    /// Every member of the group has reached this point: a barrier over each of its axes in
    /// turn (after the last, every member of the product has arrived).
    pub fn barrier(&self, comm: &dyn Communicator) -> Result<(), Error> {
        self.axes
            .iter()
            .try_for_each(|&a| comm.barrier(Group::Axis(a)))
    }

    /// Run `backward` (one backward action of the group's stage) in the group's turn.
    pub(crate) fn in_turn<T>(
        &self,
        comm: &dyn Communicator,
        backward: impl FnOnce() -> T,
    ) -> Result<T, Error> {
        self.barrier(comm)?;
        let turn = self.leader.then(Turn::take);
        self.barrier(comm)?;
        let out = backward();
        self.barrier(comm)?;
        drop(turn);
        Ok(out)
    }
}
