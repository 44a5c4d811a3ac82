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
//! deadlock), so time in `memcpy` or a futex call is missing from the totals; samples inside
//! CUDA's libraries (`libcuda`, `libcublasLt`, `libcudart`) are kept ([`BLOCKLIST`]).
//!
//! Samples are not CPU time: SIGPROF comes at most once per kernel tick, and a thread that
//! blocks SIGPROF is never sampled (lavapipe's shader and queue threads block it: Mesa's mask;
//! made by CubeCL's Wgpu device thread, they carry its name, `DSD-N-N`). So beside the stacks
//! the profile writes each thread's CPU time over the same window, read from the thread's own
//! CPU clock (`FILE.threads.tsv`, [`ThreadClocks`]): how busy each
//! thread was, per step, and how many samples each of its CPU seconds left.
//!
//! The profile starts at the run's third step (the first ones compile kernels, tune GEMMs and
//! make the gathers' plans) and ends after the last; only a build with the `host-profile`
//! feature has it ([`PretrainConfig::check`](super::PretrainConfig::check) refuses the flag
//! otherwise, before anything runs).

use super::PretrainError;
use std::path::{Path, PathBuf};

/// The steps before the profile starts (kernel compilation, GEMM tuning, first plans).
pub(crate) const SKIPPED_STEPS: usize = 2;

/// Samples per second of a thread's CPU time asked of pprof (a prime: no beat with periodic
/// work; the kernel delivers at most one per tick).
pub const FREQUENCY: i32 = 997;

/// The shared objects whose samples are dropped: pprof matches each loaded object's path
/// *containing* a name, so these are spelled so that only glibc's `libc.so`, `libgcc_s`,
/// `libpthread` and the vDSO match — a bare `libc` would also drop every sample inside
/// `libcuda.so`, `libcublasLt.so` and `libcudart.so`, where a GPU step's device thread spends
/// its time.
pub const BLOCKLIST: [&str; 4] = ["/libc.so", "/libgcc_s.so", "/libpthread.so", "vdso"];

/// Whether pprof drops the samples of the shared object at `path` under [`BLOCKLIST`] (its
/// rule: the path contains one of the names).
pub fn blocked(path: &str) -> bool {
    BLOCKLIST.iter().any(|name| path.contains(name))
}

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
    #[cfg(feature = "host-profile")]
    clocks: ThreadClocks,
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
                .blocklist(&BLOCKLIST)
                .build()
                .map_err(|e| PretrainError::Config(format!("--host-profile: {e}")))?;
            tracing::info!(
                "host profile: sampling every thread at {FREQUENCY} Hz until the run's last step"
            );
            Ok(Some(Self {
                path: path.to_path_buf(),
                guard: Some(guard),
                clocks: ThreadClocks::start(),
            }))
        }
        #[cfg(not(feature = "host-profile"))]
        {
            let _ = path;
            Err(PretrainError::Config(NOT_BUILT.into()))
        }
    }

    /// Stop sampling after `steps` profiled steps and write the folded stacks and the threads'
    /// CPU times ([`threads_path`]; both atomically); the number of samples.
    #[cfg_attr(not(feature = "host-profile"), allow(unused_mut))]
    pub(crate) fn finish(mut self, steps: usize) -> Result<u64, PretrainError> {
        #[cfg(feature = "host-profile")]
        {
            let threads = self.clocks.finish();
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
            let write = |path: &Path, text: &str| {
                wildfire_checkpoint::io::write_atomic(path, text.as_bytes()).map_err(|source| {
                    PretrainError::Io {
                        path: path.to_path_buf(),
                        source,
                    }
                })
            };
            write(&self.path, &text)?;
            let cpu: f64 = threads.threads.iter().map(|t| t.cpu_seconds).sum();
            write(&threads_path(&self.path), &threads.tsv(steps, samples))?;
            tracing::info!(
                samples,
                cpu_seconds = format!("{cpu:.2}"),
                wall_seconds = format!("{:.2}", threads.wall_seconds),
                "host profile: {} ({:.0} samples per CPU-second)",
                self.path.display(),
                samples as f64 / cpu.max(1e-9)
            );
            Ok(samples)
        }
        #[cfg(not(feature = "host-profile"))]
        {
            let _ = steps;
            unreachable!("{}: never started", self.path.display())
        }
    }
}

/// Where a profile at `path` writes its threads' CPU times: `path` with `.threads.tsv` added.
pub fn threads_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".threads.tsv");
    PathBuf::from(name)
}

/// One thread's CPU time over a window.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadCpu {
    /// The thread's name (`/proc/self/task/TID/comm`: at most 15 bytes).
    pub name: String,
    /// Its id.
    pub tid: u32,
    /// Seconds on a CPU, user and system.
    pub cpu_seconds: f64,
    /// Whether the thread blocks SIGPROF (`SigBlk` of its status): pprof's samples never
    /// reach it, whatever its CPU time. Threads made by a thread that blocked every signal
    /// inherit the mask (Mesa's lavapipe does this to CubeCL's Wgpu device threads).
    pub sigprof_blocked: bool,
}

/// The CPU time of every thread of the process from [`ThreadClocks::start`] to
/// [`ThreadClocks::finish`], read from each thread's own CPU clock (exact, unlike samples). A
/// thread started within the window counts from its start; one that ended within it is missing.
/// Empty where the system has no per-thread clocks to read (not Linux).
#[derive(Debug)]
pub struct ThreadClocks {
    started: std::time::Instant,
    at_start: std::collections::HashMap<u32, f64>,
}

/// What [`ThreadClocks::finish`] measured.
#[derive(Clone, Debug)]
pub struct ThreadTimes {
    /// The window's wall time.
    pub wall_seconds: f64,
    /// Each thread alive at the end, busiest first.
    pub threads: Vec<ThreadCpu>,
}

impl ThreadClocks {
    /// Read every thread's clock now.
    pub fn start() -> Self {
        Self {
            started: std::time::Instant::now(),
            at_start: thread_cpu()
                .into_iter()
                .map(|t| (t.tid, t.cpu_seconds))
                .collect(),
        }
    }

    /// Each thread's CPU time since [`ThreadClocks::start`].
    pub fn finish(&self) -> ThreadTimes {
        let wall_seconds = self.started.elapsed().as_secs_f64();
        let mut threads: Vec<ThreadCpu> = thread_cpu()
            .into_iter()
            .map(|t| ThreadCpu {
                cpu_seconds: (t.cpu_seconds - self.at_start.get(&t.tid).copied().unwrap_or(0.0))
                    .max(0.0),
                ..t
            })
            .collect();
        threads.sort_by(|a, b| {
            b.cpu_seconds
                .total_cmp(&a.cpu_seconds)
                .then(a.tid.cmp(&b.tid))
        });
        ThreadTimes {
            wall_seconds,
            threads,
        }
    }
}

impl ThreadTimes {
    /// The tab-separated table `tools/host_profile.py` reads: `# key value` lines (the window's
    /// `steps`, `wall_seconds` and the profile's `samples`), a header, a row per thread.
    pub fn tsv(&self, steps: usize, samples: u64) -> String {
        let mut text = format!(
            "# each thread's CPU time over the host profile's window (its CPU clock)\n\
             # steps {steps}\n# wall_seconds {:.6}\n# samples {samples}\n\
             thread\ttid\tcpu_seconds\tsigprof\n",
            self.wall_seconds
        );
        for t in &self.threads {
            text.push_str(&format!(
                "{}\t{}\t{:.6}\t{}\n",
                clean(&t.name),
                t.tid,
                t.cpu_seconds,
                if t.sigprof_blocked { "blocked" } else { "open" }
            ));
        }
        text
    }
}

/// Every live thread of this process with its CPU time so far.
#[cfg(target_os = "linux")]
fn thread_cpu() -> Vec<ThreadCpu> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(|task| {
            let tid: u32 = task.ok()?.file_name().to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
            // Linux's CPU clock of thread `tid` (`MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)`:
            // what glibc's `pthread_getcpuclockid` hands out), readable for any thread of
            // this process; nanoseconds, not the ticks of `/proc/…/stat`.
            let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
            let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status"));
            let sigprof_blocked = status.ok().is_some_and(|status| blocks_sigprof(&status));
            let mut now = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `now` is a valid timespec to write; a thread that ended meanwhile makes
            // the call fail (EINVAL), not misbehave.
            (unsafe { libc::clock_gettime(clock, &mut now) } == 0).then(|| ThreadCpu {
                name: name.trim_end().to_string(),
                tid,
                cpu_seconds: now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9,
                sigprof_blocked,
            })
        })
        .collect()
}

/// Whether a thread's `/proc/…/status` says it blocks SIGPROF (its `SigBlk` mask, in hex, has
/// bit `SIGPROF - 1`).
#[cfg(target_os = "linux")]
fn blocks_sigprof(status: &str) -> bool {
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigBlk:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask >> (libc::SIGPROF - 1) & 1 == 1)
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu() -> Vec<ThreadCpu> {
    Vec::new()
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

    #[test]
    fn the_blocklist_drops_glibc_and_keeps_cuda() {
        for path in [
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/libgcc_s.so.1",
            "/usr/lib/x86_64-linux-gnu/libpthread.so.0",
            "linux-vdso.so.1",
        ] {
            assert!(blocked(path), "{path}");
        }
        for path in [
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
            "/usr/local/cuda/lib64/libcublasLt.so.13",
            "/usr/local/cuda/lib64/libcublas.so.13",
            "/usr/local/cuda/lib64/libcudart.so.13",
            "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
            "/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so",
            "/usr/lib/x86_64-linux-gnu/libclang-14.so.1",
            "",
        ] {
            assert!(!blocked(path), "{path}");
        }
    }

    /// Each thread's CPU time over the window, from its own clock: a sleeping thread's about
    /// none, one that ended inside the window missing, a spinning one's more than none and at
    /// most the wall time; the table names the threads and the SIGPROF mask is read right.
    #[cfg(target_os = "linux")]
    #[test]
    fn thread_clocks_read_each_threads_own_cpu_time() {
        use std::time::{Duration, Instant};
        let (ready, go) = std::sync::mpsc::channel();
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let spin = std::thread::Builder::new()
            .name("spinner".into())
            .spawn({
                let ready = ready.clone();
                move || {
                    ready.send(()).unwrap();
                    let start = Instant::now();
                    let mut x = 0u64;
                    while start.elapsed() < Duration::from_millis(300) {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    }
                    x
                }
            })
            .unwrap();
        let sleep = std::thread::Builder::new()
            .name("sleeper".into())
            .spawn(move || {
                ready.send(()).unwrap();
                finished.recv().unwrap();
            })
            .unwrap();
        go.recv().unwrap();
        go.recv().unwrap();
        let clocks = ThreadClocks::start();
        spin.join().unwrap();
        // `join` returns when the thread's id is cleared, early in the kernel's exit path: its
        // `/proc` task (all signals blocked, glibc's last act) can outlive that for a moment
        // on a loaded machine (seen in CI). Gone within a second.
        let gone = Instant::now();
        while thread_cpu().iter().any(|t| t.name == "spinner") {
            assert!(
                gone.elapsed() < Duration::from_secs(1),
                "the spinner's task stays"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let times = clocks.finish();
        done.send(()).unwrap();
        sleep.join().unwrap();
        let cpu = |name: &str| {
            times
                .threads
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.cpu_seconds)
        };
        // The spinner ended inside the window: it is missing, as documented; the sleeper
        // is there with next to no CPU time.
        assert_eq!(cpu("spinner"), None, "{times:?}");
        assert!(cpu("sleeper").unwrap() < 0.05, "{times:?}");
        assert!(times.wall_seconds >= 0.25, "{times:?}");
        // A thread alive at both ends: this test's own, which spins now.
        let clocks = ThreadClocks::start();
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(200) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let times = clocks.finish();
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() } as u32;
        let mine = times.threads.iter().find(|t| t.tid == me).unwrap();
        assert!(
            mine.cpu_seconds > 0.02 && mine.cpu_seconds <= times.wall_seconds + 0.01,
            "{times:?}"
        );
        assert!(
            times
                .threads
                .windows(2)
                .all(|w| w[0].cpu_seconds >= w[1].cpu_seconds),
            "busiest first: {times:?}"
        );
        let tsv = times.tsv(7, 123);
        assert!(
            tsv.contains("# steps 7\n") && tsv.contains("# samples 123\n"),
            "{tsv}"
        );
        assert!(tsv.contains(&format!("\t{}\t", mine.tid)), "{tsv}");
        assert_eq!(
            threads_path(Path::new("/tmp/h.folded")),
            Path::new("/tmp/h.folded.threads.tsv")
        );
        assert!(!mine.sigprof_blocked, "{times:?}");
        // Mesa's mask (every signal but the fatal ones), and one that leaves SIGPROF open.
        assert!(blocks_sigprof(
            "Name:\tDSD-4-0\nSigBlk:\tfffffffe3ffbfaff\n"
        ));
        assert!(!blocks_sigprof("SigBlk:\tfffffffe3bfbfaff\nSigIgn:\t0\n"));
        assert!(!blocks_sigprof("SigBlk:\t0000000000000000\n"));
    }
}
