//! Pipeline schedules as data: for every rank of the `pp` axis, the ordered list of compute
//! actions it runs in one optimizer step — forward (`F`), full backward (`B`), and the backward
//! split in two for zero-bubble schedules: input gradient (`I`, on the critical path) and weight
//! gradient (`W`, deferrable). The point-to-point traffic follows from the actions: a forward on
//! any stage but the last sends its activation to the next stage, a backward (`B` or `I`) on any
//! stage but the first sends its input gradient to the previous one, and each receives what it
//! needs before it runs. A runner executes the lists; a new schedule is a new list, not a new
//! runner (torchtitan's and PyTorch's `_Action` lists, Megatron's schedules, DeepSpeed's
//! `PipeSchedule` instructions).
//!
//! Stages: with `V` virtual stages per rank (interleaved schedules), stage `s` of `S = p·V` lives
//! on rank `s mod p` (Megatron's model chunk `s / p`); otherwise stage `s` is rank `s`.
//!
//! [`Schedule::simulate`] runs the lists against the dependencies with given action costs and
//! gives each rank's timeline: it refuses a schedule that deadlocks or misses an action (a typed
//! error naming the rank and the action), and measures the bubble and the micro-batches whose
//! activations a rank holds at once — what [`Schedule::table`] and [`Schedule::svg`] draw.
//!
//! | schedule | bubble (uniform costs, no link time) | activations held per rank |
//! |---|---|---|
//! | GPipe | (p−1)/(M+p−1) | M |
//! | 1F1B | (p−1)/(M+p−1) | ≤ p |
//! | interleaved 1F1B, V chunks | (p−1)/(V·M+p−1) | ≤ p·V + p − 1 chunks (Megatron's warm-up) |
//! | ZB-H1 | below 1F1B's: `W`s fill the cool-down | ≤ p, as 1F1B |

use std::fmt;

use crate::error::Error;

/// What a compute action does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Work {
    /// Forward of one micro-batch through the stage.
    Forward,
    /// Full backward: input and weight gradients.
    Backward,
    /// Backward for the input gradient only (zero-bubble's `B`).
    BackwardInput,
    /// Backward for the weight gradients only (zero-bubble's `W`), after the stage's
    /// [`Work::BackwardInput`] for the same micro-batch.
    BackwardWeight,
}

impl Work {
    fn letter(self) -> char {
        match self {
            Work::Forward => 'F',
            Work::Backward => 'B',
            Work::BackwardInput => 'I',
            Work::BackwardWeight => 'W',
        }
    }
}

/// One compute action: `work` on `stage` for micro-batch `microbatch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// What it computes.
    pub work: Work,
    /// The stage (of `S = p·V`).
    pub stage: usize,
    /// The micro-batch (of `M`).
    pub microbatch: usize,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}s{}",
            self.work.letter(),
            self.microbatch,
            self.stage
        )
    }
}

/// The schedules by name (`--pp-schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (GPipe).
    GPipe,
    /// One forward, one backward (PipeDream-flush / Megatron's 1F1B).
    OneFOneB,
    /// 1F1B over `V` model chunks per rank (Megatron's interleaved schedule).
    Interleaved,
    /// Zero bubble ZB-H1: 1F1B's memory, the weight gradients deferred into the bubbles.
    ZeroBubble,
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "gpipe" => Self::GPipe,
            "1f1b" => Self::OneFOneB,
            "interleaved" | "interleaved-1f1b" => Self::Interleaved,
            "zb" | "zb-h1" | "zero-bubble" => Self::ZeroBubble,
            _ => {
                return Err(Error::InvalidSchedule(format!(
                    "unknown pipeline schedule \"{s}\"; the schedules are gpipe, 1f1b, \
                     interleaved, zb"
                )));
            }
        })
    }
}

/// A pipeline schedule: each rank's actions, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    kind: ScheduleKind,
    ranks: usize,
    virtual_stages: usize,
    microbatches: usize,
    actions: Vec<Vec<Action>>,
}

/// The cost of each kind of work, per stage (arbitrary units; the runner measures seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// A forward.
    pub forward: f64,
    /// An input-gradient backward; a full backward costs `backward_input + backward_weight`.
    pub backward_input: f64,
    /// A weight-gradient backward.
    pub backward_weight: f64,
    /// Moving an activation or a gradient to the next rank.
    pub transfer: f64,
}

impl Default for Costs {
    /// The zero-bubble paper's unit costs: F = I = W = 1, free transfers.
    fn default() -> Self {
        Self {
            forward: 1.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            transfer: 0.0,
        }
    }
}

impl Costs {
    fn of(&self, work: Work) -> f64 {
        match work {
            Work::Forward => self.forward,
            Work::Backward => self.backward_input + self.backward_weight,
            Work::BackwardInput => self.backward_input,
            Work::BackwardWeight => self.backward_weight,
        }
    }
}

/// One action placed in time by [`Schedule::simulate`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placed {
    /// The action.
    pub action: Action,
    /// When it starts and ends.
    pub start: f64,
    /// When it ends.
    pub end: f64,
}

/// Every rank's actions in time ([`Schedule::simulate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Per rank, its actions in the order it runs them.
    pub ranks: Vec<Vec<Placed>>,
}

impl Timeline {
    /// When the last action ends.
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .flat_map(|r| r.last().map(|p| p.end))
            .fold(0.0, f64::max)
    }

    /// The fraction of the step rank `rank` is idle (from 0 to the makespan).
    pub fn bubble(&self, rank: usize) -> f64 {
        let busy: f64 = self.ranks[rank].iter().map(|p| p.end - p.start).sum();
        1.0 - busy / self.makespan()
    }

    /// The mean idle fraction over the ranks.
    pub fn mean_bubble(&self) -> f64 {
        (0..self.ranks.len()).map(|r| self.bubble(r)).sum::<f64>() / self.ranks.len() as f64
    }

    /// The most micro-batch activations rank `rank` holds at once: forwards done whose
    /// backward (`B` or `I`) is not, counted per stage it holds (an interleaved rank counts one
    /// per chunk).
    pub fn peak_activations(&self, rank: usize) -> usize {
        let (mut held, mut peak) = (0usize, 0usize);
        for p in &self.ranks[rank] {
            match p.action.work {
                Work::Forward => {
                    held += 1;
                    peak = peak.max(held);
                }
                Work::Backward | Work::BackwardInput => held -= 1,
                Work::BackwardWeight => {}
            }
        }
        peak
    }

    /// The timeline as an SVG picture, 1000 units wide whatever its time unit: one row per rank,
    /// a box per action (forward blue, backward green, input gradient light green, weight
    /// gradient orange) labelled with its micro-batch, idle time blank, each rank's bubble at
    /// the end of its row.
    pub fn svg(&self, title: &str) -> String {
        let span = self.makespan().max(f64::MIN_POSITIVE);
        let (unit, row, left) = (1000.0 / span, 28.0, 70.0);
        let width = left + 1000.0 + 100.0;
        let height = row * self.ranks.len() as f64 + 30.0;
        let mut out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" \
             height=\"{height:.0}\" font-family=\"monospace\" font-size=\"11\">\n\
             <text x=\"4\" y=\"14\">{title}</text>\n"
        );
        for (rank, placed) in self.ranks.iter().enumerate() {
            let y = 20.0 + row * rank as f64;
            out += &format!("<text x=\"4\" y=\"{:.0}\">rank {rank}</text>\n", y + 17.0);
            for p in placed {
                let color = match p.action.work {
                    Work::Forward => "#4a7fd4",
                    Work::Backward => "#3a9a4a",
                    Work::BackwardInput => "#7cc46e",
                    Work::BackwardWeight => "#e69a3a",
                };
                let x = left + p.start * unit;
                let w = (p.end - p.start) * unit;
                out += &format!(
                    "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{:.1}\" \
                     fill=\"{color}\" stroke=\"white\"/><text x=\"{:.1}\" y=\"{:.1}\" \
                     fill=\"white\">{}</text>\n",
                    row - 4.0,
                    x + 3.0,
                    y + 17.0,
                    p.action.microbatch
                );
            }
            out += &format!(
                "<text x=\"{:.1}\" y=\"{:.0}\">bubble {:.1}%</text>\n",
                left + 1000.0 + 6.0,
                y + 17.0,
                100.0 * self.bubble(rank)
            );
        }
        out += "</svg>\n";
        out
    }
}

impl Schedule {
    /// The schedule `kind` for `ranks` pipeline ranks, `microbatches` micro-batches and
    /// `virtual_stages` stages per rank (1 except for [`ScheduleKind::Interleaved`], which
    /// needs 2 or more and a micro-batch count that is a multiple of the ranks, as Megatron's).
    pub fn new(
        kind: ScheduleKind,
        ranks: usize,
        microbatches: usize,
        virtual_stages: usize,
    ) -> Result<Self, Error> {
        let invalid = |reason: String| Err(Error::InvalidSchedule(reason));
        if ranks == 0 || microbatches == 0 || virtual_stages == 0 {
            return invalid(format!(
                "a pipeline needs at least one rank, micro-batch and stage per rank (got \
                 {ranks} ranks, {microbatches} micro-batches, {virtual_stages} stages per rank)"
            ));
        }
        match kind {
            ScheduleKind::Interleaved if virtual_stages < 2 => {
                return invalid(
                    "the interleaved schedule needs 2 or more virtual stages per rank \
                     (--pp-virtual)"
                        .into(),
                );
            }
            ScheduleKind::Interleaved if !microbatches.is_multiple_of(ranks) => {
                return invalid(format!(
                    "the interleaved schedule needs a micro-batch count that is a multiple of \
                     the pipeline ranks: {microbatches} micro-batches on {ranks} ranks"
                ));
            }
            ScheduleKind::Interleaved => {}
            _ if virtual_stages != 1 => {
                return invalid(format!(
                    "{kind:?} runs one stage per rank; --pp-virtual {virtual_stages} is for the \
                     interleaved schedule"
                ));
            }
            _ => {}
        }
        let actions = (0..ranks)
            .map(|r| match kind {
                ScheduleKind::GPipe => gpipe(r, microbatches),
                ScheduleKind::OneFOneB => one_f_one_b(r, ranks, microbatches),
                ScheduleKind::Interleaved => interleaved(r, ranks, microbatches, virtual_stages),
                ScheduleKind::ZeroBubble => zero_bubble_h1(r, ranks, microbatches),
            })
            .collect();
        let schedule = Self {
            kind,
            ranks,
            virtual_stages,
            microbatches,
            actions,
        };
        schedule.check()?;
        Ok(schedule)
    }

    /// A schedule from explicit per-rank action lists (checked as [`Schedule::new`]'s are).
    pub fn from_actions(
        kind: ScheduleKind,
        microbatches: usize,
        virtual_stages: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Self, Error> {
        let schedule = Self {
            kind,
            ranks: actions.len(),
            virtual_stages,
            microbatches,
            actions,
        };
        schedule.check()?;
        Ok(schedule)
    }

    /// Which schedule this is.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Pipeline ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Stages over all ranks (`p·V`).
    pub fn stages(&self) -> usize {
        self.ranks * self.virtual_stages
    }

    /// Rank `rank`'s stages, chunk by chunk: `c·p + rank` for `c = 0, 1, …, V − 1`.
    pub fn stages_of(&self, rank: usize) -> impl Iterator<Item = usize> + use<> {
        (rank..self.stages()).step_by(self.ranks)
    }

    /// Micro-batches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The rank stage `stage` runs on.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.ranks
    }

    /// Rank `rank`'s actions, in order.
    pub fn actions(&self, rank: usize) -> &[Action] {
        &self.actions[rank]
    }

    /// The point-to-point messages rank `rank` sends and receives in one step: an activation
    /// to the next stage's rank after every forward but the last stage's, an input gradient to
    /// the previous stage's rank after every backward (`B` or `I`) but the first stage's; each
    /// received by the rank that needs it. Messages between stages on one rank are not counted.
    pub fn p2p_counts(&self, rank: usize) -> (usize, usize) {
        let last = self.stages() - 1;
        let other = |stage: usize| usize::from(self.rank_of(stage) != rank);
        let (mut sends, mut recvs) = (0, 0);
        for a in &self.actions[rank] {
            let (to, from) = match a.work {
                Work::Forward => (a.stage.checked_add(1), a.stage.checked_sub(1)),
                Work::Backward | Work::BackwardInput => {
                    (a.stage.checked_sub(1), a.stage.checked_add(1))
                }
                Work::BackwardWeight => continue,
            };
            sends += to.filter(|&s| s <= last).map_or(0, other);
            recvs += from.filter(|&s| s <= last).map_or(0, other);
        }
        (sends, recvs)
    }

    /// Every rank holds exactly its stages' actions: a forward and a backward (`B`, or `I` then
    /// `W`) for every micro-batch, each once.
    fn check(&self) -> Result<(), Error> {
        use std::collections::HashSet;
        let invalid = |reason: String| Err(Error::InvalidSchedule(reason));
        for (rank, list) in self.actions.iter().enumerate() {
            let mut seen = HashSet::new();
            for a in list {
                if a.stage >= self.stages() || self.rank_of(a.stage) != rank {
                    return invalid(format!("rank {rank} runs {a}, a stage of another rank"));
                }
                if a.microbatch >= self.microbatches {
                    return invalid(format!("rank {rank} runs {a}: no such micro-batch"));
                }
                if !seen.insert(*a) {
                    return invalid(format!("rank {rank} runs {a} twice"));
                }
                if a.work == Work::BackwardWeight {
                    let input = Action {
                        work: Work::BackwardInput,
                        ..*a
                    };
                    if !seen.contains(&input) {
                        return invalid(format!("rank {rank} runs {a} before its input gradient"));
                    }
                }
            }
            for stage in self.stages_of(rank) {
                for microbatch in 0..self.microbatches {
                    let has = |work| {
                        seen.contains(&Action {
                            work,
                            stage,
                            microbatch,
                        })
                    };
                    let split = has(Work::BackwardInput) && has(Work::BackwardWeight);
                    if !has(Work::Forward) || has(Work::Backward) == split {
                        return invalid(format!(
                            "rank {rank} does not run micro-batch {microbatch} of stage {stage} \
                             forward and backward exactly once"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs every rank's list in order against the dependencies — a forward after the previous
    /// stage's forward of the micro-batch, a backward after its own forward and the next
    /// stage's backward (`B` or `I`), a `W` after its `I` — each action as early as its rank and
    /// its inputs allow, `costs.transfer` added across ranks. Fails with
    /// [`Error::ScheduleDeadlock`] when no rank can go on (naming what each waits for).
    pub fn simulate(&self, costs: &Costs) -> Result<Timeline, Error> {
        use std::collections::HashMap;
        let mut done: HashMap<(Work, usize, usize), (f64, usize)> = HashMap::new();
        let mut next = vec![0usize; self.ranks];
        let mut free = vec![0.0f64; self.ranks];
        let mut placed: Vec<Vec<Placed>> = vec![Vec::new(); self.ranks];
        let last = self.stages() - 1;
        let total: usize = self.actions.iter().map(Vec::len).sum();
        let mut count = 0;
        while count < total {
            let mut progressed = false;
            for rank in 0..self.ranks {
                while let Some(&a) = self.actions[rank].get(next[rank]) {
                    let key = |work, stage| (work, stage, a.microbatch);
                    let backward_of = |stage| {
                        done.get(&key(Work::Backward, stage))
                            .or_else(|| done.get(&key(Work::BackwardInput, stage)))
                    };
                    let deps: Vec<Option<&(f64, usize)>> = match a.work {
                        Work::Forward if a.stage > 0 => {
                            vec![done.get(&key(Work::Forward, a.stage - 1))]
                        }
                        Work::Forward => vec![],
                        Work::Backward | Work::BackwardInput => {
                            let mut d = vec![done.get(&key(Work::Forward, a.stage))];
                            if a.stage < last {
                                d.push(backward_of(a.stage + 1));
                            }
                            d
                        }
                        Work::BackwardWeight => {
                            vec![done.get(&key(Work::BackwardInput, a.stage))]
                        }
                    };
                    if deps.iter().any(Option::is_none) {
                        break;
                    }
                    let ready = deps
                        .iter()
                        .flatten()
                        .map(|&&(end, on)| end + if on == rank { 0.0 } else { costs.transfer })
                        .fold(free[rank], f64::max);
                    let end = ready + costs.of(a.work);
                    done.insert(key(a.work, a.stage), (end, rank));
                    placed[rank].push(Placed {
                        action: a,
                        start: ready,
                        end,
                    });
                    free[rank] = end;
                    next[rank] += 1;
                    count += 1;
                    progressed = true;
                }
            }
            if !progressed {
                let waiting = (0..self.ranks)
                    .filter_map(|r| {
                        self.actions[r]
                            .get(next[r])
                            .map(|a| format!("rank {r} at {a}"))
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(Error::ScheduleDeadlock(waiting));
            }
        }
        Ok(Timeline { ranks: placed })
    }

    /// The schedule as a table, one row per rank and one column per time unit of a simulation
    /// with the default [`Costs`] (`F` = `I` = `W` = 1 unit, `B` = 2), each cell the action
    /// running then (`F3` forward of micro-batch 3; `.3` stage suffix when interleaved) or `.`
    /// for idle, and each rank's bubble: what `--pp-schedule-dump` prints.
    pub fn table(&self) -> Result<String, Error> {
        let timeline = self.simulate(&Costs::default())?;
        let span = timeline.makespan().round() as usize;
        let cell = |a: &Action| {
            if self.virtual_stages > 1 {
                format!(
                    "{}{}.{}",
                    a.work.letter(),
                    a.microbatch,
                    a.stage / self.ranks
                )
            } else {
                format!("{}{}", a.work.letter(), a.microbatch)
            }
        };
        let width = timeline
            .ranks
            .iter()
            .flatten()
            .map(|p| cell(&p.action).len())
            .max()
            .unwrap_or(1);
        let mut out = format!(
            "{:?}: {} ranks, {} micro-batches, {} stage(s) per rank; F = I = W = 1, B = 2\n",
            self.kind, self.ranks, self.microbatches, self.virtual_stages
        );
        for (rank, row) in timeline.ranks.iter().enumerate() {
            let mut cells = vec![".".to_string(); span];
            for p in row {
                for slot in cells
                    .iter_mut()
                    .take(p.end.round() as usize)
                    .skip(p.start.round() as usize)
                {
                    *slot = cell(&p.action);
                }
            }
            let cells: Vec<String> = cells.iter().map(|c| format!("{c:>width$}")).collect();
            out += &format!(
                "rank {rank}: {}  bubble {:.1}%\n",
                cells.join(" "),
                100.0 * timeline.bubble(rank)
            );
        }
        Ok(out)
    }

    /// The timeline of a simulation with `costs` as an SVG picture ([`Timeline::svg`]).
    pub fn svg(&self, costs: &Costs) -> Result<String, Error> {
        let title = format!(
            "{:?}: p = {}, M = {}, V = {} (simulated)",
            self.kind, self.ranks, self.microbatches, self.virtual_stages
        );
        Ok(self.simulate(costs)?.svg(&title))
    }
}

fn action(work: Work, stage: usize, microbatch: usize) -> Action {
    Action {
        work,
        stage,
        microbatch,
    }
}

/// GPipe: every forward, then every backward (in micro-batch order).
fn gpipe(rank: usize, m: usize) -> Vec<Action> {
    let forwards = (0..m).map(|i| action(Work::Forward, rank, i));
    forwards
        .chain((0..m).map(|i| action(Work::Backward, rank, i)))
        .collect()
}

/// 1F1B: `p − r − 1` warm-up forwards, then one forward and one backward in turn, then the
/// remaining backwards.
fn one_f_one_b(rank: usize, p: usize, m: usize) -> Vec<Action> {
    let warmup = (p - rank - 1).min(m);
    let mut out: Vec<Action> = (0..warmup)
        .map(|i| action(Work::Forward, rank, i))
        .collect();
    for i in 0..m - warmup {
        out.push(action(Work::Forward, rank, warmup + i));
        out.push(action(Work::Backward, rank, i));
    }
    out.extend((m - warmup..m).map(|i| action(Work::Backward, rank, i)));
    out
}

/// Megatron's interleaved 1F1B: rank `r` holds stages `c·p + r` for chunks `c < V`; its `k`-th
/// forward is chunk `(k / p) mod V` of micro-batch `(k / (p·V))·p + k mod p`, its `k`-th
/// backward the same with the chunks in reverse; `(p − r − 1)·2 + (V − 1)·p` warm-up forwards
/// (all of them when `M = p`), then one forward and one backward in turn.
fn interleaved(rank: usize, p: usize, m: usize, v: usize) -> Vec<Action> {
    let total = m * v;
    let at = |k: usize, forward: bool| {
        let chunk = (k / p) % v;
        let chunk = if forward { chunk } else { v - 1 - chunk };
        let microbatch = (k / (p * v)) * p + k % p;
        let work = if forward {
            Work::Forward
        } else {
            Work::Backward
        };
        action(work, chunk * p + rank, microbatch)
    };
    let warmup = if m == p {
        total
    } else {
        ((p - rank - 1) * 2 + (v - 1) * p).min(total)
    };
    let mut out: Vec<Action> = (0..warmup).map(|k| at(k, true)).collect();
    for k in 0..total - warmup {
        out.push(at(warmup + k, true));
        out.push(at(k, false));
    }
    out.extend((total - warmup..total).map(|k| at(k, false)));
    out
}

/// ZB-H1 (the zero-bubble paper's handcrafted schedule, DeepSpeed's `ZeroBubbleH1Pipeline`):
/// 1F1B's `p − r − 1` warm-up forwards; then `r` rounds of a forward and an input gradient
/// (`I`), the weight gradients held back; then a forward, an `I` and a `W` in turn; the
/// remaining `I`s with their `W`s; the held-back `W`s last, in the cool-down bubble 1F1B leaves.
/// The first stage has no input gradient to send: it runs full backwards, and its `W`s are not
/// held back.
fn zero_bubble_h1(rank: usize, p: usize, m: usize) -> Vec<Action> {
    let warmup = (p - rank - 1).min(m);
    let mut out: Vec<Action> = (0..warmup)
        .map(|i| action(Work::Forward, rank, i))
        .collect();
    let (mut forward, mut backward, mut weight) = (warmup, 0, 0);
    // The next backward; its weight gradient too unless held back.
    let mut backward_step = |out: &mut Vec<Action>, hold: bool| {
        if rank == 0 {
            out.push(action(Work::Backward, rank, backward));
            weight += 1;
        } else {
            out.push(action(Work::BackwardInput, rank, backward));
            if !hold {
                out.push(action(Work::BackwardWeight, rank, weight));
                weight += 1;
            }
        }
        backward += 1;
    };
    for round in 0..m - warmup {
        out.push(action(Work::Forward, rank, forward));
        forward += 1;
        backward_step(&mut out, round < rank);
    }
    for _ in 0..warmup {
        backward_step(&mut out, false);
    }
    let weight = if rank == 0 {
        m
    } else {
        m - rank.min(m - warmup)
    };
    out.extend((weight..m).map(|i| action(Work::BackwardWeight, rank, i)));
    out
}

#[cfg(test)]
mod tests;
