//! The Llama family through the pretraining driver: sharded runs follow one rank, a resume is
//! bitwise, a `transformers` directory starts a run (its `config.json` the shape), the last
//! checkpoint exports under Hugging Face's names, pipeline stages (tied and untied heads) follow
//! one rank, and what is not built yet is refused.

use super::*;
use wildfire::models::ModelConfig;
use wildfire::models::llama::{Llama, init_llama};

/// A CI-sized Llama on the embedded corpus: 2 layers, 4 query heads over 2 key/value heads,
/// width 32, context 32.
fn tiny_llama(steps: usize) -> PretrainConfig {
    PretrainConfig {
        model: ModelFlags {
            preset: Preset::LlamaTiny,
            n_kv_head: Some(2),
            n_head: Some(4),
            ..small(steps).model
        },
        ..small(steps)
    }
}

/// dp 2 × tp 2 FullShard with sequence parallelism and selective recomputation follows one
/// rank, and the text it samples at the end through its key/value cache (each rank its heads'
/// keys and values, past the context of 32 too) is one rank's; saved at step 3 under dp 2
/// FullShard and resumed to step 6, the run is bitwise the uninterrupted one; the export holds
/// every tensor under Hugging Face's name and orientation.
#[test]
fn llama_pretrains_sharded_and_resumes_bitwise() {
    let sampled = |config: PretrainConfig| PretrainConfig {
        sample_tokens: 40,
        ..config
    };
    let one = run(&sampled(tiny_llama(6))).unwrap();
    assert!(matches!(one.model, Some(ModelConfig::Llama(_))));
    let sharded = run(&sampled(PretrainConfig {
        parallel: ParallelConfig {
            sp: true,
            recompute: Recompute::Selective,
            ..ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None)
        },
        ..tiny_llama(6)
    }))
    .unwrap();
    same_run("llama dp 2 x tp 2 + SP", &sharded, &one, 1e-5);
    assert!(one.sample.chars().count() > 32, "{:?}", one.sample);
    assert_eq!(
        sharded.sample, one.sample,
        "llama dp 2 x tp 2 + SP: sampled text"
    );
    let fsdp = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
    let straight = run(&PretrainConfig {
        parallel: fsdp.clone(),
        ..tiny_llama(6)
    })
    .unwrap();
    let dir = scratch("llama-resume");
    let out = dir.join("export.safetensors");
    let first = run(&PretrainConfig {
        parallel: fsdp.clone(),
        save: Some(dir.clone()),
        ..tiny_llama(3)
    })
    .unwrap();
    let resumed = run(&PretrainConfig {
        parallel: fsdp,
        resume: Some(dir.clone()),
        save: Some(dir.clone()),
        export_hf: Some(out.clone()),
        ..tiny_llama(6)
    })
    .unwrap();
    assert_eq!(
        bits(&resumed_losses(&first, &resumed)),
        bits(&losses(&straight))
    );
    same_bits("llama resumed", &resumed.parameters, &straight.parameters);
    let exported = wildfire::checkpoint::safetensors::read(&out).unwrap();
    let (shape, _) = &exported["model.layers.1.self_attn.k_proj.weight"];
    assert_eq!(shape, &[16, 32], "k_proj is [kv heads · head width, width]");
    assert!(exported.contains_key("model.embed_tokens.weight"));
    assert!(exported.contains_key("model.norm.weight"));
    assert!(
        !exported.contains_key("lm_head.weight"),
        "the tiny preset ties its head"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--init-from` a directory `transformers` wrote: its `config.json` gives the shape (grouped
/// heads, an untied head, the rotary scaling) whatever the preset's, and at learning rate 0
/// the parameters after a step are the file's exactly (as the library's import reads them).
#[test]
fn llama_starts_from_a_transformers_directory() {
    let dir = transformers_llama_dir();
    let config = PretrainConfig {
        lr: 0.0,
        ..from_transformers_llama(1)
    };
    let summary = run(&config).unwrap();
    let Some(ModelConfig::Llama(shape)) = &summary.model else {
        panic!("a Llama: {:?}", summary.model);
    };
    assert_eq!(
        (
            shape.d_model,
            shape.n_kv_head,
            shape.tie_embeddings,
            shape.block_size
        ),
        (32, 2, false, 24)
    );
    let mesh = ParallelConfig::default().mesh().unwrap();
    let expected = crate::suite::threads(&mesh, |device| {
        let model =
            init_llama::<crate::suite::Dist>(shape, &device, &ParallelConfig::default()).unwrap();
        let model: Llama<crate::suite::Dist> = wildfire::models::hf::import_llama(&dir)
            .unwrap()
            .load_model(model)
            .unwrap();
        wildfire::demo::parameters(&model)
    });
    same_bits("llama from transformers", &summary.parameters, &expected[0]);
}

/// What the Llama family does not have yet, and flags of the other family, are typed refusals.
#[test]
fn llama_refusals_are_typed() {
    let refused = |config: PretrainConfig, needle: &str| match run(&config) {
        Err(PretrainError::Config(msg))
        | Err(PretrainError::Models(wildfire::models::Error::Config(msg))) => {
            assert!(msg.contains(needle), "{msg}")
        }
        Err(e) => panic!("{needle}: {e}"),
        Ok(_) => panic!("{needle}: ran"),
    };
    refused(
        PretrainConfig {
            model: ModelFlags {
                dropout: 0.1,
                ..tiny_llama(1).model
            },
            ..tiny_llama(1)
        },
        "--dropout",
    );
    refused(
        PretrainConfig {
            model: ModelFlags {
                n_kv_head: Some(2),
                ..small(1).model
            },
            ..small(1)
        },
        "--n-kv-head",
    );
    // tp 3 over 6 query heads and 2 key/value heads: neither split nor replicated.
    refused(
        PretrainConfig {
            model: ModelFlags {
                n_head: Some(6),
                n_embd: Some(48),
                ..tiny_llama(1).model
            },
            parallel: ParallelConfig::layout(1, 3, FsdpStrategy::NoShard, None),
            ..tiny_llama(1)
        },
        "tp 3 neither divides the 2 key/value heads",
    );
}

/// The memory estimate of a Llama equals the decorator's accounting of a step (grouped
/// key/value heads split over tp, or replicated at tp 4 over its 2 key/value heads; the tied
/// table vocabulary-parallel).
#[test]
fn llama_memory_estimate_equals_the_accounting() {
    estimate_matches_the_accounting(&tiny_llama(1));
    estimate_matches_the_accounting_at(
        &tiny_llama(1),
        &[
            (1, 4, FsdpStrategy::NoShard),
            (2, 4, FsdpStrategy::FullShard),
        ],
    );
}

/// The Llama's pipeline stages against one rank accumulating the same micro-batches (4 blocks,
/// 10 steps, every loss, the validation losses and every parameter within 1e-5): 1F1B, ZB-H1 and
/// interleaved at pp 2 with the tied head (the tied table's two copies take one summed gradient),
/// 1F1B with full and selective recomputation inside the stages,
/// 1F1B with the untied head of a `transformers` directory (its weights loaded stage by stage),
/// and pp 2 × tp 2 with sequence parallelism and FSDP against the same layout without the
/// pipeline. A checkpoint the stages saved resumes on one rank, no pipeline.
#[test]
fn llama_pipeline_stages_match_one_rank() {
    let base = PretrainConfig {
        model: ModelFlags {
            n_layer: Some(4),
            ..tiny_llama(10).model
        },
        batch_size: 8,
        eval_every: 5,
        eval_iters: 2,
        ..tiny_llama(10)
    };
    let stages = |schedule: &str, virt: usize| ParallelConfig {
        pp: 2,
        pp_schedule: schedule.into(),
        microbatches: 4,
        pp_virtual: virt,
        ..ParallelConfig::default()
    };
    let one = run(&PretrainConfig {
        accum: 4,
        ..base.clone()
    })
    .unwrap();
    for (schedule, virt) in [("1f1b", 1), ("zb", 1), ("interleaved", 2)] {
        let got = run(&PretrainConfig {
            parallel: stages(schedule, virt),
            ..base.clone()
        })
        .unwrap();
        same_run(&format!("llama {schedule} pp 2"), &got, &one, 1e-5);
    }
    // Recomputation inside the stages: re-materialised, and the selective attention core.
    for recompute in [Recompute::Full, Recompute::Selective] {
        let got = run(&PretrainConfig {
            parallel: ParallelConfig {
                recompute,
                ..stages("1f1b", 1)
            },
            ..base.clone()
        })
        .unwrap();
        same_run(&format!("llama pp 2 {recompute:?}"), &got, &one, 1e-5);
    }
    // Untied: the transformers directory's shape and weights (2 blocks: a stage each).
    let dir = transformers_llama_dir();
    let untied = PretrainConfig {
        model: ModelFlags {
            block_size: Some(24),
            ..base.model.clone()
        },
        init_from: Some(dir),
        ..base.clone()
    };
    let one_untied = run(&PretrainConfig {
        accum: 4,
        ..untied.clone()
    })
    .unwrap();
    let got = run(&PretrainConfig {
        parallel: stages("1f1b", 1),
        ..untied.clone()
    })
    .unwrap();
    same_run("llama untied 1f1b pp 2", &got, &one_untied, 1e-5);
    // pp 2 × tp 2 + SP, FSDP over dp 2: against the same layout without stages.
    let layout = ParallelConfig {
        sp: true,
        ..ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None)
    };
    let unpipelined = run(&PretrainConfig {
        accum: 2,
        parallel: layout.clone(),
        ..base.clone()
    })
    .unwrap();
    let got = run(&PretrainConfig {
        parallel: ParallelConfig {
            pp: 2,
            pp_schedule: "1f1b".into(),
            microbatches: 2,
            ..layout
        },
        ..base.clone()
    })
    .unwrap();
    same_run("llama dp 2 x pp 2 x tp 2 + SP", &got, &unpipelined, 1e-5);
    // Saved by the stages at step 4, resumed on one rank without them.
    let dir = scratch("llama-pp-resume");
    run(&PretrainConfig {
        parallel: stages("zb", 1),
        save: Some(dir.clone()),
        steps: 4,
        ..base.clone()
    })
    .unwrap();
    let resumed = run(&PretrainConfig {
        accum: 4,
        resume: Some(dir.clone()),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(resumed.steps[0].step, 4);
    tensors_close(
        "llama pp checkpoint on one rank",
        &resumed.parameters,
        &one.parameters,
        1e-5,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--tokenizer-file`: a Llama trains on text a `tokenizer.json` tokenises (one built as
/// Llama-3's, `tools/tokenizer_reference.py`): its vocabulary (512 merges and bytes, 2 special
/// tokens) sizes the model, padded to 576 with the padding masked (the first loss is that of a
/// uniform guess over the 514 real tokens); the token cache is named by the file's content, and
/// the sample decodes through it.
#[test]
fn llama_trains_on_a_tokenizer_json() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let cache = scratch("tokenizer-json");
    let config = PretrainConfig {
        data: DataFlags {
            path: Some(fixtures.join("trained/data.txt")),
            tokenizer_file: Some(fixtures.join("tokenizer/tokenizer.json")),
            token_cache: Some(cache.clone()),
            val_fraction: Some(0.2),
            ..DataFlags::default()
        },
        sample_tokens: 16,
        ..tiny_llama(3)
    };
    let summary = run(&config).unwrap();
    let Some(ModelConfig::Llama(model)) = &summary.model else {
        panic!("a Llama");
    };
    assert_eq!((model.vocab_size, model.vocab_used), (576, Some(514)));
    let first = summary.steps[0].loss;
    assert!((first - 514f32.ln()).abs() < 0.05, "first loss {first}");
    assert!(summary.steps.iter().all(|m| m.loss.is_finite()));
    assert!(!summary.sample.is_empty());
    let names: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.len() == 1 && names[0].starts_with("data.txt.json-") && names[0].ends_with(".tokens"),
        "{names:?}"
    );
    let _ = std::fs::remove_dir_all(&cache);
}
