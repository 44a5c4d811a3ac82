//! Keeping a job going when a rank is lost (`--max-restarts`, torchelastic's restarts): the
//! failed attempt's ranks all return (a dead rank's peers fail at once, a hung rank's after the
//! collective timeout), the lost ranks are named from the typed errors, the mesh is re-formed
//! without their data-parallel replicas, and the run resumes from the latest checkpoint of
//! `--save`, resharded onto the smaller mesh, with the same global batch. With
//! `--restart-grace`, a lost rank whose device answers a probe within the grace is replaced
//! instead (its replica stays). The `--fail-at` test hook makes a rank fail on purpose.
//!
//! What a thread cannot do: a rank stuck in its own computation (not in a collective) cannot be
//! ended from outside its thread; its peers time out and fail, but the launch waits for it. A
//! rank stuck inside a collective is released by the world's abort, and handled like a dead one.

use super::{
    CheckpointState, FailAt, PretrainConfig, PretrainError, Restart, RunSummary, run_once,
};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use wildfire_checkpoint::CheckpointDir;
use wildfire_checkpoint::dcp::{MemoryCheckpoints, MemoryFiles, read_state_file};
use wildfire_kernels::FusedOps;
use wildfire_parallel::DeviceLaunch;
use wildfire_parallel::comm::Communicator;

impl FailAt {
    /// Rank `rank` at the start of step `step`: fail if this is the hook's step and rank. A
    /// dead rank panics; a hung one polls only for the world's abort (a peer's timeout), then
    /// fails as a rank released from a collective does. Where the communicator cannot tell of
    /// an abort (MPI: its watchdog ends the job), it gives up after three timeouts.
    pub(crate) fn strike(
        &self,
        step: usize,
        rank: usize,
        comm: &dyn Communicator,
        timeout: Duration,
    ) -> Result<(), PretrainError> {
        if (self.step, self.rank) != (step, rank) {
            return Ok(());
        }
        if !self.hang {
            panic!(
                "--fail-at {self}: rank {rank} killed at the start of step {step} (a test hook)"
            );
        }
        tracing::warn!("--fail-at {self}: rank {rank} hangs at the start of step {step}");
        let started = Instant::now();
        loop {
            if let Some((rank, reason)) = comm.aborted() {
                return Err(wildfire_parallel::Error::PeerFailed { rank, reason }.into());
            }
            if started.elapsed() > 3 * timeout {
                return Err(PretrainError::Config(format!(
                    "--fail-at {self}: rank {rank} hung for three timeouts and no peer aborted \
                     the job (a world of one rank, or a communicator that cannot tell)"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// What an elastic run gives one attempt: where rank 0 records its progress, the store of the
/// checkpoints held in memory, and the one in memory to resume from.
pub(crate) struct Attempt {
    pub progress: Progress,
    /// The restart this attempt is, and when it was decided (its first step's metrics carry it,
    /// timed).
    pub restart: Option<(Restart, Instant)>,
    pub memory: Option<Arc<MemoryCheckpoints>>,
    /// (the checkpoint's name, for errors; its files).
    pub from_memory: Option<(PathBuf, Arc<MemoryFiles>)>,
}

/// Where an attempt got to, recorded by its rank 0 (instants since `origin`, in nanoseconds
/// plus one; 0: not yet).
#[derive(Debug)]
pub(crate) struct Progress {
    origin: Instant,
    launched: AtomicU64,
    looping: AtomicU64,
    stepped: AtomicU64,
    steps: AtomicUsize,
}

impl Progress {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            launched: AtomicU64::new(0),
            looping: AtomicU64::new(0),
            stepped: AtomicU64::new(0),
            steps: AtomicUsize::new(0),
        }
    }

    fn mark(&self, slot: &AtomicU64) {
        let nanos = self.origin.elapsed().as_nanos() as u64 + 1;
        slot.store(nanos, Ordering::Relaxed);
    }

    /// `restart`, decided at `decided`, with its re-forming and reloading timed from this
    /// attempt's progress.
    pub fn timed(&self, restart: &Restart, decided: Instant) -> Restart {
        let launched = self.at(&self.launched);
        let looping = self.at(&self.looping);
        Restart {
            reform: launched.map_or(0.0, |t| (t - decided).as_secs_f64()),
            reload: match (launched, looping) {
                (Some(a), Some(b)) => (b - a).as_secs_f64(),
                _ => 0.0,
            },
            ..restart.clone()
        }
    }

    fn at(&self, slot: &AtomicU64) -> Option<Instant> {
        match slot.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.origin + Duration::from_nanos(n - 1)),
        }
    }

    /// The ranks started.
    pub fn launched(&self) {
        self.mark(&self.launched);
    }

    /// The model is built and loaded: the step loop begins at step `first`.
    pub fn looping(&self, first: usize) {
        self.steps.store(first, Ordering::Relaxed);
        self.mark(&self.looping);
    }

    /// `steps` steps are completed (every rank took part in the last one's collectives).
    pub fn stepped(&self, steps: usize) {
        self.steps.store(steps, Ordering::Relaxed);
        self.mark(&self.stepped);
    }
}

/// The ranks a failed attempt lost, from its root-cause error: a rank that panicked, or the
/// ranks a collective timed out waiting for. `None`: a failure no restart mends (bad input, a
/// non-finite loss, a checkpoint that cannot be read, …).
pub fn lost_ranks(error: &PretrainError) -> Option<Vec<usize>> {
    fn of(error: &wildfire_parallel::Error) -> Option<Vec<usize>> {
        use wildfire_parallel::Error as E;
        match error {
            E::RankFailed { rank, .. } => Some(vec![*rank]),
            E::Timeout { missing, .. } if !missing.is_empty() => Some(missing.clone()),
            E::OnRank { error, .. } => of(error),
            _ => None,
        }
    }
    match error {
        PretrainError::Parallel(e) => of(e),
        _ => None,
    }
}

/// The configuration to restart `config` with after losing `lost`: the data-parallel replicas
/// holding a lost rank removed (the model axes stay whole), the global batch kept with at most
/// the micro-batch each rank had (more accumulation where it would grow), the hook off.
pub fn shrink(config: &PretrainConfig, lost: &[usize]) -> Result<PretrainConfig, PretrainError> {
    let next = shrunk(config, lost)?;
    next.check()?;
    Ok(next)
}

/// [`shrink`] without checking the rest of the configuration.
fn shrunk(config: &PretrainConfig, lost: &[usize]) -> Result<PretrainConfig, PretrainError> {
    let p = &config.parallel;
    let mesh = p.mesh()?;
    let replicas: BTreeSet<usize> = lost
        .iter()
        .filter(|&&rank| rank < mesh.world_size())
        .map(|&rank| mesh.data_index(rank).0)
        .collect();
    let cannot = |why: String| {
        PretrainError::Config(format!(
            "cannot restart after losing rank(s) {lost:?} of mesh {mesh}: {why}"
        ))
    };
    let dp = p.dp - replicas.len().min(p.dp);
    if dp == 0 {
        return Err(cannot(format!(
            "no data-parallel replica is left (--dp {}), and the model axes (--tp {}, --pp {}, \
             --cp {}) cannot shrink",
            p.dp, p.tp, p.pp, p.cp
        )));
    }
    if p.ep > 1 && !dp.is_multiple_of(p.ep) {
        return Err(cannot(format!(
            "the {dp} data-parallel ranks left are not a multiple of --ep {}: the expert axis \
             cannot shrink",
            p.ep
        )));
    }
    if let Some(shard) = p.dp_shard
        && !dp.is_multiple_of(shard)
    {
        return Err(cannot(format!(
            "the {dp} data-parallel ranks left do not make whole HSDP shard groups of \
             --dp-shard {shard}"
        )));
    }
    let pipelined = p.pp > 1;
    let count = micro_batches(config);
    let batch = config.batch_size;
    let micro = batch / (p.dp * count);
    let fits = |n: usize| batch.is_multiple_of(dp * n) && batch / (dp * n) <= micro;
    let count = (count..=batch).find(|&n| fits(n)).ok_or_else(|| {
        cannot(format!(
            "--batch-size {batch} does not split into {dp} ranks × N micro-batches of at most \
             {micro} rows (the global batch is kept): choose a batch size divisible by every \
             data-parallel degree the job may shrink to"
        ))
    })?;
    let mut next = config.clone();
    next.parallel.dp = dp;
    if pipelined {
        next.parallel.microbatches = count;
    } else {
        next.accum = count;
    }
    next.fail_at = None;
    Ok(next)
}

/// The lost ranks (of `lost`) replaced within `grace`: each is probed (`answers`) until it
/// answers or the grace ends, the others again every 100 ms.
fn wait_for_replacements(
    lost: &[usize],
    grace: Duration,
    mut answers: impl FnMut(usize) -> bool,
) -> Vec<usize> {
    let deadline = Instant::now() + grace;
    let mut waiting = lost.to_vec();
    let mut replaced = Vec::new();
    loop {
        waiting.retain(|&rank| {
            let back = answers(rank);
            if back {
                tracing::info!("rank {rank}'s device answers: a replacement joins");
                replaced.push(rank);
            }
            !back
        });
        let left = deadline.saturating_duration_since(Instant::now());
        if waiting.is_empty() || left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(Duration::from_millis(100)));
    }
    if !waiting.is_empty() {
        tracing::warn!(
            "no replacement for rank(s) {waiting:?} within --restart-grace {:.1} s",
            grace.as_secs_f64()
        );
    }
    replaced.sort_unstable();
    replaced
}

/// Whether `device` answers within `within`: a small tensor made on it and read back, on a
/// thread of its own (a device that hangs or panics does not answer).
fn device_answers<B: burn::tensor::backend::Backend>(device: B::Device, within: Duration) -> bool {
    use burn::tensor::Tensor;
    let (tx, rx) = std::sync::mpsc::channel();
    let probe = std::thread::Builder::new()
        .name("wildfire-device-probe".into())
        .spawn(move || {
            let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let values = [1.0f32, 2.0, 3.0];
                let t = Tensor::<B, 1>::from_floats(values, &device) * 2.0;
                t.into_data().to_vec::<f32>().ok() == Some(vec![2.0, 4.0, 6.0])
            }));
            let _ = tx.send(read.unwrap_or(false));
        });
    probe.is_ok() && rx.recv_timeout(within).unwrap_or(false)
}

/// Micro-batches per step: `--microbatches` under `--pp`, else `--accum`.
fn micro_batches(config: &PretrainConfig) -> usize {
    if config.parallel.pp > 1 {
        config.parallel.microbatches
    } else {
        config.accum
    }
}

/// Run `config`, restarting it up to `--max-restarts` times when a rank is lost.
pub(crate) fn run_elastic<B: FusedOps, D: DeviceLaunch<B>>(
    config: &PretrainConfig,
    device: &B::Device,
    support: &D,
) -> Result<RunSummary, PretrainError> {
    if config.max_restarts == 0 {
        return run_once::<B, D>(config, device, support, None);
    }
    // The first restart must be possible: a job that could only fail after losing a rank is
    // refused now, not after hours of training.
    let last = config.parallel.mesh()?.world_size() - 1;
    shrunk(config, &[last]).map_err(|e| {
        PretrainError::Config(format!("--max-restarts {}: {e}", config.max_restarts))
    })?;
    let started = Instant::now();
    let save = config
        .save
        .clone()
        .expect("checked: --max-restarts needs --save");
    let mut attempt = config.clone();
    let memory = config.memory_checkpoints.then(MemoryCheckpoints::new);
    let mut from_memory = None;
    let mut restarts: Vec<Restart> = Vec::new();
    // A restart whose re-forming and reloading the next attempt measures, and when it began.
    let mut measuring: Option<(Restart, Instant)> = None;
    loop {
        let attempt_started = Instant::now();
        let this = Attempt {
            progress: Progress::new(),
            restart: measuring.take(),
            memory: memory.clone(),
            from_memory: from_memory.take(),
        };
        let result = run_once::<B, D>(&attempt, device, support, Some(&this));
        let returned = Instant::now();
        let progress = &this.progress;
        if let Some((restart, decided)) = &this.restart {
            let restart = progress.timed(restart, *decided);
            tracing::warn!(
                "restart {}: lost {:.2} s (detect {:.2} s, re-form {:.2} s, reload {:.2} s), {} \
                 steps trained again",
                restarts.len() + 1,
                restart.lost(),
                restart.detect,
                restart.reform,
                restart.reload,
                restart.redone_steps()
            );
            restarts.push(restart);
        }
        let error = match result {
            Ok(mut summary) => {
                summary.wall.restarts = (attempt_started - started).as_secs_f64();
                summary.wall.total += summary.wall.restarts;
                summary.restarts = restarts;
                return Ok(summary);
            }
            Err(error) => error,
        };
        let Some(lost) = lost_ranks(&error) else {
            return Err(error);
        };
        if restarts.len() >= config.max_restarts {
            tracing::error!(
                "rank(s) {lost:?} lost, and the {} restart(s) of --max-restarts are used",
                config.max_restarts
            );
            return Err(error);
        }
        let decided = Instant::now();
        // `--restart-grace`: the lost ranks whose device answers again within it are replaced
        // (the new mesh keeps their replicas); the others' replicas are dropped.
        let replaced = if attempt.restart_grace > 0.0 {
            let job = super::job_spec(&attempt)?;
            let gone = attempt.fail_at.filter(|f| f.gone).map(|f| f.rank);
            wait_for_replacements(
                &lost,
                Duration::from_secs_f64(attempt.restart_grace),
                |rank| {
                    Some(rank) != gone
                        && device_answers::<B>(
                            wildfire_parallel::rank_device::<B>(&job, device, rank),
                            Duration::from_secs_f64(attempt.restart_grace),
                        )
                },
            )
        } else {
            Vec::new()
        };
        let dropped: Vec<usize> = lost
            .iter()
            .copied()
            .filter(|r| !replaced.contains(r))
            .collect();
        let mut next = shrink(&attempt, &dropped)?;
        // The latest committed checkpoint (every rank's writer finished before its rank
        // returned); none yet: the run's own start (`--resume`, or step 0).
        if CheckpointDir::new(&save).latest().is_ok() {
            next.resume = Some(save.clone());
        }
        let mut resumed_from = match &next.resume {
            Some(root) => {
                let dir = super::resume_dir(root)?;
                read_state_file::<CheckpointState>(&dir, "state.json")?.step
            }
            None => 0,
        };
        // The lost ranks' memory is gone; the checkpoint held in memory is used when every
        // rank's files survive (its own copy or its buddy's) and it is not older than the disk's.
        if let Some(store) = &memory {
            store.lose(&lost);
            if let Some((step, files)) = store.recover().filter(|(step, _)| *step >= resumed_from) {
                let label = save.join(format!("step-{step:08} (held in memory)"));
                from_memory = Some((label, files));
                next.resume = Some(save.clone());
                resumed_from = step;
            }
        }
        let stepped = progress.at(&progress.stepped);
        let since = stepped
            .or(progress.at(&progress.looping))
            .unwrap_or(attempt_started);
        let restart = Restart {
            failure: error.to_string(),
            lost_ranks: lost,
            replaced,
            dp: [attempt.parallel.dp, next.parallel.dp],
            micro_batches: [micro_batches(&attempt), micro_batches(&next)],
            failed_at: progress.steps.load(Ordering::Relaxed),
            resumed_from,
            from_memory: from_memory.is_some(),
            detect: (returned - since).as_secs_f64(),
            reform: 0.0,
            reload: 0.0,
        };
        tracing::warn!(
            "rank(s) {:?} lost after step {} ({}), {:?} replaced: restarting on --dp {} \
             (micro-batches per step {} → {}) from step {}, the checkpoint {}",
            restart.lost_ranks,
            restart.failed_at,
            restart.failure,
            restart.replaced,
            next.parallel.dp,
            restart.micro_batches[0],
            restart.micro_batches[1],
            resumed_from,
            if restart.from_memory {
                "held in memory"
            } else {
                "on disk"
            }
        );
        measuring = Some((restart, decided));
        // The failed attempt's freed buffers, cached by the binaries' allocator, have the old
        // layout's sizes: unmapped now, they leave the cache's room to the new attempt's own
        // (kept, a restart from memory read GPT-2 124M's checkpoint in 0.8–1.4 s, released
        // 0.35–0.39 s; see the README).
        crate::alloc::release_cached_memory();
        attempt = next;
    }
}
