//! `--trace FILE`: every rank's compute regions and collectives as a Chrome / Perfetto trace
//! (the JSON that PyTorch's profiler exports): one process, one thread per rank, a compute region
//! as a complete event, a collective as a begin event at its issue and an end event at its
//! completion. Open it in `chrome://tracing` or <https://ui.perfetto.dev>.

use std::path::Path;

use serde_json::{Value, json};
use wildfire_parallel::comm::TraceEvent;

/// The trace of `ranks` (rank, its events) as Chrome's trace-event JSON.
pub fn chrome_trace(ranks: &[(usize, Vec<TraceEvent>)]) -> Value {
    let mut events = Vec::new();
    for (rank, trace) in ranks {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
            "args": { "name": format!("rank {rank}") },
        }));
        for e in trace {
            let cat = if e.kind.is_some() {
                "collective"
            } else {
                "compute"
            };
            let common = |ph: &str, ts: f64| json!({ "name": e.name, "cat": cat, "ph": ph, "ts": ts, "pid": 0, "tid": rank });
            if e.kind.is_some() {
                let mut begin = common("B", e.start_us);
                begin["args"] = json!({ "group": e.group, "bytes": e.bytes });
                events.push(begin);
                events.push(common("E", e.start_us + e.dur_us));
            } else {
                let mut complete = common("X", e.start_us);
                complete["dur"] = json!(e.dur_us);
                events.push(complete);
            }
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// Write the trace of `ranks` to `path` (atomically).
pub fn write_trace(path: &Path, ranks: &[(usize, Vec<TraceEvent>)]) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(&chrome_trace(ranks)).map_err(std::io::Error::other)?;
    wildfire_models::io::write_atomic(path, &bytes)
}
