//! The optimizer flags: `--optimizer adafactor`, `--optimizer muon`, `--optim-state bf16`
//! (AdamW's moments in bf16) and `--optim-state int8` (8-bit block-quantised) train every layout as one rank does, resume bitwise on the saving
//! layout and follow the straight run on another, keep exactly the state bytes the estimate
//! gives, and a combination that means nothing is refused before any work.

use super::*;
use crate::suite::losses_close_f32;
use wildfire::pretrain::{MuonSplit, Offload, OptimState, OptimizerKind};

fn with(optimizer: OptimizerKind, optim_state: OptimState, steps: usize) -> PretrainConfig {
    PretrainConfig {
        optimizer,
        optim_state,
        ..small(steps)
    }
}

/// A run saved part-way (`first`) and `resumed` follows the `straight` run: bitwise without a
/// tolerance, else within `tol` (losses, and every parameter of the tensor's scale).
fn follows_straight(
    what: &str,
    first: &RunSummary,
    resumed: &RunSummary,
    straight: &RunSummary,
    tol: Option<f32>,
) {
    let got = resumed_losses(first, resumed);
    match tol {
        None => {
            assert_eq!(bits(&got), bits(&losses(straight)), "{what}");
            same_bits(what, &resumed.parameters, &straight.parameters);
        }
        Some(tol) => {
            losses_close_f32(what, &got, &losses(straight), tol);
            tensors_close(what, &resumed.parameters, &straight.parameters, tol);
        }
    }
}

/// The settings beyond f32 AdamW.
const COMPACT: [(OptimizerKind, OptimState); 4] = [
    (OptimizerKind::Adafactor, OptimState::F32),
    (OptimizerKind::Muon, OptimState::F32),
    (OptimizerKind::Adamw, OptimState::Bf16),
    (OptimizerKind::Adamw, OptimState::Int8),
];

/// ZeRO-1, FSDP with full recomputation, tp 2, dp 2 × tp 2 FSDP, pp 2 (1F1B, two
/// micro-batches) and dp 2 × pp 2 follow one rank step by step (losses, validation losses,
/// gradient norms, every parameter) for Adafactor, for Muon (its Newton–Schulz iteration on the
/// whole matrix gathered from the shards) and for AdamW with bf16 moments; and each differs
/// from f32 AdamW (the flag reaches the optimizer).
///
/// Adafactor and Muon within 1e-4 (as f32 AdamW in `sharded_runs_match_one_rank`: a bias still near
/// zero after 8 steps, scale 7e-6, differs by 1e-5 of it). bf16 moments within 1e-3 of the tensor's scale: they keep 8
/// significant bits, so the last-bit differences of f32 gradients reduced in another order
/// (which f32 AdamW follows within 1e-5) can round a moment to the neighbouring bf16 value, a
/// 2⁻⁸ change of that element's step. The update itself is checked against its formula, step by
/// step, in `bf16_adamw_moments_follow_the_rounded_formula`.
#[test]
fn compact_optimizers_shard_like_one_rank() {
    let adamw = run(&small(8)).unwrap();
    for (optimizer, state) in COMPACT {
        let tol = match state {
            OptimState::Bf16 | OptimState::Int8 => 1e-3,
            OptimState::F32 => 1e-4,
        };
        let one = run(&with(optimizer, state, 8)).unwrap();
        assert_ne!(
            losses(&one)[7],
            losses(&adamw)[7],
            "{optimizer:?} {state:?} trains like f32 AdamW"
        );
        let layouts = [
            ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None),
            ParallelConfig {
                recompute: Recompute::Full,
                ..ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None)
            },
            ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None),
            ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None),
            ParallelConfig {
                pp: 2,
                microbatches: 2,
                ..ParallelConfig::default()
            },
            ParallelConfig {
                pp: 2,
                microbatches: 2,
                ..ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None)
            },
        ];
        for parallel in layouts {
            let what = format!(
                "{optimizer:?} {state:?} dp {} tp {} pp {} {:?}",
                parallel.dp, parallel.tp, parallel.pp, parallel.fsdp
            );
            let many = run(&PretrainConfig {
                parallel,
                ..with(optimizer, state, 8)
            })
            .unwrap();
            same_run(&what, &many, &one, tol);
        }
    }
}

/// Muon's owner ranks (`--muon-split owner`, the default): each rank of the data-parallel group
/// orthogonalises one matrix of each round and broadcasts it. The run is the every-rank run
/// (`--muon-split every`) bit for bit — losses, validation losses, every parameter — on ZeRO-1,
/// FSDP, dp 2 × tp 2 FSDP and dp 2 × pp 2 (1F1B); rank 0 ran its share of the iterations (the
/// first of each pair of matrices: half, rounded up), and every step moved more bytes (the
/// broadcasts). On one data rank there is no one to share with: every rank orthogonalises every
/// matrix either way.
#[test]
fn muon_owner_ranks_are_the_every_rank_run_bitwise() {
    for parallel in [
        ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None),
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None),
        ParallelConfig {
            pp: 2,
            microbatches: 2,
            ..ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None)
        },
        ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None),
    ] {
        let what = format!(
            "dp {} tp {} pp {} {:?}",
            parallel.dp, parallel.tp, parallel.pp, parallel.fsdp
        );
        let steps = 3;
        let dp = parallel.dp;
        let config = |muon_split| PretrainConfig {
            parallel: parallel.clone(),
            muon_split,
            gather_parameters: true,
            ..with(OptimizerKind::Muon, OptimState::F32, steps)
        };
        let every = run(&config(MuonSplit::Every)).unwrap();
        let owner = run(&config(MuonSplit::Owner)).unwrap();
        assert_eq!(bits(&losses(&owner)), bits(&losses(&every)), "{what}");
        let val = |s: &RunSummary| s.steps.iter().map(|m| m.val_loss).collect::<Vec<_>>();
        assert_eq!(val(&owner), val(&every), "{what}: validation losses");
        same_bits(&what, &owner.parameters, &every.parameters);
        let matrices = every.orthogonalised / steps as u64;
        assert!(matrices > 1, "{what}: {} iterations", every.orthogonalised);
        assert_eq!(every.orthogonalised, matrices * steps as u64, "{what}");
        let comm = |s: &RunSummary| s.steps.iter().map(|m| m.comm_bytes).collect::<Vec<_>>();
        if dp == 1 {
            assert_eq!(owner.orthogonalised, every.orthogonalised, "{what}");
            assert_eq!(comm(&owner), comm(&every), "{what}");
            continue;
        }
        assert_eq!(
            owner.orthogonalised,
            matrices.div_ceil(2) * steps as u64,
            "{what}: rank 0's iterations"
        );
        for (o, e) in pairs(&comm(&owner), &comm(&every)) {
            assert!(o > e, "{what}: {o} bytes with owner ranks, {e} without");
        }
    }
}

/// The optimizer-state bytes are the estimate's, from the decorator's accounting: bf16 moments
/// 4 bytes per parameter on one rank (half of f32's 8), Adafactor a row and a column statistic
/// per matrix, Muon one buffer per hidden matrix (AdamW's two for the tables and vectors); and
/// under DDP, ZeRO-2, FSDP, tp 2 and dp 2 × tp 2 (Adafactor's column statistics replicated over
/// the data ranks, its row statistics split with the rows).
#[test]
fn compact_optimizer_state_bytes_are_the_estimate() {
    let adamw = run(&small(1)).unwrap().steps[0].optim_bytes;
    let bf16 = run(&with(OptimizerKind::Adamw, OptimState::Bf16, 1)).unwrap();
    assert_eq!(2 * bf16.steps[0].optim_bytes, adamw);
    let adafactor = run(&with(OptimizerKind::Adafactor, OptimState::F32, 1)).unwrap();
    assert!(
        adafactor.steps[0].optim_bytes * 4 < adamw,
        "Adafactor {} vs AdamW {adamw}",
        adafactor.steps[0].optim_bytes
    );
    let muon = run(&with(OptimizerKind::Muon, OptimState::F32, 1)).unwrap();
    let muon = muon.steps[0].optim_bytes;
    assert!(
        muon < adamw && 2 * muon > adamw,
        "Muon {muon} vs AdamW {adamw}"
    );
    // 8-bit: per tensor of at least 4,096 elements a byte per moment element and an f32 scale
    // per block of 2,048 for each moment; 8 bytes per element below.
    let int8 = run(&with(OptimizerKind::Adamw, OptimState::Int8, 1)).unwrap();
    let formula: usize = int8
        .parameters
        .iter()
        .map(|p| match p.len() {
            n if n < 4096 => 8 * n,
            n => 2 * n + 2 * 4 * n.div_ceil(2048),
        })
        .sum();
    assert_eq!(int8.steps[0].optim_bytes, formula as u64);
    for (optimizer, state) in COMPACT {
        estimate_matches_the_accounting(&with(optimizer, state, 1));
    }
}

/// Saved at step 4 and resumed to step 8: bitwise the straight run on the saving layout (dp 2
/// FullShard), and within 1e-4 of it on dp 1 and on tp 2 (the state resharded; bf16 moments
/// saved as bf16, 8-bit ones as their codes and block scales). A run resumed with another moment
/// dtype goes on (the first step widens what it loaded, or quantises f32 moments to 8 bits).
#[test]
fn compact_optimizers_resume() {
    let saving = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
    for (optimizer, state) in COMPACT {
        let config = |parallel: &ParallelConfig, steps| PretrainConfig {
            parallel: parallel.clone(),
            ..with(optimizer, state, steps)
        };
        let straight = run(&config(&saving, 8)).unwrap();
        let dir = scratch(&format!("resume-{optimizer:?}-{state:?}"));
        let first = run(&PretrainConfig {
            save: Some(dir.clone()),
            ..config(&saving, 4)
        })
        .unwrap();
        for parallel in [
            saving.clone(),
            ParallelConfig::default(),
            ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None),
        ] {
            let what = format!(
                "{optimizer:?} {state:?} resumed on dp {} tp {}",
                parallel.dp, parallel.tp
            );
            let resumed = run(&PretrainConfig {
                resume: Some(dir.clone()),
                ..config(&parallel, 8)
            })
            .unwrap();
            let tol = (parallel != saving).then_some(1e-4);
            follows_straight(&what, &first, &resumed, &straight, tol);
        }
    }
    // f32 moments saved, resumed with bf16 moments.
    let dir = scratch("resume-moment-dtype");
    run(&PretrainConfig {
        save: Some(dir.clone()),
        ..small(4)
    })
    .unwrap();
    for state in [OptimState::Bf16, OptimState::Int8] {
        let resumed = run(&PretrainConfig {
            resume: Some(dir.clone()),
            ..with(OptimizerKind::Adamw, state, 8)
        })
        .unwrap();
        assert_eq!(resumed.steps.len(), 4);
        assert!(resumed.steps.iter().all(|s| s.loss.is_finite()));
    }
}

fn offloaded(config: PretrainConfig) -> PretrainConfig {
    PretrainConfig {
        offload: Offload::Optimizer,
        ..config
    }
}

/// `--offload optimizer` is the run without it, bit for bit, on one rank, dp 2 FSDP, ZeRO-1 and
/// ZeRO-2 (the moments kept for the gradient's shard), tp 2 and dp 2 × tp 2: the host step is the
/// Flex kernel's arithmetic. The device keeps no optimizer state (the accounting's optimizer
/// bytes are 0) and the host holds exactly what the device held without offload; both are the
/// estimate's. Pipeline stages (which step with Burn's AdamW without offload) follow within 1e-5.
#[test]
fn offloaded_optimizer_is_the_device_run_bitwise() {
    for parallel in [
        ParallelConfig::default(),
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None),
        ParallelConfig::layout(2, 1, FsdpStrategy::ShardGradOp, None),
        ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None),
        ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None),
    ] {
        let what = format!("dp {} tp {} {:?}", parallel.dp, parallel.tp, parallel.fsdp);
        let config = PretrainConfig {
            parallel,
            ..small(6)
        };
        let device = run(&config).unwrap();
        let host = run(&offloaded(config.clone())).unwrap();
        assert_eq!(bits(&losses(&host)), bits(&losses(&device)), "{what}");
        same_bits(&what, &host.parameters, &device.parameters);
        for (h, d) in pairs(&host.steps, &device.steps) {
            assert_eq!(h.optim_bytes, 0, "{what}: optimizer bytes on the device");
            assert_eq!(h.host_bytes, d.optim_bytes, "{what}: host bytes");
            assert_eq!(d.host_bytes, 0, "{what}");
        }
        estimate_matches_the_accounting_on(&offloaded(small(1)), &[config.parallel]);
    }
    let pipelined = PretrainConfig {
        parallel: ParallelConfig {
            pp: 2,
            microbatches: 2,
            ..ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None)
        },
        ..small(6)
    };
    let device = run(&pipelined).unwrap();
    let host = run(&offloaded(pipelined)).unwrap();
    same_run("pp 2 offloaded", &host, &device, 1e-5);
    assert!(host.steps.iter().all(|s| s.host_bytes > 0));
}

/// A checkpoint saved with the optimizer offloaded resumes without offload, and the other way
/// round, bitwise the straight run (dp 2 FullShard saves; dp 2 FullShard and ZeRO-1 resume:
/// the moments move between host and device, and between layouts).
#[test]
fn offloaded_optimizer_state_resumes_on_and_off_the_device() {
    let saving = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
    let config = |parallel: &ParallelConfig, steps| PretrainConfig {
        parallel: parallel.clone(),
        ..small(steps)
    };
    let straight = run(&config(&saving, 8)).unwrap();
    for (save_offloaded, resuming) in [
        (true, saving.clone()),
        (false, saving.clone()),
        (
            true,
            ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None),
        ),
    ] {
        let what = format!(
            "saved offloaded {save_offloaded}, resumed {:?}",
            resuming.fsdp
        );
        let dir = scratch(&format!("offload-{save_offloaded}-{:?}", resuming.fsdp));
        let mut first = PretrainConfig {
            save: Some(dir.clone()),
            ..config(&saving, 4)
        };
        let mut second = PretrainConfig {
            resume: Some(dir.clone()),
            ..config(&resuming, 8)
        };
        if save_offloaded {
            first = offloaded(first);
        } else {
            second = offloaded(second);
        }
        let first = run(&first).unwrap();
        let resumed = run(&second).unwrap();
        let tol = (resuming != saving).then_some(1e-5);
        follows_straight(&what, &first, &resumed, &straight, tol);
    }
}

fn params_offloaded(config: PretrainConfig) -> PretrainConfig {
    PretrainConfig {
        offload: Offload::Params,
        ..config
    }
}

/// `config` with the optimizer offloaded, and with the parameters too: the two runs, their
/// losses and final parameters checked bit for bit.
fn with_and_without_parameters(what: &str, config: &PretrainConfig) -> (RunSummary, RunSummary) {
    let device = run(&offloaded(config.clone())).unwrap();
    let host = run(&params_offloaded(config.clone())).unwrap();
    assert_eq!(bits(&losses(&host)), bits(&losses(&device)), "{what}");
    same_bits(what, &host.parameters, &device.parameters);
    (device, host)
}

/// `--offload params` (the optimizer offloaded as well) is the `--offload optimizer` run bit
/// for bit on dp 2 FSDP, dp 2 × tp 2 FSDP and one rank: every use uploads the very values it
/// would have read on the device. Between steps the device holds no parameter bytes (the
/// accounting's parameter and optimizer bytes are 0), the host holds the moments and every
/// parameter shard, each as the estimate gives; the step's device peak is lower by at least
/// the parameters' shards. Each use reads the host piece once, whatever the layout (the same
/// count on all three), more than once per parameter and step: on one rank the compute thread
/// uploads it; under FSDP the shard goes to its gather from host memory as it is — the compute
/// thread uploads nothing, the communication thread uploads the gathered parameter — and from
/// the second step the prefetch issues those gathers ahead of use.
#[test]
fn offloaded_parameters_are_the_device_run_bitwise() {
    let mut uploads = Vec::new();
    for parallel in [
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None),
        ParallelConfig::layout(1, 1, FsdpStrategy::FullShard, None),
    ] {
        let what = format!("dp {} tp {} {:?}", parallel.dp, parallel.tp, parallel.fsdp);
        let config = PretrainConfig {
            parallel,
            gather_parameters: true,
            ..small(6)
        };
        let (device, host) = with_and_without_parameters(&what, &config);
        let val = |s: &RunSummary| s.steps.iter().map(|m| m.val_loss).collect::<Vec<_>>();
        assert_eq!(val(&host), val(&device), "{what}: validation losses");
        for (h, d) in pairs(&host.steps, &device.steps) {
            assert_eq!(h.param_bytes, 0, "{what}: parameter bytes on the device");
            assert_eq!(h.optim_bytes, 0, "{what}: other bytes on the device");
            assert!(d.param_bytes > 0, "{what}");
            assert_eq!(
                h.host_bytes,
                d.host_bytes + d.param_bytes,
                "{what}: host bytes (moments and parameter shards)"
            );
            assert!(
                h.peak_bytes + d.param_bytes <= d.peak_bytes,
                "{what}: device peak {} with the parameters offloaded, {} without ({} of \
                 parameters)",
                h.peak_bytes,
                d.peak_bytes,
                d.param_bytes
            );
        }
        assert_eq!((device.host_uploads, device.host_gathers), (0, 0), "{what}");
        let uses = host.host_uploads + host.host_gathers;
        uploads.push(uses);
        let params = host.parameters.len() as u64;
        assert!(
            uses > params * 6,
            "{what}: {uses} uses in 6 steps of {params} parameters"
        );
        if config.parallel.dp > 1 {
            assert!(host.prefetch.used > 0, "{what}: {:?}", host.prefetch);
            assert_eq!(host.prefetch.used, device.prefetch.used, "{what}");
            // Shards go to their gathers from host memory (never uploaded), and the
            // communication thread uploads the gathered parameters, on the compute thread's
            // stream. On dp alone the compute thread uploads a shard only for
            // the tied head's transposition of the token table (a layout op on the shard,
            // before the head's gather), once per forward pass: the 6 steps and the
            // validation. (With tp a redistribution that is not one axis's gather, see
            // `parameter_gather`, still uploads on the compute thread.)
            let forwards = host.steps.len() as u64 * 2;
            let tp = config.parallel.tp;
            assert!(
                host.host_gathers > 0
                    && (tp > 1
                        || host.host_uploads <= forwards
                            && host.host_gathers > 20 * host.host_uploads),
                "{what}: {} uploads on the compute thread, {} shards gathered from the host",
                host.host_uploads,
                host.host_gathers
            );
            assert!(
                host.comm_uploads >= host.host_gathers,
                "{what}: {} uploads on the communication thread for {} host gathers",
                host.comm_uploads,
                host.host_gathers
            );
        } else {
            assert_eq!(
                host.host_gathers, 0,
                "{what}: nothing to gather on one rank"
            );
        }
        if config.parallel.dp > 1 && config.parallel.tp == 1 {
            // The device-collectives path (NCCL's) staged through host memory takes the host
            // shards as they are too, and uploads on the communication thread: the same bits.
            let staged = run(&params_offloaded(PretrainConfig {
                collectives: Collectives::Staged,
                ..config.clone()
            }))
            .unwrap();
            assert_eq!(
                bits(&losses(&staged)),
                bits(&losses(&host)),
                "{what} staged"
            );
            same_bits(&what, &staged.parameters, &host.parameters);
            assert_eq!(
                (staged.host_uploads, staged.host_gathers),
                (host.host_uploads, host.host_gathers),
                "{what} staged"
            );
        }
        estimate_matches_the_accounting_on(&params_offloaded(small(1)), &[config.parallel]);
    }
    assert!(uploads.windows(2).all(|w| w[0] == w[1]), "{uploads:?}");
}

/// The Llama (RMSNorm, SwiGLU, rotary embedding, grouped heads, an untied head) started from
/// the weights `transformers` wrote, FSDP over two, tp 2 as well: with the parameters offloaded
/// (the loaded weights moved to the host before step 0) bitwise the run with only the
/// optimizer offloaded, no parameter bytes on the device.
#[test]
fn offloaded_llama_parameters_are_the_device_run_bitwise() {
    for parallel in [
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None),
    ] {
        let what = format!("llama dp {} tp {}", parallel.dp, parallel.tp);
        let config = PretrainConfig {
            parallel,
            ..from_transformers_llama(4)
        };
        let (_, host) = with_and_without_parameters(&what, &config);
        assert!(host.steps.iter().all(|m| m.param_bytes == 0), "{what}");
        assert!(host.host_gathers > 0 && host.prefetch.used > 0, "{what}");
    }
}

/// Pipeline stages (1F1B, two micro-batches) with their parameters offloaded — pp 2 on FSDP's
/// full sharding of one data rank, and dp 2 × pp 2 — are the stages with only the optimizer
/// offloaded, bit for bit, no parameter bytes on the device between steps; and such a run
/// resumes from its checkpoint bitwise the straight run.
#[test]
fn offloaded_stage_parameters_are_the_device_run_bitwise() {
    for dp in [1, 2] {
        let what = format!("dp {dp} pp 2");
        let config = PretrainConfig {
            parallel: ParallelConfig {
                pp: 2,
                microbatches: 2,
                ..ParallelConfig::layout(dp, 1, FsdpStrategy::FullShard, None)
            },
            ..small(6)
        };
        let (device, host) = with_and_without_parameters(&what, &config);
        assert!(host.steps.iter().all(|m| m.param_bytes == 0), "{what}");
        assert!(device.steps.iter().all(|m| m.param_bytes > 0), "{what}");
        if dp == 1 {
            assert!(host.host_uploads > 0 && host.host_gathers == 0, "{what}");
        } else {
            // The stages' FSDP gathers take the shards from host memory.
            assert!(host.host_gathers > host.host_uploads, "{what}");
        }
        if dp == 2 {
            let dir = scratch("offload-params-pp");
            let first = run(&params_offloaded(PretrainConfig {
                save: Some(dir.clone()),
                steps: 3,
                ..config.clone()
            }))
            .unwrap();
            let resumed = run(&params_offloaded(PretrainConfig {
                resume: Some(dir.clone()),
                ..config.clone()
            }))
            .unwrap();
            follows_straight(&what, &first, &resumed, &host, None);
        }
    }
}

/// A checkpoint saved with the parameters offloaded (their pieces read from host memory)
/// resumes with them offloaded, and with only the optimizer offloaded, bitwise the straight
/// run; and one saved from the device resumes offloaded (the loaded weights move to the host).
#[test]
fn offloaded_parameters_save_and_resume_bitwise() {
    let layout = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
    let config = |steps| PretrainConfig {
        parallel: layout.clone(),
        gather_parameters: true,
        ..small(steps)
    };
    let straight = run(&offloaded(config(8))).unwrap();
    for (save_params, resume_params) in [(true, true), (true, false), (false, true)] {
        let what = format!("saved params offloaded {save_params}, resumed {resume_params}");
        let dir = scratch(&format!("offload-params-{save_params}-{resume_params}"));
        let pick = |params: bool, c: PretrainConfig| {
            if params {
                params_offloaded(c)
            } else {
                offloaded(c)
            }
        };
        let first = run(&pick(
            save_params,
            PretrainConfig {
                save: Some(dir.clone()),
                ..config(4)
            },
        ))
        .unwrap();
        let resumed = run(&pick(
            resume_params,
            PretrainConfig {
                resume: Some(dir.clone()),
                ..config(8)
            },
        ))
        .unwrap();
        follows_straight(&what, &first, &resumed, &straight, None);
        if resume_params {
            assert!(resumed.steps.iter().all(|m| m.param_bytes == 0), "{what}");
        }
    }
}

/// One rank, and FSDP over two: the layouts the Wgpu checks run.
#[cfg(feature = "wgpu")]
fn one_rank_and_fsdp_two() -> [ParallelConfig; 2] {
    [
        ParallelConfig::default(),
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
    ]
}

/// On Wgpu (device buffers) the offloaded run follows the run with the optimizer on the
/// device (the CubeCL AdamW kernel) within 1e-5: two implementations of one formula.
#[cfg(feature = "wgpu")]
#[test]
fn offloaded_optimizer_on_wgpu_follows_the_device_optimizer() {
    use wildfire::pretrain::run_on;
    let device = Default::default();
    for parallel in one_rank_and_fsdp_two() {
        let config = PretrainConfig {
            parallel,
            timeout: crate::suite::ON_LAVAPIPE_TIMEOUT,
            ..small(4)
        };
        let on_device = run_on::<burn::backend::Wgpu>(&config, &device).unwrap();
        let on_host = run_on::<burn::backend::Wgpu>(&offloaded(config), &device).unwrap();
        same_run("wgpu offloaded", &on_host, &on_device, 1e-5);
        assert!(
            on_host
                .steps
                .iter()
                .all(|s| s.optim_bytes == 0 && s.host_bytes > 0)
        );
    }
}

/// 8-bit AdamW on Wgpu (its codes in `i32`: WGSL has no 8-bit integers) follows Flex's (`u8`
/// codes) within 1e-4: the same maps and blocks, the quantisation in CubeCL's kernels
/// (`cube::quant`, which ran).
#[cfg(feature = "wgpu")]
#[test]
fn int8_adamw_on_wgpu_follows_flex() {
    use wildfire::pretrain::run_on;
    for parallel in one_rank_and_fsdp_two() {
        let config = PretrainConfig {
            parallel,
            timeout: crate::suite::ON_LAVAPIPE_TIMEOUT,
            ..with(OptimizerKind::Adamw, OptimState::Int8, 4)
        };
        let before = wildfire_kernels::cube::quant_launches();
        let wgpu = run_on::<burn::backend::Wgpu>(&config, &Default::default()).unwrap();
        assert!(
            cfg!(feature = "fusion") || wildfire_kernels::cube::quant_launches() > before,
            "the 8-bit state kernels ran"
        );
        let flex = run(&config).unwrap();
        same_steps("wgpu int8", &wgpu, &flex, 1e-4);
        close_but_for_flipped_codes("wgpu int8", &wgpu.parameters, &flex.parameters);
    }
}

/// Every parameter within 1e-4 of its tensor's scale, except at most one element in 1,000 (and
/// at least one) per tensor, within 1e-3: where a moment lies on the boundary between two 8-bit
/// codes, Flex's and Wgpu's f32 sums (in different orders, last-bit apart: with f32 state the
/// same runs agree within 2e-6 everywhere) may round it to either, and one step of the map moves
/// the weight by about the learning rate over 127 of its block's update (measured: one element
/// of the embedding table at 1.4e-4 after four steps).
#[cfg(feature = "wgpu")]
fn close_but_for_flipped_codes(what: &str, got: &[Vec<f32>], expected: &[Vec<f32>]) {
    for (i, (p, q)) in crate::suite::pairs(got, expected).enumerate() {
        assert_eq!(p.len(), q.len(), "{what}: tensor {i}");
        let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut flipped = 0;
        for (x, y) in crate::suite::pairs(p, q) {
            let d = (x - y).abs();
            assert!(
                d <= 1e-3 * scale,
                "{what}: tensor {i}: {x} vs {y} (scale {scale})"
            );
            flipped += usize::from(d > 1e-4 * scale);
        }
        assert!(
            flipped <= (p.len() / 1000).max(1),
            "{what}: tensor {i}: {flipped} of {} elements beyond 1e-4",
            p.len()
        );
    }
}

/// On Wgpu (device buffers: each use's upload is a real write to the device) the run with the
/// parameters offloaded is the run with only the optimizer offloaded, bit for bit, on one rank
/// and on FSDP over two: the parameter shards live in host memory between uses, and no
/// parameter bytes stay on the device. Under FSDP the gathered parameters and the reduced
/// gradients are uploaded on the communication thread, on the compute thread's stream
/// (`wildfire_parallel::comm::on_callers_stream`): on the communication thread's own stream
/// the runs differ from the second step on, differently each time (20 runs of 20 measured).
#[cfg(feature = "wgpu")]
#[test]
fn offloaded_parameters_on_wgpu_are_the_device_parameters_bitwise() {
    use wildfire::pretrain::run_on;
    let device = Default::default();
    for parallel in [
        ParallelConfig::layout(1, 1, FsdpStrategy::FullShard, None),
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
    ] {
        let dp = parallel.dp;
        let config = PretrainConfig {
            parallel,
            timeout: crate::suite::ON_LAVAPIPE_TIMEOUT,
            ..small(4)
        };
        let on_device = run_on::<burn::backend::Wgpu>(&offloaded(config.clone()), &device).unwrap();
        let on_host = run_on::<burn::backend::Wgpu>(&params_offloaded(config), &device).unwrap();
        assert_eq!(bits(&losses(&on_host)), bits(&losses(&on_device)), "wgpu");
        same_bits(
            "wgpu parameters offloaded",
            &on_host.parameters,
            &on_device.parameters,
        );
        assert!(on_host.host_uploads > 0);
        if dp > 1 {
            assert!(
                on_host.comm_uploads >= on_host.host_gathers && on_host.host_gathers > 0,
                "{} uploads on the communication thread, {} host gathers",
                on_host.comm_uploads,
                on_host.host_gathers
            );
            assert!(on_device.comm_uploads > 0, "the gradients' reductions");
        }
        for (h, d) in pairs(&on_host.steps, &on_device.steps) {
            assert_eq!(h.param_bytes, 0);
            assert_eq!(h.host_bytes, d.host_bytes + d.param_bytes);
        }
    }
}

/// `--optim-state bf16` or `int8` with Adafactor or Muon (whose state is f32), and `--offload
/// optimizer` with anything but f32 AdamW, are typed errors before any work; so is resuming a
/// checkpoint of one optimizer with another (its state is not there), 8-bit AdamW's with f32.
#[test]
fn meaningless_optimizer_combinations_are_refused() {
    for optimizer in [OptimizerKind::Adafactor, OptimizerKind::Muon] {
        for state in [OptimState::Bf16, OptimState::Int8] {
            let err = run(&with(optimizer, state, 1)).unwrap_err();
            assert!(
                matches!(&err, PretrainError::Config(m) if m.contains("--optim-state")),
                "{err}"
            );
        }
    }
    // The offloaded step is AdamW's with f32 moments.
    for (optimizer, state) in COMPACT {
        let err = run(&offloaded(with(optimizer, state, 1))).unwrap_err();
        assert!(
            matches!(&err, PretrainError::Config(m) if m.contains("--offload optimizer")),
            "{err}"
        );
        let err = run(&params_offloaded(PretrainConfig {
            parallel: ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
            ..with(optimizer, state, 1)
        }))
        .unwrap_err();
        assert!(
            matches!(&err, PretrainError::Config(m) if m.contains("--offload params")),
            "{err}"
        );
    }
    // Offloaded parameters are FSDP shards: a replicated parameter or ZeRO-1/2's would be
    // uploaded whole at every use.
    for fsdp in [
        FsdpStrategy::NoShard,
        FsdpStrategy::ShardOptimizer,
        FsdpStrategy::ShardGradOp,
    ] {
        let err = run(&params_offloaded(PretrainConfig {
            parallel: ParallelConfig::layout(2, 1, fsdp, None),
            ..small(1)
        }))
        .unwrap_err();
        assert!(
            matches!(&err, PretrainError::Config(m) if m.contains("--fsdp full")),
            "{fsdp:?}: {err}"
        );
    }

    let dir = scratch("resume-other-optimizer");
    run(&PretrainConfig {
        save: Some(dir.clone()),
        ..small(2)
    })
    .unwrap();
    for optimizer in [OptimizerKind::Adafactor, OptimizerKind::Muon] {
        let err = run(&PretrainConfig {
            resume: Some(dir.clone()),
            ..with(optimizer, OptimState::F32, 4)
        })
        .unwrap_err();
        assert!(
            matches!(&err, PretrainError::Checkpoint { reason, .. } if reason.contains("not in the checkpoint")),
            "{optimizer:?}: {err}"
        );
    }
    // 8-bit moments are not f32 AdamW's: resuming them with f32 moments is refused.
    let dir = scratch("resume-int8-as-f32");
    run(&PretrainConfig {
        save: Some(dir.clone()),
        ..with(OptimizerKind::Adamw, OptimState::Int8, 2)
    })
    .unwrap();
    let err = run(&PretrainConfig {
        resume: Some(dir),
        ..small(4)
    })
    .unwrap_err();
    assert!(
        matches!(&err, PretrainError::Checkpoint { reason, .. } if reason.contains("moment_1")),
        "{err}"
    );
}

/// On Wgpu the fused AdamW runs many parameters per launch and hands each new parameter back
/// deferred until the launch runs (`FusedOps::adamw_batch` > 1), as the offloaded AdamW hands
/// back each piece its thread is still computing: a checkpoint saved right after such a step
/// holds the new values (the snapshot waits for them), so a run resumed from it is the straight
/// run bit for bit, on one rank and on FSDP over two.
#[cfg(feature = "wgpu")]
#[test]
fn deferred_parameters_are_saved_with_their_values_on_wgpu() {
    use wildfire::pretrain::run_on;
    let device = Default::default();
    for parallel in one_rank_and_fsdp_two() {
        let config = |steps| PretrainConfig {
            parallel: parallel.clone(),
            timeout: crate::suite::ON_LAVAPIPE_TIMEOUT,
            ..small(steps)
        };
        let what = format!("wgpu dp {}", parallel.dp);
        let straight = run_on::<burn::backend::Wgpu>(&config(4), &device).unwrap();
        let dir = scratch(&format!("deferred-wgpu-{}", parallel.dp));
        let first = run_on::<burn::backend::Wgpu>(
            &PretrainConfig {
                save: Some(dir.clone()),
                ..config(2)
            },
            &device,
        )
        .unwrap();
        let resumed = run_on::<burn::backend::Wgpu>(
            &PretrainConfig {
                resume: Some(dir),
                ..config(4)
            },
            &device,
        )
        .unwrap();
        follows_straight(&what, &first, &resumed, &straight, None);
    }
}
