//! What a training run reports: one [`StepMetrics`] record per step (JSON lines, as llm.c's
//! log), the human log line, model FLOPs utilisation and the process's peak memory.

use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One step's record (rank 0's view; `loss` is the mean over the data-parallel ranks).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StepMetrics {
    /// Step number (0-based).
    pub step: usize,
    /// Training loss.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Loss scale (1 without loss scaling).
    pub loss_scale: f32,
    /// Whether the optimizer step was skipped.
    pub skipped: bool,
    /// Training tokens per second over all ranks.
    pub tokens_per_s: f64,
    /// Parameter bytes on this rank.
    pub param_bytes: u64,
    /// Gradient bytes on this rank.
    pub grad_bytes: u64,
    /// Optimizer-state bytes on this rank's device.
    pub optim_bytes: u64,
    /// Bytes this rank holds in host memory for its training state (an offloaded optimizer's
    /// moments).
    #[serde(default)]
    pub host_bytes: u64,
    /// Peak bytes of this rank's live distributed tensors during the step (the decorator's
    /// accounting; clones count once, views made by ops again: an upper bound).
    pub peak_bytes: u64,
    /// Of those, the peak of parameters gathered over data axes for use (FSDP).
    #[serde(default)]
    pub gathered_peak_bytes: u64,
    /// The peak in each phase of the step (forward, backward, sync, optimizer); the largest is
    /// `peak_bytes` (which also spans the data loading before the forward).
    #[serde(default)]
    pub phases: crate::PhasePeaks,
    /// Peak resident memory of the whole process so far (VmHWM; all thread-ranks share it).
    pub process_peak_rss: u64,
    /// Bytes this rank passed to collectives during the step (point-to-point messages
    /// included, sent and received).
    pub comm_bytes: u64,
    /// Of those, the bytes of the point-to-point messages this rank sent (pipeline activations
    /// and gradients, with their headers).
    #[serde(default)]
    pub p2p_sent_bytes: u64,
    /// Weight gradients the zero-bubble schedule deferred from a backward into a weight pass,
    /// over every rank of the mesh (`--pp-schedule zb`, where every stage but the first splits
    /// its backward; 0 otherwise).
    #[serde(default)]
    pub deferred_weight_grads: u64,
    /// Validation loss, on evaluation steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    /// What the mixture-of-experts routers did, over every rank (a mixture-of-experts model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterMetrics>,
    /// The first step after an elastic restart: the restart, with the time it cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<Restart>,
    /// Per pipeline rank (the position on the `pp` axis), the largest of what the mesh's ranks
    /// at that position held ([`ranks_peaks`]): under pipeline parallelism, where the stages
    /// differ, and in the memory planner's probes; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<RankPeaks>,
}

/// What the ranks at one pipeline position held in a step, the largest over them (each field on
/// its own: the data-parallel ranks of a stage differ only by their shards' rounding).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RankPeaks {
    /// [`StepMetrics::peak_bytes`].
    pub peak_bytes: u64,
    /// [`StepMetrics::phases`].
    pub phases: crate::PhasePeaks,
    /// The bytes alive after the step: the parameters' pieces and the optimizer state.
    pub resident_bytes: u64,
    /// [`StepMetrics::host_bytes`].
    pub host_bytes: u64,
    /// The step's seconds.
    pub seconds: f64,
}

impl RankPeaks {
    const FIELDS: usize = 9;

    fn encode(&self) -> [f64; Self::FIELDS] {
        let p = &self.phases;
        [
            self.peak_bytes as f64,
            p.forward as f64,
            p.backward as f64,
            p.recomputed as f64,
            p.sync as f64,
            p.optimizer as f64,
            self.resident_bytes as f64,
            self.host_bytes as f64,
            self.seconds,
        ]
    }

    fn decode(v: &[f64]) -> Self {
        let b = |i: usize| v[i] as u64;
        Self {
            peak_bytes: b(0),
            phases: crate::PhasePeaks {
                forward: b(1),
                backward: b(2),
                recomputed: b(3),
                sync: b(4),
                optimizer: b(5),
            },
            resident_bytes: b(6),
            host_bytes: b(7),
            seconds: v[8],
        }
    }
}

/// Every pipeline position's [`RankPeaks`], the largest over the ranks there (one all-reduce
/// of the mesh; `position` is this rank's index on the `pp` axis of `positions`, 0 of 1 without
/// one): this rank's `mine` at its position, the maximum taken field by field. Byte counts go
/// through `f64`, exact below 2⁵³.
pub fn ranks_peaks(
    ctx: &wildfire_parallel::RankContext,
    position: usize,
    positions: usize,
    mine: RankPeaks,
) -> Result<Vec<RankPeaks>, wildfire_parallel::Error> {
    use wildfire_parallel::{Group, ReduceOp};
    let n = RankPeaks::FIELDS;
    let mut values = vec![0.0; n * positions];
    values[position * n..(position + 1) * n].copy_from_slice(&mine.encode());
    if ctx.world_size() > 1 {
        let data = burn::tensor::TensorData::new(values, [n * positions]);
        values = ctx
            .comm()
            .all_reduce(Group::World, data, ReduceOp::Max)?
            .to_vec::<f64>()
            .expect("f64");
    }
    Ok(values.chunks(n).map(RankPeaks::decode).collect())
}

/// One restart of an elastic run (`--max-restarts`): what failed, the mesh before and after, and
/// the time lost. In the run's summary, and in the metrics of the first step after the restart.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Restart {
    /// The failure, as the attempt reported it.
    pub failure: String,
    /// The global ranks lost (of the attempt's mesh).
    pub lost_ranks: Vec<usize>,
    /// The lost ranks replaced within `--restart-grace` (their device answered again): the new
    /// mesh keeps their replicas.
    #[serde(default)]
    pub replaced: Vec<usize>,
    /// The data-parallel degree before and after.
    pub dp: [usize; 2],
    /// Micro-batches per step before and after (`--accum`, or `--microbatches` under `--pp`):
    /// the global batch is kept.
    pub micro_batches: [usize; 2],
    /// Steps the failed attempt completed (its last step reported).
    pub failed_at: usize,
    /// The step the restart resumed from: the latest checkpoint's (or the run's start).
    pub resumed_from: usize,
    /// Whether it resumed from the checkpoint held in host memory (`--memory-checkpoints`:
    /// no file read), not the disk's.
    pub from_memory: bool,
    /// Seconds from the end of the last step every rank completed to every rank of the failed
    /// attempt having returned: the detection (a peer's error, or the collective timeout).
    pub detect: f64,
    /// Seconds from then to the new attempt's ranks starting: the wait for replacements
    /// (`--restart-grace`), the mesh re-formed, the data and the checkpoint's metadata read.
    pub reform: f64,
    /// Seconds from the ranks starting to their first step: the model built and laid out, the
    /// checkpoint's pieces loaded, resharded.
    pub reload: f64,
}

impl Restart {
    /// The steps trained again: from the checkpoint to the failure.
    pub fn redone_steps(&self) -> usize {
        self.failed_at.saturating_sub(self.resumed_from)
    }

    /// Detection, re-forming and reloading: the seconds the failure cost besides the steps
    /// trained again.
    pub fn lost(&self) -> f64 {
        self.detect + self.reform + self.reload
    }
}

/// One step's mixture-of-experts routing over the whole mesh ([`router_over_ranks`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RouterMetrics {
    /// The auxiliary losses (load balance and z-loss, times their coefficients) summed over the
    /// blocks, the mean over the data-parallel ranks.
    pub aux_loss: f32,
    /// The mixture-of-experts blocks, by index in the model.
    pub layers: Vec<usize>,
    /// Per block, the assignments (token, choice) each expert received over the global batch,
    /// before capacity.
    pub tokens_per_expert: Vec<Vec<u64>>,
    /// Per block, the assignments dropped for capacity.
    pub dropped: Vec<u64>,
}

impl RouterMetrics {
    /// The share of all assignments that were dropped.
    pub fn dropped_share(&self) -> f64 {
        let total: u64 = self.tokens_per_expert.iter().flatten().sum();
        self.dropped.iter().sum::<u64>() as f64 / total.max(1) as f64
    }

    /// The busiest expert's load over the mean (1: perfectly balanced), the worst block's.
    pub fn max_load(&self) -> f64 {
        self.tokens_per_expert
            .iter()
            .map(|counts| {
                let mean = counts.iter().sum::<u64>() as f64 / counts.len().max(1) as f64;
                counts.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE)
            })
            .fold(0.0, f64::max)
    }
}

/// A step's routing over every rank (a collective: every rank calls it, `record` `None` where it
/// holds no mixture-of-experts block — a pipeline stage without one): the counts of the
/// `layers` blocks of `experts` experts summed over the data ranks (tensor-parallel peers route
/// the same tokens, counted once), the auxiliary loss averaged over them (each block's held by
/// the ranks of its pipeline stage). `None` without any mixture-of-experts block.
pub fn router_over_ranks(
    ctx: &wildfire_parallel::RankContext,
    record: Option<&crate::RouterRecord>,
    layers: &[usize],
    experts: usize,
) -> Result<Option<RouterMetrics>, wildfire_parallel::Error> {
    use wildfire_parallel::{Group, ReduceOp};
    if layers.is_empty() {
        return Ok(None);
    }
    // [aux, then per block: routed per expert, dropped; ranks that hold a record].
    let width = experts + 1;
    let len = 2 + layers.len() * width;
    let mut v = vec![0f64; len];
    if let Some(r) = record {
        v[0] = r.aux_loss as f64;
        v[len - 1] = 1.0;
        for (layer, routing) in &r.layers {
            let Some(i) = layers.iter().position(|l| l == layer) else {
                continue;
            };
            let at = 1 + i * width;
            for (slot, &c) in v[at..at + experts].iter_mut().zip(&routing.routed) {
                *slot = c as f64;
            }
            v[at + experts] = routing.dropped as f64;
        }
    }
    let mesh = ctx.mesh();
    let size_of = |name: &str| mesh.axis_index(name).map_or(1, |a| mesh.axis_size(a));
    let (world, tp, pp) = (mesh.world_size(), size_of("tp"), size_of("pp"));
    if world > 1 {
        let data = burn::tensor::TensorData::new(v, [len]);
        v = ctx
            .comm()
            .all_reduce(Group::World, data, ReduceOp::Sum)?
            .to_vec::<f64>()
            .expect("f64");
    }
    if v[len - 1] == 0.0 {
        // No rank recorded any routing (no forward went through a mixture-of-experts block).
        return Ok(None);
    }
    let counts = |x: f64| (x / tp as f64).round() as u64;
    let block = |i: usize| &v[1 + i * width..1 + (i + 1) * width];
    Ok(Some(RouterMetrics {
        aux_loss: (v[0] * pp as f64 / world as f64) as f32,
        layers: layers.to_vec(),
        tokens_per_expert: (0..layers.len())
            .map(|i| block(i)[..experts].iter().map(|&c| counts(c)).collect())
            .collect(),
        dropped: (0..layers.len())
            .map(|i| counts(block(i)[experts]))
            .collect(),
    }))
}

impl StepMetrics {
    /// The human log line: `step 10 | loss 2.3456 | lr 1.00e-3 | grad_norm 0.812 | tok/s 19031
    /// | scale 1`, with `| mfu x%` when `mfu` is given and `| val_loss` on evaluation steps.
    pub fn log_line(&self, mfu: Option<f64>) -> String {
        let mfu = mfu.map_or(String::new(), |m| format!(" | mfu {:.2}%", 100.0 * m));
        let val = self
            .val_loss
            .map_or(String::new(), |v| format!(" | val_loss {v:.4}"));
        let router = self.router.as_ref().map_or(String::new(), |r| {
            format!(
                " | moe aux {:.4} max_load {:.2} dropped {:.1}%",
                r.aux_loss,
                r.max_load(),
                100.0 * r.dropped_share()
            )
        });
        format!(
            "step {} | loss {:.4} | lr {:.2e} | grad_norm {:.3} | tok/s {:.0}{mfu} | scale {}{router}{val}",
            self.step, self.loss, self.lr, self.grad_norm, self.tokens_per_s, self.loss_scale
        )
    }
}

/// One step's measurement: started before the step (the rank's peak reset, its collective
/// counters read), [`StepWatch::finish`]ed after it into the step's [`StepMetrics`].
pub struct StepWatch {
    started: std::time::Instant,
    stats_before: wildfire_parallel::CommStats,
}

impl StepWatch {
    /// Start measuring a step on the rank `ctx`.
    pub fn start(ctx: &wildfire_parallel::RankContext) -> Self {
        let stats_before = ctx.comm_stats();
        ctx.reset_peak_bytes();
        Self {
            started: std::time::Instant::now(),
            stats_before,
        }
    }

    /// The step's metrics (`record.loss` already the mesh's; `tokens`: the global batch's) and
    /// its seconds: the decorator's accounting of this rank's pieces, of which `param_bytes` are
    /// the parameters' (after the step only they and the optimizer state are alive).
    pub fn finish(
        &self,
        ctx: &wildfire_parallel::RankContext,
        step: usize,
        lr: f64,
        record: &crate::StepRecord,
        param_bytes: u64,
        tokens: usize,
    ) -> (StepMetrics, f64) {
        let elapsed = self.started.elapsed().as_secs_f64();
        let stats = ctx.comm_stats().since(&self.stats_before);
        let metrics = StepMetrics {
            step,
            loss: record.loss,
            lr,
            grad_norm: record.grad_norm,
            loss_scale: record.loss_scale,
            skipped: record.skipped,
            tokens_per_s: tokens as f64 / elapsed,
            param_bytes,
            grad_bytes: record.grad_bytes,
            optim_bytes: ctx.live_bytes().saturating_sub(param_bytes),
            host_bytes: ctx.host_bytes(),
            peak_bytes: ctx.peak_bytes(),
            gathered_peak_bytes: ctx.peak_gathered_bytes(),
            phases: record.phases,
            process_peak_rss: peak_rss(),
            comm_bytes: stats.total_bytes(),
            p2p_sent_bytes: stats.bytes(wildfire_parallel::CollectiveKind::Send),
            deferred_weight_grads: record.deferred_weight_grads as u64,
            val_loss: None,
            router: None,
            restart: None,
            stages: Vec::new(),
        };
        (metrics, elapsed)
    }
}

/// A JSON-lines metrics file, shared by the thread-ranks of a process (rank 0 writes).
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: Mutex<File>,
}

impl MetricsLog {
    /// Open `path` (its folder made if missing): truncated for a new run, appended to for a
    /// resumed one (as llm.c does, so one file holds the whole run).
    pub fn open(path: &Path, resumed: bool) -> std::io::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed)
            .truncate(!resumed)
            .open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            file: Mutex::new(file),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one record as a line.
    pub fn write(&self, m: &StepMetrics) -> std::io::Result<()> {
        let line = serde_json::to_string(m).map_err(std::io::Error::other)?;
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(file, "{line}")
    }

    /// Every record of a metrics file (to plot or compare runs).
    pub fn read(path: &Path) -> std::io::Result<Vec<StepMetrics>> {
        std::fs::read_to_string(path)?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).map_err(std::io::Error::other))
            .collect()
    }
}

/// Model FLOPs utilisation: the run's model FLOP/s (`flops_per_token × tokens_per_s`, tokens of
/// the global batch) over the peak of every rank's device (`peak_flops × world_size`: data,
/// tensor and any other model axis alike).
pub fn mfu(flops_per_token: f64, tokens_per_s: f64, peak_flops: f64, world_size: usize) -> f64 {
    flops_per_token * tokens_per_s / (peak_flops * world_size.max(1) as f64)
}

/// The mean of a per-rank scalar over the world (a collective: every rank calls it).
pub fn mean_over_ranks<B: burn::prelude::Backend>(
    device: &wildfire_parallel::DistDevice<B>,
    value: f32,
) -> Result<f32, wildfire_parallel::Error> {
    use wildfire_parallel::{Group, ReduceOp};
    let comm = device.context().comm();
    if comm.mesh().world_size() == 1 {
        return Ok(value);
    }
    let data = burn::tensor::TensorData::new(vec![value], [1]);
    let mean = comm.all_reduce(Group::World, data, ReduceOp::Avg)?;
    Ok(mean.to_vec::<f32>().map_or(f32::NAN, |v| v[0]))
}

/// The mean of values only some ranks hold (a pipeline's last stage holds the losses): each
/// rank gives the sum of its values and their count, one all-reduce of `[Σ, count]` over the
/// world adds them up (a collective: every rank calls it, with `count` 0 where it holds none).
pub fn mean_where_held(
    ctx: &wildfire_parallel::RankContext,
    sum: f64,
    count: usize,
) -> Result<f32, wildfire_parallel::Error> {
    let out = sum_over_world(ctx, vec![sum, count as f64])?;
    Ok((out[0] / out[1].max(1.0)) as f32)
}

/// [`mean_where_held`], and `total` summed over every rank of the mesh in the same call (a
/// pipeline step's deferred weight gradients, which only some stages defer).
pub fn mean_where_held_and_total(
    ctx: &wildfire_parallel::RankContext,
    sum: f64,
    count: usize,
    total: f64,
) -> Result<(f32, f64), wildfire_parallel::Error> {
    let out = sum_over_world(ctx, vec![sum, count as f64, total])?;
    Ok(((out[0] / out[1].max(1.0)) as f32, out[2]))
}

/// `values` summed element by element over every rank of the mesh (one all-reduce).
fn sum_over_world(
    ctx: &wildfire_parallel::RankContext,
    values: Vec<f64>,
) -> Result<Vec<f64>, wildfire_parallel::Error> {
    use wildfire_parallel::{Group, ReduceOp};
    if ctx.world_size() == 1 {
        return Ok(values);
    }
    let n = values.len();
    let data = burn::tensor::TensorData::new(values, [n]);
    Ok(ctx
        .comm()
        .all_reduce(Group::World, data, ReduceOp::Sum)?
        .to_vec::<f64>()
        .expect("f64"))
}

/// The process's peak resident memory in bytes (`VmHWM` of `/proc/self/status`; 0 where there
/// is no procfs).
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_log_appends() {
        let path = std::env::temp_dir().join(format!("wildfire-metrics-{}", std::process::id()));
        let record = |step| StepMetrics {
            step,
            ..Default::default()
        };
        let log = MetricsLog::open(&path, false).unwrap();
        log.write(&record(0)).unwrap();
        log.write(&record(1)).unwrap();
        drop(log);
        MetricsLog::open(&path, true)
            .unwrap()
            .write(&record(2))
            .unwrap();
        let steps: Vec<usize> = MetricsLog::read(&path)
            .unwrap()
            .iter()
            .map(|m| m.step)
            .collect();
        assert_eq!(steps, [0, 1, 2]);
        MetricsLog::open(&path, false).unwrap();
        assert!(MetricsLog::read(&path).unwrap().is_empty());
        std::fs::remove_file(&path).unwrap();
    }

    /// The metrics file reads back every `f64` bit for bit (serde_json's `float_roundtrip`: its
    /// default parser can be an ulp off, e.g. a restart's 2.0248772329999998 s read back as
    /// 2.024877233).
    #[test]
    fn the_log_reads_back_every_f64_exactly() {
        let path = std::env::temp_dir().join(format!("wildfire-f64-{}", std::process::id()));
        let seconds = [
            2.0248772329999998,
            0.1 + 0.2,
            1e-300,
            f64::MAX,
            123.456_789_012_345_67,
        ];
        let log = MetricsLog::open(&path, false).unwrap();
        for (step, &s) in seconds.iter().enumerate() {
            let restart = Restart {
                detect: s,
                ..Default::default()
            };
            log.write(&StepMetrics {
                step,
                lr: s,
                tokens_per_s: s,
                restart: Some(restart),
                ..Default::default()
            })
            .unwrap();
        }
        drop(log);
        let read = MetricsLog::read(&path).unwrap();
        assert_eq!(read.len(), seconds.len());
        for (m, &s) in read.iter().zip(&seconds) {
            assert_eq!(m.lr.to_bits(), s.to_bits());
            assert_eq!(m.tokens_per_s.to_bits(), s.to_bits());
            assert_eq!(m.restart.as_ref().unwrap().detect.to_bits(), s.to_bits());
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_log_line_has_mfu_only_when_asked() {
        let m = StepMetrics {
            step: 3,
            loss: 2.5,
            val_loss: Some(2.25),
            ..Default::default()
        };
        assert!(!m.log_line(None).contains("mfu"));
        assert!(m.log_line(Some(0.5)).contains("| mfu 50.00%"));
        assert!(m.log_line(None).ends_with("| val_loss 2.2500"));
    }
}
