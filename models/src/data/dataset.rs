//! Token datasets: in memory, or memory-mapped from llm.c / nanoGPT `.bin` files and from the cache
//! of a tokenised text file.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::UNIX_EPOCH;

use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;

use super::{DataError, DataSource, Tokenizer, TokenizerKind, embedded_corpus};

/// llm.c's token-file magic (`dev/data/data_common.py`).
const LLMC_MAGIC: i32 = 20240520;
/// llm.c's *model* checkpoint magic, recognised only to say that the file is not tokens.
const LLMC_MODEL_MAGIC: i32 = 20240326;
/// llm.c's header: 256 little-endian i32.
const LLMC_HEADER_BYTES: usize = 256 * 4;

/// Magic of Wildfire's token cache (`<file>.<tokenizer>.tokens`).
const CACHE_MAGIC: &[u8; 8] = b"WFTOKENS";
/// Version of the cache layout below; a different version is rebuilt.
const CACHE_VERSION: u32 = 1;
/// The cache header, all little-endian:
///
/// | bytes  | field                                                   |
/// |--------|---------------------------------------------------------|
/// | 0..8   | magic `WFTOKENS`                                        |
/// | 8..12  | layout version (1)                                      |
/// | 12..16 | bytes per token: 2 (vocab ≤ 65536) or 4                 |
/// | 16..20 | tokenizer: 0 bytes, 1 GPT-2                             |
/// | 20..24 | vocab size                                              |
/// | 24..32 | source length in bytes                                  |
/// | 32..40 | source mtime, whole seconds since the Unix epoch (i64)  |
/// | 40..44 | source mtime, nanoseconds (u32)                         |
/// | 44..48 | zero                                                    |
/// | 48..56 | token count                                             |
/// | 56..64 | zero                                                    |
///
/// The tokens follow. The cache is valid while the source's length and mtime match.
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
}

/// A sequence of token ids, in memory or memory-mapped (a multi-GB token file is never read into
/// memory). `Send + Sync`: share one between data-parallel ranks by reference.
pub struct TokenDataset {
    storage: Storage,
    len: usize,
    /// Where the tokens came from, for `Debug` and logs.
    origin: String,
    max_token: OnceLock<u32>,
}

impl fmt::Debug for TokenDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let storage = match self.storage {
            Storage::Owned(_) => "memory",
            Storage::U16 { .. } => "mapped u16",
            Storage::U32 { .. } => "mapped u32",
        };
        f.debug_struct("TokenDataset")
            .field("origin", &self.origin)
            .field("len", &self.len)
            .field("storage", &storage)
            .finish()
    }
}

/// The little-endian i32 at `index` of an llm.c header.
fn header_i32(bytes: &[u8], index: usize) -> i32 {
    let at = index * 4;
    i32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// The length and mtime of a text file, recorded in its cache to notice a changed source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SourceStamp {
    len: u64,
    mtime_secs: i64,
    mtime_nanos: u32,
}

impl SourceStamp {
    fn of(meta: &fs::Metadata) -> Self {
        let (mtime_secs, mtime_nanos) = match meta.modified().map(|t| t.duration_since(UNIX_EPOCH))
        {
            Ok(Ok(d)) => (d.as_secs() as i64, d.subsec_nanos()),
            Ok(Err(before)) => (
                -(before.duration().as_secs() as i64),
                before.duration().subsec_nanos(),
            ),
            Err(_) => (0, 0), // no mtime on this platform: the length alone decides
        };
        Self {
            len: meta.len(),
            mtime_secs,
            mtime_nanos,
        }
    }
}

/// `<file>.<tokenizer>.tokens`, next to the text file.
fn cache_path(path: &Path, kind: TokenizerKind) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{kind}.tokens"));
    PathBuf::from(name)
}

fn tokenizer_id(kind: TokenizerKind) -> u32 {
    match kind {
        TokenizerKind::Bytes => 0,
        TokenizerKind::Gpt2 => 1,
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
fn map(path: &Path) -> Result<Mmap, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    // SAFETY: the mapping is read-only and token files are treated as immutable while training
    // (as llm.c and nanoGPT do); a file truncated underneath us is outside what we support.
    unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))
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
    ///   records the source's length and mtime: a changed source is tokenised again). Later loads
    ///   map the cache. The cache is written to a temporary file and renamed, so ranks loading the
    ///   same file at once do not see half a cache; if it cannot be written (read-only directory),
    ///   the tokens stay in memory and a warning is logged.
    /// - [`DataSource::Embedded`]: the built-in corpus ([`embedded_corpus`]), tokenised in memory.
    pub fn load(source: &DataSource, tokenizer: &Tokenizer) -> Result<Self, DataError> {
        Self::load_with_progress(source, tokenizer, true)
    }

    /// [`TokenDataset::load`], with the tokenising progress bar shown only if `progress` (pass
    /// `rank == 0`) and stderr is a terminal.
    pub fn load_with_progress(
        source: &DataSource,
        tokenizer: &Tokenizer,
        progress: bool,
    ) -> Result<Self, DataError> {
        match source {
            DataSource::Embedded => {
                let mut data = Self::from_tokens(tokenizer.encode(embedded_corpus()));
                data.origin = format!("embedded corpus ({})", tokenizer.kind());
                Ok(data)
            }
            DataSource::File(path) => {
                let meta = fs::metadata(path).map_err(|e| DataError::io(path, e))?;
                if !meta.is_file() {
                    let err = io::Error::new(io::ErrorKind::InvalidInput, "not a regular file");
                    return Err(DataError::io(path, err));
                }
                if meta.len() == 0 {
                    return Err(DataError::Empty { path: path.clone() });
                }
                if path.extension().is_some_and(|e| e == "bin") {
                    Self::load_bin(path)
                } else {
                    Self::load_text(path, &meta, tokenizer, progress)
                }
            }
        }
    }

    /// Tokens held in memory.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self {
            len: tokens.len(),
            storage: Storage::Owned(tokens),
            origin: "memory".into(),
            max_token: OnceLock::new(),
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
        }
    }

    /// The largest token id (0 when empty), computed on first call and cached.
    pub fn max_token(&self) -> u32 {
        *self.max_token.get_or_init(|| match &self.storage {
            Storage::Owned(tokens) => tokens.iter().copied().max().unwrap_or(0),
            Storage::U16 { map, start } => map[*start..*start + 2 * self.len]
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .max()
                .map_or(0, u32::from),
            Storage::U32 { map, start } => map[*start..*start + 4 * self.len]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .max()
                .unwrap_or(0),
        })
    }

    /// Checks that every token id is `< vocab_size` (via [`TokenDataset::max_token`]).
    pub fn check_vocab(&self, vocab_size: usize) -> Result<(), DataError> {
        let token = self.max_token();
        if !self.is_empty() && token as usize >= vocab_size {
            return Err(DataError::TokenOutOfVocab { token, vocab_size });
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
        (
            TokenSlice {
                data: self,
                start: 0,
                len: train,
                name: "train",
            },
            TokenSlice {
                data: self,
                start: train,
                len: self.len - train,
                name: "val",
            },
        )
    }

    /// An llm.c or nanoGPT token file (non-empty), memory-mapped.
    fn load_bin(path: &Path) -> Result<Self, DataError> {
        let map = map(path)?;
        let bytes = map.len();
        let bad = |reason: String| DataError::BadHeader {
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
                return Err(DataError::TokenCountMismatch {
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
                return Err(DataError::OddLength {
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
        })
    }

    /// A UTF-8 text file: its cache if that is current, else tokenised now and cached.
    fn load_text(
        path: &Path,
        meta: &fs::Metadata,
        tokenizer: &Tokenizer,
        progress: bool,
    ) -> Result<Self, DataError> {
        let stamp = SourceStamp::of(meta);
        let cache = cache_path(path, tokenizer.kind());
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

        let bytes = fs::read(path).map_err(|e| DataError::io(path, e))?;
        let text = String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
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
            DataError::io(
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
            Err(DataError::Missing { .. }) => return Err(None),
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
            mtime_secs: u64_at(32) as i64,
            mtime_nanos: u32_at(40),
        };
        if cached != stamp {
            return Err(Some("is stale (the source's size or mtime changed)".into()));
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
        })
    }
}

/// Writes the cache to a temporary file next to `cache`, then renames it into place (atomic on
/// one file system, so concurrent readers see the old cache, none, or the whole new one).
fn write_cache(
    cache: &Path,
    stamp: SourceStamp,
    tokenizer: &Tokenizer,
    tokens: &[u32],
) -> Result<(), DataError> {
    let width = token_width(tokenizer);
    let mut header = [0u8; CACHE_HEADER_BYTES];
    header[..8].copy_from_slice(CACHE_MAGIC);
    header[8..12].copy_from_slice(&CACHE_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&(width as u32).to_le_bytes());
    header[16..20].copy_from_slice(&tokenizer_id(tokenizer.kind()).to_le_bytes());
    header[20..24].copy_from_slice(&(tokenizer.vocab_size() as u32).to_le_bytes());
    header[24..32].copy_from_slice(&stamp.len.to_le_bytes());
    header[32..40].copy_from_slice(&stamp.mtime_secs.to_le_bytes());
    header[40..44].copy_from_slice(&stamp.mtime_nanos.to_le_bytes());
    header[48..56].copy_from_slice(&(tokens.len() as u64).to_le_bytes());

    crate::io::write_atomic_with(cache, |out| {
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
        DataError::io(
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
        (0..self.len).map(|i| self.get(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::scratch::ScratchDir;
    use crate::data::{BatchSampler, TokenizerKind};

    fn bytes_tokenizer() -> Tokenizer {
        Tokenizer::new(TokenizerKind::Bytes).unwrap()
    }

    fn llmc_bin(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
        let mut header = [0i32; 256];
        header[..3].copy_from_slice(&[magic, version, count]);
        let mut out: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        out.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        out
    }

    fn load(path: &Path) -> Result<TokenDataset, DataError> {
        TokenDataset::load(&DataSource::File(path.to_owned()), &bytes_tokenizer())
    }

    #[test]
    fn llmc_bin_reads_back_and_bad_headers_are_errors() {
        let dir = ScratchDir::new("llmc");
        let tokens: Vec<u16> = vec![50256, 15496, 995, 0, 7, 65535];
        let path = dir.path().join("train.bin");
        fs::write(&path, llmc_bin(LLMC_MAGIC, 1, 6, &tokens)).unwrap();
        let data = load(&path).unwrap();
        assert_eq!(data.len(), 6);
        assert_eq!(
            data.all().to_vec(),
            tokens.iter().map(|&t| u32::from(t)).collect::<Vec<_>>()
        );
        assert_eq!(data.max_token(), 65535);
        let err = data.check_vocab(50257).unwrap_err();
        assert!(matches!(
            err,
            DataError::TokenOutOfVocab {
                token: 65535,
                vocab_size: 50257
            }
        ));
        assert!(err.to_string().contains("at least 65536"), "{err}");

        let bad_magic = dir.path().join("bad_magic.bin");
        fs::write(&bad_magic, llmc_bin(12345, 1, 6, &tokens)).unwrap();
        let err = load(&bad_magic).unwrap_err();
        assert!(matches!(err, DataError::BadHeader { .. }), "{err}");
        assert!(
            err.to_string().contains("magic 12345, expected 20240520"),
            "{err}"
        );
        assert!(err.to_string().contains("bad_magic.bin"), "{err}");

        let bad_version = dir.path().join("v2.bin");
        fs::write(&bad_version, llmc_bin(LLMC_MAGIC, 2, 6, &tokens)).unwrap();
        assert!(matches!(
            load(&bad_version),
            Err(DataError::BadHeader { .. })
        ));

        let model = dir.path().join("gpt2_124M.bin");
        fs::write(&model, llmc_bin(LLMC_MODEL_MAGIC, 3, 0, &[])).unwrap();
        let err = load(&model).unwrap_err();
        assert!(err.to_string().contains("model checkpoint"), "{err}");

        let truncated = dir.path().join("truncated.bin");
        fs::write(&truncated, llmc_bin(LLMC_MAGIC, 1, 100, &tokens)).unwrap();
        let err = load(&truncated).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TokenCountMismatch {
                    expected: 100,
                    found: 6,
                    ..
                }
            ),
            "{err}"
        );

        let short_header = dir.path().join("short_header.bin");
        fs::write(&short_header, &llmc_bin(LLMC_MAGIC, 1, 6, &tokens)[..100]).unwrap();
        let err = load(&short_header).unwrap_err();
        assert!(
            err.to_string()
                .contains("shorter than the 1024-byte header"),
            "{err}"
        );
    }

    #[test]
    fn nanogpt_bin_reads_back_and_odd_length_is_an_error() {
        let dir = ScratchDir::new("nanogpt");
        let tokens: Vec<u16> = (0..1000u16).map(|i| i.wrapping_mul(251)).collect();
        let path = dir.path().join("val.bin");
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        fs::write(&path, &bytes).unwrap();
        let data = load(&path).unwrap();
        assert_eq!(data.len(), 1000);
        assert_eq!(data.get(999), u32::from(tokens[999]));
        assert_eq!(
            data.all().to_vec(),
            tokens.iter().map(|&t| u32::from(t)).collect::<Vec<_>>()
        );
        assert_eq!(data.max_token(), u32::from(*tokens.iter().max().unwrap()));

        let odd = dir.path().join("odd.bin");
        fs::write(&odd, &bytes[..7]).unwrap();
        assert!(matches!(
            load(&odd),
            Err(DataError::OddLength { len: 7, .. })
        ));
    }

    #[test]
    fn text_is_cached_reused_and_retokenised_when_changed() {
        let dir = ScratchDir::new("cache");
        let path = dir.path().join("input.txt");
        fs::write(&path, "hello, world\n").unwrap();
        let cache = dir.path().join("input.txt.bytes.tokens");

        let first = load(&path).unwrap();
        assert_eq!(first.all().to_vec(), b"hello, world\n".map(u32::from));
        assert!(matches!(first.storage, Storage::U16 { .. }), "{first:?}");
        let written = fs::metadata(&cache).unwrap().modified().unwrap();
        assert_eq!(
            fs::metadata(&cache).unwrap().len(),
            (CACHE_HEADER_BYTES + 2 * 13) as u64
        );

        let second = load(&path).unwrap();
        assert_eq!(second.all().to_vec(), first.all().to_vec());
        assert_eq!(
            fs::metadata(&cache).unwrap().modified().unwrap(),
            written,
            "cache reused"
        );

        // A changed source (here: another length and mtime) is tokenised again.
        fs::write(&path, "goodbye, cruel world\n").unwrap();
        let third = load(&path).unwrap();
        assert_eq!(
            third.all().to_vec(),
            b"goodbye, cruel world\n".map(u32::from)
        );
        assert_eq!(
            fs::metadata(&cache).unwrap().len(),
            (CACHE_HEADER_BYTES + 2 * 21) as u64
        );

        // GPT-2 caches separately, with its own name.
        let gpt2 = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        let data = TokenDataset::load(&DataSource::File(path.clone()), &gpt2).unwrap();
        assert_eq!(data.all().to_vec(), gpt2.encode("goodbye, cruel world\n"));
        assert!(dir.path().join("input.txt.gpt2.tokens").exists());

        // A damaged cache is rebuilt, not trusted.
        fs::write(&cache, b"garbage").unwrap();
        assert_eq!(load(&path).unwrap().len(), 21);
        assert!(fs::read(&cache).unwrap().starts_with(CACHE_MAGIC));
    }

    #[test]
    fn u32_cache_round_trips() {
        // No tokenizer has a vocab > 65536 yet; exercise the u32 layout directly.
        let dir = ScratchDir::new("u32");
        let path = dir.path().join("big.tokens");
        let tokens = vec![0, 70_000, u32::MAX, 5];
        let mut bytes = vec![0u8; CACHE_HEADER_BYTES];
        bytes.extend(tokens.iter().flat_map(|t: &u32| t.to_le_bytes()));
        fs::write(&path, bytes).unwrap();
        let data = TokenDataset {
            storage: Storage::U32 {
                map: map(&path).unwrap(),
                start: CACHE_HEADER_BYTES,
            },
            len: 4,
            origin: "test".into(),
            max_token: OnceLock::new(),
        };
        assert_eq!(data.all().to_vec(), tokens);
        assert_eq!(data.max_token(), u32::MAX);
    }

    #[test]
    fn missing_empty_not_utf8_and_short_are_typed_errors() {
        let dir = ScratchDir::new("errors");
        let missing = dir.path().join("nope.txt");
        let err = load(&missing).unwrap_err();
        assert!(matches!(err, DataError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("nope.txt"), "{err}");

        for name in ["empty.txt", "empty.bin"] {
            let empty = dir.path().join(name);
            fs::write(&empty, b"").unwrap();
            let err = load(&empty).unwrap_err();
            assert!(matches!(err, DataError::Empty { .. }), "{err}");
            assert!(err.to_string().contains(name), "{err}");
        }

        let latin1 = dir.path().join("latin1.txt");
        fs::write(&latin1, b"caf\xe9 au lait").unwrap();
        let err = load(&latin1).unwrap_err();
        assert!(matches!(err, DataError::NotUtf8 { offset: 3, .. }), "{err}");

        let short = dir.path().join("short.txt");
        fs::write(&short, "tiny").unwrap();
        let data = load(&short).unwrap();
        let sampler = BatchSampler {
            seed: 0,
            block_size: 8,
            global_batch: 1,
        };
        let err = sampler.batch(data.all(), 0, 0..1).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TooShort {
                    tokens: 4,
                    needed: 9,
                    ..
                }
            ),
            "{err}"
        );
        assert!(matches!(
            sampler.check(data.all()),
            Err(DataError::TooShort { .. })
        ));
    }

    #[test]
    fn embedded_loads_and_splits_like_nanogpt() {
        let data = TokenDataset::load(&DataSource::Embedded, &bytes_tokenizer()).unwrap();
        assert_eq!(data.len(), embedded_corpus().len());
        data.check_vocab(256).unwrap();
        assert!(data.max_token() < 128);
        let (train, val) = data.split(0.1);
        assert_eq!(train.len(), (data.len() as f64 * 0.9) as usize);
        assert_eq!(train.len() + val.len(), data.len());
        assert_eq!(val.get(0), data.get(train.len()));
        assert_eq!((train.name(), val.name()), ("train", "val"));
        let (all, none) = data.split(0.0);
        assert_eq!((all.len(), none.len()), (data.len(), 0));
    }

    #[test]
    fn progress_bar_builds_and_hides() {
        let _ = progress_style(); // the template parses
        assert!(progress_bar(10, Path::new("x.txt"), false).is_hidden());
    }

    #[test]
    fn tinyshakespeare_if_present() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tinyshakespeare.txt");
        if !path.exists() {
            println!(
                "note: {} is absent; skipping the tinyshakespeare check",
                path.display()
            );
            return;
        }
        // Tokenise a copy, so the cache is not written into the shared directory.
        let dir = ScratchDir::new("shakespeare");
        let copy = dir.path().join("input.txt");
        fs::copy(&path, &copy).unwrap();
        let data = load(&copy).unwrap();
        assert_eq!(data.len(), 1_115_394);
        assert!(
            data.all()
                .to_vec()
                .starts_with(&b"First Citizen:".map(u32::from))
        );

        // GPT-2 token counts as nanoGPT's data/shakespeare/prepare.py reports them: it splits the
        // text at 90% of its characters and encodes each part (`train has 301,966 tokens`,
        // `val has 36,059 tokens`).
        let gpt2 = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        let text = fs::read_to_string(&copy).unwrap();
        let n = text.len() * 9 / 10;
        assert_eq!(gpt2.encode(&text[..n]).len(), 301_966);
        assert_eq!(gpt2.encode(&text[n..]).len(), 36_059);
        // Loading tokenises in chunks on all cores: the same ids as one pass over the whole text.
        let whole = gpt2.encode(&text);
        let loaded = TokenDataset::load(&DataSource::File(copy), &gpt2).unwrap();
        assert_eq!(loaded.all().to_vec(), whole);
    }
}
