//! What the examples share: logging and the allocator setting.

/// Set up a binary: the allocator keeps freed memory (see `wildfire::alloc`), and logs go through
/// `tracing` to stderr, filtered by `RUST_LOG` (else `default`, e.g. `"info"`), coloured only on a
/// terminal (a log redirected to a file stays plain text).
pub fn init(default: &str) {
    wildfire::alloc::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .init();
}
