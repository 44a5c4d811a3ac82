//! Dynamic loss scaling for f16 training.
//!
//! Defaults follow PyTorch's `GradScaler` (initial scale 2¹⁶, ×2 after 2000 finite steps in a row,
//! ×0.5 on overflow, no hysteresis). DeepSpeed (`initial_scale_power` 16, `loss_scale_window`
//! 1000, `hysteresis` 2, `min_loss_scale` 1) and Megatron (initial 2³², window 1000, hysteresis 2,
//! min 1) wait for `hysteresis` overflows before backing off; set the fields to match either.

use serde::{Deserialize, Serialize};

/// Settings of [`DynamicLossScaler`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScalerConfig {
    /// Starting scale.
    pub init_scale: f32,
    /// Multiplier after `growth_interval` finite steps in a row.
    pub growth_factor: f32,
    /// Multiplier on overflow.
    pub backoff_factor: f32,
    /// Finite steps in a row before growing.
    pub growth_interval: u32,
    /// Overflows in a row before backing off (1: at once).
    pub hysteresis: u32,
    /// The scale never goes below this.
    pub min_scale: f32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: 1.0,
        }
    }
}

/// What to do with a step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepDecision {
    /// Finite gradients: take the optimizer step.
    Apply,
    /// Some gradient overflowed (on any rank): skip the step.
    Skip,
}

/// The scaler's state (stored in checkpoints).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossScaler {
    /// Settings.
    pub config: LossScalerConfig,
    /// Current scale.
    pub scale: f32,
    /// Finite steps since the last change.
    pub good_steps: u32,
    /// Overflows still tolerated before backing off.
    pub hysteresis_left: u32,
}

impl DynamicLossScaler {
    /// A scaler at its initial scale.
    pub fn new(config: LossScalerConfig) -> Self {
        Self {
            scale: config.init_scale,
            good_steps: 0,
            hysteresis_left: config.hysteresis.max(1),
            config,
        }
    }

    /// Multiply the loss by this before `backward()`.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Record a step's outcome (`found_inf`: some gradient on some rank was not finite, already
    /// agreed across the mesh) and decide.
    pub fn update(&mut self, found_inf: bool) -> StepDecision {
        if found_inf {
            self.good_steps = 0;
            self.hysteresis_left = self.hysteresis_left.saturating_sub(1);
            if self.hysteresis_left == 0 {
                self.scale = (self.scale * self.config.backoff_factor).max(self.config.min_scale);
                self.hysteresis_left = self.config.hysteresis.max(1);
            }
            return StepDecision::Skip;
        }
        self.good_steps += 1;
        if self.good_steps >= self.config.growth_interval {
            self.scale *= self.config.growth_factor;
            self.good_steps = 0;
            self.hysteresis_left = self.config.hysteresis.max(1);
        }
        StepDecision::Apply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_after_the_interval_and_backs_off_on_overflow() {
        let mut s = DynamicLossScaler::new(LossScalerConfig {
            growth_interval: 3,
            ..LossScalerConfig::default()
        });
        let mut seen = Vec::new();
        for inf in [false, false, false, false, true, false, true, true] {
            let d = s.update(inf);
            seen.push((d, s.scale));
        }
        use StepDecision::{Apply, Skip};
        assert_eq!(
            seen,
            vec![
                (Apply, 65536.0),
                (Apply, 65536.0),
                (Apply, 131072.0),
                (Apply, 131072.0),
                (Skip, 65536.0),
                (Apply, 65536.0),
                (Skip, 32768.0),
                (Skip, 16384.0),
            ]
        );
    }

    #[test]
    fn hysteresis_and_minimum_scale() {
        let mut s = DynamicLossScaler::new(LossScalerConfig {
            init_scale: 4.0,
            hysteresis: 2,
            min_scale: 1.0,
            ..LossScalerConfig::default()
        });
        let scales: Vec<(StepDecision, f32)> = [true, true, true, true, true, true]
            .iter()
            .map(|&i| (s.update(i), s.scale))
            .collect();
        // Every overflow skips; the scale halves on every second one, and stops at 1.
        assert!(scales.iter().all(|(d, _)| *d == StepDecision::Skip));
        assert_eq!(
            scales.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
            vec![4.0, 2.0, 2.0, 1.0, 1.0, 1.0]
        );
        // A finite step resets nothing of the count towards growth beyond itself.
        assert_eq!(s.update(false), StepDecision::Apply);
        assert_eq!(s.good_steps, 1);
    }
}
