//! Training data from token files as llm.c and nanoGPT prepare them: the shards a pattern
//! names (`fineweb_train_*.bin`) and a held-out set given apart (`val.bin`).

use super::*;
use wildfire::models::data::{Tokenizer, embedded_corpus};

/// A run on the shards of a pattern with `--val-data` is, bit for bit, the run on the one file
/// they concatenate with its last tenth held out (`--val-fraction 0.1`): the same losses, the
/// same validation losses, the same parameters — data parallel, so each rank reads its rows
/// from the shards.
#[test]
fn shards_and_a_held_out_file_train_as_the_file_they_concatenate() {
    let dir = scratch("data-shards");
    let mut tokens: Vec<u32> = Tokenizer::new(TokenizerKind::Bytes)
        .unwrap()
        .encode(embedded_corpus());
    tokens.truncate(tokens.len() / 10 * 10);
    let split = tokens.len() / 10 * 9;
    let raw = |t: &[u32]| -> Vec<u8> {
        t.iter()
            .flat_map(|&t| u16::try_from(t).unwrap().to_le_bytes())
            .collect()
    };
    // llm.c's header: magic, version 1, the token count, then 253 zeros.
    let llmc = |t: &[u32]| -> Vec<u8> {
        let mut header = [0i32; 256];
        header[..3].copy_from_slice(&[20240520, 1, t.len() as i32]);
        let mut out: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        out.extend(raw(t));
        out
    };
    std::fs::write(dir.join("all.bin"), raw(&tokens)).unwrap();
    // Uneven shards in both formats; the held-out set llm.c's.
    let (a, b) = (split / 3, split / 3 + split / 5);
    std::fs::write(dir.join("train_000.bin"), llmc(&tokens[..a])).unwrap();
    std::fs::write(dir.join("train_001.bin"), raw(&tokens[a..b])).unwrap();
    std::fs::write(dir.join("train_002.bin"), llmc(&tokens[b..split])).unwrap();
    std::fs::write(dir.join("val_000.bin"), llmc(&tokens[split..])).unwrap();

    let base = PretrainConfig {
        parallel: ParallelConfig {
            dp: 2,
            ..ParallelConfig::default()
        },
        eval_every: 2,
        ..small(4)
    };
    let whole = DataFlags {
        path: Some(dir.join("all.bin")),
        val_fraction: Some(0.1),
        ..DataFlags::default()
    };
    let sharded = DataFlags {
        path: Some(dir.join("train_*.bin")),
        val_data: Some(dir.join("val_*.bin")),
        ..DataFlags::default()
    };
    // The file's tenth is the held-out file exactly.
    let (_, all) = whole.load().unwrap();
    assert_eq!(all.split(0.1).0.len(), split);
    let (_, shards) = sharded.load().unwrap();
    assert_eq!(
        (shards.len(), shards.held_out(), shards.parts()),
        (tokens.len(), Some(split), 2)
    );

    let one = run(&PretrainConfig {
        data: whole,
        ..base.clone()
    })
    .unwrap();
    let parts = run(&PretrainConfig {
        data: sharded,
        ..base.clone()
    })
    .unwrap();
    let losses = |s: &RunSummary| -> Vec<(u32, Option<u32>)> {
        s.steps
            .iter()
            .map(|m| (m.loss.to_bits(), m.val_loss.map(f32::to_bits)))
            .collect()
    };
    assert_eq!(losses(&parts), losses(&one));
    assert_eq!(
        one.steps.iter().filter(|m| m.val_loss.is_some()).count(),
        2,
        "evaluated at steps 1 and 3"
    );
    same_bits("parameters", &parts.parameters, &one.parameters);
    // And it is not the embedded corpus's run (the same tokens, another held-out share).
    let embedded = run(&base).unwrap();
    assert_ne!(losses(&embedded), losses(&one));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Documents separated by GPT-2's `<|endoftext|>` (as nanoGPT's and llm.c's data scripts write
/// them): a model that learnt where a document ends stops its generated text there, the
/// end-of-text kept as its last token, without a Hugging Face directory to name it.
#[test]
fn gpt2_text_generation_stops_at_the_end_of_a_document() {
    let dir = scratch("data-eot");
    let path = dir.join("docs.txt");
    std::fs::write(&path, "a<|endoftext|>".repeat(2000)).unwrap();
    let summary = run(&PretrainConfig {
        data: DataFlags {
            path: Some(path),
            tokenizer: TokenizerKind::Gpt2,
            ..DataFlags::default()
        },
        lr: 1e-2,
        decay_steps: None,
        prompt: Some("a".into()),
        temperature: 0.0,
        sample_tokens: 16,
        eval_iters: 0,
        ..small(30)
    })
    .unwrap();
    let sample = &summary.sample;
    assert!(
        sample.ends_with("<|endoftext|>") && sample.matches("<|endoftext|>").count() == 1,
        "stopped at the first end of text: {sample:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
