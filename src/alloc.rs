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
//! Binaries declare
//! `#[global_allocator] static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;`
//! and call [`keep_freed_memory`] first thing in `main`; [`heap_peak`] then tells the program's
//! own memory apart from what the allocators keep.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

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

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// 0: not chosen yet, 1: mimalloc, 2: the system's, 3: mimalloc for every block (no large-block
/// cache).
static CHOICE: AtomicU8 = AtomicU8::new(0);
/// The process's cache of large blocks (used where [`Allocator`] is the global allocator).
static LARGE: BlockCache = BlockCache::new();

/// Bytes allocated through [`Allocator`] and not yet freed (0 where it is not the global
/// allocator).
pub fn heap_live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most bytes live at once through [`Allocator`] since the start or the last
/// [`reset_heap_peak`]: what the resident set would be if the allocator kept nothing.
pub fn heap_peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Start a new [`heap_peak`] from the bytes live now.
pub fn reset_heap_peak() {
    PEAK.store(heap_live(), Ordering::Relaxed);
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

fn system() -> bool {
    choice() == 2
}

/// The allocator choice, read from `WILDFIRE_ALLOC` once (see [`CHOICE`]).
fn choice() -> u8 {
    match CHOICE.load(Ordering::Relaxed) {
        0 => {
            // Read with libc's getenv: the first allocation happens before `main`, and
            // `std::env` would allocate. Every later call sees the same answer.
            // SAFETY: a NUL-terminated name; the returned pointer is only compared and read
            // as a C string while the environment is not being modified (process start).
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
        chosen => chosen,
    }
}

fn grow(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

/// Whether a block of this layout takes the large path (the same answer at its free).
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
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
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
                LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
                grow(new_size);
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
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grow(new_size);
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
