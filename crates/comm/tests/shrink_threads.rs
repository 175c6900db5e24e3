//! Shrinking a group after a failure on the threads backend: the survivors agree on the same
//! members, get a fresh group whose collectives work, shrink again after a second failure,
//! and never hang (every test's time is bounded and asserted).

use bonfire_comm::{CommError, ProcessGroup, ReduceOp, Shrunk, ThreadWorld, World};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(5);
/// Every test finishes well within this (failures wake peers at once; only the test of a
/// missing live rank waits for the timeout).
const BOUND: Duration = Duration::from_secs(20);

/// Where in its program the doomed rank dies.
#[derive(Debug, Clone, Copy)]
enum Point {
    /// Before its first call.
    Start,
    /// Between two all-reduces.
    BetweenCollectives,
    /// After sending a message its peer waits for in vain.
    AfterASend,
    /// It returns (no panic) instead of making its next call.
    Returns,
}

/// What a survivor reports: its shrink outcome and the sum of world ranks over the new group.
#[derive(Debug)]
struct Survived {
    survivors: Vec<usize>,
    failed: Vec<usize>,
    world_ranks: Vec<usize>,
    rank_sum: f32,
    first_seq_ok: bool,
}

/// The survivor's side: the failed call's error, then the shrink and a collective on it.
fn survive(pg: &ProcessGroup, err: CommError) -> Survived {
    assert!(
        err.is_fatal(),
        "a peer failure is fatal to the group: {err}"
    );
    let Shrunk {
        group,
        survivors,
        failed,
    } = pg.shrink().expect("the survivors agree");
    assert_eq!(group.size(), survivors.len());
    assert_eq!(survivors[group.rank()], pg.rank());
    let mut v = [pg.rank() as f32];
    group.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    Survived {
        survivors,
        failed: failed.iter().map(|f| f.0).collect(),
        world_ranks: group.world_ranks(),
        rank_sum: v[0],
        first_seq_ok: group.flight_recorder().dump("").contains("#0 all_reduce"),
    }
}

/// Rank 2 of 4 dies at `point`; the others run until their call fails, then shrink.
fn kill_one(point: Point) -> Vec<Option<Survived>> {
    let outcomes = ThreadWorld::new(4).timeout(TIMEOUT).launch_each(|pg| {
        let doomed = pg.rank() == 2;
        if doomed && matches!(point, Point::Start) {
            panic!("rank 2 dies at the start");
        }
        let mut v = vec![1.0f32; 8];
        if let Err(err) = pg.all_reduce(&mut v, ReduceOp::Sum) {
            assert!(matches!(point, Point::Start), "{point:?}: {err}");
            return Some(survive(&pg, err));
        }
        if doomed {
            match point {
                Point::BetweenCollectives => panic!("rank 2 dies between collectives"),
                Point::AfterASend => {
                    pg.send(&[7.0f32], 3, 1).unwrap();
                    panic!("rank 2 dies after a send");
                }
                Point::Returns => return None,
                Point::Start => unreachable!(),
            }
        }
        let err = match (point, pg.rank()) {
            // Rank 3 receives the message, then waits for a second one that never comes.
            (Point::AfterASend, 3) => {
                let mut m = [0.0f32];
                pg.recv(&mut m, 2, 1).unwrap();
                pg.recv(&mut m, 2, 1).unwrap_err()
            }
            _ => pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err(),
        };
        Some(survive(&pg, err))
    });
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, o)| match o {
            Ok(s) => s,
            Err(f) => {
                assert_eq!(rank, 2, "only rank 2 fails: {}", f.message);
                None
            }
        })
        .collect()
}

#[test]
fn survivors_of_one_failure_agree_on_one_group_wherever_it_dies() {
    for point in [
        Point::Start,
        Point::BetweenCollectives,
        Point::AfterASend,
        Point::Returns,
    ] {
        let started = Instant::now();
        let outcomes = kill_one(point);
        assert!(
            started.elapsed() < BOUND,
            "{point:?} took {:?}",
            started.elapsed()
        );
        let survived: Vec<&Survived> = outcomes.iter().flatten().collect();
        assert_eq!(survived.len(), 3, "{point:?}");
        for s in &survived {
            assert_eq!(s.survivors, vec![0, 1, 3], "{point:?}");
            assert_eq!(s.failed, vec![2], "{point:?}");
            assert_eq!(s.world_ranks, vec![0, 1, 3], "{point:?}");
            assert_eq!(s.rank_sum, 4.0, "{point:?}: 0 + 1 + 3");
            assert!(
                s.first_seq_ok,
                "{point:?}: the fresh group starts at call #0"
            );
        }
    }
}

#[test]
fn a_second_failure_shrinks_again() {
    let started = Instant::now();
    let outcomes = ThreadWorld::new(4).timeout(TIMEOUT).launch_each(|pg| {
        if pg.rank() == 1 {
            panic!("first failure");
        }
        let err = pg.barrier().unwrap_err();
        let first = pg.shrink().unwrap();
        assert_eq!(first.survivors, vec![0, 2, 3]);
        // The new group's rank 2 is world rank 3: it dies next.
        if first.group.rank() == 2 {
            panic!("second failure");
        }
        let err2 = first.group.barrier().unwrap_err();
        let second = first.group.shrink().unwrap();
        let mut v = [1.0f64];
        second.group.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        (
            err.to_string(),
            err2,
            second.survivors,
            second.group.world_ranks(),
            v[0],
        )
    });
    assert!(started.elapsed() < BOUND);
    assert!(outcomes[1].is_err() && outcomes[3].is_err());
    for rank in [0, 2] {
        let (_, err2, survivors, world, sum) = outcomes[rank].as_ref().unwrap();
        assert!(err2.to_string().contains("second failure"), "{err2}");
        assert_eq!(survivors, &vec![0, 1], "ranks of the 3-member group");
        assert_eq!(world, &vec![0, 2]);
        assert_eq!(*sum, 2.0);
    }
}

#[test]
fn a_rank_that_dies_during_the_agreement_is_left_out() {
    let started = Instant::now();
    let outcomes = ThreadWorld::new(4).timeout(TIMEOUT).launch_each(|pg| {
        if pg.rank() == 3 {
            panic!("first failure");
        }
        let err = pg.barrier().unwrap_err();
        if pg.rank() == 1 {
            // Alive while the others wait in the agreement, then dead before joining it.
            std::thread::sleep(Duration::from_millis(300));
            panic!("dies during the agreement");
        }
        let shrunk = pg.shrink().unwrap();
        let mut v = [pg.rank() as f32];
        shrunk.group.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        (err.is_fatal(), shrunk.survivors, shrunk.failed, v[0])
    });
    assert!(started.elapsed() < BOUND);
    for rank in [0, 2] {
        let (fatal, survivors, failed, sum) = outcomes[rank].as_ref().unwrap();
        assert!(fatal);
        assert_eq!(survivors, &vec![0, 2]);
        let failed: Vec<usize> = failed.iter().map(|f| f.0).collect();
        assert_eq!(failed, vec![1, 3]);
        assert_eq!(*sum, 2.0);
    }
}

#[test]
fn no_agreement_while_a_live_rank_stays_away_fails_clearly_and_bounded() {
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let outcomes = ThreadWorld::new(3).timeout(timeout).launch_each(|pg| {
        if pg.rank() == 2 {
            // Alive but never joins: it sleeps past the agreement's timeout.
            std::thread::sleep(timeout * 4);
            return None;
        }
        let t = Instant::now();
        let err = pg.shrink().unwrap_err();
        Some((err.to_string(), t.elapsed()))
    });
    assert!(started.elapsed() < BOUND);
    let texts: Vec<String> = outcomes
        .iter()
        .take(2)
        .map(|o| {
            let (text, waited) = o.as_ref().unwrap().as_ref().unwrap();
            // The first caller's deadline decides for both (they start a little apart).
            let early = timeout - Duration::from_millis(150);
            assert!(*waited >= early && *waited < timeout * 3, "{waited:?}");
            assert!(text.contains("ranks [2] are alive"), "{text}");
            text.clone()
        })
        .collect();
    assert_eq!(texts[0], texts[1], "every caller gets the same decision");
}

#[test]
fn stale_messages_of_the_old_group_do_not_reach_the_new_one() {
    let outcomes = ThreadWorld::new(3).timeout(TIMEOUT).launch_each(|pg| {
        match pg.rank() {
            // Sent on the old group, never received there; then rank 2 is told to die, so
            // the send cannot meet a group already aborted by the death (it did, under load,
            // and rank 0's unwrap took rank 0 down too).
            0 => {
                pg.send(&[1.0f32], 1, 7).unwrap();
                pg.send(&[0.0f32], 2, 8).unwrap();
            }
            2 => {
                pg.recv(&mut [0.0f32], 0, 8).unwrap();
                panic!("dies")
            }
            _ => {}
        }
        pg.barrier().unwrap_err();
        let shrunk = pg.shrink().unwrap();
        let g = shrunk.group;
        if g.rank() == 0 {
            g.send(&[2.0f32], 1, 7).unwrap();
            None
        } else {
            let mut m = [0.0f32];
            g.recv(&mut m, 0, 7).unwrap();
            Some(m[0])
        }
    });
    assert_eq!(*outcomes[1].as_ref().unwrap(), Some(2.0));
}

#[test]
fn the_old_group_is_unusable_after_the_shrink_and_shrinks_once() {
    let outcomes = ThreadWorld::new(2).timeout(TIMEOUT).launch_each(|pg| {
        if pg.rank() == 1 {
            panic!("dies");
        }
        pg.barrier().unwrap_err();
        let shrunk = pg.shrink().unwrap();
        let again = pg.shrink().unwrap_err();
        let old = pg.barrier().unwrap_err();
        // A group of one still works.
        shrunk.group.barrier().unwrap();
        (again.to_string(), old.is_fatal())
    });
    let (again, old_fatal) = outcomes[0].as_ref().unwrap();
    assert!(again.contains("shrank this group already"), "{again}");
    assert!(old_fatal);
}

#[test]
fn a_backend_that_cannot_shrink_says_so() {
    // A single-process world (the backend of a plain process, like MPI's it cannot shrink).
    let world = World::from_env().unwrap();
    let err = world.group().shrink().unwrap_err();
    assert!(
        matches!(err, CommError::Unsupported { .. }) && err.to_string().contains("checkpoint"),
        "{err}"
    );
}

/// A program of mixed calls, run until one fails; then the survivors shrink and sum.
fn until_failure(pg: &ProcessGroup) -> Option<Survived> {
    let mut v = vec![pg.rank() as f32; 5];
    let next = (pg.rank() + 1) % pg.size();
    let prev = (pg.rank() + pg.size() - 1) % pg.size();
    for round in 0..4 {
        let step = pg
            .all_reduce(&mut v, ReduceOp::Sum)
            .and_then(|_| pg.send(&[round as f32], next, 3))
            .and_then(|_| pg.recv(&mut [0.0f32], prev, 3))
            .and_then(|_| pg.barrier());
        if let Err(err) = step {
            return Some(survive(pg, err));
        }
    }
    None
}

#[test]
fn an_injected_failure_at_any_call_is_survived() {
    // Rank 1 makes 4 calls per round, 16 in all: kill it at each of the first 9.
    for call in 0..9 {
        let started = Instant::now();
        let outcomes = ThreadWorld::new(4)
            .timeout(TIMEOUT)
            .inject_failure(1, call)
            .launch_each(|pg| {
                let out = until_failure(&pg);
                assert!(
                    pg.rank() != 1 || out.is_none(),
                    "the dead rank does not shrink"
                );
                out
            });
        assert!(started.elapsed() < BOUND, "call {call}");
        for (rank, o) in outcomes.iter().enumerate() {
            match (rank, o) {
                (1, Err(f)) => assert!(f.message.contains("injected failure"), "{}", f.message),
                (1, Ok(_)) => panic!("call {call}: the dead rank's survive() must fail"),
                (_, Ok(Some(s))) => {
                    assert_eq!(s.survivors, vec![0, 2, 3], "call {call}");
                    assert_eq!(s.rank_sum, 5.0, "call {call}");
                }
                (_, other) => panic!("call {call}: rank {rank}: {other:?}"),
            }
        }
    }
}
