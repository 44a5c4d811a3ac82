//! What rank 0 shows of a run while it trains: each step's record to the metrics file, a
//! progress bar (on a terminal), and the log line every few steps, on evaluations and at the
//! end; and the learning-rate schedule the log line reports.

use crate::metrics::{MetricsLog, StepMetrics, mfu};
use serde::{Deserialize, Serialize};

/// What the learning rate does after warmup, until the decay's end ([`LrSchedule`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LrDecay {
    /// Half a cosine from the peak to the floor (nanoGPT, llm.c).
    #[default]
    Cosine,
    /// A straight line from the peak to the floor.
    Linear,
    /// Warmup–stable–decay (MiniCPM; Hägele et al. 2024): the peak held, then a linear
    /// cooldown to the floor over the last `cooldown` share of the decay span. A run can be
    /// continued from a checkpoint of its stable phase with more steps.
    Wsd,
    /// [`LrDecay::Wsd`] whose cooldown follows `1 − √q` (Hägele et al.'s better cooldown).
    WsdSqrt,
    /// The peak, held (no floor).
    Constant,
}

/// Linear warmup over `warmup` steps to `lr` (step `s` < `warmup` at `lr · (s + 1) / warmup`,
/// nanoGPT's and llm.c's convention), then `decay` to `lr · min_ratio` at step `decay_steps`,
/// the floor after. The default decay, cosine to a tenth, is nanoGPT's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The peak learning rate.
    pub lr: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// The step where the decay ends.
    pub decay_steps: usize,
    /// The shape of the decay.
    pub decay: LrDecay,
    /// The floor, as a share of the peak (`0..=1`).
    pub min_ratio: f64,
    /// [`LrDecay::Wsd`]'s and [`LrDecay::WsdSqrt`]'s cooldown: this share (`0 < c ≤ 1`) of the
    /// steps from the warmup's end to `decay_steps`, rounded up to whole steps.
    pub cooldown: f64,
}

impl LrSchedule {
    /// Warmup then nanoGPT's cosine to a tenth at `decay_steps`.
    pub fn warmup_cosine(lr: f64, warmup: usize, decay_steps: usize) -> Self {
        Self {
            lr,
            warmup,
            decay_steps,
            decay: LrDecay::Cosine,
            min_ratio: 0.1,
            cooldown: 0.2,
        }
    }

    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let min = self.lr * self.min_ratio;
        let span = self.decay_steps.saturating_sub(self.warmup).max(1);
        let done = step - self.warmup;
        // The share of the decay behind us, 0 at its start and 1 from its end on.
        let share = |from: usize, steps: usize| {
            (done.saturating_sub(from) as f64 / steps.max(1) as f64).min(1.0)
        };
        let down = |q: f64| self.lr - q * (self.lr - min);
        match self.decay {
            LrDecay::Constant => self.lr,
            LrDecay::Cosine => {
                min + 0.5 * (1.0 + (std::f64::consts::PI * share(0, span)).cos()) * (self.lr - min)
            }
            LrDecay::Linear => down(share(0, span)),
            LrDecay::Wsd | LrDecay::WsdSqrt => {
                let cool = ((self.cooldown * span as f64).ceil() as usize).clamp(1, span);
                let stable = span - cool;
                if done < stable {
                    return self.lr;
                }
                let q = share(stable, cool);
                match self.decay {
                    LrDecay::Wsd => down(q),
                    _ => min + (1.0 - q.sqrt()) * (self.lr - min),
                }
            }
        }
    }

    /// Refuse a floor outside `0..=1` or a cooldown outside `(0, 1]`, naming the flag.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.min_ratio) {
            return Err(format!(
                "--min-lr-ratio {}: a share of --lr in [0, 1]",
                self.min_ratio
            ));
        }
        if !(self.cooldown > 0.0 && self.cooldown <= 1.0) {
            return Err(format!(
                "--cooldown {}: a share of the decay's steps in (0, 1]",
                self.cooldown
            ));
        }
        Ok(())
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
        let s = LrSchedule::warmup_cosine(1e-3, 10, 110);
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

    /// Each decay at the points its formula fixes: warmup 10, decay over steps 10..110 to a
    /// floor of 0.2 · 1e-3, WSD's cooldown the last quarter (steps 85..110).
    #[test]
    fn every_decay_at_its_anchor_points() {
        let at = |decay, step| {
            LrSchedule {
                decay,
                min_ratio: 0.2,
                cooldown: 0.25,
                ..LrSchedule::warmup_cosine(1e-3, 10, 110)
            }
            .at(step)
        };
        let close = |got: f64, want: f64, what: &str| {
            assert!((got - want).abs() < 1e-15, "{what}: {got} vs {want}")
        };
        for decay in [
            LrDecay::Cosine,
            LrDecay::Linear,
            LrDecay::Wsd,
            LrDecay::WsdSqrt,
            LrDecay::Constant,
        ] {
            close(at(decay, 4), 5e-4, "warmup is linear whatever follows");
            close(at(decay, 10), 1e-3, "the peak at the warmup's end");
            let floor = if decay == LrDecay::Constant {
                1e-3
            } else {
                2e-4
            };
            close(at(decay, 110), floor, "the floor at the decay's end");
            close(at(decay, 1000), floor, "and after it");
        }
        close(
            at(LrDecay::Cosine, 60),
            6e-4,
            "cosine halfway: the mean of peak and floor",
        );
        close(at(LrDecay::Linear, 35), 8e-4, "a quarter down the line");
        close(at(LrDecay::Linear, 60), 6e-4, "halfway down the line");
        for decay in [LrDecay::Wsd, LrDecay::WsdSqrt] {
            close(at(decay, 84), 1e-3, "stable up to the cooldown");
            close(at(decay, 85), 1e-3, "the cooldown starts at the peak");
        }
        // 85 + 25/4: not a whole step; 85 + 5 = 90 is a fifth of the cooldown.
        close(
            at(LrDecay::Wsd, 90),
            1e-3 - 0.2 * 8e-4,
            "a fifth down the linear cooldown",
        );
        close(
            at(LrDecay::WsdSqrt, 90),
            2e-4 + (1.0 - 0.2f64.sqrt()) * 8e-4,
            "1 - sqrt(1/5) of the way from the floor",
        );
        // A cooldown share rounds up to whole steps, at least one.
        let one = LrSchedule {
            decay: LrDecay::Wsd,
            cooldown: 1e-6,
            ..LrSchedule::warmup_cosine(1e-3, 0, 10)
        };
        close(one.at(8), 1e-3, "stable");
        close(one.at(9), 1e-3, "the one cooldown step starts at the peak");
        close(one.at(10), 1e-4, "the floor");
        for (min_ratio, cooldown, flag) in [
            (1.5, 0.2, "--min-lr-ratio"),
            (0.1, 0.0, "--cooldown"),
            (0.1, f64::NAN, "--cooldown"),
        ] {
            let bad = LrSchedule {
                min_ratio,
                cooldown,
                ..LrSchedule::warmup_cosine(1e-3, 0, 10)
            };
            assert!(bad.check().unwrap_err().contains(flag));
        }
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
