//! A run's trace — every rank's compute regions and collectives, as each rank's communication
//! member records them (`Member::take_trace`) — as a Chrome / Perfetto trace (the JSON that
//! PyTorch's profiler exports; the pretraining binary's `--trace FILE`): one process; per rank a compute track (its
//! regions, as complete events) and a communication track (its collectives, one after another,
//! each a begin event when it starts to run and an end event at its completion, with the time it
//! was issued in its arguments: a prefetched gather is issued while the compute track works).
//! Open it in `chrome://tracing` or <https://ui.perfetto.dev>.

use serde_json::{Value, json};
use wildfire_parallel::comm::TraceEvent;

/// The thread id of rank `rank`'s communication track.
pub fn comm_track(rank: usize) -> usize {
    1000 + rank
}

/// The trace of `ranks` (rank, its events) as Chrome's trace-event JSON.
pub fn chrome_trace(ranks: &[(usize, Vec<TraceEvent>)]) -> Value {
    let mut events = Vec::new();
    for (rank, trace) in ranks {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
            "args": { "name": format!("rank {rank}") },
        }));
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": comm_track(*rank),
            "args": { "name": format!("rank {rank}: communication") },
        }));
        for e in trace {
            let cat = if e.kind.is_some() {
                "collective"
            } else {
                "compute"
            };
            let tid = if e.kind.is_some() {
                comm_track(*rank)
            } else {
                *rank
            };
            let common = |ph: &str, ts: f64| json!({ "name": e.name, "cat": cat, "ph": ph, "ts": ts, "pid": 0, "tid": tid });
            if e.kind.is_some() {
                let mut begin = common("B", e.start_us);
                begin["args"] =
                    json!({ "group": e.group, "bytes": e.bytes, "issued": e.issued_us });
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

/// The trace of `ranks` as the bytes of a `.json` file.
pub fn chrome_trace_bytes(ranks: &[(usize, Vec<TraceEvent>)]) -> Vec<u8> {
    serde_json::to_vec(&chrome_trace(ranks)).expect("a JSON value serialises")
}
