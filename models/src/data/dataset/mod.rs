//! Token datasets: in memory, or memory-mapped from llm.c / nanoGPT `.bin` files and from the cache
//! of a tokenised text file.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;

use super::{DataSource, Error, Tokenizer, TokenizerKind, embedded_corpus};

/// llm.c's token-file magic (`dev/data/data_common.py`).
const LLMC_MAGIC: i32 = 20240520;
/// llm.c's *model* checkpoint magic, recognised only to say that the file is not tokens.
const LLMC_MODEL_MAGIC: i32 = 20240326;
/// llm.c's header: 256 little-endian i32.
const LLMC_HEADER_BYTES: usize = 256 * 4;

/// Magic of Wildfire's token cache (`<file>.<tokenizer>.tokens`).
const CACHE_MAGIC: &[u8; 8] = b"WFTOKENS";
/// Version of the cache layout below; a different version is rebuilt (1 keyed the source by its
/// mtime, which a fresh checkout changes).
const CACHE_VERSION: u32 = 2;
/// The cache header, all little-endian:
///
/// | bytes  | field                                                   |
/// |--------|---------------------------------------------------------|
/// | 0..8   | magic `WFTOKENS`                                        |
/// | 8..12  | layout version (2)                                      |
/// | 12..16 | bytes per token: 2 (vocab ≤ 65536) or 4                 |
/// | 16..20 | tokenizer: 0 bytes, 1 GPT-2                             |
/// | 20..24 | vocab size                                              |
/// | 24..32 | source length in bytes                                  |
/// | 32..40 | xxh3-64 of the source's bytes                           |
/// | 40..48 | zero                                                    |
/// | 48..56 | token count                                             |
/// | 56..64 | zero                                                    |
///
/// The tokens follow. The cache is valid while the source's length and content hash match: a
/// copied or freshly checked-out file keeps its cache, an edited one is tokenised again.
const CACHE_HEADER_BYTES: usize = 64;

/// Text is tokenised in chunks of about this many bytes (the progress bar's granularity).
const CHUNK_BYTES: usize = 1 << 20;

/// Where the tokens live.
enum Storage {
    /// Tokens in memory (the embedded corpus, tests, or a text file whose cache could not be written).
    Owned(Vec<u32>),
    /// Little-endian u16 tokens in a mapped file, from byte `start`.
    U16 { map: Mmap, start: usize },
    /// Little-endian u32 tokens in a mapped file, from byte `start`.
    U32 { map: Mmap, start: usize },
    /// Several datasets one after the other (the shards of a token-file pattern, or the training
    /// tokens then a held-out set): part `k` holds tokens `starts[k]..starts[k + 1]` (the last
    /// to the end). `starts[0]` is 0 and every part is non-empty.
    Parts {
        parts: Vec<TokenDataset>,
        starts: Vec<usize>,
    },
}

/// A sequence of token ids, in memory or memory-mapped (a multi-GB token file is never read into
/// memory). `Send + Sync`: share one between data-parallel ranks by reference.
pub struct TokenDataset {
    storage: Storage,
    len: usize,
    /// Where the tokens came from, for `Debug` and logs.
    origin: String,
    max_token: OnceLock<u32>,
    /// The first token of a held-out set given apart from the training tokens
    /// ([`TokenDataset::with_held_out`]).
    held_out: Option<usize>,
}

impl fmt::Debug for TokenDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let storage = match self.storage {
            Storage::Owned(_) => "memory",
            Storage::U16 { .. } => "mapped u16",
            Storage::U32 { .. } => "mapped u32",
            Storage::Parts { .. } => "parts",
        };
        f.debug_struct("TokenDataset")
            .field("origin", &self.origin)
            .field("len", &self.len)
            .field("storage", &storage)
            .field("parts", &self.parts())
            .field("held_out", &self.held_out)
            .finish()
    }
}

/// The little-endian i32 at `index` of an llm.c header.
fn header_i32(bytes: &[u8], index: usize) -> i32 {
    let at = index * 4;
    i32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// The length and content hash of a text file, recorded in its cache to notice a changed source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SourceStamp {
    len: u64,
    hash: u64,
}

impl SourceStamp {
    /// The stamp of the file at `path`, read in 1 MiB chunks (xxh3 hashes at memory speed).
    fn of(path: &Path) -> Result<Self, Error> {
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            let n = io::Read::read(&mut file, &mut buf).map_err(|e| Error::io(path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            len += n as u64;
        }
        Ok(Self {
            len,
            hash: hasher.digest(),
        })
    }
}

/// `<file>.<tokenizer>.tokens` ([`Tokenizer::cache_name`]): next to the text file, or in `dir`
/// when given.
fn cache_path(path: &Path, tokenizer: &Tokenizer, dir: Option<&Path>) -> PathBuf {
    let mut name = match dir {
        Some(dir) => dir
            .join(path.file_name().unwrap_or(path.as_os_str()))
            .into_os_string(),
        None => path.as_os_str().to_owned(),
    };
    name.push(format!(".{}.tokens", tokenizer.cache_name()));
    PathBuf::from(name)
}

fn tokenizer_id(kind: TokenizerKind) -> u32 {
    match kind {
        TokenizerKind::Bytes => 0,
        TokenizerKind::Gpt2 => 1,
        TokenizerKind::Json => 2,
    }
}

/// Bytes per token in a cache for `tokenizer`.
fn token_width(tokenizer: &Tokenizer) -> usize {
    if tokenizer.vocab_size() <= 1 << 16 {
        2
    } else {
        4
    }
}

/// Maps `file` read-only.
fn map(path: &Path) -> Result<Mmap, Error> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only and token files are treated as immutable while training
    // (as llm.c and nanoGPT do); a file truncated underneath us is outside what we support.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// The little-endian u16 token ids in `bytes`, widened.
fn u16_tokens(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(2)
        .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
}

/// The little-endian u32 token ids in `bytes`.
fn u32_tokens(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Whether `path` is a pattern naming several files: a glob metacharacter (`*`, `?`, `[`) in
/// it and no file of that very name.
fn is_pattern(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.contains(['*', '?', '['])) && !path.exists()
}

/// The regular files `pattern` matches (`glob`'s syntax: `*`, `?`, `[…]`, `**` for folders at
/// any depth), sorted by path. None is an error naming the pattern.
fn pattern_files(pattern: &Path) -> Result<Vec<PathBuf>, Error> {
    let text = pattern.to_str().expect("a pattern is UTF-8 (is_pattern)");
    let bad = |reason: String| Error::BadPattern {
        pattern: pattern.to_owned(),
        reason,
    };
    let mut files = Vec::new();
    for entry in glob::glob(text).map_err(|e| bad(e.to_string()))? {
        let path = entry.map_err(|e| Error::io(e.path().to_owned(), e.into()))?;
        if path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(bad("no file matches it".into()));
    }
    files.sort();
    Ok(files)
}

impl TokenDataset {
    /// Loads tokens from `source`, with a progress bar while tokenising (see
    /// [`TokenDataset::load_with_progress`]).
    ///
    /// - [`DataSource::File`] with a path ending in `.bin`: a token file, memory-mapped. llm.c format
    ///   if it starts with llm.c's header (256 little-endian i32: magic 20240520, version 1 = u16
    ///   tokens, token count; then the tokens), else nanoGPT format (raw little-endian u16 tokens).
    ///   `tokenizer` is not used: check the ids with [`TokenDataset::check_vocab`].
    /// - Any other file: UTF-8 text, tokenised with `tokenizer` and cached next to it as
    ///   `<file>.<tokenizer>.tokens` (u16 when the vocab fits, else u32, after a 64-byte header that
    ///   records the source's length and content hash: an edited source is tokenised again, a
    ///   copied or checked-out one keeps its cache; [`TokenDataset::load_with_cache`] puts the
    ///   cache in another folder). Later loads map the cache. The cache is written to a temporary file and renamed, so ranks loading the
    ///   same file at once do not see half a cache; if it cannot be written (read-only directory),
    ///   the tokens stay in memory and a warning is logged.
    /// - A path with `*`, `?` or `[…]` in it (and no file of that name): every regular file the
    ///   pattern matches (`glob` syntax), in the order of their paths, one after the other — the
    ///   shards of llm.c's FineWeb (`fineweb_train_*.bin`), each loaded as above. None matching
    ///   is [`Error::BadPattern`].
    /// - [`DataSource::Embedded`]: the built-in corpus ([`embedded_corpus`]), tokenised in memory.
    pub fn load(source: &DataSource, tokenizer: &Tokenizer) -> Result<Self, Error> {
        Self::load_with_progress(source, tokenizer, true)
    }

    /// [`TokenDataset::load`], with the tokenising progress bar shown only if `progress` (pass
    /// `rank == 0`) and stderr is a terminal.
    pub fn load_with_progress(
        source: &DataSource,
        tokenizer: &Tokenizer,
        progress: bool,
    ) -> Result<Self, Error> {
        Self::load_with_cache(source, tokenizer, progress, None)
    }

    /// [`TokenDataset::load_with_progress`] with a text file's token cache in `cache_dir` (made
    /// if missing) rather than next to the file — for a read-only data folder, or one shared by
    /// runs that should not write into it.
    pub fn load_with_cache(
        source: &DataSource,
        tokenizer: &Tokenizer,
        progress: bool,
        cache_dir: Option<&Path>,
    ) -> Result<Self, Error> {
        match source {
            DataSource::Embedded => {
                let mut data = Self::from_tokens(tokenizer.encode(embedded_corpus()));
                data.origin = format!("embedded corpus ({})", tokenizer.kind());
                Ok(data)
            }
            DataSource::File(path) if is_pattern(path) => {
                Self::load_pattern(path, tokenizer, progress, cache_dir)
            }
            DataSource::File(path) => Self::load_file(path, tokenizer, progress, cache_dir),
        }
    }

    /// Every file a pattern names, in the order of their names, one after the other.
    fn load_pattern(
        pattern: &Path,
        tokenizer: &Tokenizer,
        progress: bool,
        cache_dir: Option<&Path>,
    ) -> Result<Self, Error> {
        let files = pattern_files(pattern)?;
        let mut parts = Vec::with_capacity(files.len());
        for file in &files {
            parts.push(Self::load_file(file, tokenizer, progress, cache_dir)?);
        }
        let origin = format!(
            "{} ({} files: {} … {})",
            pattern.display(),
            files.len(),
            files[0].display(),
            files[files.len() - 1].display()
        );
        let data = Self::concat(parts, origin);
        tracing::debug!(pattern = %pattern.display(), files = files.len(), tokens = data.len, "token files of a pattern");
        Ok(data)
    }

    /// One file: a token file (`*.bin`) or a text file.
    fn load_file(
        path: &Path,
        tokenizer: &Tokenizer,
        progress: bool,
        cache_dir: Option<&Path>,
    ) -> Result<Self, Error> {
        let meta = fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if !meta.is_file() {
            let err = io::Error::new(io::ErrorKind::InvalidInput, "not a regular file");
            return Err(Error::io(path, err));
        }
        if meta.len() == 0 {
            return Err(Error::EmptyFile {
                path: path.to_owned(),
            });
        }
        if path.extension().is_some_and(|e| e == "bin") {
            Self::load_bin(path)
        } else {
            Self::load_text(path, tokenizer, progress, cache_dir)
        }
    }

    /// `parts` one after the other, as one dataset from `origin` (a part of no tokens is left
    /// out). The parts' own held-out marks are dropped.
    fn concat(parts: Vec<TokenDataset>, origin: String) -> Self {
        let mut parts: Vec<TokenDataset> = parts.into_iter().filter(|p| !p.is_empty()).collect();
        if parts.len() == 1 {
            let mut only = parts.pop().expect("one part");
            only.held_out = None;
            only.origin = origin;
            return only;
        }
        let mut starts = Vec::with_capacity(parts.len());
        let mut len = 0;
        for part in &parts {
            starts.push(len);
            len += part.len;
        }
        Self {
            storage: Storage::Parts { parts, starts },
            len,
            origin,
            max_token: OnceLock::new(),
            held_out: None,
        }
    }

    /// The training tokens `train` followed by a held-out set `val` given apart (nanoGPT's
    /// `val.bin`, llm.c's `fineweb_val_*.bin`): [`TokenDataset::held_out`] says where `val`
    /// starts.
    pub fn with_held_out(train: TokenDataset, val: TokenDataset) -> Self {
        let at = train.len;
        let origin = format!("{}, held out: {}", train.origin, val.origin);
        let mut data = Self::concat(vec![train, val], origin);
        data.held_out = Some(at);
        data
    }

    /// Where a held-out set given apart starts ([`TokenDataset::with_held_out`]); `None` when
    /// the held-out tokens are a share of the data ([`TokenDataset::split`]).
    pub fn held_out(&self) -> Option<usize> {
        self.held_out
    }

    /// The datasets this one is made of, one after the other (1 for a single file or memory).
    pub fn parts(&self) -> usize {
        match &self.storage {
            Storage::Parts { parts, .. } => parts.len(),
            _ => 1,
        }
    }

    /// Tokens held in memory.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self {
            len: tokens.len(),
            storage: Storage::Owned(tokens),
            origin: "memory".into(),
            max_token: OnceLock::new(),
            held_out: None,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token `i`.
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn get(&self, i: usize) -> u32 {
        assert!(
            i < self.len,
            "token {i} out of range for {} tokens",
            self.len
        );
        match &self.storage {
            Storage::Owned(tokens) => tokens[i],
            Storage::U16 { map, start } => {
                let at = start + 2 * i;
                u32::from(u16::from_le_bytes([map[at], map[at + 1]]))
            }
            Storage::U32 { map, start } => {
                let at = start + 4 * i;
                u32::from_le_bytes(map[at..at + 4].try_into().expect("4 bytes"))
            }
            Storage::Parts { parts, starts } => {
                let k = starts.partition_point(|&s| s <= i) - 1;
                parts[k].get(i - starts[k])
            }
        }
    }

    /// Appends tokens `range` to `out` (what [`TokenDataset::get`] gives for each, read in runs).
    ///
    /// # Panics
    /// If `range` reaches past `len()`.
    pub fn extend_range(&self, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "tokens {range:?} out of range for {} tokens",
            self.len
        );
        match &self.storage {
            Storage::Owned(tokens) => out.extend_from_slice(&tokens[range]),
            Storage::U16 { map, start } => out.extend(u16_tokens(
                &map[start + 2 * range.start..start + 2 * range.end],
            )),
            Storage::U32 { map, start } => out.extend(u32_tokens(
                &map[start + 4 * range.start..start + 4 * range.end],
            )),
            Storage::Parts { parts, starts } => {
                let first = starts.partition_point(|&s| s <= range.start).max(1) - 1;
                for (part, &from) in parts.iter().zip(starts).skip(first) {
                    if from >= range.end {
                        break;
                    }
                    let lo = range.start.max(from) - from;
                    let hi = range.end.min(from + part.len) - from;
                    part.extend_range(lo..hi, out);
                }
            }
        }
    }

    /// The largest token id (0 when empty), computed on first call and cached.
    pub fn max_token(&self) -> u32 {
        *self.max_token.get_or_init(|| match &self.storage {
            Storage::Owned(tokens) => tokens.iter().copied().max().unwrap_or(0),
            Storage::U16 { map, start } => u16_tokens(&map[*start..*start + 2 * self.len])
                .max()
                .unwrap_or(0),
            Storage::U32 { map, start } => u32_tokens(&map[*start..*start + 4 * self.len])
                .max()
                .unwrap_or(0),
            // The parts' scans on threads of their own (a pattern of a hundred shards is tens of
            // GB read once): as many at a time as the machine has cores.
            Storage::Parts { parts, .. } => {
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let chunk = parts.len().div_ceil(threads).max(1);
                std::thread::scope(|scope| {
                    let scans: Vec<_> = parts
                        .chunks(chunk)
                        .map(|group| {
                            scope.spawn(|| group.iter().map(Self::max_token).max().unwrap_or(0))
                        })
                        .collect();
                    scans
                        .into_iter()
                        .map(|scan| scan.join().expect("a token scan does not panic"))
                        .max()
                        .unwrap_or(0)
                })
            }
        })
    }

    /// Checks that every token id is `< vocab_size` (via [`TokenDataset::max_token`]).
    pub fn check_vocab(&self, vocab_size: usize) -> Result<(), Error> {
        let token = self.max_token();
        if !self.is_empty() && token as usize >= vocab_size {
            return Err(Error::TokenOutOfVocab { token, vocab_size });
        }
        Ok(())
    }

    /// All tokens, as a slice named "whole".
    pub fn all(&self) -> TokenSlice<'_> {
        TokenSlice {
            data: self,
            start: 0,
            len: self.len,
            name: "whole",
        }
    }

    /// The tokens before `at` for training ("train"), the rest for validation ("val").
    ///
    /// # Panics
    /// If `at > len()`.
    pub fn split_at(&self, at: usize) -> (TokenSlice<'_>, TokenSlice<'_>) {
        assert!(at <= self.len, "split at {at} of {} tokens", self.len);
        (
            TokenSlice {
                data: self,
                start: 0,
                len: at,
                name: "train",
            },
            TokenSlice {
                data: self,
                start: at,
                len: self.len - at,
                name: "val",
            },
        )
    }

    /// Train/validation split as nanoGPT does it: the first `floor(len * (1 - val_fraction))`
    /// tokens for training ("train"), the rest for validation ("val").
    ///
    /// # Panics
    /// Unless `0 <= val_fraction < 1` (validate the config before).
    pub fn split(&self, val_fraction: f64) -> (TokenSlice<'_>, TokenSlice<'_>) {
        assert!(
            (0.0..1.0).contains(&val_fraction),
            "val_fraction {val_fraction} must be in [0, 1)"
        );
        let train = ((self.len as f64 * (1.0 - val_fraction)) as usize).min(self.len);
        self.split_at(train)
    }

    /// An llm.c or nanoGPT token file (non-empty), memory-mapped.
    fn load_bin(path: &Path) -> Result<Self, Error> {
        let map = map(path)?;
        let bytes = map.len();
        let bad = |reason: String| Error::BadHeader {
            path: path.to_owned(),
            reason,
        };
        let magic = (bytes >= 4).then(|| header_i32(&map, 0));
        let (start, len, format) = if magic == Some(LLMC_MAGIC) {
            if bytes < LLMC_HEADER_BYTES {
                return Err(bad(format!(
                    "the file is {bytes} bytes, shorter than the {LLMC_HEADER_BYTES}-byte header"
                )));
            }
            let version = header_i32(&map, 1);
            if version != 1 {
                return Err(bad(format!("version {version}, expected 1 (u16 tokens)")));
            }
            let count = header_i32(&map, 2);
            let expected =
                u64::try_from(count).map_err(|_| bad(format!("negative token count {count}")))?;
            let payload = (bytes - LLMC_HEADER_BYTES) as u64;
            if payload != 2 * expected {
                return Err(Error::TokenCountMismatch {
                    path: path.to_owned(),
                    expected,
                    found: payload / 2,
                });
            }
            (LLMC_HEADER_BYTES, expected as usize, "llm.c")
        } else if magic == Some(LLMC_MODEL_MAGIC) {
            return Err(bad(format!(
                "magic {LLMC_MODEL_MAGIC} marks an llm.c model checkpoint, not a token file"
            )));
        } else if bytes >= LLMC_HEADER_BYTES
            && header_i32(&map, 1) == 1
            && u64::try_from(header_i32(&map, 2))
                .is_ok_and(|n| (LLMC_HEADER_BYTES as u64) + 2 * n == bytes as u64)
        {
            // An llm.c header in all but its magic. (A nanoGPT file matching this by chance would
            // need its tokens 2..6 to spell out its own length; its first two tokens being llm.c's
            // magic needs token 54600, which GPT-2 does not have.)
            return Err(bad(format!(
                "magic {}, expected {LLMC_MAGIC}",
                magic.unwrap_or_default()
            )));
        } else {
            if bytes % 2 != 0 {
                return Err(Error::OddLength {
                    path: path.to_owned(),
                    len: bytes as u64,
                });
            }
            (0, bytes / 2, "nanoGPT")
        };
        tracing::debug!(path = %path.display(), tokens = len, format, "mapped token file");
        Ok(Self {
            storage: Storage::U16 { map, start },
            len,
            origin: format!("{} ({format} u16)", path.display()),
            max_token: OnceLock::new(),
            held_out: None,
        })
    }

    /// A UTF-8 text file: its cache if that is current, else tokenised now and cached.
    fn load_text(
        path: &Path,
        tokenizer: &Tokenizer,
        progress: bool,
        cache_dir: Option<&Path>,
    ) -> Result<Self, Error> {
        let stamp = SourceStamp::of(path)?;
        let cache = cache_path(path, tokenizer, cache_dir);
        match Self::open_cache(&cache, stamp, tokenizer) {
            Ok(data) => {
                tracing::debug!(cache = %cache.display(), tokens = data.len, "using token cache");
                return Ok(data);
            }
            Err(Some(reason)) => {
                tracing::info!(cache = %cache.display(), "token cache {reason}: tokenising again");
            }
            Err(None) => {}
        }

        let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
        let text = String::from_utf8(bytes).map_err(|e| Error::NotUtf8 {
            path: path.to_owned(),
            offset: e.utf8_error().valid_up_to(),
        })?;
        let bar = progress_bar(text.len() as u64, path, progress);
        let tokens = tokenizer.encode_chunked(&text, CHUNK_BYTES, &|n| bar.inc(n));
        bar.finish_and_clear();
        drop(text);
        tracing::info!(
            path = %path.display(),
            tokenizer = %tokenizer.kind(),
            tokens = tokens.len(),
            "tokenised text file"
        );

        if let Err(e) = write_cache(&cache, stamp, tokenizer, &tokens) {
            tracing::warn!("{e}; keeping the tokens in memory without a cache");
            let mut data = Self::from_tokens(tokens);
            data.origin = format!("{} ({}, uncached)", path.display(), tokenizer.kind());
            return Ok(data);
        }
        // Map what was just written, so a first load and a later one read the same bytes.
        Self::open_cache(&cache, stamp, tokenizer).map_err(|reason| {
            let reason = reason.unwrap_or_else(|| "vanished".into());
            Error::io(
                &cache,
                io::Error::other(format!("token cache {reason} just after writing it")),
            )
        })
    }

    /// The cache at `cache` if it is current for `stamp` and `tokenizer`. `Err(None)`: there is
    /// none; `Err(Some(reason))`: it is stale or unreadable.
    fn open_cache(
        cache: &Path,
        stamp: SourceStamp,
        tokenizer: &Tokenizer,
    ) -> Result<Self, Option<String>> {
        let map = match map(cache) {
            Ok(map) => map,
            Err(Error::Missing { .. }) => return Err(None),
            Err(e) => return Err(Some(format!("is unreadable ({e})"))),
        };
        if map.len() < CACHE_HEADER_BYTES || &map[..8] != CACHE_MAGIC {
            return Err(Some("has no Wildfire header".into()));
        }
        let u32_at = |at: usize| u32::from_le_bytes(map[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(map[at..at + 8].try_into().expect("8 bytes"));
        let width = token_width(tokenizer);
        if u32_at(8) != CACHE_VERSION
            || u32_at(12) as usize != width
            || u32_at(16) != tokenizer_id(tokenizer.kind())
            || u32_at(20) as usize != tokenizer.vocab_size()
        {
            return Err(Some("was written by another version or tokenizer".into()));
        }
        let cached = SourceStamp {
            len: u64_at(24),
            hash: u64_at(32),
        };
        if cached != stamp {
            return Err(Some("is stale (the source's content changed)".into()));
        }
        let len = u64_at(48);
        if (CACHE_HEADER_BYTES as u64).checked_add(len.saturating_mul(width as u64))
            != Some(map.len() as u64)
        {
            return Err(Some("is truncated".into()));
        }
        let start = CACHE_HEADER_BYTES;
        let storage = if width == 2 {
            Storage::U16 { map, start }
        } else {
            Storage::U32 { map, start }
        };
        Ok(Self {
            storage,
            len: len as usize,
            origin: format!("{} ({})", cache.display(), tokenizer.kind()),
            max_token: OnceLock::new(),
            held_out: None,
        })
    }
}

/// Writes the cache to a temporary file next to `cache` (its folder made if missing), then renames
/// it into place (atomic on one file system, so concurrent readers see the old cache, none, or
/// the whole new one).
fn write_cache(
    cache: &Path,
    stamp: SourceStamp,
    tokenizer: &Tokenizer,
    tokens: &[u32],
) -> Result<(), Error> {
    let width = token_width(tokenizer);
    let mut header = [0u8; CACHE_HEADER_BYTES];
    header[..8].copy_from_slice(CACHE_MAGIC);
    header[8..12].copy_from_slice(&CACHE_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&(width as u32).to_le_bytes());
    header[16..20].copy_from_slice(&tokenizer_id(tokenizer.kind()).to_le_bytes());
    header[20..24].copy_from_slice(&(tokenizer.vocab_size() as u32).to_le_bytes());
    header[24..32].copy_from_slice(&stamp.len.to_le_bytes());
    header[32..40].copy_from_slice(&stamp.hash.to_le_bytes());
    header[48..56].copy_from_slice(&(tokens.len() as u64).to_le_bytes());

    if let Some(dir) = cache.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    wildfire_checkpoint::io::write_atomic_with(cache, |out| {
        out.write_all(&header)?;
        let mut buf = Vec::with_capacity(width * 65536);
        for chunk in tokens.chunks(65536) {
            buf.clear();
            for &t in chunk {
                if width == 2 {
                    let t = u16::try_from(t).expect("token id fits the cache's u16");
                    buf.extend_from_slice(&t.to_le_bytes());
                } else {
                    buf.extend_from_slice(&t.to_le_bytes());
                }
            }
            out.write_all(&buf)?;
        }
        Ok(())
    })
    .map_err(|e| {
        Error::io(
            cache,
            io::Error::new(e.kind(), format!("could not write token cache: {e}")),
        )
    })
}

/// The tokenising progress bar's look.
fn progress_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
    )
    .expect("valid progress template")
    .progress_chars("=> ")
}

/// A byte-counting progress bar for tokenising `path`: hidden unless `show` and stderr is a terminal.
fn progress_bar(total: u64, path: &Path, show: bool) -> ProgressBar {
    if !show || !io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total).with_style(progress_style());
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    bar.set_message(format!("tokenising {name}"));
    bar
}

/// A contiguous range of a [`TokenDataset`], named for error messages ("whole", "train", "val").
#[derive(Clone, Copy)]
pub struct TokenSlice<'a> {
    data: &'a TokenDataset,
    start: usize,
    len: usize,
    name: &'static str,
}

impl fmt::Debug for TokenSlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenSlice")
            .field("name", &self.name)
            .field("range", &(self.start..self.start + self.len))
            .field("of", &self.data.origin)
            .finish()
    }
}

impl<'a> TokenSlice<'a> {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token `i` of the slice.
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn get(&self, i: usize) -> u32 {
        assert!(
            i < self.len,
            "token {i} out of range for the {} slice of {}",
            self.name,
            self.len
        );
        self.data.get(self.start + i)
    }

    /// Appends tokens `range` of the slice to `out`.
    ///
    /// # Panics
    /// If `range` reaches past `len()`.
    pub fn extend_range(&self, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "tokens {range:?} out of range for the {} slice of {}",
            self.name,
            self.len
        );
        self.data
            .extend_range(self.start + range.start..self.start + range.end, out);
    }

    /// The slice's name: "whole", "train" or "val".
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Where the slice lies in its dataset.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }

    /// The dataset the slice is part of.
    pub fn dataset(&self) -> &'a TokenDataset {
        self.data
    }

    /// The tokens, copied out.
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        self.extend_range(0..self.len, &mut out);
        out
    }
}

#[cfg(test)]
mod tests;
