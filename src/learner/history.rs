//! A loss metric that keeps its values: every step's loss as the Learner's metric pipeline
//! computed it, for curves and comparisons after `launch`.

use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::train::metric::{
    LossInput, LossMetric, Metric, MetricMetadata, MetricName, Numeric, NumericEntry,
    SerializedEntry,
};

/// Burn's [`LossMetric`], each value also appended to a shared list (one per training step or
/// validation batch, in order). Register it with `metric_train_numeric` or
/// `metric_valid_numeric`; read the list with [`LossHistory::values`] after training.
#[derive(Clone)]
pub struct LossHistory {
    inner: LossMetric<Flex>,
    name: MetricName,
    values: Arc<Mutex<Vec<f64>>>,
}

impl LossHistory {
    /// A metric named `name` (unique among the run's metrics).
    pub fn new(name: &str) -> Self {
        Self {
            inner: LossMetric::new(),
            name: Arc::new(name.to_string()),
            values: Arc::default(),
        }
    }

    /// The values so far (the metric's clones share them).
    pub fn values(&self) -> Vec<f64> {
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Metric for LossHistory {
    type Input = LossInput<Flex>;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn update(&mut self, item: &Self::Input, metadata: &MetricMetadata) -> SerializedEntry {
        let entry = self.inner.update(item, metadata);
        let value = match self.inner.value() {
            NumericEntry::Value(v) => v,
            NumericEntry::Aggregated {
                aggregated_value, ..
            } => aggregated_value,
        };
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(value);
        entry
    }

    fn clear(&mut self) {
        self.inner.clear();
    }
}

impl Numeric for LossHistory {
    fn value(&self) -> NumericEntry {
        self.inner.value()
    }

    fn running_value(&self) -> NumericEntry {
        self.inner.running_value()
    }
}
