//! Communication: installed device collectives, the trace, modelled links, FSDP prefetch and DDP
//! buckets — none of which changes a result.

use super::*;

/// What `--collectives nccl` does, exercised on CPU: a backend's launch support
/// (`DeviceLaunch`, NCCL on CUDA) installs device collectives on every rank — host-staged here —
/// and the run is bitwise the run without them, with every parameter gather and gradient
/// reduction passing through them. Asking for NCCL of a launch that does not offer it is a typed
/// error naming the build and flag that would.
#[test]
fn gpt_pretraining_through_installed_device_collectives_matches_bitwise() {
    use std::sync::{Arc, Mutex};
    use wildfire::parallel::{DeviceLaunch, DeviceMesh, DistDevice, HostStaged};
    use wildfire::pretrain::run_on_with;

    type F = burn::backend::Flex;

    /// NCCL's place in the launch, taken by host-staged collectives it keeps a hold on.
    #[derive(Default)]
    struct Staged(Mutex<Vec<Arc<HostStaged>>>);

    impl DeviceLaunch<F> for Staged {
        fn offers_nccl(&self) -> bool {
            true
        }

        fn install_nccl(&self, d: &DistDevice<F>) -> Result<(), wildfire::parallel::Error> {
            let staged = Arc::new(HostStaged::new(d.context().comm_arc()));
            d.context().set_device_collectives::<F>(staged.clone());
            self.0.lock().unwrap().push(staged);
            Ok(())
        }

        fn rendezvous<T>(
            &self,
            _: &DeviceMesh,
            _: &mut dyn FnMut(DistDevice<F>) -> T,
        ) -> Result<T, wildfire::parallel::Error> {
            unreachable!("ranks as threads")
        }
    }

    let config = PretrainConfig {
        parallel: ParallelConfig {
            dp: 2,
            tp: 2,
            fsdp: FsdpStrategy::FullShard,
            ..ParallelConfig::default()
        },
        ..small(3)
    };
    let plain = run(&config).unwrap();
    let support = Staged::default();
    let nccl = PretrainConfig {
        collectives: Collectives::Nccl,
        ..config.clone()
    };
    let staged = run_on_with::<F, _>(&nccl, &Default::default(), &support).unwrap();
    let installed = support.0.into_inner().unwrap();
    assert_eq!(installed.len(), 4);
    for collectives in &installed {
        let calls: u64 = collectives.calls().values().sum();
        assert!(calls > 25, "{:?}", collectives.calls());
    }
    for (a, b) in pairs(&plain.steps, &staged.steps) {
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
    }
    assert_eq!(plain.parameters, staged.parameters);

    let nccl = PretrainConfig {
        collectives: Collectives::Nccl,
        ..small(1)
    };
    let err = run(&nccl).unwrap_err();
    assert!(
        matches!(
            err,
            PretrainError::Parallel(wildfire::parallel::Error::Unsupported(_))
        ) && err.to_string().contains("--features cuda"),
        "{err}"
    );
}

/// `--trace`: a Chrome trace every rank's collectives are in, each a begin event at its issue and
/// an end event at its completion, one after another on the rank's thread; the bytes they carry
/// are exactly the steps' communication counters; forward, backward and optimizer regions per
/// step on every rank; the ranks ran the same collectives (SPMD); the tied embedding's table is
/// gathered three times a step, never for its gradient.
#[test]
fn the_trace_holds_every_collective_of_every_rank() {
    let dir = scratch("trace");
    let path = dir.join("trace.json");
    let summary = run(&PretrainConfig {
        parallel: ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        eval_iters: 0,
        trace: Some(path.clone()),
        ..small(3)
    })
    .unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut per_rank: Vec<Vec<(String, u64)>> = Vec::new();
    for rank in 0..2u64 {
        let mine: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| {
                let tid = e["tid"].as_u64();
                tid == Some(rank) || tid == Some(1000 + rank)
            })
            .collect();
        assert!(
            mine.iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == format!("rank {rank}"))
        );
        // Begin and end events pair up in order, never overlapping.
        let (mut open, mut last_end, mut collectives) = (None::<f64>, 0.0, Vec::new());
        for e in mine.iter().filter(|e| e["cat"] == "collective") {
            let ts = e["ts"].as_f64().unwrap();
            match e["ph"].as_str().unwrap() {
                "B" => {
                    assert!(
                        open.is_none(),
                        "rank {rank}: a collective began inside another"
                    );
                    assert!(ts >= last_end, "rank {rank}: collectives overlap");
                    open = Some(ts);
                    collectives.push((
                        e["name"].as_str().unwrap().to_string(),
                        e["args"]["bytes"].as_u64().unwrap(),
                    ));
                }
                "E" => {
                    let began = open.take().expect("an end event after its begin event");
                    assert!(ts >= began);
                    last_end = ts;
                }
                other => panic!("phase {other}"),
            }
        }
        assert!(open.is_none(), "rank {rank}: a collective never completed");
        for region in ["forward", "backward", "sync and check", "optimizer", "step"] {
            let n = mine
                .iter()
                .filter(|e| e["ph"] == "X" && e["name"] == region)
                .count();
            assert_eq!(n, 3, "rank {rank}: {region} regions");
        }
        let names: Vec<&str> = collectives.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"AllGather") && names.contains(&"ReduceScatter"));
        per_rank.push(collectives);
    }
    assert_eq!(per_rank[0].len(), per_rank[1].len());
    let table = 4 * 256 * 32 / 2; // a rank's shard of the tied embedding [256, 32]
    let gathers = per_rank[0]
        .iter()
        .filter(|(name, bytes)| name == "AllGather" && *bytes == table)
        .count();
    // Per step: the table gathered for the embedding, for the head, and again for the head's
    // backward; its two gradients (the head's, born transposed, and the table's) are both
    // reduce-scattered into the parameter's own split, so their sum gathers nothing (a fourth
    // gather per step before).
    assert_eq!(gathers, 3 * 3, "the tied table's all-gathers");
    let traced: u64 = per_rank[0].iter().map(|(_, b)| b).sum();
    let counted: u64 = summary.steps.iter().map(|s| s.comm_bytes).sum();
    assert_eq!(traced, counted, "the trace's bytes are the counters' bytes");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--link`: a modelled link paces the collectives over its axis (in the trace, each lasts at
/// least the link's time for its kind, group size and bytes) and changes no result: the losses
/// are bitwise those of the run without it. A link for an axis the mesh lacks is refused.
#[test]
fn modelled_links_pace_collectives_and_change_no_result() {
    use wildfire::parallel::CollectiveKind;
    use wildfire::parallel::comm::LinkModel;
    let dir = scratch("link");
    let path = dir.join("trace.json");
    let base = PretrainConfig {
        parallel: ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        eval_iters: 0,
        ..small(2)
    };
    let plain = run(&base).unwrap();
    let paced = run(&PretrainConfig {
        links: vec!["dp=2GB/s,40us".into()],
        trace: Some(path.clone()),
        ..base.clone()
    })
    .unwrap();
    let losses = |s: &RunSummary| s.steps.iter().map(|m| m.loss).collect::<Vec<_>>();
    assert_eq!(losses(&plain), losses(&paced));
    let link: LinkModel = "2GB/s,40us".parse().unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut begun = None;
    let mut checked = 0;
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["tid"] != 1000 || e["cat"] != "collective" {
            continue;
        }
        let ts = e["ts"].as_f64().unwrap();
        if e["ph"] == "B" {
            let kind = match e["name"].as_str().unwrap() {
                "AllReduce" => CollectiveKind::AllReduce,
                "AllGather" => CollectiveKind::AllGather,
                "ReduceScatter" => CollectiveKind::ReduceScatter,
                "Broadcast" => CollectiveKind::Broadcast,
                "Barrier" => CollectiveKind::Barrier,
                other => panic!("{other}"),
            };
            begun = Some((ts, kind, e["args"]["bytes"].as_u64().unwrap()));
        } else {
            let (start, kind, bytes) = begun.take().unwrap();
            let least = link.collective_time(kind, 2, bytes).as_secs_f64() * 1e6;
            assert!(
                ts - start >= least,
                "{kind:?} of {bytes} B: {} µs",
                ts - start
            );
            checked += 1;
        }
    }
    assert!(checked > 10, "{checked} collectives");
    let err = run(&PretrainConfig {
        links: vec!["pp=nvlink".into()],
        ..base
    })
    .unwrap_err();
    assert!(err.to_string().contains("no axis pp"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--prefetch` and `--reduce-in-flight`: FSDP's parameter gathers issued ahead on each rank's
/// communication thread, in the order the previous step gathered them, and its gradients'
/// reduce-scatters issued where they are born and waited for at first use (at most 2
/// outstanding), change nothing but their timing: losses and parameters bitwise those of the
/// blocking run, the same collectives of each kind and bytes every step (from the trace and the
/// counters), under FullShard with full recomputation, HSDP (its reduce-scatter and all-reduce
/// issued as one chain), FullShard × TP with sequence parallelism, gradient accumulation, and
/// ZeRO-2 reducing in bf16; on the host path and on the device-collectives path NCCL takes
/// (`--collectives staged`). From the second step on every gather of the recorded order is served
/// by a prefetch, none wasted.
#[test]
fn fsdp_prefetch_changes_nothing_but_timing() {
    let dir = scratch("prefetch");
    let cases = [
        (
            FsdpStrategy::FullShard,
            2,
            None,
            1,
            false,
            Recompute::Full,
            1,
        ),
        (
            FsdpStrategy::Hybrid,
            4,
            Some(2),
            1,
            false,
            Recompute::None,
            1,
        ),
        (
            FsdpStrategy::FullShard,
            2,
            None,
            2,
            true,
            Recompute::None,
            1,
        ),
        (
            FsdpStrategy::FullShard,
            2,
            None,
            1,
            false,
            Recompute::None,
            2,
        ),
        (
            FsdpStrategy::ShardGradOp,
            2,
            None,
            1,
            false,
            Recompute::None,
            1,
        ),
    ];
    for (fsdp, dp, dp_shard, tp, sp, recompute, accum) in cases {
        // ZeRO-2's reductions in bf16: cast, reduced on the queue, cast back.
        let grad_reduce = match fsdp {
            FsdpStrategy::ShardGradOp => Precision::Bf16,
            _ => Precision::F32,
        };
        let what =
            format!("{fsdp:?} dp={dp} tp={tp} sp={sp} {recompute:?} accum={accum} {grad_reduce:?}");
        let config = |prefetch: usize, collectives: Collectives| PretrainConfig {
            reduce_in_flight: prefetch.min(2),
            grad_reduce,
            collectives,
            parallel: ParallelConfig {
                dp,
                fsdp,
                dp_shard,
                tp,
                sp,
                sp_keep_gathers: false,
                recompute,
                ..ParallelConfig::default()
            },
            accum,
            prefetch,
            eval_iters: 0,
            trace: Some(dir.join(format!("{prefetch}-{collectives:?}.json"))),
            ..small(4)
        };
        let plain = run(&config(0, Collectives::Host)).unwrap();
        let ahead = run(&config(3, Collectives::Host)).unwrap();
        // The device-collectives path (NCCL's), asynchronous calls issued through it: staged.
        let staged = run(&config(3, Collectives::Staged)).unwrap();
        let losses = |s: &RunSummary| s.steps.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
        let bytes = |s: &RunSummary| s.steps.iter().map(|m| m.comm_bytes).collect::<Vec<_>>();
        for (other, how) in [(&ahead, "ahead"), (&staged, "staged")] {
            assert_eq!(losses(&plain), losses(other), "{what} {how}: losses");
            for (a, b) in pairs(&plain.parameters, &other.parameters) {
                assert_eq!(bits(a), bits(b), "{what} {how}: parameters");
            }
            assert_eq!(bytes(&plain), bytes(other), "{what} {how}: bytes per step");
        }
        let kinds = |name: &str| {
            let path = dir.join(format!("{name}.json"));
            let trace: serde_json::Value =
                serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
            let mut kinds = std::collections::BTreeMap::<String, usize>::new();
            for e in trace["traceEvents"].as_array().unwrap() {
                if e["cat"] == "collective" && e["ph"] == "B" {
                    *kinds
                        .entry(e["name"].as_str().unwrap().to_string())
                        .or_default() += 1;
                }
            }
            kinds
        };
        for name in ["3-Host", "3-Staged"] {
            assert_eq!(
                kinds("0-Host"),
                kinds(name),
                "{what} {name}: collectives of each kind"
            );
        }
        assert_eq!(plain.prefetch, Default::default(), "{what}");
        assert_eq!(ahead.prefetch, staged.prefetch, "{what}");
        let p = ahead.prefetch;
        // ZeRO-2 gathers its parameters after the optimizer step, not op by op: nothing to
        // prefetch.
        let gathers = fsdp != FsdpStrategy::ShardGradOp;
        assert!(
            p.used == p.issued && (p.used > 0) == gathers,
            "{what}: {p:?}"
        );
        assert_eq!((p.wasted, p.diverged), (0, 0), "{what}: {p:?}");
        // Gradients reduced on the queue (HSDP's reduce-scatter and all-reduce as one chain,
        // ZeRO-2's cast to bf16 and back around it).
        if accum == 1 {
            assert!(p.reductions > 0, "{what}: {p:?}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--bucket-mb`: DDP's and ZeRO-1's gradients all-reduced in flat buckets where they are born
/// (in bf16 when the reductions are). Issued on the communication thread and waited for at first
/// use (`--reduce-in-flight 2`) or waited for at once: bitwise the losses, parameters and bytes
/// of the unbucketed run — the tied table's two gradients are kept out of the buckets (seen
/// being added in the first step, which only watches) and all-reduced once, summed, as without
/// buckets. One all-reduce per bucket replaces the one per parameter, counted: a step's
/// all-reduces are its buckets.
#[test]
fn ddp_buckets_reduce_as_gradients_are_born() {
    let dir = scratch("buckets");
    for (fsdp, grad_reduce) in [
        (FsdpStrategy::NoShard, Precision::F32),
        (FsdpStrategy::ShardOptimizer, Precision::Bf16),
    ] {
        let what = format!("{fsdp:?} {grad_reduce:?}");
        let name = |bucket_mb: f64, reduce_in_flight: usize| {
            format!("{fsdp:?}-{bucket_mb}-{reduce_in_flight}")
        };
        let config = |bucket_mb: f64, reduce_in_flight: usize| PretrainConfig {
            parallel: ParallelConfig {
                dp: 2,
                fsdp,
                ..ParallelConfig::default()
            },
            grad_reduce,
            bucket_mb,
            reduce_in_flight,
            eval_iters: 0,
            trace: Some(dir.join(format!("{}.json", name(bucket_mb, reduce_in_flight)))),
            ..small(4)
        };
        // Buckets of 20 KiB: several per step on the tiny GPT (140 KB of gradients).
        let size = 0.02;
        let plain = run(&config(0.0, 0)).unwrap();
        let blocking = run(&config(size, 0)).unwrap();
        let overlapped = run(&config(size, 2)).unwrap();
        let losses = |s: &RunSummary| s.steps.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
        let bytes = |s: &RunSummary| s.steps.iter().map(|m| m.comm_bytes).collect::<Vec<_>>();
        for (bucketed, how) in [(&blocking, "blocking"), (&overlapped, "overlapped")] {
            assert_eq!(losses(bucketed), losses(&plain), "{what} {how}: losses");
            for (a, b) in pairs(&bucketed.parameters, &plain.parameters) {
                assert_eq!(bits(a), bits(b), "{what} {how}: parameters");
            }
            assert_eq!(
                bytes(bucketed),
                bytes(&plain),
                "{what} {how}: bytes per step"
            );
        }
        let all_reduces = |name: String| {
            let path = dir.join(format!("{name}.json"));
            let trace: serde_json::Value =
                serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
            trace["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["tid"] == 1000 && e["ph"] == "B" && e["name"] == "AllReduce")
                .count()
        };
        // The tiny GPT's parameter tensors: the tied table, positions, 12 per block, the final
        // norm, each all-reduced once per step without buckets; with them, a step's all-reduces
        // are its buckets (the gradients kept out in backward join the last one at the sync).
        let tensors = 2 + 12 * 2 + 2;
        for (run, flight) in [(&blocking, 0), (&overlapped, 2)] {
            let buckets = run.prefetch.buckets as usize;
            assert!(buckets >= 8, "{what}: {buckets} buckets in 4 steps");
            assert_eq!(
                all_reduces(name(size, flight)) + 4 * tensors,
                all_reduces(name(0.0, 0)) + buckets,
                "{what}: one all-reduce per bucket instead of one per parameter"
            );
        }
        assert_eq!(
            overlapped.prefetch.buckets, blocking.prefetch.buckets,
            "{what}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Gradient reductions are issued while backward runs: in the trace of every rank, each step's
/// backward region holds the issue (the begin event, not the duration, so it holds on any number
/// of cores) of some of the step's reduce-scatters (FSDP) or bucket all-reduces (DDP with small
/// buckets, `--reduce-in-flight 2`, from the second step: the first learns the buckets). The
/// control: DDP without buckets all-reduces after backward, none issued inside it.
#[test]
fn gradient_reductions_are_issued_before_backward_ends() {
    let dir = scratch("issued-in-backward");
    for (fsdp, kind, bucket_mb) in [
        (FsdpStrategy::FullShard, "ReduceScatter", 25.0),
        (FsdpStrategy::NoShard, "AllReduce", 0.01),
        (FsdpStrategy::NoShard, "AllReduce", 0.0),
    ] {
        let what = format!("{fsdp:?} {kind} buckets {bucket_mb} MiB");
        let path = dir.join(format!("{fsdp:?}-{bucket_mb}.json"));
        run(&PretrainConfig {
            parallel: ParallelConfig::layout(2, 1, fsdp, None),
            reduce_in_flight: 2,
            bucket_mb,
            eval_iters: 0,
            trace: Some(path.clone()),
            ..small(3)
        })
        .unwrap();
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        for rank in 0..2u64 {
            let mine = |e: &&serde_json::Value| {
                let tid = e["tid"].as_u64();
                tid == Some(rank) || tid == Some(1000 + rank)
            };
            let backward: Vec<(f64, f64)> = events
                .iter()
                .filter(mine)
                .filter(|e| e["ph"] == "X" && e["name"] == "backward")
                .map(|e| {
                    let ts = e["ts"].as_f64().unwrap();
                    (ts, ts + e["dur"].as_f64().unwrap())
                })
                .collect();
            assert_eq!(backward.len(), 3, "{what}: rank {rank}'s backward regions");
            let issued: Vec<f64> = events
                .iter()
                .filter(mine)
                .filter(|e| e["cat"] == "collective" && e["ph"] == "B" && e["name"] == kind)
                .map(|e| e["ts"].as_f64().unwrap())
                .collect();
            for (step, &(start, end)) in backward.iter().enumerate() {
                let inside = issued.iter().filter(|&&t| start <= t && t < end).count();
                if bucket_mb == 0.0 && fsdp == FsdpStrategy::NoShard {
                    assert_eq!(inside, 0, "{what}: rank {rank} step {step}");
                } else if step > 0 || fsdp == FsdpStrategy::FullShard {
                    // (DDP's first step only watches the gradients' order, as PyTorch DDP
                    // rebuilds its buckets after the first iteration.)
                    assert!(
                        inside > 0,
                        "{what}: rank {rank} step {step}: none of {} issued in backward \
                         [{start}, {end}]",
                        issued.len()
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
