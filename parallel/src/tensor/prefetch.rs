//! FSDP prefetch: a sharded parameter's all-gather issued before the op that needs it.
//!
//! Each step, the training loop hands the rank the step's parameters in the model's order
//! ([`crate::prefetch_parameters`]). The rank records the order in which the step gathers them
//! (forward, backward, recomputation: every use), and in the next step follows that order: when
//! a gather is asked for, the next [`RankPolicy::prefetch`](crate::RankPolicy) gathers of the
//! recorded order are already issued on the rank's communication queue
//! ([`crate::comm::CommQueue`]), so they run while this op and the next ones compute — in forward
//! the next blocks' parameters, in backward the previous blocks' (PyTorch FSDP's forward and
//! backward prefetch, from the recorded execution order as FSDP1 does). The gathers, their
//! number and their results are those of the blocking path; only their timing moves. A step that
//! leaves the recorded order (another program path) stops prefetching for the rest of the step
//! and gathers as it goes; every rank runs the same program, so every rank leaves it alike.
//!
//! In flight: at most `prefetch` gathers beyond the one in use, their bytes counted as gathered
//! in the rank's accounting from their issue.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use burn_backend::Backend;

use super::{DTensor, PendingGather};
use crate::device::RankContext;
use crate::error::Error;
use crate::placement::Layout;

/// A rank's prefetch state for backend `B` (kept type-erased in its context).
pub(crate) struct Prefetch<B: Backend> {
    /// Gathers in flight ahead of the one in use.
    depth: usize,
    /// This step's parameters (the model's order), until the gradients are synced.
    params: Vec<DTensor<B>>,
    /// A parameter's identity → its index in `params`.
    index: HashMap<usize, usize>,
    /// The gathers of the last step, in order: (parameter index, target layout).
    recorded: Arc<Vec<(usize, Layout)>>,
    /// This step's gathers so far.
    recording: Vec<(usize, Layout)>,
    /// Where this step is in `recorded`, and how far it has issued.
    cursor: usize,
    issued: usize,
    /// Issued gathers by their place in `recorded`, oldest first.
    pending: VecDeque<(usize, PendingGather<B>)>,
    /// This step has followed `recorded` so far.
    following: bool,
}

/// Start a step: `params` (the model's order) are this step's parameters; the first gathers of
/// the last step's order are issued at once. `depth` 0 turns prefetching off.
pub(crate) fn start_step<B: Backend>(ctx: &RankContext, params: Vec<DTensor<B>>, depth: usize) {
    ctx.with_prefetch::<Prefetch<B>, _>(|state| {
        let recorded = match state.take() {
            Some(old) => old.finish(ctx),
            None => Arc::default(),
        };
        if depth == 0 {
            return;
        }
        let index = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.identity(), i))
            .collect();
        let mut next = Prefetch {
            depth,
            params,
            index,
            recorded: recorded.clone(),
            recording: Vec::new(),
            cursor: 0,
            issued: 0,
            pending: VecDeque::new(),
            // The first step records the order; the next ones follow it.
            following: !recorded.is_empty(),
        };
        next.issue_ahead(ctx);
        *state = Some(next);
    });
}

/// The step's gradients are synced: its parameters are let go (the optimizer replaces them) and
/// any gather still in flight is dropped; the recorded order stays for the next step.
pub(crate) fn end_step<B: Backend>(ctx: &RankContext) {
    ctx.with_prefetch::<Prefetch<B>, _>(|state| {
        if let Some(s) = state.as_mut() {
            s.params.clear();
            s.index.clear();
            s.drop_pending(ctx);
        }
    });
}

/// The gather of `t` to `target`, if it is a parameter's gather this step planned: served by the
/// prefetch (issued earlier), the next ones issued first. `None`: gather it now.
pub(crate) fn take<B: Backend>(
    t: &DTensor<B>,
    target: &Layout,
) -> Option<Result<DTensor<B>, Error>> {
    let (axis, dim) = t.parameter_gather(target)?;
    let ctx = t.device.context();
    let pending = ctx.with_prefetch::<Prefetch<B>, _>(|state| {
        let s = state.as_mut()?;
        let &param = s.index.get(&t.identity())?;
        s.recording.push((param, target.clone()));
        if !s.following {
            return None;
        }
        let expected = s.recorded.get(s.cursor);
        if expected != Some(&(param, target.clone())) {
            // Another path than the last step's: gather as we go for the rest of this step.
            s.following = false;
            ctx.count_prefetch(|c| c.diverged += 1);
            s.drop_pending(ctx);
            return None;
        }
        let position = s.cursor;
        s.cursor += 1;
        let mine = match s.pending.front() {
            Some((p, _)) if *p == position => {
                ctx.count_prefetch(|c| c.used += 1);
                s.pending.pop_front().map(|(_, g)| g)
            }
            _ => None,
        };
        // Not issued ahead (the step's first gathers past the depth): issue it now, before the
        // next ones, then keep `depth` gathers in flight beyond it.
        let mine = mine.unwrap_or_else(|| {
            s.issued = s.issued.max(s.cursor);
            t.issue_gather(axis, dim)
        });
        s.issue_ahead(ctx);
        Some(mine)
    })?;
    debug_assert_eq!(t.parameter_gather(target), Some((axis, dim)));
    Some(t.finish_gather(pending, target))
}

impl<B: Backend> Prefetch<B> {
    fn issue_ahead(&mut self, ctx: &RankContext) {
        let end = (self.cursor + self.depth).min(self.recorded.len());
        while self.issued < end {
            let position = self.issued;
            self.issued += 1;
            let (param, target) = &self.recorded[position];
            let Some(p) = self.params.get(*param) else {
                continue;
            };
            let Some((axis, dim)) = p.parameter_gather(target) else {
                continue;
            };
            self.pending
                .push_back((position, p.issue_gather(axis, dim)));
            ctx.count_prefetch(|c| c.issued += 1);
        }
    }

    fn drop_pending(&mut self, ctx: &RankContext) {
        let wasted = self.pending.len() as u64;
        if wasted > 0 {
            ctx.count_prefetch(|c| c.wasted += wasted);
        }
        // Dropped unwaited: the calls still run on the queue, in order; their results are let go.
        self.pending.clear();
        self.issued = self.recorded.len();
    }

    /// The order to follow next step: this step's, when it gathered any planned parameter.
    fn finish(mut self, ctx: &RankContext) -> Arc<Vec<(usize, Layout)>> {
        self.drop_pending(ctx);
        if self.recording.is_empty() {
            self.recorded
        } else {
            Arc::new(self.recording)
        }
    }
}
