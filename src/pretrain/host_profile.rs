//! `--host-profile FILE`: where the host's time goes, as folded stacks of every thread of the
//! process (`thread;outermost;…;innermost count`, one line per distinct stack: the format
//! `flamegraph.pl`, `inferno-flamegraph` and speedscope read; `tools/host_profile.py` prints each
//! thread's heaviest functions from it).
//!
//! A GPU step can be bound by the host: the rank's thread preparing launches and CubeCL's device
//! thread taking them (architecture §21 found the GPT-2 step at the speed of its host work, ≈ 60
//! to 100 µs per device operation). A machine lent with a GPU has no `perf`, so the binary
//! samples itself: [pprof](https://docs.rs/pprof) (SIGPROF at [`FREQUENCY`] Hz of CPU time, so a
//! thread asleep or parked in a wait is not sampled; a spinning one is). Symbols come from the
//! binary's symbol table: keep it (`objcopy --strip-debug`, not `strip`). Samples taken inside
//! libc, libgcc, libpthread or the vDSO are dropped (pprof's advice: unwinding from there can
//! deadlock), so time in `memcpy` or a futex call is missing from the totals.
//!
//! The profile starts at the run's third step (the first ones compile kernels, tune GEMMs and
//! make the gathers' plans) and ends after the last; only a build with the `host-profile`
//! feature has it ([`PretrainConfig::check`](super::PretrainConfig::check) refuses the flag
//! otherwise, before anything runs).

use super::PretrainError;
use std::path::{Path, PathBuf};

/// The steps before the profile starts (kernel compilation, GEMM tuning, first plans).
pub(crate) const SKIPPED_STEPS: usize = 2;

/// Samples per second of a thread's CPU time (a prime: no beat with periodic work).
pub const FREQUENCY: i32 = 997;

/// The step at which a run of `first_step..steps` starts its profile: after
/// [`SKIPPED_STEPS`], or at the last step of a shorter run.
pub(crate) fn first_profiled(first_step: usize, steps: usize) -> usize {
    (first_step + SKIPPED_STEPS).min(steps.saturating_sub(1).max(first_step))
}

/// Why a build without the feature cannot profile.
pub(crate) const NOT_BUILT: &str = "--host-profile samples this process with pprof, which this \
     build leaves out: build with `--features host-profile` (and keep the symbol table: \
     `objcopy --strip-debug`, not `strip`)";

/// A profile running in this process until [`HostProfile::finish`].
pub(crate) struct HostProfile {
    path: PathBuf,
    #[cfg(feature = "host-profile")]
    guard: Option<pprof::ProfilerGuard<'static>>,
}

/// Whether a [`HostProfile`] of this process is running (pprof samples the whole process: one
/// at a time).
#[cfg(feature = "host-profile")]
static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(feature = "host-profile")]
impl Drop for HostProfile {
    fn drop(&mut self) {
        drop(self.guard.take());
        STARTED.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl HostProfile {
    /// Start sampling every thread of the process, to write `path` at [`HostProfile::finish`];
    /// `None` when another rank of this process (ranks as threads) has started it.
    pub(crate) fn start(path: &Path) -> Result<Option<Self>, PretrainError> {
        #[cfg(feature = "host-profile")]
        {
            if STARTED.swap(true, std::sync::atomic::Ordering::AcqRel) {
                return Ok(None);
            }
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(FREQUENCY)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .map_err(|e| PretrainError::Config(format!("--host-profile: {e}")))?;
            tracing::info!(
                "host profile: sampling every thread at {FREQUENCY} Hz until the run's last step"
            );
            Ok(Some(Self {
                path: path.to_path_buf(),
                guard: Some(guard),
            }))
        }
        #[cfg(not(feature = "host-profile"))]
        {
            let _ = path;
            Err(PretrainError::Config(NOT_BUILT.into()))
        }
    }

    /// Stop sampling and write the folded stacks (atomically); the number of samples.
    #[cfg_attr(not(feature = "host-profile"), allow(unused_mut))]
    pub(crate) fn finish(mut self) -> Result<u64, PretrainError> {
        #[cfg(feature = "host-profile")]
        {
            let guard = self.guard.take().expect("running until finished");
            let report = guard
                .report()
                .build()
                .map_err(|e| PretrainError::Config(format!("--host-profile: {e}")))?;
            drop(guard);
            let stacks = report.data.iter().map(|(frames, &count)| {
                let names = frames
                    .frames
                    .iter()
                    .rev()
                    .flat_map(|frame| frame.iter().rev().map(|symbol| symbol.name()));
                (
                    frames.thread_name_or_id(),
                    names.collect::<Vec<_>>(),
                    count.max(0) as u64,
                )
            });
            let (text, samples) = folded(stacks);
            wildfire_checkpoint::io::write_atomic(&self.path, text.as_bytes()).map_err(
                |source| PretrainError::Io {
                    path: self.path.clone(),
                    source,
                },
            )?;
            tracing::info!(samples, "host profile: {}", self.path.display());
            Ok(samples)
        }
        #[cfg(not(feature = "host-profile"))]
        {
            unreachable!("{}: never started", self.path.display())
        }
    }
}

/// Folded stacks of `(thread, frames from the outermost, samples)`: one line per distinct
/// stack, counts of equal lines summed (threads are named by name, so two threads of one name
/// share their lines), sorted; and the total samples. A `;` inside a name (an array type in a
/// generic's path) becomes `,`, since `;` separates frames.
pub fn folded(stacks: impl IntoIterator<Item = (String, Vec<String>, u64)>) -> (String, u64) {
    let mut lines = std::collections::BTreeMap::<String, u64>::new();
    let mut samples = 0;
    for (thread, frames, count) in stacks {
        if count == 0 {
            continue;
        }
        let mut line = clean(&thread);
        for frame in &frames {
            line.push(';');
            line.push_str(&clean(frame));
        }
        *lines.entry(line).or_default() += count;
        samples += count;
    }
    let mut text = String::new();
    for (line, count) in lines {
        text.push_str(&line);
        text.push(' ');
        text.push_str(&count.to_string());
        text.push('\n');
    }
    (text, samples)
}

/// A name fit for one field of a folded line: no separator, no line break, not empty.
fn clean(name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| match c {
            ';' => ',',
            '\n' | '\r' => ' ',
            c => c,
        })
        .collect();
    if name.trim().is_empty() {
        "?".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> String {
        x.to_string()
    }

    #[test]
    fn folded_lines_sum_equal_stacks_and_keep_names_whole() {
        let (text, samples) = folded([
            (s("rank-0"), vec![s("main"), s("step"), s("enqueue")], 3),
            (s("rank-0"), vec![s("main"), s("step"), s("enqueue")], 2),
            (s("cubecl"), vec![s("run"), s("<[f32; 4] as Foo>::bar")], 1),
            (s(""), vec![s("idle")], 4),
            (s("rank-1"), vec![s("never")], 0),
        ]);
        assert_eq!(samples, 10);
        assert_eq!(
            text,
            "?;idle 4\ncubecl;run;<[f32, 4] as Foo>::bar 1\nrank-0;main;step;enqueue 5\n"
        );
    }

    #[test]
    fn the_profile_skips_the_first_steps_but_never_the_whole_run() {
        assert_eq!(first_profiled(0, 30), 2);
        assert_eq!(first_profiled(10, 30), 12);
        assert_eq!(first_profiled(0, 2), 1);
        assert_eq!(first_profiled(0, 1), 0);
        assert_eq!(first_profiled(5, 6), 5);
    }
}
