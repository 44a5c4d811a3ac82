//! The allocator the binaries use, counting the bytes live on the heap and their peak.
//!
//! A training step frees and allocates the same large buffers every step (a 50k-vocabulary
//! model's logits and their gradient are 206 MB each at batch 4, sequence 256). Returned to the
//! kernel, every step faults their pages in again and the kernel zeroes them (13% of such a step,
//! 47k page faults in 10 steps). Kept in per-thread pools (mimalloc with purging off), they are
//! reused only by the thread that freed them, and with ranks as threads the resident set grew to
//! 1.6× the live heap at a resumed step's peak (the `fsdp_memory` bench).
//!
//! So blocks of [`LARGE_BLOCK`] bytes or more take their own path, as PyTorch's caching
//! allocators do: each is a mapping of its own, rounded up to a size class (at most 1/32 more),
//! and a freed one goes to one cache shared by every thread, where the next request of its class
//! (from any rank) takes it back with its pages still resident. The cache keeps the resident
//! bytes of large blocks (live plus cached) within 1.25× the most live large bytes there have
//! ever been: a request that finds no block of its class unmaps cached blocks first (the smallest
//! that covers it, else the largest that do not) whenever mapping a new one would pass that mark.
//! [`LargeBlockStats`] counts what it did.
//!
//! **The slack (2026-11-28).** With the mark at exactly the most ever live, ranks as threads
//! thrashed the cache: two ranks in different phases of their steps ask for sizes the other has
//! just freed, and every miss mapped a block and unmapped another. `gpt_pretrain --preset small
//! --batch-size 8 --dp 2`, 20 steps: 613 mappings, 730k page faults (mimalloc: 659), 15% of the
//! time in the kernel's TLB shootdowns (copy-on-write faults in `memset`), 12.7 s against
//! mimalloc's 8.2 s. With a quarter of slack over the mark: 195 mappings (most in the first
//! steps), 186k faults, 8.4 s. Then (40 steps, median tokens/s after the third, ranks with their
//! own rayon pools, runs on this machine move by ±20%): dp 2 5,936 and 6,472 tok/s at 0.38 GB
//! peak resident, against 4,510 and 4,175 at 0.33 GB with the exact mark and 5,886–7,522 at
//! 0.37–0.39 GB with `WILDFIRE_ALLOC=mimalloc`. The slack costs memory where ranks are many: the
//! `fsdp_memory` bench below (dp 4) peaks at 4.04 GB (2 steps, each saved) and 3.99 GB (resume
//! and step) by default, against 4.31 and 3.89 GB with mimalloc in the same run — the exact
//! mark's 3.34 and 3.27 GB were measured the day before and not again. Reusing a larger free
//! block (up to twice the class) was tried too: no faster, 0.16 GB more.
//!
//! Smaller blocks go to mimalloc, told to keep what it frees ([`keep_freed_memory`]), or with
//! `WILDFIRE_ALLOC=system` to glibc's malloc. `WILDFIRE_ALLOC=mimalloc` sends every block to
//! mimalloc (no large-block cache), for comparison.
//!
//! **Measured (2026-11-27, this 2-core CPU, with the exact mark: see the slack above) — why the
//! cache stays, and what it costs.**
//! `cargo bench --bench fsdp_memory -- --only checkpoint` runs GPT-2 124M, block 64, dp 4
//! FullShard with ranks as threads, each phase in a process of its own. Its peak resident set
//! (VmHWM, GB):
//!
//! | phase | default (this cache) | mimalloc for every block, freed pages kept |
//! |---|---|---|
//! | init | 0.56 | 0.63 |
//! | 2 steps, each saved | 3.34 | 4.39 |
//! | resume + step | 3.27 | 3.91 |
//!
//! So mimalloc's own pools, with its option to keep freed memory, hold 13–31% more than this
//! cache does.
//!
//! The other way to bound them, mimalloc's purging, is what this module replaced: every step
//! faults the freed pages back in.
//!
//! The cache costs speed. `cargo bench --bench gpt_throughput` (4 layers, d 256, t 256, 50k
//! vocabulary, batch 4), two runs each:
//! - default: 894 and 974 tokens/s, peak RSS 0.75 GB;
//! - `WILDFIRE_ALLOC=mimalloc`: 1,043 and 1,196 tokens/s, peak RSS 1.01 GB.
//!
//! That is about 18% faster for 1.34× the memory. Where the time goes (the shared cache's lock,
//! or the unmapping that keeps the resident bytes under their high-water mark) is not profiled
//! yet. `WILDFIRE_ALLOC=mimalloc` is the choice for speed when memory allows.
//!
//! **The counting** is per thread and batched (`HeapCounts`, 2026-12-03): a block costs a
//! thread-local add, and the shared counts move once a thread's net change passes
//! [`COUNT_BATCH`]. Counted straight into shared atomics it cost 16 ns a block on one thread and
//! 260 ns with two threads allocating at once (one contended cache line); now 6.6 ns either way
//! over mimalloc's own 4.5 (`cargo bench --bench overhead -- --only alloc`).
//!
//! Binaries declare
//! `#[global_allocator] static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;`
//! and call [`keep_freed_memory`] first thing in `main`; [`heap_peak`] then tells the program's
//! own memory apart from what the allocators keep.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicIsize, AtomicU8, AtomicUsize, Ordering};

/// Blocks of this many bytes or more are mappings of their own, cached across threads.
pub const LARGE_BLOCK: usize = 1 << 20;

/// The page size the mappings are aligned to (a block asking for more alignment takes the small
/// path).
const PAGE: usize = 4096;

/// mimalloc's `mi_option_purge_delay` (the `mi_option_e` enum of mimalloc 3, `mimalloc.h`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Never purge the small blocks' freed pages (mimalloc's purge delay −1): memory a step frees
/// stays mapped for the next step.
pub fn keep_freed_memory() {
    // SAFETY: sets one integer option; mimalloc documents `mi_option_set` as callable at any
    // time (we call it before any thread of ours starts).
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// The process's heap counts (see [`HeapCounts`]).
static COUNTS: HeapCounts = HeapCounts::new();
/// 0: not chosen yet, 1: mimalloc, 2: the system's, 3: mimalloc for every block (no large-block
/// cache).
static CHOICE: AtomicU8 = AtomicU8::new(0);
/// The process's cache of large blocks (used where [`Allocator`] is the global allocator).
static LARGE: BlockCache = BlockCache::new();

/// Bytes allocated through [`Allocator`] and not yet freed (0 where it is not the global
/// allocator).
///
/// Exact for the calling thread's blocks; each other thread's count may be off by less than
/// [`COUNT_BATCH`] either way (see the private `HeapCounts`).
pub fn heap_live() -> usize {
    flush_this_thread();
    COUNTS.live()
}

/// The most bytes live at once through [`Allocator`] since the start or the last
/// [`reset_heap_peak`]: what the resident set would be if the allocator kept nothing.
/// Within [`COUNT_BATCH`] per thread, as [`heap_live`].
pub fn heap_peak() -> usize {
    flush_this_thread();
    COUNTS.peak.0.load(Ordering::Relaxed)
}

/// Start a new [`heap_peak`] from the bytes live now.
pub fn reset_heap_peak() {
    COUNTS.peak.0.store(heap_live(), Ordering::Relaxed);
}

/// Whether [`Allocator`] forwards small blocks to the system's allocator
/// (`WILDFIRE_ALLOC=system`).
pub fn uses_system_allocator() -> bool {
    system()
}

/// The allocator [`Allocator`] runs as: `"default"` (large blocks cached across threads, small
/// ones from mimalloc), `"system"` or `"mimalloc"` (every block), as `WILDFIRE_ALLOC` chose.
pub fn allocator_name() -> &'static str {
    match choice() {
        2 => "system",
        3 => "mimalloc",
        _ => "default",
    }
}

/// What the process's cache of large blocks has done (all zero where [`Allocator`] is not the
/// global allocator).
pub fn large_block_stats() -> LargeBlockStats {
    LARGE.stats()
}

/// Unmap every cached large block (as `torch.cuda.empty_cache` does): the resident set drops to
/// the live blocks. Returns the bytes unmapped.
pub fn release_cached_memory() -> usize {
    LARGE.release()
}

#[inline]
fn system() -> bool {
    choice() == 2
}

/// The allocator choice, read from `WILDFIRE_ALLOC` once (see [`CHOICE`]). Inlined into every
/// allocation and free: one load and a branch once chosen.
#[inline(always)]
fn choice() -> u8 {
    match CHOICE.load(Ordering::Relaxed) {
        0 => choose(),
        chosen => chosen,
    }
}

/// The first [`choice`]: read `WILDFIRE_ALLOC`.
#[cold]
#[inline(never)]
fn choose() -> u8 {
    // Read with libc's getenv: the first allocation happens before `main`, and `std::env` would
    // allocate. Every later call sees the same answer.
    // SAFETY: a NUL-terminated name; the returned pointer is only compared and read as a C
    // string while the environment is not being modified (process start).
    let value = unsafe { libc::getenv(c"WILDFIRE_ALLOC".as_ptr()) };
    let value = if value.is_null() {
        &b""[..]
    } else {
        // SAFETY: getenv returned a valid C string.
        unsafe { std::ffi::CStr::from_ptr(value) }.to_bytes()
    };
    let choice = match value {
        b"system" => 2,
        b"mimalloc" => 3,
        _ => 1,
    };
    match CHOICE.compare_exchange(0, choice, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => choice,
        Err(chosen) => chosen,
    }
}

/// A thread's allocations and frees reach the shared counts once their net sum passes this many
/// bytes either way (see the private `HeapCounts`).
pub const COUNT_BATCH: usize = 64 << 10;

/// One counter on a cache line of its own (128 bytes: adjacent-line prefetch pairs lines).
#[repr(align(128))]
struct Padded<T>(T);

/// The heap's live bytes and their peak, shared by every thread.
///
/// **Why batched (2026-12-03).** Counting every block straight into shared atomics put a
/// `lock xadd` and a compare-exchange on one cache line into every allocation and free. A rank's
/// thread and CubeCL's device thread allocate all the time (tensor metadata, launch closures,
/// bindings), so that line moved between cores on nearly every block: `perf` of a GPT-2-shaped
/// Wgpu run put 11% of the rank thread's own work (outside its wait for the device thread) and
/// 20% of the device thread's Rust code on that one instruction. `cargo bench --bench overhead
/// -- --only alloc` (a 2-core AMD EPYC, both builds in one session) measured a 64–127-byte block
/// at 21 ns through the global allocator against mimalloc's 4.6 on one thread, and 264 against
/// 7 with two threads allocating at once; batched (and the allocator choice's first read moved
/// out of line), 11 against 4.5 and 12 against 4.6. So each thread sums its own changes
/// ([`PENDING`]) and adds them to the shared counts when the sum passes [`COUNT_BATCH`] either
/// way, at the thread's exit, and before it reads [`heap_live`] or [`heap_peak`]. A large block
/// (≥ [`LARGE_BLOCK`] > the batch) always reaches them at once.
///
/// So the counts are exact for the reading thread's blocks and off by less than [`COUNT_BATCH`]
/// per other thread, either way (a thread's unreported frees leave the shared count high): with
/// the 20-odd threads of a run (ranks, rayon's workers, CubeCL's device threads) a few MB, against
/// the hundreds of MB to GB the peaks are read for.
///
/// The live count is signed: a block one thread allocates and another frees can reach the shared
/// count as the free first, and an unsigned count would wrap there and set a peak of 2⁶⁴ bytes.
struct HeapCounts {
    live: Padded<AtomicIsize>,
    peak: Padded<AtomicUsize>,
}

impl HeapCounts {
    const fn new() -> Self {
        Self {
            live: Padded(AtomicIsize::new(0)),
            peak: Padded(AtomicUsize::new(0)),
        }
    }

    /// The live bytes the shared count holds (0 while other threads' frees run ahead of their
    /// allocations).
    fn live(&self) -> usize {
        self.live.0.load(Ordering::Relaxed).max(0) as usize
    }

    /// Add a net change of `delta` bytes to the shared counts.
    fn apply(&self, delta: isize) {
        if delta == 0 {
            return;
        }
        let live = self.live.0.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 && live > 0 {
            let live = live as usize;
            // Read first: the peak's line is written only when it moves.
            if live > self.peak.0.load(Ordering::Relaxed) {
                self.peak.0.fetch_max(live, Ordering::Relaxed);
            }
        }
    }

    /// Count `delta` bytes into a thread's `pending` sum, which reaches the shared counts when it
    /// passes [`COUNT_BATCH`] either way.
    fn count(&self, pending: &Cell<isize>, delta: isize) {
        let sum = pending.get() + delta;
        if sum.unsigned_abs() < COUNT_BATCH {
            pending.set(sum);
        } else {
            pending.set(0);
            self.apply(sum);
        }
    }
}

/// A thread's bytes not yet added to [`COUNTS`]; added when the thread exits.
struct Pending(Cell<isize>);

impl Drop for Pending {
    fn drop(&mut self) {
        COUNTS.apply(self.0.replace(0));
    }
}

thread_local! {
    // Constant-initialised: no allocation on first use. On Linux its exit hook is registered with
    // glibc's `__cxa_thread_atexit_impl`, which allocates with glibc's malloc, not through this
    // allocator.
    static PENDING: Pending = const { Pending(Cell::new(0)) };
}

/// Count an allocation (`delta` > 0) or a free: into this thread's sum, or straight into the
/// shared counts where the thread's storage is gone (blocks freed by the thread's exit hooks
/// that run after [`PENDING`]'s).
#[inline]
fn count(delta: isize) {
    if PENDING.try_with(|p| COUNTS.count(&p.0, delta)).is_err() {
        COUNTS.apply(delta);
    }
}

/// Add this thread's pending bytes to the shared counts.
fn flush_this_thread() {
    let _ = PENDING.try_with(|p| COUNTS.apply(p.0.replace(0)));
}

#[inline]
fn grow(bytes: usize) {
    count(bytes as isize);
}

#[inline]
fn shrink(bytes: usize) {
    count(-(bytes as isize));
}

/// A block resized from `old` to `new` bytes: one net change.
#[inline]
fn resize(old: usize, new: usize) {
    count(new as isize - old as isize);
}

/// Whether a block of this layout takes the large path (the same answer at its free).
#[inline]
fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE_BLOCK && layout.align() <= PAGE && choice() != 3
}

/// The size class of a large block: rounded up to a 32nd of the power of two at or below it
/// (so at most 1/32 more), and to whole pages.
fn size_class(size: usize) -> usize {
    let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let step = (floor / 32).max(PAGE);
    size.div_ceil(step) * step
}

/// What the process's cache of large blocks has done since the process started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LargeBlockStats {
    /// Requests served from the cache (no new mapping, pages already resident).
    pub hits: u64,
    /// New mappings made.
    pub maps: u64,
    /// Cached blocks unmapped to stay within the mark (or by [`release_cached_memory`]).
    pub unmaps: u64,
    /// Bytes of live large blocks (by size class).
    pub live: usize,
    /// Bytes of cached (free, still mapped) large blocks.
    pub cached: usize,
    /// The most bytes of live large blocks there have been at once: live + cached stays within it.
    pub peak_live: usize,
}

/// The resident bytes of large blocks (live and cached) stay within the most ever live and this
/// fraction of it (1/`SLACK`).
const SLACK: usize = 4;

#[derive(Default)]
struct CacheState {
    /// Free blocks by size class (addresses).
    free: BTreeMap<usize, Vec<usize>>,
    stats: LargeBlockStats,
}

/// A cache of large blocks shared by every thread (see the module docs).
pub(crate) struct BlockCache {
    state: Mutex<Option<CacheState>>,
}

impl BlockCache {
    pub(crate) const fn new() -> Self {
        Self {
            state: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<CacheState>> {
        // A panic while the lock was held (an allocation failing inside the map) leaves counts
        // that are still consistent: take the state as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block of `size` bytes (≥ [`LARGE_BLOCK`]), page aligned; null if the kernel refuses.
    /// `zeroed`: its bytes are 0.
    pub(crate) fn alloc(&self, size: usize, zeroed: bool) -> *mut u8 {
        let class = size_class(size);
        let mut evicted = Vec::new();
        let hit = {
            let mut guard = self.lock();
            let state = guard.get_or_insert_with(CacheState::default);
            let hit = state.free.get_mut(&class).and_then(Vec::pop);
            if state.free.get(&class).is_some_and(Vec::is_empty) {
                state.free.remove(&class);
            }
            let stats = &mut state.stats;
            stats.live += class;
            stats.peak_live = stats.peak_live.max(stats.live);
            match hit {
                Some(_) => {
                    stats.cached -= class;
                    stats.hits += 1;
                }
                None => {
                    stats.maps += 1;
                    // Unmap cached blocks until the new mapping keeps live + cached within the
                    // mark: first the smallest block that covers it alone, else the largest ones.
                    let over = |s: &LargeBlockStats| {
                        (s.live + s.cached).saturating_sub(s.peak_live + s.peak_live / SLACK)
                    };
                    while over(&state.stats) > 0 {
                        let need = over(&state.stats);
                        let pick = state
                            .free
                            .range(need..)
                            .next()
                            .or_else(|| state.free.iter().next_back())
                            .map(|(&c, _)| c);
                        let Some(c) = pick else { break };
                        let blocks = state.free.get_mut(&c).expect("a listed class");
                        evicted.push((blocks.pop().expect("a non-empty class"), c));
                        if blocks.is_empty() {
                            state.free.remove(&c);
                        }
                        state.stats.cached -= c;
                        state.stats.unmaps += 1;
                    }
                }
            }
            hit
        };
        for (addr, c) in evicted {
            // SAFETY: a mapping of `c` bytes this cache made and no one uses (it was free).
            unsafe { libc::munmap(addr as *mut libc::c_void, c) };
        }
        if let Some(addr) = hit {
            if zeroed {
                // SAFETY: the block holds `class ≥ size` bytes and is ours alone.
                unsafe { std::ptr::write_bytes(addr as *mut u8, 0, size) };
            }
            return addr as *mut u8;
        }
        // SAFETY: an anonymous private mapping, no address hint; its pages are zero.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                class,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let mut guard = self.lock();
            let stats = &mut guard.as_mut().expect("initialised above").stats;
            stats.live -= class;
            stats.maps -= 1;
            return std::ptr::null_mut();
        }
        p as *mut u8
    }

    /// Return a block [`BlockCache::alloc`] gave for `size` bytes.
    pub(crate) fn free(&self, ptr: *mut u8, size: usize) {
        let class = size_class(size);
        let mut guard = self.lock();
        let state = guard.as_mut().expect("a block was allocated");
        state.free.entry(class).or_default().push(ptr as usize);
        state.stats.live -= class;
        state.stats.cached += class;
    }

    pub(crate) fn stats(&self) -> LargeBlockStats {
        self.lock().as_ref().map(|s| s.stats).unwrap_or_default()
    }

    /// Unmap every cached block; the bytes unmapped.
    pub(crate) fn release(&self) -> usize {
        let free = {
            let mut guard = self.lock();
            let Some(state) = guard.as_mut() else {
                return 0;
            };
            let free = std::mem::take(&mut state.free);
            let blocks: usize = free.values().map(Vec::len).sum();
            state.stats.unmaps += blocks as u64;
            state.stats.cached = 0;
            free
        };
        let mut bytes = 0;
        for (class, blocks) in free {
            for addr in blocks {
                // SAFETY: a free mapping of `class` bytes this cache made.
                unsafe { libc::munmap(addr as *mut libc::c_void, class) };
                bytes += class;
            }
        }
        bytes
    }
}

/// The binaries' global allocator (see the module docs): large blocks from the shared cache,
/// small ones from mimalloc or, with `WILDFIRE_ALLOC=system`, the system's; counted either way.
pub struct Allocator;

impl Allocator {
    /// A small block from the chosen allocator.
    #[inline]
    unsafe fn small(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            match (system(), zeroed) {
                (true, false) => System.alloc(layout),
                (true, true) => System.alloc_zeroed(layout),
                (false, false) => mimalloc::MiMalloc.alloc(layout),
                (false, true) => mimalloc::MiMalloc.alloc_zeroed(layout),
            }
        }
    }

    #[inline]
    unsafe fn any(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        let p = if is_large(layout) {
            LARGE.alloc(layout.size(), zeroed)
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.small(layout, zeroed) }
        };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
}

// SAFETY: a block's path (the large cache, or one small allocator chosen once before the first
// allocation returns and never changed) is a function of its layout, which the caller passes
// again at its free, so each block is freed by the allocator that made it; the large path hands
// out page-aligned mappings of at least the size asked for, each to one owner at a time; the
// counters only observe sizes.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's guarantees.
        unsafe { self.any(layout, false) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's guarantees.
        unsafe { self.any(layout, true) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        if is_large(layout) {
            LARGE.free(ptr, layout.size());
            return;
        }
        // SAFETY: forwarded with the caller's guarantees, to the allocator that made it.
        unsafe {
            if system() {
                System.dealloc(ptr, layout)
            } else {
                mimalloc::MiMalloc.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` rounded to the alignment does not overflow.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if is_large(layout) || is_large(new_layout) {
            if is_large(layout) && size_class(layout.size()) == size_class(new_size) {
                // The same mapping holds it.
                resize(layout.size(), new_size);
                return ptr;
            }
            // SAFETY: a new block, the old one's bytes copied in, the old one freed.
            unsafe {
                let p = self.any(new_layout, false);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                return p;
            }
        }
        // SAFETY: forwarded with the caller's guarantees, to the allocator that made it.
        let p = unsafe {
            if system() {
                System.realloc(ptr, layout, new_size)
            } else {
                mimalloc::MiMalloc.realloc(ptr, layout, new_size)
            }
        };
        if !p.is_null() {
            resize(layout.size(), new_size);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option number is the purge delay's: its documented default (1000 ms in mimalloc 3)
    /// before, −1 after.
    #[test]
    fn the_purge_delay_is_the_option_set() {
        // SAFETY: reads an integer option.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(get(), 1000);
        keep_freed_memory();
        assert_eq!(get(), -1);
    }

    /// Every thread's changes reach the shared counts in sums of at least a batch: the shared
    /// live count plus what the threads hold back is the exact count at every moment, and the
    /// reported peak is within a batch per thread of the exact one; a large block is counted at
    /// once.
    #[test]
    fn batched_heap_counts_stay_within_a_batch_per_thread() {
        let counts = HeapCounts::new();
        let live = |c: &HeapCounts| c.live();
        let peak = |c: &HeapCounts| c.peak.0.load(Ordering::Relaxed);
        let threads = [Cell::new(0isize), Cell::new(0), Cell::new(0)];
        // Small blocks stay with their thread until their sum passes the batch.
        counts.count(&threads[0], 1000);
        assert_eq!((live(&counts), threads[0].get()), (0, 1000));
        counts.count(&threads[0], COUNT_BATCH as isize - 1000);
        assert_eq!((live(&counts), peak(&counts)), (COUNT_BATCH, COUNT_BATCH));
        assert_eq!(threads[0].get(), 0);
        // A large block goes at once, with what its thread held back.
        counts.count(&threads[1], 300);
        counts.count(&threads[1], LARGE_BLOCK as isize);
        assert_eq!(live(&counts), COUNT_BATCH + LARGE_BLOCK + 300);
        counts.count(&threads[1], -(LARGE_BLOCK as isize));
        assert_eq!(live(&counts), COUNT_BATCH + 300);
        assert_eq!(peak(&counts), COUNT_BATCH + LARGE_BLOCK + 300);

        // Blocks one thread allocated and another frees: the free can reach the shared count
        // first; it goes below zero there and neither the live count nor the peak wraps.
        let counts = HeapCounts::new();
        let (a, b) = (Cell::new(0isize), Cell::new(0isize));
        for _ in 0..60 {
            counts.count(&a, 1024);
        }
        for _ in 0..70 {
            counts.count(&b, -1024);
        }
        assert_eq!(
            counts.live.0.load(Ordering::Relaxed),
            -(COUNT_BATCH as isize)
        );
        assert_eq!((live(&counts), peak(&counts)), (0, 0));
        counts.count(&a, COUNT_BATCH as isize);
        assert_eq!(
            live(&counts) as isize + a.get() + b.get(),
            -10 * 1024 + COUNT_BATCH as isize
        );
        assert!(peak(&counts) <= 2 * COUNT_BATCH, "{}", peak(&counts));

        // Random allocations and frees of every size over three threads.
        let counts = HeapCounts::new();
        let (mut exact, mut exact_peak) = (0isize, 0isize);
        let mut held: Vec<Vec<isize>> = vec![Vec::new(); threads.len()];
        for t in &threads {
            t.set(0);
        }
        let mut x = 99u64;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let t = (x >> 33) as usize % threads.len();
            let free = !held[t].is_empty() && (x >> 40).is_multiple_of(2);
            let delta = if free {
                let i = (x >> 20) as usize % held[t].len();
                -held[t].swap_remove(i)
            } else {
                // Mostly small blocks, now and then a large one.
                let size = if (x >> 50).is_multiple_of(64) {
                    LARGE_BLOCK + (x >> 8) as usize % LARGE_BLOCK
                } else {
                    16 + (x >> 8) as usize % 4096
                };
                held[t].push(size as isize);
                size as isize
            };
            counts.count(&threads[t], delta);
            exact += delta;
            exact_peak = exact_peak.max(exact);
            let pending: isize = threads.iter().map(Cell::get).sum();
            assert_eq!(live(&counts) as isize + pending, exact);
            for t in &threads {
                assert!(t.get().unsigned_abs() < COUNT_BATCH);
            }
            let slack = (threads.len() * COUNT_BATCH) as isize;
            assert!(
                (peak(&counts) as isize - exact_peak).abs() < slack,
                "{} vs {exact_peak}",
                peak(&counts)
            );
        }
        assert!(exact_peak > 2 * LARGE_BLOCK as isize, "{exact_peak}");
    }

    /// A thread's held-back bytes reach the process's counts when it exits, and a reading thread
    /// sees its own blocks exactly.
    #[test]
    fn a_threads_pending_bytes_are_counted_at_its_exit() {
        // This test binary's global allocator is the system's: only this test counts.
        let before = heap_live();
        std::thread::spawn(|| {
            grow(1000);
            grow(2000);
            shrink(500);
            assert_eq!(PENDING.with(|p| p.0.get()), 2500);
        })
        .join()
        .unwrap();
        assert_eq!(heap_live(), before + 2500);
        grow(700);
        assert_eq!(heap_live(), before + 3200);
        assert!(heap_peak() >= before + 3200);
        shrink(3200);
        assert_eq!(heap_live(), before);
    }

    #[test]
    fn size_classes_round_up_by_at_most_a_32nd() {
        for size in [
            LARGE_BLOCK,
            LARGE_BLOCK + 1,
            3 << 20,
            206_045_184,
            (1 << 30) + 12345,
        ] {
            let class = size_class(size);
            assert!(
                class >= size && class.is_multiple_of(PAGE),
                "{size} → {class}"
            );
            assert!((class - size) * 32 <= size, "{size} → {class}");
        }
        assert_eq!(size_class(LARGE_BLOCK), LARGE_BLOCK);
        assert_eq!(size_class(LARGE_BLOCK + 1), LARGE_BLOCK + 32 * 1024);
    }

    /// A block freed by one thread serves the next request of its class from another, with its
    /// bytes intact (resident); live + cached bytes never pass 1.25× the most ever live, whatever the
    /// order of sizes; `alloc(zeroed)` gives zeros from the cache too.
    #[test]
    fn freed_large_blocks_serve_every_thread_within_the_live_mark() {
        let cache = BlockCache::new();
        let mb = 1 << 20;
        let a = cache.alloc(8 * mb, false) as usize;
        // SAFETY: the block holds 8 MB.
        unsafe { std::ptr::write_bytes(a as *mut u8, 7, 8 * mb) };
        cache.free(a as *mut u8, 8 * mb);
        let b = std::thread::spawn(move || {
            let cache = &cache;
            let b = cache.alloc(8 * mb - 100, false);
            // SAFETY: the block holds 8 MB - 100 bytes (the old bytes are still there).
            assert_eq!(unsafe { *b.add(8 * mb - 101) }, 7);
            cache.free(b, 8 * mb - 100);
            let z = cache.alloc(8 * mb, true);
            // SAFETY: 8 MB, zeroed.
            assert!(
                unsafe { std::slice::from_raw_parts(z, 8 * mb) }
                    .iter()
                    .all(|&x| x == 0)
            );
            cache.free(z, 8 * mb);
            (b as usize, cache.stats())
        });
        let (b, stats) = b.join().unwrap();
        assert_eq!(b, a, "the freed block was taken back");
        assert_eq!((stats.hits, stats.maps, stats.unmaps), (2, 1, 0));
        assert_eq!(
            (stats.live, stats.cached, stats.peak_live),
            (0, 8 * mb, 8 * mb)
        );

        // Two sizes in turn (two ranks in different phases): within the slack both stay cached,
        // two mappings in all (at the exact mark every request would map one and unmap the
        // other).
        let cache = BlockCache::new();
        for _ in 0..10 {
            for size in [8 * mb, 3 * mb / 2] {
                let p = cache.alloc(size, false);
                cache.free(p, size);
            }
        }
        let stats = cache.stats();
        assert_eq!(
            (stats.maps, stats.unmaps, stats.hits),
            (2, 0, 18),
            "{stats:?}"
        );
        cache.release();

        // Mixed sizes: the resident bytes (live + cached) stay within 1.25× the peak of live
        // bytes.
        let cache = BlockCache::new();
        let mut held: Vec<(usize, usize)> = Vec::new();
        let mut x = 12345u64;
        for _ in 0..400 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if held.len() > 6 || (!held.is_empty() && x >> 63 == 1) {
                let (p, s) = held.swap_remove((x >> 20) as usize % held.len());
                cache.free(p as *mut u8, s);
            } else {
                let s = mb + (x >> 40) as usize % (24 * mb);
                let p = cache.alloc(s, false);
                assert!(!p.is_null() && (p as usize).is_multiple_of(PAGE));
                held.push((p as usize, s));
            }
            let stats = cache.stats();
            let mark = stats.peak_live + stats.peak_live / SLACK;
            assert!(stats.live + stats.cached <= mark, "{stats:?}");
        }
        let stats = cache.stats();
        assert!(stats.hits > 0 && stats.unmaps > 0, "{stats:?}");
        for (p, s) in held {
            cache.free(p as *mut u8, s);
        }
        let cached = cache.stats().cached;
        assert_eq!(cache.release(), cached);
        assert_eq!(cache.stats().cached, 0);
    }
}
