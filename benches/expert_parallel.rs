//! Expert parallelism on a tiny mixture of experts: gpt_pretrain's `llama-moe-tiny` (4 blocks,
//! d 128, 8 SwiGLU experts of width 192, top-2, in every other block; byte vocabulary) on 4
//! data-parallel ranks under FullShard, at ep 1, 2 and 4 — ranks as threads. A markdown table
//! per rank 0: the parameter bytes it holds and the decorator's peak of live tensor bytes in a
//! step, the bytes its all-to-alls moved in a step (dispatch and combine, forward and backward)
//! and everything it passed to collectives (a buffer counted at each collective it goes
//! through: a gradient reduce-scattered over ep, then over dp, counts twice), the step time without and with a modelled link on
//! the expert axis (`--link`, medians over the timed steps), the link's time of the step's
//! all-to-alls, and the exposed part (the step time's increase).
//!
//! On a 2-core machine the 4 ranks share the cores: the step times measure thread contention,
//! not scaling. The bytes are exact; the all-to-alls' depend on the routing (an untrained
//! router sends most tokens to a few experts).
//!
//! ```text
//! cargo bench --bench expert_parallel [-- --link 1GB/s,10us --steps 2]
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
use wildfire::models::{ModelFlags, Preset};
use wildfire::parallel::CollectiveKind;
use wildfire::parallel::comm::LinkModel;
use wildfire::pretrain::{PretrainConfig, RunSummary, run};

mod common;

/// Per step of rank 0's trace: (all-to-all bytes, their time on `link` over `ep` members).
fn all_to_all(summary: &RunSummary, link: &LinkModel, ep: usize) -> Vec<(u64, f64)> {
    let (_, trace) = &summary.trace[0];
    trace
        .iter()
        .filter(|e| e.kind.is_none() && e.name == "step")
        .map(|step| {
            let end = step.start_us + step.dur_us;
            trace
                .iter()
                .filter(|e| e.start_us >= step.start_us && e.start_us <= end)
                .filter(|e| e.kind == Some(CollectiveKind::AllToAll))
                .fold((0, 0.0), |(bytes, ms), e| {
                    let t = link.collective_time(CollectiveKind::AllToAll, ep, e.bytes);
                    (bytes + e.bytes, ms + t.as_secs_f64() * 1e3)
                })
        })
        .collect()
}

fn main() {
    wildfire::alloc::keep_freed_memory();
    // A smoke run (`cargo test --all-targets`): one step at ep 1 and 2.
    let smoke = common::smoke();
    let link_spec = common::arg::<String>("--link").unwrap_or_else(|| "1GB/s,10us".into());
    let link: LinkModel = link_spec.parse().expect("--link BANDWIDTH,LATENCY");
    let steps: usize = common::arg("--steps").unwrap_or(if smoke { 1 } else { 2 });
    let degrees: &[usize] = if smoke { &[1, 2] } else { &[1, 2, 4] };
    let (dp, batch, t) = (4, 8, 128);
    let dir = std::env::temp_dir().join(format!("wildfire-bench-ep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    println!(
        "llama-moe-tiny (4 blocks, d 128, 8 experts of 192, top-2, every other block), dp {dp} \
         FullShard, batch {batch} x {t}, f32; link ep={link_spec}; {steps} timed steps after \
         one warm-up; rank 0\n\n\
         | ep | parameter bytes | peak bytes | all-to-all (MB) | all comm (MB) | step, no link \
         (ms) | step, link (ms) | all-to-all on the link (ms) | exposed (ms) |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for &ep in degrees {
        let config = PretrainConfig {
            data: common::corpus(true),
            model: ModelFlags {
                preset: Preset::LlamaMoeTiny,
                ..PretrainConfig::quiet().model
            },
            batch_size: batch,
            steps: steps + 1,
            parallel: ParallelConfig {
                ep,
                ..ParallelConfig::layout(dp, 1, FsdpStrategy::FullShard, None)
            },
            gather_parameters: false,
            trace: Some(dir.join("trace.json")),
            ..PretrainConfig::quiet()
        };
        let plain = run(&config).expect("run");
        let paced = run(&PretrainConfig {
            links: if ep > 1 {
                vec![format!("ep={link_spec}")]
            } else {
                Vec::new()
            },
            ..config.clone()
        })
        .expect("run with the link");
        let (t0, t1) = (
            common::median_step_ms(&plain, batch * t),
            common::median_step_ms(&paced, batch * t),
        );
        let moved = all_to_all(&plain, &link, ep);
        let bytes = moved.get(1).map_or(0, |m| m.0);
        let on_link = common::median(moved[1..].iter().map(|m| m.1).collect());
        let m = plain.steps.last().expect("a step ran");
        println!(
            "| {ep} | {} | {} | {:.2} | {:.2} | {t0:.1} | {t1:.1} | {on_link:.1} | {:.1} |",
            m.param_bytes,
            m.peak_bytes,
            bytes as f64 / 1e6,
            m.comm_bytes as f64 / 1e6,
            t1 - t0,
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
