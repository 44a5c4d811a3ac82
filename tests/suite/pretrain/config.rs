//! The run's configuration: refusals of bad input, the memory estimate against the measured
//! bytes, the launcher's environment, the flags' defaults.

use super::*;

/// Bad input: each a typed error that says what to do, nothing overwritten.
#[test]
fn bad_input_is_refused() {
    let missing = PretrainConfig {
        data: DataFlags {
            path: Some("/nonexistent/input.txt".into()),
            ..small(2).data
        },
        ..small(2)
    };
    // A held-out share outside [0, 1) is refused before the data is read (the file is missing:
    // reading it would have been the error).
    for val_fraction in [1.0, -0.5] {
        let bad = PretrainConfig {
            data: DataFlags {
                val_fraction: Some(val_fraction),
                ..missing.data.clone()
            },
            ..missing.clone()
        };
        match run(&bad) {
            Err(PretrainError::Config(msg)) => assert!(msg.contains("--val-fraction"), "{msg}"),
            other => panic!("--val-fraction {val_fraction}: {other:?}"),
        }
    }
    // A temperature below 0 or not a number, a top-p outside (0, 1]: refused before the data
    // is read.
    for (temperature, top_p) in [(-0.5, 1.0), (f32::NAN, 1.0), (0.8, 0.0), (0.8, 1.5)] {
        let bad = PretrainConfig {
            temperature,
            top_p,
            ..missing.clone()
        };
        match run(&bad) {
            Err(PretrainError::Config(msg)) => assert!(msg.contains("--temperature"), "{msg}"),
            other => panic!("--temperature {temperature} --top-p {top_p}: {other:?}"),
        }
    }
    let err = run(&missing).unwrap_err();
    assert!(
        matches!(
            err,
            PretrainError::Models(wildfire::models::Error::Missing { .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("/nonexistent/input.txt"), "{err}");

    let dir = scratch("shape");
    run(&PretrainConfig {
        save: Some(dir.clone()),
        ..small(2)
    })
    .unwrap();
    let before = std::fs::read_to_string(dir.join("latest")).unwrap();
    let other = PretrainConfig {
        model: ModelFlags {
            n_embd: Some(64),
            ..small(4).model
        },
        resume: Some(dir.clone()),
        save: Some(dir.clone()),
        ..small(4)
    };
    let err = run(&other).unwrap_err();
    assert!(matches!(err, PretrainError::Checkpoint { .. }), "{err}");
    assert!(err.to_string().contains("same model flags"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), before);

    // Every file of the checkpoint is checked before a step runs: a truncated piece file, a
    // changed byte of a weight (its CRC-32), a corrupt or foreign metadata file are refused with
    // the file's path, and `latest` still names the checkpoint.
    let step_dir = dir.join(&before);
    let resume = || {
        run(&PretrainConfig {
            resume: Some(dir.clone()),
            ..small(4)
        })
        .unwrap_err()
    };
    let pieces = step_dir.join("rank-00000.safetensors");
    let bytes = std::fs::read(&pieces).unwrap();
    std::fs::write(&pieces, &bytes[..bytes.len() / 2]).unwrap();
    let err = resume();
    assert!(matches!(err, PretrainError::Checkpoint { .. }), "{err}");
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(err.to_string().contains("rank-00000.safetensors"), "{err}");
    let mut flipped = bytes.clone();
    *flipped.last_mut().unwrap() ^= 0x40;
    std::fs::write(&pieces, &flipped).unwrap();
    let err = resume();
    assert!(matches!(err, PretrainError::Checkpoint { .. }), "{err}");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    std::fs::write(&pieces, &bytes).unwrap();
    let metadata = step_dir.join("metadata.json");
    let meta = std::fs::read_to_string(&metadata).unwrap();
    for broken in [
        meta[..meta.len() / 2].to_string(),
        meta.replace("wildfire-dcp/1", "wildfire-dcp/0"),
    ] {
        std::fs::write(&metadata, broken).unwrap();
        let err = resume();
        assert!(matches!(err, PretrainError::Checkpoint { .. }), "{err}");
        assert!(err.to_string().contains("metadata.json"), "{err}");
    }
    std::fs::write(&metadata, &meta).unwrap();
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), before);

    let nothing = PretrainConfig {
        resume: Some(scratch("empty")),
        ..small(2)
    };
    assert!(matches!(
        run(&nothing).unwrap_err(),
        PretrainError::Checkpoint { .. }
    ));

    let odd = PretrainConfig {
        batch_size: 3,
        parallel: ParallelConfig {
            dp: 2,
            ..ParallelConfig::default()
        },
        ..small(2)
    };
    assert!(matches!(run(&odd).unwrap_err(), PretrainError::Config(_)));

    let tp = PretrainConfig {
        parallel: ParallelConfig {
            tp: 3,
            ..ParallelConfig::default()
        },
        ..small(2)
    };
    let err = run(&tp).unwrap_err();
    assert!(
        err.to_string()
            .contains("has 2 attention heads, which do not divide by tp = 3"),
        "{err}"
    );
    let sp = PretrainConfig {
        parallel: ParallelConfig {
            sp: true,
            ..ParallelConfig::default()
        },
        ..small(2)
    };
    let err = run(&sp).unwrap_err();
    assert!(err.to_string().contains("needs --tp 2 or more"), "{err}");
    let dropout = PretrainConfig {
        model: ModelFlags {
            dropout: 1.5,
            ..small(2).model
        },
        ..small(2)
    };
    let err = run(&dropout).unwrap_err();
    assert!(err.to_string().contains("dropout 1.5"), "{err}");
    // The host profiler is a build feature (pprof): without it the flag says how to get it,
    // before anything runs or is written.
    let profiled = PretrainConfig {
        host_profile: Some(scratch("refused").join("host.folded")),
        ..small(2)
    };
    let result = run(&profiled);
    if cfg!(feature = "host-profile") {
        result.unwrap();
        let text = std::fs::read_to_string(profiled.host_profile.as_ref().unwrap()).unwrap();
        assert!(
            text.lines().any(|l| l.starts_with("rank-0-worker-")),
            "{text}"
        );
        let clocks =
            wildfire::pretrain::host_profile::threads_path(profiled.host_profile.as_ref().unwrap());
        let clocks = std::fs::read_to_string(clocks).unwrap();
        assert!(
            clocks.lines().any(|l| l.starts_with("rank-0-worker-")),
            "{clocks}"
        );
    } else {
        let err = result.unwrap_err();
        assert!(err.to_string().contains("--features host-profile"), "{err}");
        assert!(!profiled.host_profile.as_ref().unwrap().exists());
    }
}

/// `--estimate`'s parameter, gradient and optimizer bytes equal what the decorator measures
/// after a step: DDP, ZeRO-2 and FSDP on 2 ranks, tensor parallelism on 2 (vocabulary-parallel
/// embedding split, row-parallel biases and LayerNorms whole) and FSDP over dp 2 × tp 2. The
/// vocabulary is the data's (`load_data`), not a constant.
#[test]
fn estimate_matches_measured_bytes() {
    estimate_matches_the_accounting(&small(1));
}

/// A launched process takes its place from the launcher: torchrun inside a SLURM allocation
/// (both sets of variables) is a torchrun rendezvous, `--dp` defaults to `WORLD_SIZE / --tp`,
/// and a mesh that does not match the world is refused.
#[test]
fn launcher_environment_sets_the_launch_and_dp() {
    use wildfire::parallel::LaunchEnv;
    use wildfire::pretrain::Launch;
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        LaunchEnv::from_vars(|n| {
            pairs
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        })
        .unwrap()
    };
    let torchrun_in_slurm = vars(&[
        ("SLURM_NTASKS", "1"),
        ("SLURM_PROCID", "0"),
        ("WORLD_SIZE", "4"),
        ("RANK", "1"),
    ]);
    let mut config = PretrainConfig {
        parallel: ParallelConfig {
            tp: 2,
            ..ParallelConfig::default()
        },
        ..small(1)
    };
    config.apply_launcher(torchrun_in_slurm, false).unwrap();
    assert_eq!((config.launch, config.parallel.dp), (Launch::Rendezvous, 2));
    let mut given = small(1);
    let err = given.apply_launcher(torchrun_in_slurm, true).unwrap_err();
    assert!(
        err.to_string().contains(
            "torchrun started 4 processes, but --dp 1 × --pp 1 × --cp 1 × --tp 1 = 1 ranks"
        ),
        "{err}"
    );
    let mut srun = small(1);
    srun.apply_launcher(vars(&[("SLURM_NTASKS", "2"), ("SLURM_PROCID", "1")]), false)
        .unwrap();
    assert_eq!((srun.launch, srun.parallel.dp), (Launch::Mpi, 2));
    let mut alone = small(1);
    alone
        .apply_launcher(vars(&[("WORLD_SIZE", "1")]), false)
        .unwrap();
    assert_eq!((alone.launch, alone.parallel.dp), (Launch::Threads, 1));
}

/// One source for every default: `PretrainConfig::default()` is what the flags give when none
/// is passed.
#[test]
fn defaults_are_the_flags_defaults() {
    use clap::Parser;
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        config: PretrainConfig,
    }
    let parsed = Flags::try_parse_from(["x"]).unwrap().config;
    let d = PretrainConfig::default();
    assert_eq!(
        (d.steps, d.sample_tokens, d.plot.clone(), d.metrics.clone()),
        (
            300,
            300,
            Some("runs/latest/loss.png".into()),
            Some("runs/latest/metrics.jsonl".into())
        )
    );
    if std::env::var_os("WILDFIRE_DP").is_none() {
        assert_eq!(parsed, d);
    }
    let flags = Flags::try_parse_from(["x", "--dp", "2", "--fsdp", "full", "--precision", "bf16"])
        .unwrap()
        .config;
    assert_eq!((flags.parallel.dp, flags.precision), (2, Precision::Bf16));
    // The flattened groups' own defaults are the flags' too.
    assert_eq!(d.model, ModelFlags::default());
    assert_eq!(d.data, DataFlags::default());
    // A stored configuration keeps its flat keys (checkpoints written before the groups load).
    let json = serde_json::to_value(&d).unwrap();
    for key in [
        "preset",
        "n_layer",
        "dropout",
        "data",
        "tokenizer",
        "val_fraction",
    ] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
    let back: PretrainConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back, d);
}

/// Without libcuda (a CPU-only machine), a CUDA run is the typed error NCCL gives, whatever the
/// collectives, not cudarc's panic at the device's first use (CI runs the same through the
/// binary). With it, nothing to check here (the GPU runs are the bench's).
#[cfg(feature = "cuda")]
#[test]
fn cuda_without_libcuda_is_a_typed_error() {
    use wildfire::pretrain::run_cuda;
    if wildfire::parallel::check_libcuda().is_ok() {
        return;
    }
    for collectives in [Collectives::Host, Collectives::Staged, Collectives::Nccl] {
        let config = PretrainConfig {
            collectives,
            steps: 1,
            ..PretrainConfig::quiet()
        };
        match run_cuda(&config) {
            Err(PretrainError::Parallel(wildfire::parallel::Error::Cuda(reason))) => {
                assert!(reason.contains("libcuda"), "{collectives:?}: {reason}");
            }
            Err(e) => panic!("{collectives:?}: {e}"),
            Ok(_) => panic!("{collectives:?}: ran without libcuda"),
        }
    }
}

/// The learning rate each step trains with (its metrics' `lr`) is `--lr-decay`'s: warmup 2,
/// then warmup–stable–decay over steps 2..8 with half of them cooldown, to a floor of 0
/// (written out here, not through the schedule); a floor or cooldown out of range is refused.
#[test]
fn steps_train_at_the_decays_learning_rate() {
    use wildfire::engine::report::LrDecay;
    let config = PretrainConfig {
        lr: 1e-3,
        warmup: 2,
        lr_decay: LrDecay::Wsd,
        min_lr_ratio: 0.0,
        cooldown: 0.5,
        eval_iters: 0,
        ..small(8)
    };
    let summary = run(&PretrainConfig {
        decay_steps: None,
        ..config.clone()
    })
    .unwrap();
    let lrs: Vec<f64> = summary.steps.iter().map(|m| m.lr).collect();
    let want = [
        5e-4,
        1e-3,
        1e-3,
        1e-3,
        1e-3,
        1e-3,
        1e-3 * 2.0 / 3.0,
        1e-3 / 3.0,
    ];
    assert_eq!(lrs.len(), want.len());
    for (step, (got, want)) in lrs.iter().zip(want).enumerate() {
        assert!((got - want).abs() < 1e-15, "step {step}: {got} vs {want}");
    }
    for (min_lr_ratio, cooldown, flag) in [(-0.1, 0.2, "--min-lr-ratio"), (0.1, 1.5, "--cooldown")]
    {
        let bad = PretrainConfig {
            min_lr_ratio,
            cooldown,
            ..config.clone()
        };
        match run(&bad) {
            Err(PretrainError::Config(msg)) => assert!(msg.contains(flag), "{msg}"),
            other => panic!("{flag}: {other:?}"),
        }
    }
}
