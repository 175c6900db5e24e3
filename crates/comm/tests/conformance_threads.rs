//! The conformance suite on the in-process backend, world sizes 1 to 8 (oversubscribed on
//! small machines).

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::conformance;
use std::time::Duration;

fn run(world_size: usize) {
    let outcomes = ThreadWorld::new(world_size)
        .timeout(Duration::from_secs(60))
        .launch(|pg| conformance::run_all(&pg))
        .expect("no rank panicked");
    let failures: Vec<String> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(rank, o)| o.as_ref().err().map(|e| format!("rank {rank}: {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "{world_size} ranks:\n{}",
        failures.join("\n")
    );
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let checks = outcome.unwrap();
        assert!(checks > 500, "rank {rank} made only {checks} checks");
    }
}

#[test]
fn world_of_1() {
    run(1);
}
#[test]
fn world_of_2() {
    run(2);
}
#[test]
fn world_of_3() {
    run(3);
}
#[test]
fn world_of_4() {
    run(4);
}
#[test]
fn world_of_5() {
    run(5);
}
#[test]
fn world_of_6() {
    run(6);
}
#[test]
fn world_of_7() {
    run(7);
}
#[test]
fn world_of_8() {
    run(8);
}
