//! Shared by the benches. `cargo test --all-targets` runs every bench binary without `--bench`:
//! a quick smoke run then.

/// Whether this is a smoke run (no `--bench` on the command line).
pub fn smoke() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

/// The value after `name` on the command line, parsed.
pub fn arg<T: std::str::FromStr>(name: &str) -> Option<T> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1)?.parse().ok())
}

/// The data flags of a bench: the embedded corpus, tokenised as bytes or with GPT-2's BPE.
#[allow(dead_code)] // not every bench trains the driver
pub fn corpus(bytes: bool) -> wildfire::models::data::DataFlags {
    use wildfire::models::data::{DataFlags, TokenizerKind};
    DataFlags {
        tokenizer: if bytes {
            TokenizerKind::Bytes
        } else {
            TokenizerKind::Gpt2
        },
        ..DataFlags::default()
    }
}

/// Per step of a traced run (rank 0's trace): the modelled `link`'s time, in ms, of every
/// collective and point-to-point exchange that started inside the step, each over `members(kind)`
/// ranks.
#[allow(dead_code)] // not every bench models a link
pub fn step_communication(
    summary: &wildfire::pretrain::RunSummary,
    link: &wildfire::parallel::comm::LinkModel,
    members: impl Fn(wildfire::parallel::CollectiveKind) -> usize,
) -> Vec<f64> {
    let (_, trace) = &summary.trace[0];
    let steps = trace
        .iter()
        .filter(|e| e.kind.is_none() && e.name == "step");
    steps
        .map(|step| {
            let end = step.start_us + step.dur_us;
            trace
                .iter()
                .filter(|e| e.start_us >= step.start_us && e.start_us <= end)
                .filter_map(|e| Some(link.collective_time(e.kind?, members(e.kind?), e.bytes)))
                .map(|t| t.as_secs_f64() * 1e3)
                .sum()
        })
        .collect()
}

/// The median (the upper one of an even count; 0 for none).
#[allow(dead_code)] // not every bench takes medians of f64
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The median step time (ms) of a run's steps after the first (a warm-up), each step of
/// `tokens` tokens.
#[allow(dead_code)] // not every bench times steps
pub fn median_step_ms(summary: &wildfire::pretrain::RunSummary, tokens: usize) -> f64 {
    median(
        summary.steps[1..]
            .iter()
            .map(|m| tokens as f64 / m.tokens_per_s * 1e3)
            .collect(),
    )
}
