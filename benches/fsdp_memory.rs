//! FSDP / ZeRO memory and communication per rank on the small GPT (4 layers, d = 256, 4 heads,
//! sequence 256, GPT-2 vocabulary 50304, global batch 4, f32, AdamW), for N = 1, 2, 4 ranks (as
//! threads) and each strategy: the decorator's measured bytes after a step beside the ZeRO
//! formulas, and their ratio. A markdown table, printed and written to a file.
//!
//! ```text
//! cargo bench --bench fsdp_memory [-- --out target/fsdp_memory.md] [--only checkpoint]
//! ```
//!
//! A second table: GPT-2 124M (block 64, dp 4, FullShard, ranks as threads) with sharded
//! initialisation, a distributed checkpoint save (after each of two steps: the second step runs
//! while the first save is written) and a resume from it: the most heap bytes live at once and
//! the process's peak resident set (VmHWM, reset before each run) under the binaries' allocators
//! (the default: blocks of 1 MiB or more from one cache shared by the threads, smaller ones from
//! mimalloc keeping freed pages; glibc's for the small ones, `WILDFIRE_ALLOC=system`; or mimalloc
//! for every block, keeping freed pages, `WILDFIRE_ALLOC=mimalloc`),
//! beside the formula: the model state, plus, once a step ran, the decorator's peak of live
//! tensor bytes (activations, gathered parameters, gradients: measured, times the ranks). Also
//! the save's time on the step's path (taking the pieces) against its background write (reading
//! them out and writing them). Each run is a process of its own (this binary with `--phase`).
//!
//! Formulas (Ψ parameters, f32): parameters 4Ψ (4Ψ/N sharded), gradients 4Ψ (4Ψ/N), AdamW state
//! 8Ψ (8Ψ/N); communication in the bytes each rank passes to its collectives: DDP all-reduces the
//! gradients (4Ψ), ZeRO-1 adds the parameters' all-gather after the step (4Ψ/N), ZeRO-2
//! reduce-scatters instead of all-reducing (4Ψ + 4Ψ/N), FSDP gathers the parameters for forward
//! and again for backward (2 × 4Ψ/N) and reduce-scatters the gradients (4Ψ). Measured figures add
//! the padding of uneven shards, the tied embedding's second use and the small collectives of the
//! step (loss metric, overflow and norm check).

/// The binaries' allocator (see `wildfire::alloc`): large blocks cached across threads, small ones
/// from mimalloc keeping freed memory, or the
/// system's with `WILDFIRE_ALLOC=system`; it counts the live heap either way.
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
use wildfire::models::{ModelFlags, Preset};
use wildfire::pretrain::RunSummary;
use wildfire::pretrain::{PretrainConfig, run};

mod common;

fn main() {
    // A smoke run (`cargo test --all-targets`): a tiny model, N = 1 and 2.
    wildfire::alloc::keep_freed_memory();
    if let Some(phase) = common::arg::<String>("--phase") {
        return run_phase(&phase);
    }
    let smoke = common::smoke();
    let only = common::arg::<String>("--only");
    let checkpoint = checkpoint_memory(smoke);
    println!("{checkpoint}");
    if only.as_deref() == Some("checkpoint") {
        return;
    }
    let out = common::arg::<String>("--out").unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        format!("{dir}/fsdp_memory.md")
    });
    let strategies = [
        ("ddp", FsdpStrategy::NoShard),
        ("zero1", FsdpStrategy::ShardOptimizer),
        ("zero2", FsdpStrategy::ShardGradOp),
        ("fsdp", FsdpStrategy::FullShard),
    ];
    let ranks: &[usize] = if smoke { &[1, 2] } else { &[1, 2, 4] };
    let mut table = String::from(
        "| N | strategy | params (formula) | grads (formula) | AdamW state (formula) | persistent / 16Ψ | peak | comm bytes (formula) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for &n in ranks {
        for (name, strategy) in strategies {
            let config = PretrainConfig {
                data: common::corpus(smoke),
                model: ModelFlags {
                    preset: if smoke { Preset::Tiny } else { Preset::Small },
                    n_layer: smoke.then_some(2),
                    block_size: smoke.then_some(32),
                    ..PretrainConfig::quiet().model
                },
                steps: 2,
                batch_size: 4,
                parallel: ParallelConfig {
                    dp: n,
                    fsdp: strategy,
                    ..ParallelConfig::default()
                },
                ..PretrainConfig::quiet()
            };
            let summary = run(&config).expect("run");
            let psi = summary.model.as_ref().expect("model").num_params() as f64;
            let m = summary.steps.last().expect("a step");
            let nf = n as f64;
            let sharded = |full: f64, yes: bool| if yes { full / nf } else { full };
            let (p, g, o) = match strategy {
                FsdpStrategy::NoShard => (4.0 * psi, 4.0 * psi, 8.0 * psi),
                FsdpStrategy::ShardOptimizer => (4.0 * psi, 4.0 * psi, sharded(8.0 * psi, true)),
                FsdpStrategy::ShardGradOp => (
                    4.0 * psi,
                    sharded(4.0 * psi, true),
                    sharded(8.0 * psi, true),
                ),
                _ => (
                    sharded(4.0 * psi, true),
                    sharded(4.0 * psi, true),
                    sharded(8.0 * psi, true),
                ),
            };
            let comm = if n == 1 {
                0.0
            } else {
                match strategy {
                    FsdpStrategy::NoShard => 4.0 * psi,
                    FsdpStrategy::ShardOptimizer | FsdpStrategy::ShardGradOp => {
                        4.0 * psi + 4.0 * psi / nf
                    }
                    _ => 4.0 * psi + 2.0 * 4.0 * psi / nf,
                }
            };
            let ratio = |measured: u64, formula: f64| {
                if formula == 0.0 {
                    "—".to_string()
                } else {
                    format!("{:.3}", measured as f64 / formula)
                }
            };
            let persistent = m.param_bytes + m.grad_bytes + m.optim_bytes;
            table.push_str(&format!(
                "| {n} | {name} | {} ({:.0}, ×{}) | {} ({:.0}, ×{}) | {} ({:.0}, ×{}) | {:.3} | {} | {} ({:.0}, ×{}) |\n",
                m.param_bytes,
                p,
                ratio(m.param_bytes, p),
                m.grad_bytes,
                g,
                ratio(m.grad_bytes, g),
                m.optim_bytes,
                o,
                ratio(m.optim_bytes, o),
                persistent as f64 / (16.0 * psi),
                m.peak_bytes,
                m.comm_bytes,
                comm,
                ratio(m.comm_bytes, comm),
            ));
        }
    }
    println!("{table}");
    let table = format!("{table}\n{checkpoint}");
    match std::fs::write(&out, &table) {
        Ok(()) => eprintln!("written to {out}"),
        Err(e) => eprintln!("could not write {out}: {e}"),
    }
}

/// The process's resident set now (VmRSS).
fn rss() -> u64 {
    status_kb("VmRSS:")
}

fn status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Reset the peak resident set (VmHWM) to the current one (Linux: `5` to `clear_refs`).
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Sharded init, save and resume: measured peaks beside the formula (see the module docs).
fn checkpoint_memory(smoke: bool) -> String {
    let n = if smoke { 2 } else { 4 };
    let dir = std::env::temp_dir().join(format!("wildfire-bench-dcp-{}", std::process::id()));
    // Each phase in a process of its own (this binary, `--phase`), so one run's freed memory
    // (kept by the allocator, as the binaries keep it) does not count in the next one's figures.
    let phase = |name: &str, allocator: &str| -> Phase {
        let mut command = std::process::Command::new(std::env::current_exe().expect("this binary"));
        command
            .args(["--phase", name, "--dir"])
            .arg(&dir)
            .args(smoke.then_some("--smoke"))
            .env_remove("WILDFIRE_ALLOC");
        if allocator != "default" {
            command.env("WILDFIRE_ALLOC", allocator);
        }
        let out = command.output().expect("a phase process");
        assert!(
            out.status.success(),
            "phase {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("the phase's figures")
    };
    // The same save and resume under each allocator (the second save replaces the first).
    let mut runs = Vec::new();
    let allocators = ["default", "system", "mimalloc"];
    for allocator in allocators {
        let _ = std::fs::remove_dir_all(&dir);
        runs.push((
            phase("save", allocator),
            phase("load", allocator),
            phase("resume", allocator),
        ));
    }
    let _ = std::fs::remove_dir_all(&dir);
    for (allocator, (save, ..)) in allocators.iter().zip(&runs) {
        assert_eq!(
            &save.allocator, allocator,
            "the allocator choice reached the phases"
        );
    }
    let [
        (first, loaded, resumed),
        (first_sys, loaded_sys, resumed_sys),
        (first_mi, loaded_mi, resumed_mi),
    ] = <[_; 3]>::try_from(runs).ok().unwrap();
    let baseline = first.baseline;
    let psi = first.params as f64;
    // The decorator's peak of live tensor bytes on rank 0 (model state + activations), times
    // the ranks: every rank holds the same shapes.
    let step_peak = |s: &Phase| n as f64 * s.step_peak_bytes as f64;
    let gb = |b: f64| format!("{:.3}", b / 1e9);
    let row = |phase: &str, heap: u64, rss: [u64; 3], formula: f64, what: &str| {
        let formula = formula + baseline as f64;
        let cell = |m: u64| format!("{} ({:.2})", gb(m as f64), m as f64 / formula);
        let [default, sys, mi] = rss.map(cell);
        format!(
            "| {phase} | {} | {default} | {sys} | {mi} | {} = {what} + {} baseline |\n",
            cell(heap),
            gb(formula),
            gb(baseline as f64),
        )
    };
    let mut out = format!(
        "GPT-2 {} ({} parameters), block {}, dp {n} FullShard, ranks as threads; Ψ = parameters, \
         f32 AdamW: model state 16Ψ over the process. GB, and (in brackets) the ratio to the \
         formula{}\n\n| phase | heap peak | VmHWM, default allocator | VmHWM, glibc for small blocks \
         (`WILDFIRE_ALLOC=system`) | VmHWM, mimalloc for every block, freed pages kept \
         (`WILDFIRE_ALLOC=mimalloc`) | formula |\n|---|---|---|---|---|---|\n",
        if smoke { "tiny (smoke)" } else { "124M" },
        psi as u64,
        if smoke { 32 } else { 64 },
        if first.resets {
            ""
        } else {
            " (VmHWM could not be reset: each figure is the peak so far)"
        }
    );
    out.push_str(&row(
        "init (sharded)",
        first.setup_heap_peak,
        [
            first.setup_peak_rss,
            first_sys.setup_peak_rss,
            first_mi.setup_peak_rss,
        ],
        4.0 * psi,
        "4Ψ parameters",
    ));
    out.push_str(&row(
        "2 steps, each saved",
        first.final_heap_peak,
        [
            first.final_peak_rss,
            first_sys.final_peak_rss,
            first_mi.final_peak_rss,
        ],
        step_peak(&first) + 12.0 * psi,
        "step peak of live tensors + 12Ψ held pieces of parameters and moments",
    ));
    out.push_str(&row(
        "resume (load)",
        loaded.final_heap_peak,
        [
            loaded.final_peak_rss,
            loaded_sys.final_peak_rss,
            loaded_mi.final_peak_rss,
        ],
        12.0 * psi,
        "4Ψ parameters + 8Ψ moments",
    ));
    out.push_str(&row(
        "resume + step",
        resumed.final_heap_peak,
        [
            resumed.final_peak_rss,
            resumed_sys.final_peak_rss,
            resumed_mi.final_peak_rss,
        ],
        step_peak(&resumed),
        "step peak of live tensors",
    ));
    if let Some((copy, write)) = first.save {
        out.push_str(&format!(
            "\nsave: {:.1} ms on the step's path (taking the pieces), {:.1} ms read out and written in the background (rank 0, first save)\n",
            copy * 1e3,
            write * 1e3
        ));
    }
    out
}

/// The checkpoint runs' configuration: GPT-2 124M, block 64, dp 4 FullShard (smoke: tiny, dp 2).
fn checkpoint_config(smoke: bool) -> PretrainConfig {
    let n = if smoke { 2 } else { 4 };
    PretrainConfig {
        data: common::corpus(smoke),
        model: ModelFlags {
            preset: if smoke {
                Preset::Tiny
            } else {
                Preset::Gpt2_124m
            },
            n_layer: smoke.then_some(2),
            block_size: Some(if smoke { 32 } else { 64 }),
            ..PretrainConfig::quiet().model
        },
        batch_size: n,
        parallel: ParallelConfig {
            dp: n,
            fsdp: FsdpStrategy::FullShard,
            ..ParallelConfig::default()
        },
        gather_parameters: false,
        ..PretrainConfig::quiet()
    }
}

/// What one phase process measured.
#[derive(serde::Serialize, serde::Deserialize)]
struct Phase {
    params: u64,
    baseline: u64,
    resets: bool,
    allocator: String,
    setup_peak_rss: u64,
    final_peak_rss: u64,
    setup_heap_peak: u64,
    final_heap_peak: u64,
    step_peak_bytes: u64,
    save: Option<(f64, f64)>,
}

/// `--phase save|load|resume --dir DIR [--smoke]`: two steps, each saved into DIR; a resume from
/// the second and no step; or that resume and one more step. Prints a [`Phase`] as JSON.
fn run_phase(name: &str) {
    let dir = std::path::PathBuf::from(common::arg::<String>("--dir").expect("--dir"));
    let smoke = std::env::args().any(|a| a == "--smoke");
    let baseline = rss();
    let resets = reset_peak();
    wildfire::alloc::reset_heap_peak();
    let config = checkpoint_config(smoke);
    let summary: RunSummary = match name {
        // The resume alone (no step: its peak is read once every rank has loaded).
        "load" => run(&PretrainConfig {
            steps: 2,
            resume: Some(dir),
            ..config
        }),
        "save" => run(&PretrainConfig {
            steps: 2,
            save: Some(dir),
            save_every: 1,
            ..config
        }),
        _ => run(&PretrainConfig {
            steps: 3,
            resume: Some(dir),
            ..config
        }),
    }
    .expect("run");
    let phase = Phase {
        params: summary.model.as_ref().expect("model").num_params() as u64,
        baseline,
        resets,
        allocator: wildfire::alloc::allocator_name().into(),
        setup_peak_rss: summary.setup_peak_rss,
        final_peak_rss: summary.final_peak_rss,
        setup_heap_peak: summary.setup_heap_peak,
        final_heap_peak: summary.final_heap_peak,
        step_peak_bytes: summary
            .steps
            .iter()
            .map(|s| s.peak_bytes)
            .max()
            .unwrap_or(0),
        save: summary.saves.first().copied(),
    };
    println!("{}", serde_json::to_string(&phase).expect("json"));
}
