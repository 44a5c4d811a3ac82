//! Context parallelism on a long sequence: gpt_pretrain's tiny GPT (4 layers, d = 128, 4 heads,
//! byte vocabulary) on one sequence of `--t` tokens (2,048 by default) at cp 1, 2 and 4 —
//! balanced ring attention, and at cp 4 the plain layout and the all-gather too — ranks as
//! threads. A markdown table per rank 0: the decorator's peak of live tensor bytes in a step
//! (and its ratio to cp 1), the bytes sent around the ring and everything the rank passed to
//! collectives, the step time without and with a modelled cp link (`--link`, medians over the
//! timed steps), the link's time of the step's communication (every collective and exchange of
//! rank 0's trace, at the link), the exposed part (the step time's increase) and the hidden
//! fraction.
//!
//! On a 2-core machine 2 and 4 ranks share the cores: the step times measure thread contention,
//! not scaling, and ranks that sleep in a paced exchange free cores for the others (which hides
//! link time no rank overlapped). The bytes are exact.
//!
//! ```text
//! cargo bench --bench context_parallel [-- --t 2048 --link 1GB/s,10us --steps 2]
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use wildfire::models::parallelize::ParallelConfig;
use wildfire::models::{ModelFlags, Preset};
use wildfire::parallel::comm::LinkModel;
use wildfire::parallel::{CollectiveKind, CpLayout, CpRotate};
use wildfire::pretrain::{PretrainConfig, run};

mod common;

fn main() {
    wildfire::alloc::keep_freed_memory();
    // A smoke run (`cargo test --all-targets`): a short sequence, one step.
    let smoke = common::smoke();
    let t: usize = common::arg("--t").unwrap_or(if smoke { 64 } else { 2048 });
    let link_spec = common::arg::<String>("--link").unwrap_or_else(|| "1GB/s,10us".into());
    let link: LinkModel = link_spec.parse().expect("--link BANDWIDTH,LATENCY");
    let steps: usize = common::arg("--steps").unwrap_or(if smoke { 1 } else { 2 });
    let configs: &[(usize, CpLayout, CpRotate)] = if smoke {
        &[
            (1, CpLayout::Balanced, CpRotate::Ring),
            (2, CpLayout::Balanced, CpRotate::Ring),
        ]
    } else {
        &[
            (1, CpLayout::Balanced, CpRotate::Ring),
            (2, CpLayout::Balanced, CpRotate::Ring),
            (4, CpLayout::Balanced, CpRotate::Ring),
            (4, CpLayout::Plain, CpRotate::Ring),
            (4, CpLayout::Balanced, CpRotate::AllGather),
        ]
    };
    let dir = std::env::temp_dir().join(format!("wildfire-bench-cp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    println!(
        "tiny GPT (4 layers, d 128, byte vocabulary), one sequence of {t} tokens, f32; link \
         cp={link_spec}; {steps} timed steps after one warm-up; rank 0\n\n\
         | cp | layout | rotation | peak bytes | vs cp 1 | ring sent (MB) | all comm (MB) | \
         step, no link (ms) | step, link (ms) | communication on the link (ms) | exposed (ms) | \
         hidden |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut base_peak = None;
    for &(cp, cp_layout, cp_rotate) in configs {
        let config = PretrainConfig {
            data: common::corpus(true),
            model: ModelFlags {
                preset: Preset::Tiny,
                block_size: Some(t),
                ..PretrainConfig::quiet().model
            },
            batch_size: 1,
            steps: steps + 1,
            parallel: ParallelConfig {
                cp,
                cp_layout,
                cp_rotate,
                ..ParallelConfig::default()
            },
            gather_parameters: false,
            ..PretrainConfig::quiet()
        };
        let plain = run(&config).expect("run");
        let paced = run(&PretrainConfig {
            links: if cp > 1 {
                vec![format!("cp={link_spec}")]
            } else {
                Vec::new()
            },
            trace: Some(dir.join("trace.json")),
            ..config.clone()
        })
        .expect("run with the link");
        let (t0, t1) = (
            common::median_step_ms(&plain, t),
            common::median_step_ms(&paced, t),
        );
        let comm = if cp > 1 {
            common::median(
                common::step_communication(&paced, &link, |kind| match kind {
                    CollectiveKind::Recv => 2,
                    _ => cp,
                })[1..]
                    .to_vec(),
            )
        } else {
            0.0
        };
        let m = plain.steps.last().expect("a step ran");
        let peak = m.peak_bytes;
        let base = *base_peak.get_or_insert(peak);
        let exposed = t1 - t0;
        let hidden = if comm > 0.0 {
            format!("{:.0}%", 100.0 * (1.0 - exposed / comm))
        } else {
            "–".into()
        };
        println!(
            "| {cp} | {cp_layout} | {cp_rotate} | {peak} | {:.2} | {:.2} | {:.2} | {t0:.1} | \
             {t1:.1} | {comm:.1} | {exposed:.1} | {hidden} |",
            peak as f64 / base as f64,
            m.p2p_sent_bytes as f64 / 1e6,
            m.comm_bytes as f64 / 1e6,
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
