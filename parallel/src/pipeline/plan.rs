//! Which blocks each pipeline stage holds: a model that is a sequence of `n` blocks (the GPT's
//! transformer blocks, a burn-nn `TransformerEncoder`'s layers) split into contiguous runs, one
//! per stage. A split the plan does not allow is a typed error before any step runs.

use std::ops::Range;

use super::schedule::Schedule;
use crate::error::Error;

/// The blocks of each stage, in stage order: contiguous, non-empty, covering `0..n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePlan {
    ranges: Vec<Range<usize>>,
}

impl StagePlan {
    /// `blocks` split into `stages` equal runs; refused when they do not divide (use
    /// [`StagePlan::balanced`] to allow it, or [`StagePlan::explicit`]).
    pub fn even(blocks: usize, stages: usize) -> Result<Self, Error> {
        if stages == 0 || !blocks.is_multiple_of(stages) {
            return Err(Error::InvalidStagePlan(format!(
                "{blocks} blocks do not split evenly into {stages} stages; allow an uneven \
                 split (StagePlan::balanced) or name each stage's blocks (StagePlan::explicit)"
            )));
        }
        Self::balanced(blocks, stages)
    }

    /// `blocks` split into `stages` runs whose sizes differ by at most one, the longer ones
    /// first (the last stage also computes the head and the loss).
    pub fn balanced(blocks: usize, stages: usize) -> Result<Self, Error> {
        if stages == 0 || blocks < stages {
            return Err(Error::InvalidStagePlan(format!(
                "{blocks} blocks cannot fill {stages} stages (every stage needs a block)"
            )));
        }
        let (base, extra) = (blocks / stages, blocks % stages);
        let mut start = 0;
        let ranges = (0..stages)
            .map(|s| {
                let len = base + usize::from(s < extra);
                start += len;
                start - len..start
            })
            .collect();
        Ok(Self { ranges })
    }

    /// The runs given, checked: each non-empty, each starting where the previous ended, the
    /// first at 0 and the last at `blocks`.
    pub fn explicit(blocks: usize, ranges: Vec<Range<usize>>) -> Result<Self, Error> {
        let mut next = 0;
        for (s, r) in ranges.iter().enumerate() {
            if r.start != next || r.is_empty() {
                return Err(Error::InvalidStagePlan(format!(
                    "stage {s} holds blocks {r:?}; each stage needs the blocks from {next} on, \
                     at least one"
                )));
            }
            next = r.end;
        }
        if next != blocks || ranges.is_empty() {
            return Err(Error::InvalidStagePlan(format!(
                "the stages hold blocks 0..{next} of a model of {blocks}"
            )));
        }
        Ok(Self { ranges })
    }

    /// How many stages.
    pub fn stages(&self) -> usize {
        self.ranges.len()
    }

    /// Stage `stage`'s blocks.
    pub fn blocks(&self, stage: usize) -> Range<usize> {
        self.ranges[stage].clone()
    }

    /// Pipeline rank `rank`'s blocks under `schedule`, one run per chunk (its stages
    /// `c·p + rank` in order); refused when the plan's stage count is not the schedule's.
    pub fn chunks(&self, schedule: &Schedule, rank: usize) -> Result<Vec<Range<usize>>, Error> {
        if self.stages() != schedule.stages() {
            return Err(Error::InvalidStagePlan(format!(
                "a plan of {} stages for a schedule of {} ({} ranks × {} stages each)",
                self.stages(),
                schedule.stages(),
                schedule.ranks(),
                schedule.stages() / schedule.ranks()
            )));
        }
        Ok(schedule.stages_of(rank).map(|s| self.blocks(s)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::ScheduleKind;

    #[test]
    fn plans_split_blocks_or_say_why_not() {
        let even = StagePlan::even(8, 4).unwrap();
        assert_eq!(
            (0..4).map(|s| even.blocks(s)).collect::<Vec<_>>(),
            [0..2, 2..4, 4..6, 6..8]
        );
        let e = StagePlan::even(7, 4).unwrap_err();
        assert!(
            matches!(e, Error::InvalidStagePlan(_)) && e.to_string().contains("evenly"),
            "{e}"
        );
        let uneven = StagePlan::balanced(7, 3).unwrap();
        assert_eq!(
            (0..3).map(|s| uneven.blocks(s)).collect::<Vec<_>>(),
            [0..3, 3..5, 5..7]
        );
        assert!(StagePlan::balanced(2, 3).is_err());
        assert!(StagePlan::explicit(6, vec![0..1, 1..6]).is_ok());
        for bad in [
            vec![0..2, 3..6],
            vec![0..3, 3..3, 3..6],
            vec![0..2, 2..5],
            vec![],
        ] {
            assert!(StagePlan::explicit(6, bad.clone()).is_err(), "{bad:?}");
        }
        // Interleaved over 2 ranks, 2 chunks each: rank 1 holds stages 1 and 3.
        let schedule = Schedule::new(ScheduleKind::Interleaved, 2, 4, 2).unwrap();
        assert_eq!(even.chunks(&schedule, 1).unwrap(), [2..4, 6..8]);
        let one_f_one_b = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        assert!(even.chunks(&one_f_one_b, 0).is_err());
    }
}
