//! Exposed communication under a modelled link (issue 19's measure of overlap): gpt_pretrain's
//! small GPT (4 layers, d = 256, GPT-2 vocabulary, sequence 128) at dp 2 and 4, DDP and FullShard,
//! ranks as threads, each run twice — without a link, and with `--link dp=LINK` — for a markdown
//! table of: step time without and with the link (medians over the timed steps), the step's
//! communication time on the link (the [`LinkModel`] time of every collective the step ran, from
//! its trace), the exposed part (the step time's increase) and the hidden fraction
//! `1 − exposed / communication`. Each strategy runs without overlap (every collective blocks the
//! rank) and with it: FullShard with `--prefetch` (the next gathers in flight on the rank's
//! communication thread while it computes) and `--reduce-in-flight 2` (the gradients'
//! reduce-scatters issued where they are born, waited for at first use); DDP with `--bucket-mb`
//! buckets all-reduced as they fill, 2 in flight.
//!
//! Valid only where every rank has cores of its own. Ranks as threads share the machine's cores
//! (and Flex's one thread pool): while one rank sleeps in a paced collective the others compute
//! faster, which hides link time that no rank overlapped. Lockstep collectives (FSDP's gathers,
//! every rank waiting together) show little of it; DDP's per-parameter all-reduces at the end of
//! backward, where ranks arrive at different times, show much of it on a 2-core machine.
//!
//! ```text
//! cargo bench --bench overlap [-- --link 100MB/s,20us --steps 4 --prefetch 8 --bucket-mb 2 --bytes]
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
use wildfire::models::{ModelFlags, Preset};
use wildfire::parallel::comm::LinkModel;
use wildfire::pretrain::{PretrainConfig, RunSummary, run};

mod common;

fn main() {
    wildfire::alloc::keep_freed_memory();
    // A smoke run (`cargo test --all-targets`): a tiny model, one configuration, one step.
    let smoke = common::smoke();
    let link_spec = common::arg::<String>("--link").unwrap_or_else(|| "100MB/s,20us".into());
    let link: LinkModel = link_spec.parse().expect("--link BANDWIDTH,LATENCY");
    let steps = common::arg("--steps").unwrap_or(if smoke { 1 } else { 4 });
    let prefetch = common::arg("--prefetch").unwrap_or(8);
    // 2 MiB: the byte-tokenizer model's 13 MB of gradients in several buckets (25 MiB, DDP's
    // default, would be one, issued when backward ends).
    let bucket_mb: f64 = common::arg("--bucket-mb").unwrap_or(2.0);
    // `--bytes`: the byte tokenizer (vocabulary 256, gpt_pretrain's default), so the blocks'
    // parameters dominate the traffic instead of the 50k-row embedding table.
    let bytes = std::env::args().any(|a| a == "--bytes");
    // (dp, strategy, overlap): without overlap every collective blocks the rank; with it
    // FullShard prefetches `--prefetch` gathers and issues its reduce-scatters where the
    // gradients are born, and DDP all-reduces `--bucket-mb` buckets as they fill (2 reductions
    // in flight either way).
    let configs: &[(usize, FsdpStrategy, bool)] = if smoke {
        &[
            (2, FsdpStrategy::FullShard, true),
            (2, FsdpStrategy::NoShard, true),
        ]
    } else {
        &[
            (2, FsdpStrategy::NoShard, false),
            (2, FsdpStrategy::NoShard, true),
            (2, FsdpStrategy::FullShard, false),
            (2, FsdpStrategy::FullShard, true),
            (4, FsdpStrategy::NoShard, false),
            (4, FsdpStrategy::NoShard, true),
            (4, FsdpStrategy::FullShard, false),
            (4, FsdpStrategy::FullShard, true),
        ]
    };
    let dir = std::env::temp_dir().join(format!("wildfire-bench-overlap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    println!(
        "link dp={link_spec}; {}; {} timed steps after one warm-up\n\n| dp | strategy | overlap | step, no link (ms) | step, link (ms) | communication on the link (ms) | exposed (ms) | hidden |\n|---|---|---|---|---|---|---|---|",
        if bytes {
            "byte tokenizer (vocabulary 256)"
        } else {
            "GPT-2 tokenizer (vocabulary 50304)"
        },
        steps
    );
    for &(dp, fsdp, overlap) in configs {
        let full = fsdp == FsdpStrategy::FullShard;
        let what = match (overlap, full) {
            (false, _) => "none".to_string(),
            (true, true) => format!("prefetch {prefetch}, async reduce-scatter"),
            (true, false) => format!("{bucket_mb} MiB buckets"),
        };
        let config = PretrainConfig {
            data: common::corpus(smoke || bytes),
            model: ModelFlags {
                preset: if smoke { Preset::Tiny } else { Preset::Small },
                n_layer: smoke.then_some(2),
                block_size: Some(if smoke { 32 } else { 128 }),
                ..PretrainConfig::quiet().model
            },
            batch_size: dp * 2,
            steps: steps + 1,
            parallel: ParallelConfig {
                dp,
                fsdp,
                ..ParallelConfig::default()
            },
            prefetch: if overlap && full { prefetch } else { 0 },
            bucket_mb: if overlap && !full { bucket_mb } else { 0.0 },
            reduce_in_flight: if overlap { 2 } else { 0 },
            gather_parameters: false,
            ..PretrainConfig::quiet()
        };
        let plain = run(&config).expect("run");
        let paced = run(&PretrainConfig {
            links: vec![format!("dp={link_spec}")],
            trace: Some(dir.join("trace.json")),
            ..config.clone()
        })
        .expect("run with the link");
        let tokens = (config.batch_size * config.model.block_size.unwrap_or(0)) as f64;
        let step_ms = |s: &RunSummary| {
            common::median(
                s.steps[1..]
                    .iter()
                    .map(|m| tokens / m.tokens_per_s * 1e3)
                    .collect(),
            )
        };
        let (t0, t1) = (step_ms(&plain), step_ms(&paced));
        let comm = common::median(common::step_communication(&paced, &link, |_| dp)[1..].to_vec());
        let exposed = t1 - t0;
        println!(
            "| {dp} | {fsdp:?} | {what} | {t0:.1} | {t1:.1} | {comm:.1} | {exposed:.1} | {:.0}% |",
            100.0 * (1.0 - exposed / comm)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
