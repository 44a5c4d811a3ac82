//! Pipeline parallelism in the driver: against one rank, with dropout, recomputation, sequence
//! parallelism and checkpoints, and its refusals.

use super::*;

/// Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B (2 chunks per rank) and ZB-H1 (weight
/// gradients deferred to the `W` actions) at pp 2 and 4 with 4 and 8 micro-batches; dp 2 × pp 2
/// (DDP, ZeRO-1 under ZB-H1, ZeRO-2 interleaved); pp 2 × tp 2; dp 2 × pp 2 × tp 2 with FSDP
/// (8 ranks: 1F1B, ZB-H1, interleaved); HSDP 2 × 2 × pp 2 — against one
/// rank accumulating the same micro-batches: every step's loss, the validation losses and every
/// parameter after 10 AdamW steps (clipping on) within 1e-5. The tied token table's two copies
/// (first and last stage) take one summed gradient, and the norm counts each parameter once.
#[test]
fn pipeline_parallel_matches_one_rank() {
    let base = PretrainConfig {
        model: ModelFlags {
            n_layer: Some(8),
            ..small(10).model
        },
        batch_size: 8,
        eval_every: 5,
        eval_iters: 2,
        ..small(10)
    };
    let mut references = std::collections::HashMap::new();
    use FsdpStrategy::{FullShard, Hybrid, NoShard, ShardGradOp, ShardOptimizer};
    // (schedule, pp, V, M, dp, tp, strategy)
    let mut cases = Vec::new();
    for (schedule, virt) in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)] {
        for pp in [2, 4] {
            for m in [4, 8] {
                cases.push((schedule, pp, virt, m, 1, 1, NoShard));
            }
        }
    }
    cases.extend([
        ("1f1b", 2, 1, 4, 2, 1, NoShard),
        ("zb", 2, 1, 4, 2, 1, ShardOptimizer),
        ("interleaved", 2, 2, 4, 2, 1, ShardGradOp),
        ("1f1b", 2, 1, 4, 1, 2, NoShard),
        // dp × pp × tp = 2 × 2 × 2 with FSDP, 8 ranks
        ("1f1b", 2, 1, 4, 2, 2, FullShard),
        ("zb", 2, 1, 4, 2, 2, FullShard),
        ("interleaved", 2, 2, 4, 2, 2, FullShard),
        ("gpipe", 2, 1, 2, 4, 1, Hybrid),
    ]);
    for (schedule, pp, virt, m, dp, tp, fsdp) in cases {
        // One rank, the same micro-batches (dp·m of them) accumulated.
        let expected = references.entry(dp * m).or_insert_with(|| {
            run(&PretrainConfig {
                accum: dp * m,
                ..base.clone()
            })
            .unwrap()
        });
        let got = run(&PretrainConfig {
            parallel: ParallelConfig {
                dp,
                tp,
                fsdp,
                dp_shard: (fsdp == Hybrid).then_some(2),
                pp,
                pp_schedule: schedule.into(),
                microbatches: m,
                pp_virtual: virt,
                ..ParallelConfig::default()
            },
            ..base.clone()
        })
        .unwrap();
        let what = format!("{schedule} pp={pp} V={virt} M={m} dp={dp} tp={tp} {fsdp:?}");
        if tp == 1 {
            same_run(&what, &got, expected, 1e-5);
        } else {
            // Tensor parallelism sums in another order than one rank (AdamW's normalised update
            // turns that into ~1e-5 on tiny gradients): the pipeline against the same layout
            // without it within 1e-5, against one rank within 1e-4 (as the TP tests).
            let unpipelined = run(&PretrainConfig {
                accum: m,
                parallel: ParallelConfig {
                    dp,
                    tp,
                    fsdp,
                    dp_shard: (fsdp == Hybrid).then_some(2),
                    ..ParallelConfig::default()
                },
                ..base.clone()
            })
            .unwrap();
            same_run(&what, &got, &unpipelined, 1e-5);
            same_run(&format!("{what} vs one rank"), &got, expected, 1e-4);
        }
    }
}

/// `layout` run in two stages (`schedule`, `m` micro-batches a step), and without stages on
/// the same micro-batches accumulated.
fn with_and_without_stages(
    base: &PretrainConfig,
    layout: ParallelConfig,
    schedule: &str,
    m: usize,
) -> (RunSummary, RunSummary) {
    let staged = run(&PretrainConfig {
        parallel: pipelined(layout.clone(), schedule, m),
        ..base.clone()
    })
    .unwrap();
    let unstaged = run(&PretrainConfig {
        accum: m,
        parallel: layout,
        ..base.clone()
    })
    .unwrap();
    (staged, unstaged)
}

/// Context parallelism inside pipeline stages, ranks as threads: cp 2 × pp 2 (1F1B, ring,
/// balanced), cp 2 × pp 2 with re-materialised stages (the all-gather rotation, plain layout)
/// and dp 2 × cp 2 × pp 2 with FSDP over dp × cp (ZB-H1, 8 ranks) follow the same layout
/// without stages (the same micro-batches accumulated) within 1e-5 — every loss, validation
/// loss and parameter — and one rank within 1e-4 (ring attention merges its blocks in another
/// order, as in `context_parallel_runs_match_one_rank`). The stage group's backward passes take
/// the process-wide turn (`pipeline::turns`): without it these runs deadlocked in Burn 0.21's
/// end-of-backward cleanup.
#[test]
fn context_parallel_inside_pipeline_stages_matches_one_rank() {
    use wildfire::parallel::{CpLayout, CpRotate};
    let base = PretrainConfig {
        batch_size: 8,
        eval_every: 2,
        ..small(4)
    };
    use FsdpStrategy::{FullShard, NoShard};
    // (schedule, dp, strategy, layout, rotation, recompute)
    let cases = [
        (
            "1f1b",
            1,
            NoShard,
            CpLayout::Balanced,
            CpRotate::Ring,
            Recompute::None,
        ),
        (
            "1f1b",
            1,
            NoShard,
            CpLayout::Plain,
            CpRotate::AllGather,
            Recompute::Full,
        ),
        (
            "zb",
            2,
            FullShard,
            CpLayout::Balanced,
            CpRotate::Ring,
            Recompute::None,
        ),
    ];
    let m = 2;
    let mut references = std::collections::HashMap::new();
    for (schedule, dp, fsdp, cp_layout, cp_rotate, recompute) in cases {
        let layout = ParallelConfig {
            dp,
            cp: 2,
            fsdp,
            cp_layout,
            cp_rotate,
            recompute,
            ..ParallelConfig::default()
        };
        let what =
            format!("{schedule} dp={dp} cp=2 pp=2 {fsdp:?} {cp_layout} {cp_rotate} {recompute:?}");
        let (got, unpipelined) = with_and_without_stages(&base, layout, schedule, m);
        same_run(&what, &got, &unpipelined, 1e-5);
        let one = accumulating(&mut references, &base, dp * m);
        same_run(&format!("{what} vs one rank"), &got, one, 1e-4);
    }
}

/// Dropout inside pipeline stages draws the masks one device draws (seeded by step, first row
/// and block index), also when each stage's forward runs again in its backward
/// (`--recompute full`: re-materialisation): 1F1B and ZB-H1 with dropout 0.1, with and without,
/// against one rank within 1e-5; re-materialised, each schedule holds fewer peak bytes.
#[test]
fn pipeline_dropout_matches_one_rank() {
    let base = four_layers_with_dropout();
    let expected = run(&PretrainConfig {
        accum: 4,
        ..base.clone()
    })
    .unwrap();
    let peak = |r: &RunSummary| r.steps.iter().map(|m| m.peak_bytes).max().unwrap();
    for schedule in ["1f1b", "zb"] {
        let mut peaks = Vec::new();
        for recompute in [Recompute::None, Recompute::Full] {
            let got = run(&PretrainConfig {
                parallel: ParallelConfig {
                    pp: 2,
                    pp_schedule: schedule.into(),
                    microbatches: 4,
                    recompute,
                    ..ParallelConfig::default()
                },
                ..base.clone()
            })
            .unwrap();
            same_run(
                &format!("{schedule} dropout {recompute:?}"),
                &got,
                &expected,
                1e-5,
            );
            peaks.push(peak(&got));
        }
        assert!(
            peaks[1] < peaks[0],
            "{schedule}: peak bytes kept, re-materialised: {peaks:?}"
        );
    }
    // The masks are drawn (the runs part from the one without dropout).
    let without = run(&PretrainConfig {
        model: ModelFlags {
            dropout: 0.0,
            ..base.model.clone()
        },
        accum: 4,
        ..base.clone()
    })
    .unwrap();
    assert_ne!(losses(&without), losses(&expected));
}

/// Recomputation inside pipeline stages, with dropout 0.1 (recomputed regions replay their
/// masks): `--recompute selective` (the attention core) and `every-2` (block regions that the
/// micro-batch's backward action runs again) on 1F1B, ZB-H1 and interleaved give one rank's run
/// within 1e-5, and every-2 holds fewer activation bytes than keeping everything. On
/// dp 2 × pp 2 × tp 2 with FullShard (a backward's passes take turns with the other stage
/// groups) every-2 matches the same layout without the pipeline within 1e-5. A text sampled at
/// the end through the stages (`--sample-tokens`) is one rank's text. Under ZB-H1 the step
/// record counts the weight gradients deferred into the weight passes (the second stage's: the
/// first runs whole backwards), above zero and the same every step; 1F1B and interleaved defer
/// none.
#[test]
fn pipeline_stages_recompute_as_one_device() {
    let base = four_layers_with_dropout();
    let expected = run(&PretrainConfig {
        accum: 4,
        sample_tokens: 24,
        ..base.clone()
    })
    .unwrap();
    assert!(expected.sample.chars().count() > 1, "no text sampled");
    let pipelined = |schedule: &str, virt: usize, recompute: Recompute| PretrainConfig {
        parallel: ParallelConfig {
            pp: 2,
            pp_schedule: schedule.into(),
            pp_virtual: virt,
            microbatches: 4,
            recompute,
            ..ParallelConfig::default()
        },
        ..base.clone()
    };
    let kept = run(&pipelined("1f1b", 1, Recompute::None)).unwrap();
    for (schedule, virt) in [("1f1b", 1), ("zb", 1), ("interleaved", 2)] {
        for recompute in [Recompute::Selective, Recompute::EveryNth(2)] {
            let got = run(&PretrainConfig {
                sample_tokens: 24,
                ..pipelined(schedule, virt, recompute)
            })
            .unwrap();
            let what = format!("{schedule} {recompute:?}");
            same_run(&what, &got, &expected, 1e-5);
            assert_eq!(got.sample, expected.sample, "{what}: sampled text");
            // The step record counts the weight gradients ZB-H1 deferred from its backward
            // passes into its weight passes, the same every step; the others defer none.
            let deferred: Vec<u64> = got.steps.iter().map(|m| m.deferred_weight_grads).collect();
            if schedule == "zb" {
                assert!(
                    deferred[0] > 0 && deferred.iter().all(|&d| d == deferred[0]),
                    "{what}: {deferred:?}"
                );
            } else {
                assert!(deferred.iter().all(|&d| d == 0), "{what}: {deferred:?}");
            }
            if recompute == Recompute::EveryNth(2) && schedule == "1f1b" {
                let peak = |r: &RunSummary| r.steps.iter().map(|m| m.peak_bytes).max().unwrap();
                assert!(
                    peak(&got) < peak(&kept),
                    "{what}: peak {} bytes, {} keeping every activation",
                    peak(&got),
                    peak(&kept)
                );
            }
        }
    }
    // 8 ranks: dp 2 × pp 2 × tp 2, FullShard, every-2, against the same layout unpipelined
    // with every-2 too, collectives overlapped.
    let layout = ParallelConfig {
        dp: 2,
        tp: 2,
        fsdp: FsdpStrategy::FullShard,
        ..ParallelConfig::default()
    };
    let unpipelined = run(&PretrainConfig {
        accum: 2,
        parallel: ParallelConfig {
            recompute: Recompute::EveryNth(2),
            ..layout.clone()
        },
        ..base.clone()
    })
    .unwrap();
    let got = run(&PretrainConfig {
        parallel: ParallelConfig {
            pp: 2,
            pp_schedule: "zb".into(),
            microbatches: 2,
            recompute: Recompute::EveryNth(2),
            ..layout
        },
        ..base
    })
    .unwrap();
    same_run("dp2 pp2 tp2 FullShard every-2", &got, &unpipelined, 1e-5);
    assert!(got.steps.iter().all(|m| m.deferred_weight_grads > 0));
    assert!(
        unpipelined
            .steps
            .iter()
            .all(|m| m.deferred_weight_grads == 0)
    );
}

/// Recomputation with gradient accumulation, dropout on: every policy gives bitwise the losses
/// and gradient norms of no recomputation, on one rank and on dp 2 × tp 2 with FullShard and
/// overlapped collectives, run after run. (A micro-batch's recomputed regions outlive its main
/// backward; built on the parameters' leaves that the previous micro-batch's backward had
/// reached, Burn's cleanup sometimes freed the graph under the first region, and the
/// embeddings lost that micro-batch's gradient: each micro-batch now gets fresh leaves.)
#[test]
fn recompute_with_accumulation_is_bitwise_no_recompute() {
    let base = PretrainConfig {
        model: ModelFlags {
            n_layer: Some(4),
            dropout: 0.1,
            ..small(3).model
        },
        batch_size: 8,
        accum: 2,
        ..small(3)
    };
    let with = |recompute: Recompute, parallel: &ParallelConfig| PretrainConfig {
        parallel: ParallelConfig {
            recompute,
            ..parallel.clone()
        },
        ..base.clone()
    };
    let bits_of = |r: &RunSummary| {
        r.steps
            .iter()
            .map(|m| (m.loss.to_bits(), m.grad_norm.to_bits()))
            .collect::<Vec<_>>()
    };
    let sharded = ParallelConfig {
        dp: 2,
        tp: 2,
        fsdp: FsdpStrategy::FullShard,
        ..ParallelConfig::default()
    };
    for parallel in [ParallelConfig::default(), sharded] {
        let expected = bits_of(&run(&with(Recompute::None, &parallel)).unwrap());
        for policy in [
            Recompute::Full,
            Recompute::Full,
            Recompute::Full,
            Recompute::Full,
            Recompute::EveryNth(2),
            Recompute::Selective,
        ] {
            let got = bits_of(&run(&with(policy, &parallel)).unwrap());
            assert_eq!(
                got, expected,
                "{policy:?} dp {} tp {}",
                parallel.dp, parallel.tp
            );
        }
    }
}

/// Sequence parallelism inside pipeline stages: pp 2 × tp 2 with `--sp` (1F1B; ZB-H1 on
/// dp 2 × pp 2 × tp 2 with FullShard) matches the same layout without the pipeline within
/// 1e-5 and one rank within 1e-4. An activation travels as each tensor-parallel rank's
/// sequence shard: per step the first stage's rank sends exactly half the activation bytes it
/// sends without `--sp`, with the same headers.
#[test]
fn pipeline_stages_with_sequence_parallelism() {
    let base = PretrainConfig {
        model: ModelFlags {
            n_layer: Some(4),
            ..small(6).model
        },
        batch_size: 8,
        ..small(6)
    };
    let one_rank = run(&PretrainConfig {
        accum: 4,
        ..base.clone()
    })
    .unwrap();
    let mut sent = Vec::new();
    for (schedule, dp, m, fsdp) in [
        ("1f1b", 1, 4, FsdpStrategy::NoShard),
        ("zb", 2, 2, FsdpStrategy::FullShard),
    ] {
        for sp in [true, false] {
            let layout = ParallelConfig {
                dp,
                tp: 2,
                sp,
                fsdp,
                ..ParallelConfig::default()
            };
            let got = run(&PretrainConfig {
                parallel: pipelined(layout.clone(), schedule, m),
                ..base.clone()
            })
            .unwrap();
            let what = format!("{schedule} dp={dp} sp={sp}");
            if sp {
                let unpipelined = run(&PretrainConfig {
                    accum: m,
                    parallel: layout,
                    ..base.clone()
                })
                .unwrap();
                same_run(&what, &got, &unpipelined, 1e-5);
                same_run(&format!("{what} vs one rank"), &got, &one_rank, 1e-4);
            }
            let bytes: Vec<u64> = got.steps.iter().map(|s| s.p2p_sent_bytes).collect();
            assert!(bytes.iter().all(|&b| b == bytes[0]), "{what}: {bytes:?}");
            sent.push((what, m, bytes[0]));
        }
    }
    // Rank 0 (stage 0) sends one activation per micro-batch, rows × block × n_embd f32s, which
    // the sequence split halves; its headers and the tied table's gradient exchange are the same
    // with and without.
    for pair in sent.chunks(2) {
        let [(what, m, with_sp), (_, _, without)] = pair else {
            unreachable!()
        };
        let rows = 8 / (if what.contains("dp=2") { 2 } else { 1 } * m);
        let activation = (rows * 32 * 32 * 4) as u64;
        let m = *m as u64;
        assert_eq!(without - with_sp, m * activation / 2, "{what}");
        assert!(*with_sp >= m * activation / 2, "{what}: {with_sp}");
    }
}

/// Checkpoints of pipelined runs hold the whole model under its own names: a dp 2 × pp 2 (ZB-H1,
/// ZeRO-1) run saved at step 4 and resumed the same way continues bitwise as the uninterrupted
/// run; resumed on one rank without a pipeline, and a one-rank checkpoint resumed as
/// pp 2 × tp 2 interleaved, they follow the uninterrupted runs within 1e-5 (tp: 1e-4).
#[test]
fn pipelined_checkpoints_resume_on_any_layout() {
    let base = PretrainConfig {
        model: ModelFlags {
            n_layer: Some(4),
            ..small(8).model
        },
        batch_size: 8,
        ..small(8)
    };
    let pipelined = ParallelConfig {
        dp: 2,
        fsdp: FsdpStrategy::ShardOptimizer,
        pp: 2,
        pp_schedule: "zb".into(),
        microbatches: 2,
        ..ParallelConfig::default()
    };
    let straight = run(&PretrainConfig {
        parallel: pipelined.clone(),
        ..base.clone()
    })
    .unwrap();
    let dir = scratch("pp-resume");
    let first = run(&PretrainConfig {
        parallel: pipelined.clone(),
        save: Some(dir.clone()),
        steps: 4,
        ..base.clone()
    })
    .unwrap();
    let resumed = run(&PretrainConfig {
        parallel: pipelined.clone(),
        resume: Some(dir.clone()),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(resumed.steps[0].step, 4);
    assert_eq!(
        bits(&resumed_losses(&first, &resumed)),
        bits(&losses(&straight)),
        "pipelined resume"
    );
    same_bits(
        "pipelined resume",
        &resumed.parameters,
        &straight.parameters,
    );
    // The same checkpoint on one rank, no pipeline: 4 micro-batches of 2 rows accumulated.
    let one_rank = run(&PretrainConfig {
        accum: 4,
        resume: Some(dir.clone()),
        ..base.clone()
    })
    .unwrap();
    same_run("pp checkpoint on one rank", &one_rank, &resumed, 1e-5);
    // A one-rank checkpoint resumed as pp 2 × tp 2, interleaved.
    let dir = scratch("pp-resume-from-one");
    let whole = run(&PretrainConfig {
        accum: 2,
        ..base.clone()
    })
    .unwrap();
    run(&PretrainConfig {
        accum: 2,
        save: Some(dir.clone()),
        steps: 4,
        ..base.clone()
    })
    .unwrap();
    let onto_pp = run(&PretrainConfig {
        parallel: ParallelConfig {
            tp: 2,
            pp: 2,
            pp_schedule: "interleaved".into(),
            pp_virtual: 2,
            microbatches: 2,
            ..ParallelConfig::default()
        },
        resume: Some(dir.clone()),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(onto_pp.steps[0].step, 4);
    let tail = RunSummary {
        steps: whole.steps[4..].to_vec(),
        ..whole.clone()
    };
    same_run("one-rank checkpoint on pp 2 x tp 2", &onto_pp, &tail, 1e-4);
}

/// Pipeline settings that cannot be, and splits that cannot be, are refused before a step.
#[test]
fn pipeline_refusals_are_typed_errors() {
    let pp = |f: &dyn Fn(&mut ParallelConfig)| {
        let mut parallel = ParallelConfig {
            pp: 2,
            microbatches: 2,
            ..ParallelConfig::default()
        };
        f(&mut parallel);
        PretrainConfig {
            parallel,
            batch_size: 4,
            ..small(2)
        }
    };
    let refused = |config: PretrainConfig, words: &str| {
        let err = run(&config).unwrap_err();
        assert!(err.to_string().contains(words), "{words}: {err}");
    };
    refused(pp(&|p| p.sp = true), "it needs --tp 2");
    refused(
        pp(&|p| p.pp_schedule = "2f2b".into()),
        "unknown pipeline schedule",
    );
    refused(pp(&|p| p.microbatches = 3), "--microbatches 3");
    refused(
        PretrainConfig {
            accum: 2,
            ..pp(&|_| {})
        },
        "--microbatches instead",
    );
    // 2 blocks cannot fill 4 stages (pp 2 × 2 chunks).
    let err = run(&pp(&|p| {
        p.pp_schedule = "interleaved".into();
        p.pp_virtual = 2;
    }))
    .unwrap_err();
    assert!(
        matches!(
            err,
            PretrainError::Parallel(wildfire::parallel::Error::InvalidStagePlan(_))
        ),
        "{err}"
    );
}

/// [`small`] with 4 layers, dropout 0.1 and 8 sequences a step, for 6 steps.
fn four_layers_with_dropout() -> PretrainConfig {
    PretrainConfig {
        model: ModelFlags {
            n_layer: Some(4),
            dropout: 0.1,
            ..small(6).model
        },
        batch_size: 8,
        ..small(6)
    }
}

/// The memory estimate's parameter, gradient and optimizer bytes are pipeline rank 0's
/// accounting: its stages' blocks and the token table (not the last stage's final norm, nor its
/// copy of the tied table), under pp 2, pp 2 × dp 2 ZeRO-1, pp 2 × tp 2, interleaved pp 2 × 2
/// virtual stages (rank 0 holds stages 0 and 2 of 4), pp 2 × cp 2, pp 2 × dp 2 × cp 2 with FSDP
/// over dp × cp, and a Llama in two stages.
#[test]
fn pipeline_memory_estimate_is_rank_zeros_accounting() {
    let pp = |dp, tp, fsdp, virtual_stages| {
        two_stages(ParallelConfig::layout(dp, tp, fsdp, None), virtual_stages)
    };
    let mut four = small(1);
    four.model.n_layer = Some(4);
    estimate_matches_the_accounting_on(
        &four,
        &[
            pp(1, 1, FsdpStrategy::NoShard, 1),
            pp(2, 1, FsdpStrategy::ShardOptimizer, 1),
            pp(1, 2, FsdpStrategy::NoShard, 1),
            pp(1, 1, FsdpStrategy::NoShard, 2),
            ParallelConfig {
                cp: 2,
                ..pp(1, 1, FsdpStrategy::NoShard, 1)
            },
            ParallelConfig {
                cp: 2,
                ..pp(2, 1, FsdpStrategy::FullShard, 1)
            },
        ],
    );
    let llama = PretrainConfig {
        model: wildfire::models::ModelFlags {
            preset: wildfire::models::Preset::LlamaTiny,
            ..PretrainConfig::quiet().model
        },
        ..small(1)
    };
    estimate_matches_the_accounting_on(&llama, &[pp(1, 1, FsdpStrategy::NoShard, 1)]);
}
