//! Tests of the schedules: every kind runs with paired messages, bubbles and held activations as
//! the theory says, bad schedules refused, the table.

use super::*;

const KINDS: [(ScheduleKind, usize); 4] = [
    (ScheduleKind::GPipe, 1),
    (ScheduleKind::OneFOneB, 1),
    (ScheduleKind::Interleaved, 2),
    (ScheduleKind::ZeroBubble, 1),
];

/// Every schedule, p = 2 and 4 and M = 4, 8, 16, runs to the end (no deadlock), holds every
/// action once, and sends and receives exactly one message per forward and backward that
/// crosses ranks (and as many as its peers receive and send).
#[test]
fn every_schedule_runs_and_its_messages_pair_up() {
    for (kind, v) in KINDS {
        for p in [2, 4] {
            for m in [4, 8, 16] {
                let s = Schedule::new(kind, p, m, v).unwrap();
                s.simulate(&Costs::default()).unwrap();
                let counts: Vec<_> = (0..p).map(|r| s.p2p_counts(r)).collect();
                let sends: usize = counts.iter().map(|c| c.0).sum();
                let recvs: usize = counts.iter().map(|c| c.1).sum();
                // Each stage boundary carries M activations and M gradients.
                let boundaries = s.stages() - 1;
                assert_eq!((sends, recvs), (2 * m * boundaries, 2 * m * boundaries));
                if v == 1 {
                    // First and last stages talk to one neighbour, the others to two.
                    for (r, &c) in counts.iter().enumerate() {
                        let neighbours = usize::from(r > 0) + usize::from(r + 1 < p);
                        assert_eq!(c, (m * neighbours, m * neighbours), "{kind:?} rank {r}");
                    }
                }
            }
        }
    }
}

/// Uniform costs: GPipe's and 1F1B's bubble is (p−1)/(M+p−1) on every rank; interleaving
/// with V chunks (each 1/V of a stage's work) makes it (p−1)/(V·M+p−1); ZB-H1's is below
/// 1F1B's. 1F1B and ZB-H1 hold at most p micro-batches' activations, GPipe M.
#[test]
fn bubbles_and_held_activations_match_the_theory() {
    for p in [2usize, 4] {
        for m in [4usize, 8, 16] {
            let theory = (p - 1) as f64 / (m + p - 1) as f64;
            let full = Costs {
                forward: 1.0,
                backward_input: 1.0,
                backward_weight: 1.0,
                transfer: 0.0,
            };
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let t = Schedule::new(kind, p, m, 1)
                    .unwrap()
                    .simulate(&full)
                    .unwrap();
                for r in 0..p {
                    assert!((t.bubble(r) - theory).abs() < 1e-12, "{kind:?} p={p} m={m}");
                    let held = t.peak_activations(r);
                    match kind {
                        ScheduleKind::GPipe => assert_eq!(held, m),
                        _ => assert_eq!(held, (p - r).min(m)),
                    }
                }
            }
            let v = 2;
            let chunk = Costs {
                forward: 1.0 / v as f64,
                backward_input: 1.0 / v as f64,
                backward_weight: 1.0 / v as f64,
                transfer: 0.0,
            };
            let t = Schedule::new(ScheduleKind::Interleaved, p, m, v)
                .unwrap()
                .simulate(&chunk)
                .unwrap();
            let interleaved = (p - 1) as f64 / (v * m + p - 1) as f64;
            assert!(
                (t.mean_bubble() - interleaved).abs() < 1e-9,
                "interleaved p={p} m={m}: {} vs {interleaved}",
                t.mean_bubble()
            );
            let one = Schedule::new(ScheduleKind::OneFOneB, p, m, 1)
                .unwrap()
                .simulate(&full)
                .unwrap();
            let zb = Schedule::new(ScheduleKind::ZeroBubble, p, m, 1)
                .unwrap()
                .simulate(&full)
                .unwrap();
            assert!(zb.makespan() < one.makespan(), "ZB-H1 p={p} m={m}");
            for r in 0..p {
                assert!(zb.peak_activations(r) <= p);
            }
        }
    }
}

/// Bad input: typed errors, before anything runs.
#[test]
fn bad_schedules_are_refused() {
    let e = Schedule::new(ScheduleKind::Interleaved, 4, 6, 2).unwrap_err();
    assert!(e.to_string().contains("multiple of"), "{e}");
    let e = Schedule::new(ScheduleKind::Interleaved, 4, 8, 1).unwrap_err();
    assert!(e.to_string().contains("2 or more"), "{e}");
    let e = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 2).unwrap_err();
    assert!(e.to_string().contains("interleaved"), "{e}");
    assert!("pipedream".parse::<ScheduleKind>().is_err());
    // A rank that runs its backward before the next stage's: it waits forever.
    let a = |work, stage, mb| action(work, stage, mb);
    let stuck = vec![
        vec![a(Work::Forward, 0, 0), a(Work::Backward, 0, 0)],
        vec![a(Work::Backward, 1, 0), a(Work::Forward, 1, 0)],
    ];
    let s = Schedule::from_actions(ScheduleKind::GPipe, 1, 1, stuck).unwrap();
    let e = s.simulate(&Costs::default()).unwrap_err();
    assert!(matches!(e, Error::ScheduleDeadlock(_)), "{e}");
    assert!(e.to_string().contains("rank 1 at B0s1"), "{e}");
    // A missing backward.
    let short = vec![vec![a(Work::Forward, 0, 0)]];
    assert!(Schedule::from_actions(ScheduleKind::GPipe, 1, 1, short).is_err());
}

/// The table `--pp-schedule-dump` prints: 1F1B on 2 ranks, 2 micro-batches.
#[test]
fn the_table_shows_each_rank_in_time() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let table = s.table().unwrap();
    let rows: Vec<&str> = table.lines().skip(1).collect();
    assert_eq!(rows[0], "rank 0: F0 F1  .  . B0 B0  . B1 B1  bubble 33.3%");
    assert_eq!(rows[1], "rank 1:  . F0 B0 B0 F1 B1 B1  .  .  bubble 33.3%");
    assert!(s.svg(&Costs::default()).unwrap().contains("<rect"));
}
