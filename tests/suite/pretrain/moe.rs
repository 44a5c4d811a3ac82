//! A mixture-of-experts Llama through the pretraining driver: sharded runs follow one rank (the
//! experts FSDP-sharded over dp, split over tp, recomputed), the routers' global counts are the
//! same whatever the layout, the memory estimate is the accounting, a checkpoint resumes
//! bitwise, and bad flags are refused before any work.

use super::*;
use wildfire::models::{ModelConfig, MoeFlags};

/// A CI-sized Llama whose two blocks are both mixtures of 4 experts (width 32, top-2,
/// dropless) on the embedded corpus: width 32, context 32.
fn tiny_moe(steps: usize) -> PretrainConfig {
    PretrainConfig {
        model: ModelFlags {
            preset: Preset::LlamaTiny,
            n_kv_head: Some(2),
            n_head: Some(4),
            moe: MoeFlags {
                experts: Some(4),
                top_k: Some(2),
                moe_every: Some(1),
                expert_hidden: Some(32),
                ..MoeFlags::default()
            },
            ..small(steps).model
        },
        ..small(steps)
    }
}

/// The routers' counts over the global batch: every step, every block.
fn routed(r: &RunSummary) -> Vec<(Vec<Vec<u64>>, Vec<u64>)> {
    r.steps
        .iter()
        .map(|m| {
            let router = m
                .router
                .as_ref()
                .expect("a mixture of experts reports its router");
            (router.tokens_per_expert.clone(), router.dropped.clone())
        })
        .collect()
}

/// `got`'s routers did what `reference`'s did: the same counts every step, and every step's
/// auxiliary loss within 1e-5.
fn same_routing(what: &str, got: &RunSummary, reference: &RunSummary) {
    assert_eq!(
        routed(got),
        routed(reference),
        "{what}: the routers' counts"
    );
    for (a, b) in crate::suite::pairs(&got.steps, &reference.steps) {
        let (x, y) = (a.router.as_ref().unwrap(), b.router.as_ref().unwrap());
        assert!(
            (x.aux_loss - y.aux_loss).abs() <= 1e-5 * y.aux_loss,
            "{what}: aux loss {} vs {}",
            x.aux_loss,
            y.aux_loss
        );
    }
}

/// The load-balancing loss (and a capacity) is computed per micro-batch on each rank, as
/// Switch and Megatron-Core do, so a run at dp N is the one-rank run accumulating N
/// micro-batches of the same rows, and tp (whose ranks route the same tokens) the one-rank run.
/// Against those: dp 2 FullShard (the experts sharded over the data ranks), dp 2 × tp 2
/// FullShard with full recomputation, and tp 2 (every expert split as the dense MLP is, the
/// router replicated) — losses, validation losses, gradient norms, every parameter within 1e-5,
/// the auxiliary losses reaching the router through backward in each. The routers' counts over
/// the global batch are the reference's (the sum over data ranks, tp peers counted once):
/// `b·t·k` assignments per block and step, none dropped.
#[test]
fn moe_llama_sharded_runs_match_one_rank() {
    let base = PretrainConfig {
        gather_parameters: true,
        ..tiny_moe(5)
    };
    let one = run(&base).unwrap();
    let Some(ModelConfig::Llama(c)) = &one.model else {
        panic!("a Llama");
    };
    assert_eq!(c.moe.as_ref().map(|m| m.config.experts), Some(4));
    for (blocks, dropped) in &routed(&one) {
        assert_eq!(blocks.len(), 2, "both blocks are mixtures of experts");
        for b in blocks {
            assert_eq!(
                b.iter().sum::<u64>(),
                4 * 32 * 2,
                "b·t·k assignments per block"
            );
        }
        assert_eq!(dropped, &vec![0, 0], "dropless");
    }
    let aux = one.steps[0].router.as_ref().unwrap().aux_loss;
    // Two blocks of Switch's loss at 0.01 (1 when balanced, up to E) and the z-loss.
    assert!(aux > 0.019 && aux < 0.1, "aux loss {aux}");
    let accumulated = run(&PretrainConfig {
        accum: 2,
        ..base.clone()
    })
    .unwrap();
    let layouts = [
        (
            "dp 2 FullShard",
            ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
            &accumulated,
        ),
        (
            "dp 2 x tp 2 FullShard, full recompute",
            ParallelConfig {
                recompute: Recompute::Full,
                ..ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None)
            },
            &accumulated,
        ),
        (
            "tp 2",
            ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None),
            &one,
        ),
    ];
    for (what, parallel, reference) in layouts {
        let many = run(&PretrainConfig {
            parallel,
            ..base.clone()
        })
        .unwrap();
        same_run(what, &many, reference, 1e-5);
        same_routing(what, &many, reference);
    }
}

/// Pipeline stages (pp 2, 1F1B, 4 micro-batches; the plain run, and rematerialised stages)
/// follow one rank accumulating the same 4 micro-batches: every loss, the validation losses
/// and every parameter within 1e-5 — each stage's auxiliary losses weighted by the loss scale
/// over the micro-batches — and the routers' counts and auxiliary loss (each block's on its
/// stage's ranks) are the reference's. Expert parallelism inside the stages, ranks as threads:
/// dp 2 = ep 2 × pp 2 (DDP, 4 micro-batches) and dp 4 = ep 2 × dp 2 × pp 2 (FullShard, ZB-H1,
/// 2 micro-batches; 8 ranks) follow one rank accumulating the same 8 micro-batches the same way (the stage group's
/// backward passes, whose all-to-alls wait on the expert peers, take the process-wide turn of
/// `pipeline::turns`).
#[test]
fn moe_llama_pipeline_stages_match_one_rank() {
    let base = PretrainConfig {
        batch_size: 8,
        ..tiny_moe(4)
    };
    let mut references = std::collections::HashMap::new();
    use FsdpStrategy::{FullShard, NoShard};
    // (schedule, micro-batches, dp, ep, strategy, recompute)
    let cases = [
        ("1f1b", 4, 1, 1, NoShard, Recompute::None),
        ("1f1b", 4, 1, 1, NoShard, Recompute::Full),
        ("1f1b", 4, 2, 2, NoShard, Recompute::None),
        ("zb", 2, 4, 2, FullShard, Recompute::None),
    ];
    for (schedule, m, dp, ep, fsdp, recompute) in cases {
        let what = format!("{schedule} pp 2 M {m} dp {dp} ep {ep} {fsdp:?} {recompute:?}");
        let layout = ParallelConfig {
            recompute,
            ..with_ep(dp, ep, fsdp)
        };
        let got = run(&PretrainConfig {
            parallel: pipelined(layout, schedule, m),
            ..base.clone()
        })
        .unwrap();
        let one = accumulating(&mut references, &base, dp * m);
        same_run(&what, &got, one, 1e-5);
        same_routing(&what, &got, one);
    }
}

/// Experts no token of a rank chose still take part (an empty group of the grouped matmul,
/// their gradients zero): every rank makes the same gathers and reductions in the same order.
/// 16 experts, top-1, where the untrained router
/// leaves experts idle: DDP (gradient buckets) and FSDP at dp 2 follow one rank accumulating the
/// same micro-batches within 1e-5.
#[test]
fn moe_idle_experts_keep_the_ranks_in_step() {
    let base = PretrainConfig {
        model: ModelFlags {
            moe: MoeFlags {
                experts: Some(16),
                top_k: Some(1),
                ..tiny_moe(3).model.moe
            },
            ..tiny_moe(3).model
        },
        ..tiny_moe(3)
    };
    let reference = run(&PretrainConfig {
        accum: 2,
        ..base.clone()
    })
    .unwrap();
    let idle = routed(&reference)
        .iter()
        .flat_map(|(blocks, _)| blocks.iter().flatten())
        .filter(|&&c| c == 0)
        .count();
    assert!(idle > 0, "some expert got no token at all");
    for fsdp in [FsdpStrategy::NoShard, FsdpStrategy::FullShard] {
        let many = run(&PretrainConfig {
            parallel: ParallelConfig::layout(2, 1, fsdp, None),
            ..base.clone()
        })
        .unwrap();
        same_run(
            &format!("idle experts, dp 2 {fsdp:?}"),
            &many,
            &reference,
            1e-5,
        );
    }
}

/// With a capacity factor, tokens past an expert's capacity are dropped (counted), and tp 2
/// (whose ranks route the same tokens) still follows one rank. Without the auxiliary losses
/// (coefficients 0) the run differs: they reach the parameters.
#[test]
fn moe_capacity_drops_and_the_auxiliary_losses_train() {
    let capped = |aux: f64, parallel: ParallelConfig| PretrainConfig {
        parallel,
        model: ModelFlags {
            moe: MoeFlags {
                capacity_factor: Some(1.0),
                aux_loss_coef: Some(aux),
                z_loss_coef: Some(aux / 10.0),
                ..tiny_moe(4).model.moe
            },
            ..tiny_moe(4).model
        },
        ..tiny_moe(4)
    };
    let one = run(&capped(0.01, ParallelConfig::default())).unwrap();
    let dropped: u64 = routed(&one).iter().flat_map(|(_, d)| d.iter()).sum();
    assert!(dropped > 0, "a capacity factor of 1 drops some assignments");
    let tp = run(&capped(
        0.01,
        ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None),
    ))
    .unwrap();
    same_run("capacity 1, tp 2", &tp, &one, 1e-5);
    assert_eq!(routed(&tp), routed(&one));
    let off = run(&capped(0.0, ParallelConfig::default())).unwrap();
    assert_eq!(off.steps[0].router.as_ref().unwrap().aux_loss, 0.0);
    // The first step's loss is the model's alone either way; the updates differ.
    assert_eq!(off.steps[0].loss, one.steps[0].loss);
    let moved = crate::suite::pairs(&one.parameters, &off.parameters).any(|(a, b)| a != b);
    assert!(moved, "the auxiliary losses change the parameters");
}

/// The memory estimate's parameter, gradient and optimizer bytes are the decorator's
/// accounting for the mixture of experts too: DDP, ZeRO-2, FSDP, tp 2 and dp 2 × tp 2.
#[test]
fn moe_memory_estimate_equals_the_accounting() {
    estimate_matches_the_accounting(&tiny_moe(1));
}

/// Saved at step 2 under dp 2 FullShard and resumed to step 4, the run is bitwise the
/// uninterrupted one (experts, router and optimizer state under their global names).
#[test]
fn moe_llama_resumes_bitwise() {
    let fsdp = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
    let straight = run(&PretrainConfig {
        parallel: fsdp.clone(),
        ..tiny_moe(4)
    })
    .unwrap();
    let dir = scratch("moe-resume");
    run(&PretrainConfig {
        parallel: fsdp.clone(),
        save: Some(dir.clone()),
        ..tiny_moe(2)
    })
    .unwrap();
    let resumed = run(&PretrainConfig {
        parallel: fsdp,
        resume: Some(dir.clone()),
        ..tiny_moe(4)
    })
    .unwrap();
    let tail = &straight.steps[2..];
    assert_eq!(resumed.steps.len(), tail.len());
    for (a, b) in crate::suite::pairs(&resumed.steps, tail) {
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
        assert_eq!(a.router, b.router, "step {}", a.step);
    }
    same_bits("moe resume", &resumed.parameters, &straight.parameters);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The error a run of `config` is refused with (a configuration error's message, or any
/// other error's text); a run that starts is a failure.
fn refused(config: PretrainConfig) -> String {
    match run(&config) {
        Err(PretrainError::Config(msg)) => msg,
        Err(other) => other.to_string(),
        Ok(_) => panic!("not refused"),
    }
}

/// Refused before any work, each a typed configuration error naming the flag: top-k above the
/// experts, `--moe-every` past the blocks, a refinement without `--experts` on a dense preset,
/// `--experts` on a GPT, and a Hugging Face export of a mixture of experts Mixtral's files
/// cannot hold (shared experts).
#[test]
fn moe_refusals_are_typed() {
    let with = |moe: MoeFlags| PretrainConfig {
        model: ModelFlags {
            moe,
            ..tiny_moe(1).model
        },
        ..tiny_moe(1)
    };
    let e = refused(with(MoeFlags {
        top_k: Some(5),
        ..tiny_moe(1).model.moe
    }));
    assert!(e.contains("top-k 5 over 4 experts"), "{e}");
    let e = refused(with(MoeFlags {
        moe_every: Some(3),
        ..tiny_moe(1).model.moe
    }));
    assert!(e.contains("--moe-every 3 over 2 blocks"), "{e}");
    let e = refused(with(MoeFlags {
        top_k: Some(1),
        ..MoeFlags::default()
    }));
    assert!(e.contains("without --experts"), "{e}");
    let e = refused(PretrainConfig {
        model: ModelFlags {
            moe: MoeFlags {
                experts: Some(4),
                ..MoeFlags::default()
            },
            ..small(1).model
        },
        ..small(1)
    });
    assert!(e.contains("--experts") && e.contains("Llama"), "{e}");
    // Hugging Face files hold a mixture of experts as Mixtral's: every block one, no shared
    // experts.
    let dir = scratch("moe-export");
    let e = refused(PretrainConfig {
        export_hf: Some(dir.join("model.safetensors")),
        save: Some(dir.clone()),
        ..with(MoeFlags {
            shared_experts: Some(1),
            ..tiny_moe(1).model.moe
        })
    });
    assert!(
        e.contains("read as Mixtral's") && e.contains("1 shared"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dp` data-parallel ranks, `ep` of them an expert axis, `fsdp` over them.
fn with_ep(dp: usize, ep: usize, fsdp: FsdpStrategy) -> ParallelConfig {
    ParallelConfig {
        ep,
        ..ParallelConfig::layout(dp, 1, fsdp, None)
    }
}

/// Expert parallelism follows one rank accumulating the same micro-batches (so it is the run at
/// ep 1 on the same data ranks): ep 2 from dp 2 (DDP), ep 2 × dp 2 FullShard (the experts'
/// halves FSDP-sharded over the remaining data ranks), ep 4 from dp 4 under ZeRO-2 and under
/// FullShard with full recomputation, and ep 1 at dp 4 FullShard — dropless, and with a
/// capacity factor of 1 (assignments dropped, per rank as at ep 1) — losses, validation
/// losses, gradient norms and every parameter within 1e-5, the routers' counts and auxiliary
/// losses the reference's.
#[test]
fn moe_expert_parallel_runs_match_one_rank() {
    for capacity in [None, Some(1.0)] {
        let base = PretrainConfig {
            gather_parameters: true,
            batch_size: 8,
            model: ModelFlags {
                moe: MoeFlags {
                    capacity_factor: capacity,
                    ..tiny_moe(3).model.moe
                },
                ..tiny_moe(3).model
            },
            ..tiny_moe(3)
        };
        let accumulated = |accum: usize| {
            run(&PretrainConfig {
                accum,
                ..base.clone()
            })
            .unwrap()
        };
        let (two, four) = (accumulated(2), accumulated(4));
        if capacity.is_some() {
            let dropped: u64 = routed(&four).iter().flat_map(|(_, d)| d.iter()).sum();
            assert!(dropped > 0, "a capacity factor of 1 drops some assignments");
        }
        use FsdpStrategy::{FullShard, NoShard, ShardGradOp};
        let layouts = [
            ("dp 2 = ep 2, DDP", with_ep(2, 2, NoShard), &two),
            (
                "dp 4 = ep 2 x dp 2, FullShard",
                with_ep(4, 2, FullShard),
                &four,
            ),
            ("dp 4 = ep 4, ZeRO-2", with_ep(4, 4, ShardGradOp), &four),
            (
                "dp 4 = ep 4, FullShard, full recompute",
                ParallelConfig {
                    recompute: Recompute::Full,
                    ..with_ep(4, 4, FullShard)
                },
                &four,
            ),
            ("dp 4, ep 1, FullShard", with_ep(4, 1, FullShard), &four),
        ];
        for (what, parallel, reference) in layouts {
            let what = format!("{what}, capacity {capacity:?}");
            let got = run(&PretrainConfig {
                parallel,
                ..base.clone()
            })
            .unwrap();
            same_run(&what, &got, reference, 1e-5);
            same_routing(&what, &got, reference);
        }
    }
}

/// Expert and context parallelism together: dp 2 = ep 2 × cp 2, FullShard, follows dp 2 × cp 2
/// without an expert axis (each rank routes the same chunks of the same rows either way, its
/// balancing loss over them) within 1e-5: losses, every parameter, the routers' counts.
#[test]
fn moe_expert_parallel_composes_with_context_parallel() {
    let base = PretrainConfig {
        gather_parameters: true,
        batch_size: 4,
        ..tiny_moe(3)
    };
    let at = |ep: usize| PretrainConfig {
        parallel: ParallelConfig {
            cp: 2,
            ..with_ep(2, ep, FsdpStrategy::FullShard)
        },
        ..base.clone()
    };
    let (reference, got) = (run(&at(1)).unwrap(), run(&at(2)).unwrap());
    same_run("dp 2 = ep 2, cp 2", &got, &reference, 1e-5);
    same_routing("dp 2 = ep 2, cp 2", &got, &reference);
}

/// The stacked expert weights are checkpointed whole under their global names: a run saved at
/// step 2 resumes to step 4 at another expert-parallel degree (ep 1 → 2, 2 → 4, 4 → 1, all
/// over dp 4 FullShard) and follows the uninterrupted run within 1e-5 (losses and every
/// parameter).
#[test]
fn moe_resumes_across_expert_parallel_degrees() {
    let at = |ep: usize, steps: usize| PretrainConfig {
        gather_parameters: true,
        batch_size: 8,
        parallel: with_ep(4, ep, FsdpStrategy::FullShard),
        ..tiny_moe(steps)
    };
    let straight = run(&at(1, 4)).unwrap();
    for (from, to) in [(1, 2), (2, 4), (4, 1)] {
        let what = format!("saved at ep {from}, resumed at ep {to}");
        let dir = scratch(&format!("moe-ep-{from}-{to}"));
        run(&PretrainConfig {
            save: Some(dir.clone()),
            ..at(from, 2)
        })
        .unwrap();
        let resumed = run(&PretrainConfig {
            resume: Some(dir.clone()),
            ..at(to, 4)
        })
        .unwrap();
        let tail = &straight.steps[2..];
        assert_eq!(resumed.steps.len(), tail.len(), "{what}");
        losses_close(&what, &resumed.steps, tail, 1e-5);
        tensors_close(&what, &resumed.parameters, &straight.parameters, 1e-5);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The memory estimate's parameter, gradient and optimizer bytes are the accounting under
/// expert parallelism: ep 2 from dp 2 (DDP, ZeRO-1), ep 2 × dp 2 FullShard, ep 4 ZeRO-2, and
/// ep 2 × dp 2 FullShard inside two pipeline stages (pipeline rank 0's share).
#[test]
fn moe_expert_parallel_memory_estimate_equals_the_accounting() {
    use FsdpStrategy::{FullShard, NoShard, ShardGradOp, ShardOptimizer};
    let base = PretrainConfig {
        batch_size: 8,
        ..tiny_moe(1)
    };
    estimate_matches_the_accounting_on(
        &base,
        &[
            with_ep(2, 2, NoShard),
            with_ep(2, 2, ShardOptimizer),
            with_ep(4, 2, FullShard),
            with_ep(4, 4, ShardGradOp),
            ParallelConfig {
                pp: 2,
                microbatches: 2,
                ..with_ep(4, 2, FullShard)
            },
        ],
    );
}

/// `--ep` is refused before any work where it cannot split: not dividing `--dp`, on a model
/// without a mixture of experts, not dividing the experts, and with `--tp` or HSDP.
#[test]
fn expert_parallel_refusals_are_typed() {
    let on = |parallel: ParallelConfig| PretrainConfig {
        parallel,
        batch_size: 8,
        ..tiny_moe(1)
    };
    let e = refused(on(with_ep(4, 3, FsdpStrategy::NoShard)));
    assert!(e.contains("--ep 3") && e.contains("multiple"), "{e}");
    let e = refused(PretrainConfig {
        parallel: with_ep(2, 2, FsdpStrategy::NoShard),
        ..small(1)
    });
    assert!(e.contains("--ep 2") && e.contains("has none"), "{e}");
    let e = refused(PretrainConfig {
        model: ModelFlags {
            moe: MoeFlags {
                experts: Some(6),
                ..tiny_moe(1).model.moe
            },
            ..tiny_moe(1).model
        },
        ..on(with_ep(4, 4, FsdpStrategy::NoShard))
    });
    assert!(e.contains("does not divide the 6 experts"), "{e}");
    let e = refused(on(ParallelConfig {
        tp: 2,
        ..with_ep(2, 2, FsdpStrategy::NoShard)
    }));
    assert!(e.contains("--ep 2") && e.contains("--tp"), "{e}");
    let e = refused(on(ParallelConfig {
        dp_shard: Some(2),
        ..with_ep(4, 2, FsdpStrategy::Hybrid)
    }));
    assert!(e.contains("--ep 2") && e.contains("HSDP"), "{e}");
}
