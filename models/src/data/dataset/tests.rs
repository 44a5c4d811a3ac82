//! Tests of the token dataset: the llm.c and nanoGPT loaders, the token cache, typed errors.

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

fn load(path: &Path) -> Result<TokenDataset, Error> {
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
        Error::TokenOutOfVocab {
            token: 65535,
            vocab_size: 50257
        }
    ));
    assert!(err.to_string().contains("at least 65536"), "{err}");

    let bad_magic = dir.path().join("bad_magic.bin");
    fs::write(&bad_magic, llmc_bin(12345, 1, 6, &tokens)).unwrap();
    let err = load(&bad_magic).unwrap_err();
    assert!(matches!(err, Error::BadHeader { .. }), "{err}");
    assert!(
        err.to_string().contains("magic 12345, expected 20240520"),
        "{err}"
    );
    assert!(err.to_string().contains("bad_magic.bin"), "{err}");

    let bad_version = dir.path().join("v2.bin");
    fs::write(&bad_version, llmc_bin(LLMC_MAGIC, 2, 6, &tokens)).unwrap();
    assert!(matches!(load(&bad_version), Err(Error::BadHeader { .. })));

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
            Error::TokenCountMismatch {
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
    assert!(matches!(load(&odd), Err(Error::OddLength { len: 7, .. })));
}

/// The shards of a pattern (llm.c's `fineweb_train_*.bin`) read as the one file they
/// concatenate, in the order of their names: token by token and in windows across the shards'
/// ends; formats mixed (llm.c, nanoGPT, a text file through its cache); a held-out set given
/// apart after them; a pattern naming nothing, or a bad one, a typed error.
#[test]
fn the_files_of_a_pattern_read_as_their_concatenation() {
    let dir = ScratchDir::new("pattern");
    let tokens: Vec<u16> = (0..3000u32).map(|i| (i * 7919 % 65_000) as u16).collect();
    let nanogpt = |t: &[u16]| -> Vec<u8> { t.iter().flat_map(|t| t.to_le_bytes()).collect() };
    // Written out of order; the names sort them. `shard_1` is nanoGPT's raw format.
    fs::write(
        dir.path().join("shard_2.bin"),
        llmc_bin(LLMC_MAGIC, 1, 1000, &tokens[1700..2700]),
    )
    .unwrap();
    fs::write(
        dir.path().join("shard_0.bin"),
        llmc_bin(LLMC_MAGIC, 1, 1200, &tokens[..1200]),
    )
    .unwrap();
    fs::write(dir.path().join("shard_1.bin"), nanogpt(&tokens[1200..1700])).unwrap();
    fs::write(dir.path().join("other.bin"), nanogpt(&tokens[2700..])).unwrap();
    // A folder the pattern matches is not a file: left out.
    fs::create_dir(dir.path().join("shard_9.bin")).unwrap();
    let data = load(&dir.path().join("shard_*.bin")).unwrap();
    assert_eq!((data.len(), data.parts()), (2700, 3));
    let want: Vec<u32> = tokens[..2700].iter().map(|&t| u32::from(t)).collect();
    assert_eq!(data.all().to_vec(), want);
    for i in [0, 1199, 1200, 1699, 1700, 2699] {
        assert_eq!(data.get(i), want[i], "token {i}");
    }
    // Windows inside one shard, across one end, across two, empty at the ends.
    for range in [
        5..40,
        1190..1210,
        1100..1800,
        0..2700,
        0..0,
        2700..2700,
        1200..1200,
    ] {
        let mut out = vec![7];
        data.all().extend_range(range.clone(), &mut out);
        assert_eq!(out[1..], want[range.clone()], "{range:?}");
    }
    assert_eq!(data.max_token(), want.iter().copied().max().unwrap());
    let (train, val) = data.split(0.5);
    let mut out = Vec::new();
    val.extend_range(0..10, &mut out);
    assert_eq!(out, want[1350..1360]);
    assert_eq!(train.to_vec(), want[..1350]);

    // A pattern with text files: each tokenised and cached on its own.
    fs::write(dir.path().join("a.txt"), "hello ").unwrap();
    fs::write(dir.path().join("b.txt"), "world").unwrap();
    let text = load(&dir.path().join("?.txt")).unwrap();
    assert_eq!(text.all().to_vec(), b"hello world".map(u32::from));
    assert!(dir.path().join("b.txt.bytes.tokens").exists());

    // The training shards, then a held-out file: `held_out` marks where it starts.
    let held = TokenDataset::with_held_out(data, load(&dir.path().join("other.bin")).unwrap());
    assert_eq!(
        (held.len(), held.held_out(), held.parts()),
        (3000, Some(2700), 2)
    );
    let (train, val) = held.split_at(2700);
    assert_eq!(
        val.to_vec(),
        tokens[2700..]
            .iter()
            .map(|&t| u32::from(t))
            .collect::<Vec<_>>()
    );
    assert_eq!(train.len(), 2700);
    assert!(format!("{held:?}").contains("held out"), "{held:?}");

    // A file whose name holds a pattern's characters is that file.
    let literal = dir.path().join("odd[1].bin");
    fs::write(&literal, nanogpt(&tokens[..4])).unwrap();
    assert_eq!(load(&literal).unwrap().len(), 4);

    for pattern in ["nothing_*.bin", "shard_[.bin"] {
        let err = load(&dir.path().join(pattern)).unwrap_err();
        assert!(matches!(err, Error::BadPattern { .. }), "{pattern}: {err}");
        assert!(err.to_string().contains(pattern), "{err}");
    }
    // A shard that is not a token file is named in the error.
    fs::write(dir.path().join("shard_3.bin"), [1u8, 2, 3]).unwrap();
    let err = load(&dir.path().join("shard_*.bin")).unwrap_err();
    assert!(matches!(err, Error::OddLength { len: 3, .. }), "{err}");
    assert!(err.to_string().contains("shard_3.bin"), "{err}");
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

    // The cache is keyed by content, not by the file's mtime: a touched (or freshly checked-out)
    // source keeps it; an edit of the same length is tokenised again.
    let touched = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(touched)
        .unwrap();
    load(&path).unwrap();
    assert_eq!(
        fs::metadata(&cache).unwrap().modified().unwrap(),
        written,
        "cache kept for a touched source"
    );
    fs::write(&path, "jello, world\n").unwrap();
    assert_eq!(
        load(&path).unwrap().all().to_vec(),
        b"jello, world\n".map(u32::from)
    );

    // A changed source (here: another length) is tokenised again.
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

/// With a cache folder, the cache goes there (made if missing), named after the file, and the
/// data folder is left alone.
#[test]
fn the_token_cache_can_live_elsewhere() {
    let dir = ScratchDir::new("cache-dir");
    let path = dir.path().join("input.txt");
    fs::write(&path, "hello, world\n").unwrap();
    let elsewhere = dir.path().join("caches/tokens");
    let source = DataSource::File(path.clone());
    let data = TokenDataset::load_with_cache(&source, &bytes_tokenizer(), false, Some(&elsewhere))
        .unwrap();
    assert_eq!(data.all().to_vec(), b"hello, world\n".map(u32::from));
    assert!(elsewhere.join("input.txt.bytes.tokens").exists());
    assert!(!dir.path().join("input.txt.bytes.tokens").exists());
    let again = TokenDataset::load_with_cache(&source, &bytes_tokenizer(), false, Some(&elsewhere))
        .unwrap();
    assert!(matches!(again.storage, Storage::U16 { .. }), "{again:?}");
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
        held_out: None,
    };
    assert_eq!(data.all().to_vec(), tokens);
    assert_eq!(data.max_token(), u32::MAX);
}

#[test]
fn missing_empty_not_utf8_and_short_are_typed_errors() {
    let dir = ScratchDir::new("errors");
    let missing = dir.path().join("nope.txt");
    let err = load(&missing).unwrap_err();
    assert!(matches!(err, Error::Missing { .. }), "{err}");
    assert!(err.to_string().contains("nope.txt"), "{err}");

    for name in ["empty.txt", "empty.bin"] {
        let empty = dir.path().join(name);
        fs::write(&empty, b"").unwrap();
        let err = load(&empty).unwrap_err();
        assert!(matches!(err, Error::EmptyFile { .. }), "{err}");
        assert!(err.to_string().contains(name), "{err}");
    }

    let latin1 = dir.path().join("latin1.txt");
    fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let err = load(&latin1).unwrap_err();
    assert!(matches!(err, Error::NotUtf8 { offset: 3, .. }), "{err}");

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
            Error::TooShort {
                tokens: 4,
                needed: 9,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        sampler.check(data.all()),
        Err(Error::TooShort { .. })
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
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tinyshakespeare.txt");
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
