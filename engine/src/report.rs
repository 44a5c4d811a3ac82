//! What rank 0 shows of a run while it trains: each step's record to the metrics file, a
//! progress bar (on a terminal), and the log line every few steps, on evaluations and at the
//! end; and the learning-rate schedule the log line reports.

use crate::metrics::{MetricsLog, StepMetrics, mfu};
use serde::{Deserialize, Serialize};

/// Linear warmup over `warmup` steps to `lr`, then cosine decay to `lr / 10` at step
/// `decay_steps` (nanoGPT's schedule), constant after.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WarmupCosine {
    /// The peak learning rate.
    pub lr: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// The step where the decay ends.
    pub decay_steps: usize,
}

impl WarmupCosine {
    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        let min = self.lr / 10.0;
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.decay_steps.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        min + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.lr - min)
    }
}

/// Model FLOPs utilisation in the log line: the model's FLOPs per token, one device's peak
/// FLOP/s and the devices of the run ([`mfu`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MfuSpec {
    /// Model FLOPs per token (forward and backward).
    pub flops_per_token: f64,
    /// Peak FLOP/s of one device.
    pub peak_flops: f64,
    /// Devices of the run.
    pub world_size: usize,
}

/// Rank 0's report of each step (see the module docs).
pub struct StepReporter<'a> {
    log: Option<&'a MetricsLog>,
    bar: Option<indicatif::ProgressBar>,
    steps: usize,
    log_every: usize,
    mfu: Option<MfuSpec>,
    quiet: bool,
}

impl<'a> StepReporter<'a> {
    /// A report of a run of `steps` steps starting at `first_step`, to the metrics file `log`,
    /// with a log line every `log_every` steps (and on evaluations and at the end); with
    /// `progress`, a progress bar that the log lines print above.
    pub fn new(
        log: Option<&'a MetricsLog>,
        first_step: usize,
        steps: usize,
        log_every: usize,
        progress: bool,
    ) -> Self {
        let bar = progress.then(|| {
            let bar = indicatif::ProgressBar::new(steps as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} steps {msg} [{elapsed_precise}<{eta_precise}]",
                )
                .expect("template"),
            );
            bar.set_position(first_step as u64);
            bar
        });
        Self {
            log,
            bar,
            steps,
            log_every: log_every.max(1),
            mfu: None,
            quiet: false,
        }
    }

    /// With `quiet`, the log lines at debug level (runs a user did not ask for, such as the
    /// memory planner's probes).
    pub fn quiet(mut self, quiet: bool) -> Self {
        self.quiet = quiet;
        self
    }

    /// The log line with the model FLOPs utilisation.
    pub fn with_mfu(mut self, mfu: Option<MfuSpec>) -> Self {
        self.mfu = mfu;
        self
    }

    /// Report step `m` (its wall time `elapsed` seconds): the metrics file, the bar, and the
    /// log line when it is due.
    pub fn report(&self, m: &StepMetrics, elapsed: f64) -> std::io::Result<()> {
        if let Some(log) = self.log {
            log.write(m)?;
        }
        if let Some(bar) = &self.bar {
            bar.set_position(m.step as u64 + 1);
            bar.set_message(format!("loss {:.4} ({:.0} ms/step)", m.loss, elapsed * 1e3));
        }
        if m.step.is_multiple_of(self.log_every) || m.val_loss.is_some() || m.step + 1 == self.steps
        {
            let mfu = self.mfu.map(|s| {
                mfu(
                    s.flops_per_token,
                    m.tokens_per_s,
                    s.peak_flops,
                    s.world_size,
                )
            });
            let line = m.log_line(mfu);
            let emit = || match self.quiet {
                true => tracing::debug!("{line}"),
                false => tracing::info!("{line}"),
            };
            match &self.bar {
                Some(bar) => bar.suspend(emit),
                None => emit(),
            }
        }
        Ok(())
    }

    /// The metrics file's path, for its errors.
    pub fn log_path(&self) -> Option<&std::path::Path> {
        self.log.map(MetricsLog::path)
    }
}

impl Drop for StepReporter<'_> {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_a_tenth() {
        let s = WarmupCosine {
            lr: 1e-3,
            warmup: 10,
            decay_steps: 110,
        };
        assert!((s.at(0) - 1e-4).abs() < 1e-12);
        assert!((s.at(9) - 1e-3).abs() < 1e-12);
        assert!((s.at(10) - 1e-3).abs() < 1e-12);
        assert!(
            (s.at(60) - 5.5e-4).abs() < 1e-12,
            "halfway: the mean of lr and lr/10"
        );
        assert!((s.at(110) - 1e-4).abs() < 1e-12);
        assert!((s.at(500) - 1e-4).abs() < 1e-12, "constant after the decay");
    }

    #[test]
    fn the_metrics_file_gets_every_step() {
        let dir = std::env::temp_dir().join(format!("wildfire-report-{}", std::process::id()));
        let path = dir.join("m.jsonl");
        let log = MetricsLog::open(&path, false).unwrap();
        let reporter = StepReporter::new(Some(&log), 0, 3, 10, false).with_mfu(Some(MfuSpec {
            flops_per_token: 1e6,
            peak_flops: 1e12,
            world_size: 2,
        }));
        for step in 0..3 {
            let m = StepMetrics {
                step,
                loss: 1.0 / (step + 1) as f32,
                ..StepMetrics::default()
            };
            reporter.report(&m, 0.01).unwrap();
        }
        let read = MetricsLog::read(&path).unwrap();
        assert_eq!(read.iter().map(|m| m.step).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(read[2].loss, 1.0 / 3.0);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
