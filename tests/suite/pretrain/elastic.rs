//! Elastic restarts (`--max-restarts`): a rank lost at a step (`--fail-at`, dead or hung) and
//! the run finishing on the replicas that remain (or with a replacement within
//! `--restart-grace`), from the latest checkpoint, resharded, the
//! global batch kept — its curve after the restart bitwise a `--resume` of that checkpoint on the
//! smaller mesh.

use super::{bits, same_bits, scratch, small};
use crate::suite::pairs;
use wildfire::checkpoint::CheckpointDir;
use wildfire::engine::metrics::MetricsLog;
use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
use wildfire::parallel::Error as ParallelError;
use wildfire::pretrain::{
    FailAt, PretrainConfig, PretrainError, RunSummary, lost_ranks, run, shrink,
};

/// Run `config` elastically with `fail` and the same run's reference: the checkpoint the restart
/// resumed from, resumed by hand with `--dp` and the micro-batches the restart chose. Returns
/// the elastic run after checking that its last attempt is that reference bit for bit, that the
/// metrics file holds the first attempt's steps then the restarted ones, and that the steps
/// before the failure are an uninterrupted run's.
fn lose_and_compare(name: &str, config: PretrainConfig, fail: FailAt) -> RunSummary {
    let dir = scratch(&format!("elastic-{name}"));
    let metrics = dir.join("metrics.jsonl");
    let elastic = run(&PretrainConfig {
        save: Some(dir.join("ckpt")),
        metrics: Some(metrics.clone()),
        max_restarts: 1,
        fail_at: Some(fail),
        ..config.clone()
    })
    .unwrap_or_else(|e| panic!("{name}: the elastic run failed: {e}"));
    assert_eq!(elastic.restarts.len(), 1, "{name}: one restart");
    let restart = &elastic.restarts[0];
    assert_eq!(restart.failed_at, fail.step, "{name}: {restart:?}");
    let every = config.save_every;
    assert_eq!(restart.resumed_from, fail.step / every * every, "{name}");
    assert_eq!(restart.dp[0], config.parallel.dp, "{name}");
    assert_eq!(restart.from_memory, config.memory_checkpoints, "{name}");
    assert!(
        restart.detect >= 0.0 && restart.reform > 0.0 && restart.reload > 0.0,
        "{name}: {restart:?}"
    );
    let first_step = elastic.steps.first().map(|m| m.step);
    assert_eq!(
        first_step,
        Some(restart.resumed_from),
        "{name}: the last attempt's steps"
    );
    assert_eq!(
        elastic.steps.len(),
        config.steps - restart.resumed_from,
        "{name}"
    );

    // The reference: that checkpoint resumed by hand on the restart's layout.
    let smaller = ParallelConfig {
        dp: restart.dp[1],
        ..config.parallel.clone()
    };
    let checkpoint = CheckpointDir::new(dir.join("ckpt"))
        .at(restart.resumed_from)
        .unwrap();
    let resumed = run(&PretrainConfig {
        parallel: smaller,
        accum: restart.micro_batches[1],
        resume: Some(checkpoint),
        memory_checkpoints: false,
        restart_grace: 0.0,
        ..config.clone()
    })
    .unwrap();
    let losses = |r: &RunSummary| r.steps.iter().map(|m| m.loss).collect::<Vec<_>>();
    assert_eq!(
        bits(&losses(&elastic)),
        bits(&losses(&resumed)),
        "{name}: losses"
    );
    for (a, b) in pairs(&elastic.steps, &resumed.steps) {
        assert_eq!(
            a.grad_norm.to_bits(),
            b.grad_norm.to_bits(),
            "{name} step {}",
            a.step
        );
    }
    same_bits(
        &format!("{name}: parameters"),
        &elastic.parameters,
        &resumed.parameters,
    );

    // Before the failure, the uninterrupted run's steps; the metrics file has both attempts.
    let straight = run(&PretrainConfig {
        steps: fail.step,
        memory_checkpoints: false,
        restart_grace: 0.0,
        ..config.clone()
    })
    .unwrap();
    let logged = MetricsLog::read(&metrics).unwrap();
    let steps: Vec<usize> = logged.iter().map(|m| m.step).collect();
    let expected: Vec<usize> = (0..fail.step)
        .chain(restart.resumed_from..config.steps)
        .collect();
    assert_eq!(steps, expected, "{name}: the metrics file's steps");
    // The first restarted step's metrics carry the restart, timed as in the summary.
    for (i, m) in logged.iter().enumerate() {
        let expected = (i == fail.step).then(|| restart.clone());
        assert_eq!(m.restart, expected, "{name}: the metrics of line {i}");
    }
    let before: Vec<f32> = logged[..fail.step].iter().map(|m| m.loss).collect();
    assert_eq!(
        bits(&before),
        bits(&losses(&straight)),
        "{name}: losses before the failure"
    );
    let _ = std::fs::remove_dir_all(&dir);
    elastic
}

/// [`small`] FullShard on dp × tp, a checkpoint every `every` steps.
fn layout(dp: usize, tp: usize, every: usize, steps: usize) -> PretrainConfig {
    PretrainConfig {
        parallel: ParallelConfig::layout(dp, tp, FsdpStrategy::FullShard, None),
        save_every: every,
        ..small(steps)
    }
}

/// dp 4 FullShard, `--batch-size 12`, 10 steps, a checkpoint every 5.
fn dp4_of_12() -> PretrainConfig {
    PretrainConfig {
        batch_size: 12,
        ..layout(4, 1, 5, 10)
    }
}

fn fail_at(hook: &str) -> FailAt {
    hook.parse().unwrap()
}

/// dp 4 FullShard, `--batch-size 12`, rank 2 dies at step 7: the run finishes on 3 ranks from
/// the checkpoint of step 5, each rank's 3 rows kept as 2 micro-batches of 2 (the global batch
/// of 12), bitwise a `--resume` of that checkpoint at `--dp 3 --accum 2`.
#[test]
fn a_dead_rank_restarts_the_run_on_the_replicas_left() {
    let config = dp4_of_12();
    let fail = fail_at("7:2");
    let elastic = lose_and_compare("dp4", config, fail);
    let restart = &elastic.restarts[0];
    assert_eq!(restart.lost_ranks, vec![2]);
    assert_eq!((restart.dp, restart.micro_batches), ([4, 3], [1, 2]));
    assert!(
        restart.failure.contains("--fail-at 7:2"),
        "{}",
        restart.failure
    );
    assert_eq!(restart.redone_steps(), 2);
    assert!(elastic.wall.restarts > 0.0);
}

/// `--memory-checkpoints`: the same restart reads the checkpoint every rank held in memory (rank
/// 2's files from its buddy, rank 3), no file — bitwise the `--resume` of the disk's copy.
#[test]
fn a_restart_reads_the_checkpoint_held_in_memory() {
    let config = PretrainConfig {
        memory_checkpoints: true,
        ..dp4_of_12()
    };
    let fail = fail_at("7:2");
    let elastic = lose_and_compare("memory", config, fail);
    assert!(elastic.restarts[0].from_memory);
}

/// `--restart-grace`: rank 2 dies of a software fault at step 7 and its device answers the
/// probe at once, so a replacement joins: the run restarts at dp 4 with its micro-batches
/// unchanged, and ends bitwise where the uninterrupted run ends.
#[test]
fn a_dead_rank_is_replaced_within_the_grace_period() {
    let config = PretrainConfig {
        restart_grace: 5.0,
        ..dp4_of_12()
    };
    let elastic = lose_and_compare("grace", config.clone(), fail_at("7:2"));
    let restart = &elastic.restarts[0];
    assert_eq!(restart.lost_ranks, vec![2]);
    assert_eq!(restart.replaced, vec![2]);
    assert_eq!((restart.dp, restart.micro_batches), ([4, 4], [1, 1]));
    let straight = run(&PretrainConfig {
        restart_grace: 0.0,
        ..config
    })
    .unwrap();
    same_bits(
        "grace: parameters against the uninterrupted run",
        &elastic.parameters,
        &straight.parameters,
    );
}

/// `--fail-at 7:2:gone`: rank 2's device never answers, so the restart waits out the grace
/// period (counted in its re-forming), then drops the replica and goes on with 3 ranks.
#[test]
fn a_device_that_stays_gone_is_waited_for_then_its_replica_dropped() {
    let config = PretrainConfig {
        restart_grace: 0.5,
        ..dp4_of_12()
    };
    let elastic = lose_and_compare("gone", config, fail_at("7:2:gone"));
    let restart = &elastic.restarts[0];
    assert!(restart.replaced.is_empty(), "{restart:?}");
    assert_eq!((restart.dp, restart.micro_batches), ([4, 3], [1, 2]));
    assert!(restart.reform >= 0.5, "re-formed in {} s", restart.reform);
}

/// dp 2 × tp 2 FullShard, rank 1 (of replica 0) dies at step 3: the other replica (ranks 2, 3)
/// goes on alone as dp 1 × tp 2, the tensor-parallel axis whole.
#[test]
fn a_dead_tensor_parallel_rank_takes_its_replica_with_it() {
    let config = layout(2, 2, 2, 6);
    let fail = fail_at("3:1");
    let elastic = lose_and_compare("dp2tp2", config, fail);
    let restart = &elastic.restarts[0];
    assert_eq!((restart.dp, restart.micro_batches), ([2, 1], [1, 2]));
}

/// A rank that stops arriving at collectives (as one stuck inside a collective) is found by its
/// peers' timeout, released by their abort, and handled as a dead one: the detection takes the
/// timeout.
#[test]
fn a_hung_rank_is_released_by_the_timeout_and_restarted_without() {
    let config = PretrainConfig {
        timeout: 2.0,
        ..layout(2, 1, 2, 6)
    };
    let fail = fail_at("3:1:hang");
    let elastic = lose_and_compare("hang", config, fail);
    let restart = &elastic.restarts[0];
    assert_eq!(restart.lost_ranks, vec![1]);
    assert!(restart.failure.contains("timed out"), "{}", restart.failure);
    assert!(
        restart.detect >= 2.0,
        "detected in {} s, the timeout is 2 s",
        restart.detect
    );
}

/// Without restarts the hook's failure is the run's typed error naming the rank; a restart that
/// cannot keep the model axes or the global batch is a typed error saying which; bad flags are
/// refused before any work.
#[test]
fn elastic_refusals_are_typed() {
    let dead = |parallel: ParallelConfig, batch_size: usize| PretrainConfig {
        parallel,
        batch_size,
        fail_at: Some(FailAt {
            step: 1,
            rank: 1,
            hang: false,
            gone: false,
        }),
        ..small(3)
    };
    let err = run(&dead(
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        4,
    ))
    .unwrap_err();
    assert!(
        matches!(
            &err,
            PretrainError::Parallel(ParallelError::RankFailed { rank: 1, .. })
        ),
        "{err}"
    );
    assert_eq!(lost_ranks(&err), Some(vec![1]));

    // tp 2 alone: no replica is left, and the tensor-parallel axis cannot shrink.
    let scratch_dir = scratch("elastic-refusals");
    let err = run(&PretrainConfig {
        max_restarts: 1,
        save: Some(scratch_dir.clone()),
        ..dead(ParallelConfig::layout(1, 2, FsdpStrategy::NoShard, None), 4)
    })
    .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("--max-restarts 1")
            && message.contains("no data-parallel replica is left")
            && message.contains("--tp 2"),
        "{message}"
    );
    // Refused before step 0: nothing was saved.
    assert!(CheckpointDir::new(&scratch_dir).latest().is_err());

    // The global batch of 4 on 4 ranks does not split over 3.
    let four = PretrainConfig {
        parallel: ParallelConfig::layout(4, 1, FsdpStrategy::FullShard, None),
        batch_size: 4,
        ..small(3)
    };
    let message = shrink(&four, &[3]).unwrap_err().to_string();
    assert!(message.contains("--batch-size 4"), "{message}");
    let message = run(&PretrainConfig {
        max_restarts: 1,
        save: Some(scratch_dir.clone()),
        ..four.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("--max-restarts 1") && message.contains("--batch-size 4"),
        "{message}"
    );
    // 8 over 4 → 2: 2 rows each, as 2 micro-batches of the 1 row each had.
    let eight = PretrainConfig {
        batch_size: 8,
        ..four.clone()
    };
    let two = shrink(&eight, &[0, 1]).unwrap();
    assert_eq!((two.parallel.dp, two.accum, two.batch_size), (2, 2, 8));

    for (config, expected) in [
        (
            PretrainConfig {
                max_restarts: 1,
                ..small(3)
            },
            "--save",
        ),
        (
            PretrainConfig {
                fail_at: Some(FailAt {
                    step: 0,
                    rank: 4,
                    hang: false,
                    gone: false,
                }),
                ..small(3)
            },
            "ranks 0..1",
        ),
        (
            PretrainConfig {
                timeout: 0.0,
                ..small(3)
            },
            "--timeout",
        ),
        (
            PretrainConfig {
                memory_checkpoints: true,
                ..small(3)
            },
            "--max-restarts",
        ),
        (
            PretrainConfig {
                restart_grace: 5.0,
                ..small(3)
            },
            "--max-restarts",
        ),
        (
            PretrainConfig {
                restart_grace: -1.0,
                ..small(3)
            },
            "--restart-grace",
        ),
    ] {
        let message = run(&config).unwrap_err().to_string();
        assert!(message.contains(expected), "{message}");
    }
    assert_eq!("7:2".parse::<FailAt>().unwrap().to_string(), "7:2");
    assert!("7:2:hang".parse::<FailAt>().unwrap().hang);
    let gone = "7:2:gone".parse::<FailAt>().unwrap();
    assert!(gone.gone && !gone.hang && gone.to_string() == "7:2:gone");
    assert!("7".parse::<FailAt>().is_err() && "7:x".parse::<FailAt>().is_err());
    let _ = std::fs::remove_dir_all(&scratch_dir);
}
