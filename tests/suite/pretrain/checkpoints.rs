//! Checkpoints: bitwise resume, resume onto other layouts, Hugging Face export and fine-tuning,
//! and a run that stops on non-finite steps.

use super::*;

/// Save at step 5, resume to step 10: bitwise the same losses and parameters as a straight run,
/// also on two data-parallel ranks.
#[test]
fn resume_is_bitwise_identical() {
    for dp in [1, 2] {
        let parallel = ParallelConfig {
            dp,
            ..ParallelConfig::default()
        };
        let straight = run(&PretrainConfig {
            parallel: parallel.clone(),
            ..small(10)
        })
        .unwrap();
        let dir = scratch(&format!("resume-{dp}"));
        let metrics = dir.join("metrics.jsonl");
        let first = run(&PretrainConfig {
            parallel: parallel.clone(),
            save: Some(dir.clone()),
            metrics: Some(metrics.clone()),
            ..small(5)
        })
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("latest")).unwrap(),
            "step-00000005"
        );
        wall_clock_adds_up(&first, &format!("dp={dp}"));
        let resumed = run(&PretrainConfig {
            parallel: parallel.clone(),
            resume: Some(dir.clone()),
            metrics: Some(metrics.clone()),
            ..small(10)
        })
        .unwrap();
        assert_eq!(resumed.steps[0].step, 5);
        // The resumed run appends to the metrics file: one file holds the whole run.
        let logged: Vec<u64> = std::fs::read_to_string(&metrics)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            logged,
            (0..10).collect::<Vec<u64>>(),
            "dp={dp} metrics steps"
        );
        assert_eq!(
            bits(&resumed_losses(&first, &resumed)),
            bits(&losses(&straight)),
            "dp={dp} losses"
        );
        same_bits(
            &format!("dp={dp} parameters"),
            &resumed.parameters,
            &straight.parameters,
        );
    }
}

/// The run's wall clock is split into parts that each ran (data, build, the first step, the
/// later steps, the evaluation at the last step, the checkpoint) and that add up to no more
/// than the whole.
fn wall_clock_adds_up(run: &RunSummary, what: &str) {
    let w = run.wall;
    let parts = [
        ("data", w.data),
        ("build", w.build),
        ("first step", w.first_step),
        ("steps", w.steps),
        ("eval", w.eval),
        ("checkpoint", w.checkpoint),
    ];
    for (name, seconds) in parts {
        assert!(
            seconds > 0.0,
            "{what}: wall clock part {name} is {seconds} s: {w:?}"
        );
    }
    let sum: f64 = w.parts().iter().map(|p| p.1).sum();
    assert!(
        sum <= w.total,
        "{what}: the parts ({sum} s) exceed the total: {w:?}"
    );
    // Each save's wait for the previous save's write is its own figure, none before the first,
    // and the wall clock's `save wait` is their sum.
    assert_eq!(run.save_waits.len(), run.saves.len(), "{what}");
    assert!(!run.saves.is_empty(), "{what}: no checkpoint saved");
    assert_eq!(
        run.save_waits[0], 0.0,
        "{what}: a wait before the first save"
    );
    assert!(run.save_waits.iter().all(|&s| s >= 0.0), "{what}");
    let waits: f64 = run.save_waits.iter().sum();
    assert!(
        (waits - w.save_wait).abs() < 1e-9,
        "{what}: {waits} s, {w:?}"
    );
    // The step times are those the metrics report (tokens of a global batch of 4 rows).
    let tokens = 4 * run.model.as_ref().unwrap().block_size();
    let reported: f64 = run
        .steps
        .iter()
        .map(|m| tokens as f64 / m.tokens_per_s)
        .sum();
    assert!(
        (reported - (w.first_step + w.steps)).abs() <= 1e-6 * reported,
        "{what}: metrics say {reported} s of steps, the wall clock {w:?}"
    );
    let line = w.to_string();
    assert!(
        line.starts_with("wall clock ") && line.contains(" steps "),
        "{line}"
    );
}

/// A checkpoint saved on one mesh and strategy resumes on another: saved at step 5 under dp 4
/// FullShard, resumed to step 10 under dp 4 FullShard (bitwise: the same arithmetic), dp 2
/// FullShard, dp 1, dp 2 × tp 2 FullShard and HSDP 2 × 2; saved under tp 2, resumed under tp 1.
/// Losses and parameters follow the uninterrupted run of the saving layout.
#[test]
fn resume_reshards_onto_other_layouts() {
    let layout = ParallelConfig::layout;
    let fsdp4 = layout(4, 1, FsdpStrategy::FullShard, None);
    let tp2 = layout(1, 2, FsdpStrategy::NoShard, None);
    for (from, targets) in [
        (
            fsdp4.clone(),
            vec![
                fsdp4.clone(),
                layout(2, 1, FsdpStrategy::FullShard, None),
                layout(1, 1, FsdpStrategy::NoShard, None),
                layout(2, 2, FsdpStrategy::FullShard, None),
                layout(4, 1, FsdpStrategy::Hybrid, Some(2)),
            ],
        ),
        (tp2.clone(), vec![layout(1, 1, FsdpStrategy::NoShard, None)]),
    ] {
        let straight = run(&PretrainConfig {
            parallel: from.clone(),
            ..small(10)
        })
        .unwrap();
        let dir = scratch(&format!("reshard-{}-{}", from.dp, from.tp));
        let first = run(&PretrainConfig {
            parallel: from.clone(),
            save: Some(dir.clone()),
            ..small(5)
        })
        .unwrap();
        for target in targets {
            let resumed = run(&PretrainConfig {
                parallel: target.clone(),
                resume: Some(dir.clone()),
                ..small(10)
            })
            .unwrap();
            let what = format!(
                "dp {} tp {} {:?} -> dp {} tp {} {:?}",
                from.dp, from.tp, from.fsdp, target.dp, target.tp, target.fsdp
            );
            let (losses, expected) = (resumed_losses(&first, &resumed), losses(&straight));
            if target == from {
                assert_eq!(bits(&losses), bits(&expected), "{what}: losses");
                same_bits(
                    &format!("{what}: parameters"),
                    &resumed.parameters,
                    &straight.parameters,
                );
            }
            for (a, b) in pairs(&losses, &expected) {
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: loss {a} vs {b}");
            }
            tensors_close(&what, &resumed.parameters, &straight.parameters, 1e-5);
        }
    }
}

/// GPT-2 weights out and in: a run's last checkpoint exported as a Hugging Face GPT-2 file; a
/// fine-tune from that file at tp 2 follows the same fine-tune at tp 1 (within 1e-5), and starts
/// from the exported weights (its first loss is the exporting run's loss on the same batch after
/// the last update, i.e. not a fresh initialisation's).
#[test]
fn gpt2_export_and_fine_tune_from_it() {
    let dir = scratch("hf");
    let file = dir.join("gpt2.safetensors");
    let trained = run(&PretrainConfig {
        save: Some(dir.join("ckpt")),
        export_hf: Some(file.clone()),
        ..small(6)
    })
    .unwrap();
    let fresh = run(&small(1)).unwrap();
    let mut tuned = Vec::new();
    for tp in [1, 2] {
        let summary = run(&PretrainConfig {
            init_from: Some(file.clone()),
            seed: 99,
            parallel: ParallelConfig {
                tp,
                ..ParallelConfig::default()
            },
            ..small(4)
        })
        .unwrap();
        tuned.push(summary);
    }
    crate::suite::losses_close("tp 2 vs tp 1", &tuned[1].steps, &tuned[0].steps, 1e-5);
    // Pipeline stages each load their blocks of the file by the whole model's names.
    let pipelined = run(&PretrainConfig {
        init_from: Some(file.clone()),
        seed: 99,
        parallel: ParallelConfig {
            pp: 2,
            microbatches: 2,
            ..ParallelConfig::default()
        },
        ..small(4)
    })
    .unwrap();
    crate::suite::losses_close("pp 2 vs one rank", &pipelined.steps, &tuned[0].steps, 1e-5);
    crate::suite::tensors_close(
        "pp 2 vs one rank",
        &pipelined.parameters,
        &tuned[0].parameters,
        1e-5,
    );
    // Trained weights: the fine-tune's losses sit near the end of training, far below a fresh
    // model's first loss.
    let (start, fresh_loss) = (tuned[0].steps[0].loss, fresh.steps[0].loss);
    let end = trained.steps.last().unwrap().loss;
    assert!(
        start < fresh_loss - 0.5 * (fresh_loss - end),
        "{start} vs fresh {fresh_loss}, trained {end}"
    );
    // Without --save there is no checkpoint to export.
    let err = run(&PretrainConfig {
        export_hf: Some(file),
        ..small(1)
    })
    .unwrap_err();
    assert!(matches!(err, PretrainError::Config(_)), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run whose loss and gradients stay non-finite (an absurd learning rate blows the weights up
/// after the first update) skips every such step on every rank and stops after --max-skipped of
/// them in a row, naming the step and the first parameter with a non-finite gradient, instead of
/// training on NaN.
#[test]
fn non_finite_steps_stop_the_run() {
    for dp in [1, 2] {
        let err = run(&PretrainConfig {
            lr: 1e30,
            warmup: 0,
            max_skipped: 3,
            parallel: ParallelConfig {
                dp,
                ..ParallelConfig::default()
            },
            ..small(20)
        })
        .unwrap_err();
        let PretrainError::Training(wildfire::engine::Error::NonFinite {
            step,
            in_a_row,
            parameter,
        }) = &err
        else {
            panic!("dp {dp}: expected a non-finite stop, got {err}");
        };
        assert_eq!(*in_a_row, 3, "dp {dp}");
        assert!(*step >= 3 && *step < 20, "dp {dp}: step {step}");
        assert!(parameter.is_some(), "dp {dp}: {err}");
        assert!(err.to_string().contains(&format!("step {step}")), "{err}");
    }
}

/// Models `transformers` trained briefly (`tools/trained_reference.py`: a tiny GPT-2 with the
/// tanh GELU and a tiny Llama-3 with an untied head, 300 AdamW steps on Shakespeare's bytes),
/// started with `--init-from DIR --steps 0` (no step trained: the weights are evaluated as
/// loaded): the validation loss the run reports is the mean of the losses `transformers` gives
/// on the same windows — within 0.02 as the model issue asks, and in fact to f32 rounding.
#[test]
fn trained_transformers_models_give_their_validation_loss() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained");
    for (family, preset) in [("gpt2", Preset::Tiny), ("llama", Preset::LlamaTiny)] {
        let config = PretrainConfig {
            model: ModelFlags {
                preset,
                block_size: Some(32),
                ..ModelFlags::default()
            },
            data: DataFlags {
                path: Some(root.join("data.txt")),
                token_cache: Some(scratch(&format!("trained-{family}"))),
                val_fraction: Some(0.5),
                ..DataFlags::default()
            },
            init_from: Some(root.join(family)),
            steps: 0,
            batch_size: 8,
            eval_iters: 8,
            ..PretrainConfig::quiet()
        };
        let summary = run(&config).unwrap();
        assert!(summary.steps.is_empty(), "{family}: no step trained");
        let got = summary.val_loss.expect("an evaluation");
        // `transformers`' loss of every window of data.txt, by its first byte.
        let bytes = std::fs::read(root.join(family).join("windows.safetensors")).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let meta: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
        let at = |i: usize| meta["loss"]["data_offsets"][i].as_u64().unwrap() as usize + 8 + header;
        let losses: Vec<f32> = bytes[at(0)..at(1)]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        // The windows the run evaluated: its validation sampler's, batch by batch.
        let (_, dataset) = config.data.load().unwrap();
        let [_, (val, sampler)] = (config.data)
            .samplers(&dataset, config.seed, 32, config.batch_size, true)
            .unwrap();
        let mut sum = 0.0f64;
        for i in 0..config.eval_iters {
            for row in 0..config.batch_size {
                let start = val.range().start + sampler.offset(i as u64, row, val.len());
                sum += f64::from(losses[start]);
            }
        }
        let want = sum / (config.eval_iters * config.batch_size) as f64;
        let gap = (f64::from(got) - want).abs();
        assert!(
            gap < 0.02,
            "{family}: val loss {got} vs transformers' {want}"
        );
        assert!(
            gap < 1e-4,
            "{family}: val loss {got} vs transformers' {want} (f32 rounding)"
        );
    }
}

/// `--init-from DIR --steps 0 --prompt TEXT --temperature 0` on the models `transformers` trained:
/// the sample is the prompt and the continuation `transformers`' greedy `generate` gives
/// (`tools/generate_reference.py`: 40 new tokens, within the context; or fewer, up to an
/// end-of-text id its `config.json` names), on one device, under tp 2 and over pp 2 (both
/// families; the Llama's 2 key/value heads split over tp).
/// The reference's smallest gap between a step's two largest logits is asserted far above f32
/// rounding, so an exact match is not luck. A sampled run (temperature 1.5, top-k 8, top-p 0.95)
/// gives the same text on every layout and another with another `--sample-seed`.
#[test]
fn trained_transformers_models_continue_a_prompt_as_transformers_generates() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("generate.json")).unwrap()).unwrap();
    let entries = reference["entries"].as_array().unwrap();
    assert_eq!(
        entries.len(),
        6,
        "two prompts for each family, and one stopped each"
    );
    let layouts = [
        ("one device", ParallelConfig::default()),
        (
            "tp 2",
            ParallelConfig {
                tp: 2,
                ..ParallelConfig::default()
            },
        ),
        (
            "pp 2",
            ParallelConfig {
                pp: 2,
                microbatches: 2,
                ..ParallelConfig::default()
            },
        ),
    ];
    let config =
        |model: &std::path::Path, prompt: &str, parallel: &ParallelConfig| PretrainConfig {
            model: ModelFlags {
                preset: if model.ends_with("gpt2") {
                    Preset::Tiny
                } else {
                    Preset::LlamaTiny
                },
                block_size: Some(64),
                ..ModelFlags::default()
            },
            data: DataFlags {
                path: Some(root.join("data.txt")),
                token_cache: Some(scratch("generate-tokens")),
                ..DataFlags::default()
            },
            init_from: Some(model.to_path_buf()),
            steps: 0,
            batch_size: 4,
            parallel: parallel.clone(),
            prompt: Some(prompt.into()),
            temperature: 0.0,
            sample_tokens: 40,
            ..PretrainConfig::quiet()
        };
    for entry in entries {
        let (family, prompt) = (
            entry["family"].as_str().unwrap(),
            entry["prompt"].as_str().unwrap(),
        );
        let continuation: Vec<u8> = entry["continuation"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u8::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let gaps = entry["top2_gaps"].as_array().unwrap();
        let smallest = gaps
            .iter()
            .map(|g| g.as_f64().unwrap())
            .fold(f64::INFINITY, f64::min);
        assert!(
            smallest > 1e-3,
            "{family} {prompt:?}: a near tie ({smallest}) in the reference"
        );
        let want =
            String::from_utf8_lossy(&[prompt.as_bytes(), &continuation].concat()).into_owned();
        // An end-of-text id of the reference's: written into a copy of the model's
        // `config.json` (its directory's name kept: the family), where `transformers` read it.
        let model = match entry["eos_token_id"].as_u64() {
            None => root.join(family),
            Some(eos) => {
                let dir = scratch(&format!("generate-eos-{eos}")).join(family);
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::copy(
                    root.join(family).join("model.safetensors"),
                    dir.join("model.safetensors"),
                )
                .unwrap();
                let mut hf: serde_json::Value = serde_json::from_slice(
                    &std::fs::read(root.join(family).join("config.json")).unwrap(),
                )
                .unwrap();
                hf["eos_token_id"] = eos.into();
                std::fs::write(dir.join("config.json"), hf.to_string()).unwrap();
                assert!(continuation.len() < 40, "{family}: the reference stopped");
                dir
            }
        };
        for (name, parallel) in &layouts {
            let summary = run(&config(&model, prompt, parallel)).unwrap();
            assert_eq!(summary.sample, want, "{family} {prompt:?}, {name}");
        }
    }
    // Sampled: the same draw on every layout (the logits agree to rounding; a seed fixes the
    // draws), another seed another text.
    let sampled = |parallel: &ParallelConfig, seed: u64| {
        let mut config = config(&root.join("llama"), "ROMEO:\n", parallel);
        config.temperature = 1.5;
        config.sample_top_k = 8;
        config.top_p = 0.95;
        config.sample_seed = Some(seed);
        run(&config).unwrap().sample
    };
    let one = sampled(&layouts[0].1, 5);
    assert!(
        one.starts_with("ROMEO:\n") && one.len() > "ROMEO:\n".len(),
        "{one:?}"
    );
    for (name, parallel) in &layouts[1..] {
        assert_eq!(sampled(parallel, 5), one, "{name}");
    }
    assert_ne!(sampled(&layouts[0].1, 6), one, "another seed");
}
