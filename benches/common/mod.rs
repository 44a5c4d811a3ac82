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
