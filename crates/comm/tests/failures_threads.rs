//! Failure behaviour of the in-process backend: nothing hangs, every rank learns why.

use bonfire_comm::{CommError, OpKind, ProcessGroup, ReduceOp, ThreadWorld};
use std::time::{Duration, Instant};

const SHORT: Duration = Duration::from_millis(400);

fn world(n: usize) -> ThreadWorld {
    ThreadWorld::new(n).timeout(SHORT)
}

#[test]
fn a_panicking_rank_fails_its_peers_fast() {
    let started = Instant::now();
    let outcomes = ThreadWorld::new(4)
        .timeout(Duration::from_secs(30))
        .launch_each(|pg| {
            let mut v = vec![1.0f32; 16];
            pg.all_reduce(&mut v, ReduceOp::Sum)?; // one good call first
            if pg.rank() == 2 {
                panic!("rank 2 lost its GPU");
            }
            let t = Instant::now();
            let err = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            Ok::<_, CommError>((err, t.elapsed()))
        });
    // Far below the 30 s timeout: peers are woken by the failure itself.
    assert!(started.elapsed() < Duration::from_secs(5));
    let failure = outcomes[2].as_ref().unwrap_err();
    assert!(failure.message.contains("lost its GPU"));
    for (rank, outcome) in outcomes.iter().enumerate().filter(|(r, _)| *r != 2) {
        let (err, waited) = outcome.as_ref().unwrap().as_ref().unwrap();
        assert!(
            waited < &Duration::from_secs(5),
            "rank {rank} waited {waited:?}"
        );
        let text = err.to_string();
        assert!(
            matches!(err, CommError::PeerFailed { peer: 2, .. })
                || matches!(err, CommError::Aborted { .. }),
            "rank {rank}: {err}"
        );
        assert!(
            text.contains("rank 2") && text.contains("lost its GPU"),
            "rank {rank}: {text}"
        );
    }
}

#[test]
fn launch_reports_the_panicking_rank() {
    let err = world(3)
        .launch(|pg| {
            if pg.rank() == 1 {
                panic!("boom on one");
            }
            pg.barrier().is_err()
        })
        .unwrap_err();
    assert_eq!(err.failures.len(), 1);
    assert_eq!(err.failures[0].rank, 1);
    assert!(err.to_string().contains("boom on one"));
}

#[test]
fn a_rank_that_returns_early_fails_its_peers_fast() {
    let outcomes = ThreadWorld::new(3)
        .timeout(Duration::from_secs(30))
        .launch(|pg| {
            if pg.rank() == 0 {
                return None;
            }
            let t = Instant::now();
            let err = pg.barrier().unwrap_err();
            Some((err, t.elapsed()))
        })
        .unwrap();
    for (err, waited) in outcomes.into_iter().flatten() {
        assert!(waited < Duration::from_secs(5));
        assert!(
            err.to_string()
                .contains("returned without making this call")
                || matches!(err, CommError::Aborted { .. }),
            "{err}"
        );
    }
}

#[test]
fn a_skipped_collective_times_out_with_the_flight_recorder() {
    let outcomes = world(3).launch(|pg| {
        pg.barrier().unwrap();
        if pg.rank() == 1 {
            // Skips the all_reduce and comes back late: by then the group is aborted.
            std::thread::sleep(SHORT * 3);
            let late = pg.all_reduce(&mut [0.0f32; 4], ReduceOp::Sum).unwrap_err();
            return late;
        }
        let t = Instant::now();
        let err = pg.all_reduce(&mut [0.0f32; 4], ReduceOp::Sum).unwrap_err();
        assert!(t.elapsed() >= SHORT, "gave up after {:?}", t.elapsed());
        err
    });
    let outcomes = outcomes.unwrap();
    let mut timeouts = 0;
    for (rank, err) in outcomes.iter().enumerate() {
        let text = err.to_string();
        match err {
            CommError::Timeout {
                missing,
                fingerprint,
                recorder,
                ..
            } => {
                timeouts += 1;
                assert_eq!(missing, &vec![1], "rank {rank}");
                assert_eq!(fingerprint.op, OpKind::AllReduce);
                assert!(recorder.contains("flight recorder") && recorder.contains("#0 barrier"));
                assert!(
                    text.contains("#1 all_reduce 4xf32") && text.contains("Started"),
                    "{text}"
                );
            }
            CommError::Aborted { reason, .. } => assert!(reason.contains("timed out"), "{reason}"),
            other => panic!("rank {rank}: unexpected {other}"),
        }
    }
    assert!(timeouts >= 1);
    assert!(matches!(outcomes[1], CommError::Aborted { .. }));
}

fn expect_mismatch_everywhere(n: usize, f: impl Fn(&ProcessGroup) -> Result<(), CommError> + Sync) {
    let outcomes = world(n)
        .launch(|pg| {
            let err = f(&pg).unwrap_err();
            // A mismatch is seen by every rank at the same call, so the group stays usable.
            let mut v = vec![1i64; 3];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v, vec![n as i64; 3]);
            err
        })
        .unwrap();
    for (rank, err) in outcomes.iter().enumerate() {
        match err {
            CommError::Mismatch {
                local,
                remote,
                recorder,
                ..
            } => {
                assert_ne!(local, remote, "rank {rank}");
                let text = err.to_string();
                assert!(text.contains(&local.to_string()) && text.contains(&remote.to_string()));
                assert!(recorder.contains("flight recorder"));
            }
            other => panic!("rank {rank}: expected a mismatch, got {other}"),
        }
    }
}

#[test]
fn ranks_disagreeing_on_the_kind_all_see_a_mismatch() {
    expect_mismatch_everywhere(3, |pg| {
        let mut v = vec![0.0f32; 4];
        if pg.rank() == 2 {
            pg.broadcast(&mut v, 0)
        } else {
            pg.all_reduce(&mut v, ReduceOp::Sum)
        }
    });
}

#[test]
fn ranks_disagreeing_on_the_count_all_see_a_mismatch() {
    expect_mismatch_everywhere(2, |pg| {
        let mut v = vec![0.0f32; 4 + pg.rank()];
        pg.all_reduce(&mut v, ReduceOp::Sum)
    });
}

#[test]
fn ranks_disagreeing_on_the_root_all_see_a_mismatch() {
    expect_mismatch_everywhere(4, |pg| pg.broadcast(&mut [0u8; 8], pg.rank() % 2));
}

#[test]
fn ranks_disagreeing_on_the_dtype_or_op_all_see_a_mismatch() {
    expect_mismatch_everywhere(2, |pg| {
        if pg.rank() == 0 {
            pg.all_reduce(&mut [0.0f32; 4], ReduceOp::Sum)
        } else {
            pg.all_reduce(&mut [0i32; 4], ReduceOp::Sum)
        }
    });
    expect_mismatch_everywhere(2, |pg| {
        let op = if pg.rank() == 0 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        pg.all_reduce(&mut [0.0f32; 4], op)
    });
}

#[test]
fn uneven_all_to_all_with_disagreeing_counts_fails_on_every_rank() {
    let outcomes = world(3)
        .launch(|pg| {
            let me = pg.rank();
            let mut send_counts = vec![1usize; 3];
            if me == 0 {
                send_counts[2] = 2; // rank 2 expects only 1 element from rank 0
            }
            let send = vec![me as f32; send_counts.iter().sum()];
            let mut recv = vec![0.0f32; 3];
            pg.all_to_all_uneven(&send, &send_counts, &mut recv, &[1, 1, 1])
                .unwrap_err()
        })
        .unwrap();
    for err in outcomes {
        assert!(
            matches!(
                err,
                CommError::CountMismatch {
                    sender: 0,
                    receiver: 2,
                    sent: 2,
                    expected: 1,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn even_and_uneven_all_to_all_do_not_pair_even_when_empty() {
    // Both sides move zero elements: only the form tells them apart.
    expect_mismatch_everywhere(2, |pg| {
        let mut recv: [f32; 0] = [];
        if pg.rank() == 0 {
            pg.all_to_all(&[], &mut recv)
        } else {
            pg.all_to_all_uneven(&[], &[0, 0], &mut recv, &[0, 0])
        }
    });
}

#[test]
fn send_recv_length_mismatch_is_reported_to_the_receiver() {
    let outcomes = world(2)
        .launch(|pg| {
            if pg.rank() == 0 {
                pg.send(&[1.0f32; 4], 1, 3).map(|_| None)
            } else {
                let err = pg.recv(&mut [0.0f32; 5], 0, 3).unwrap_err();
                Ok(Some(err))
            }
        })
        .unwrap();
    match outcomes[1].as_ref().unwrap() {
        Some(CommError::Mismatch { local, remote, .. }) => {
            assert_eq!((local.count, remote.count), (5, 4));
            assert_eq!((local.op, remote.op), (OpKind::Recv, OpKind::Send));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn a_recv_with_no_sender_times_out() {
    let outcomes = world(2)
        .launch(|pg| {
            if pg.rank() == 1 {
                let t = Instant::now();
                let err = pg.recv(&mut [0u8; 4], 0, 0).unwrap_err();
                assert!(t.elapsed() >= SHORT);
                Some(err)
            } else {
                std::thread::sleep(SHORT * 2);
                None
            }
        })
        .unwrap();
    assert!(
        matches!(outcomes[1], Some(CommError::Timeout { ref missing, .. }) if missing == &vec![0])
    );
}

#[test]
fn async_work_reports_a_peer_failure() {
    let outcomes = ThreadWorld::new(2)
        .timeout(Duration::from_secs(30))
        .launch_each(|pg| {
            if pg.rank() == 1 {
                panic!("rank 1 dies before the all_reduce");
            }
            let work = pg.all_reduce_async(vec![1.0f32; 1000], ReduceOp::Sum);
            work.wait().unwrap_err()
        });
    let err = outcomes[0].as_ref().unwrap();
    assert!(err.to_string().contains("dies before"), "{err}");
}

#[test]
fn disjoint_sub_groups_run_concurrently_and_fail_independently() {
    let outcomes = world(4)
        .launch(|pg| {
            let pair: Vec<usize> = if pg.rank() < 2 {
                vec![0, 1]
            } else {
                vec![2, 3]
            };
            let sub = pg.new_group(&pair).unwrap();
            if pg.rank() == 3 {
                // Its pair partner times out; the other pair is unaffected.
                std::thread::sleep(SHORT * 2);
                return sub.barrier().is_err();
            }
            let mut v = vec![pg.rank() as f64; 10];
            let r = sub.all_reduce(&mut v, ReduceOp::Sum);
            if pg.rank() < 2 {
                assert_eq!(v, vec![1.0; 10]);
            }
            r.is_err()
        })
        .unwrap();
    assert_eq!(outcomes, vec![false, false, true, true]);
}
