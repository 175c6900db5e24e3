//! The static checker accepts every generated schedule and rejects hand-made broken ones,
//! naming the offending actions.

use bonfire_comm::ThreadWorld;
use bonfire_pipeline::Generate;
use bonfire_pipeline::{
    Action, Activation, PipelineError, Problem, Schedule, ScheduleKind, StageCompute, StageMap,
    check, run_schedule,
};
use std::time::Duration;

use Action::*;

fn two_ranks(name: &str, r0: Vec<Action>, r1: Vec<Action>, m: usize) -> Schedule {
    Schedule {
        name: name.into(),
        stage_map: StageMap::Looped {
            ranks: 2,
            chunks: 1,
        },
        microbatches: m,
        actions: vec![r0, r1],
    }
}

/// A correct 2-rank, 1-micro-batch schedule.
fn good() -> Schedule {
    two_ranks(
        "good",
        vec![
            Forward { mb: 0, chunk: 0 },
            SendActivation {
                mb: 0,
                chunk: 0,
                to: 1,
            },
            RecvGrad {
                mb: 0,
                chunk: 0,
                from: 1,
            },
            Backward { mb: 0, chunk: 0 },
        ],
        vec![
            RecvActivation {
                mb: 0,
                chunk: 0,
                from: 0,
            },
            Forward { mb: 0, chunk: 0 },
            Backward { mb: 0, chunk: 0 },
            SendGrad {
                mb: 0,
                chunk: 0,
                to: 0,
            },
        ],
        1,
    )
}

#[test]
fn accepts_a_correct_schedule() {
    check(&good()).unwrap();
    assert_eq!(good().actions, ScheduleKind::GPipe.generate(2, 1).actions);
}

#[test]
fn rejects_a_missing_recv() {
    let mut s = good();
    s.name = "missing-recv".into();
    s.actions[1].remove(0); // rank 1 never receives its input
    let err = check(&s).unwrap_err();
    let text = err.to_string();
    assert!(
        err.problems.contains(&Problem::UnmatchedSend {
            rank: 0,
            index: 1,
            action: SendActivation {
                mb: 0,
                chunk: 0,
                to: 1
            },
        }),
        "{text}"
    );
    assert!(
        err.problems.iter().any(|p| matches!(
            p,
            Problem::Order {
                rank: 1,
                action: Forward { mb: 0, chunk: 0 },
                ..
            }
        )),
        "{text}"
    );
    assert!(
        text.contains("rank 0 action #1 SendActivation(mb=0, chunk=0, to=1): no matching receive"),
        "{text}"
    );
}

#[test]
fn rejects_a_missing_send() {
    let mut s = good();
    s.actions[1].pop(); // rank 1 never sends the gradient back
    let err = check(&s).unwrap_err();
    assert!(
        err.problems.contains(&Problem::UnmatchedRecv {
            rank: 0,
            index: 2,
            action: RecvGrad {
                mb: 0,
                chunk: 0,
                from: 1
            },
        }),
        "{err}"
    );
}

#[test]
fn rejects_a_cross_wait_cycle() {
    // Each rank waits for the other before sending: rank 0 wants the gradient before it has
    // sent the activation that rank 1 waits for.
    let s = two_ranks(
        "cycle",
        vec![
            Forward { mb: 0, chunk: 0 },
            RecvGrad {
                mb: 0,
                chunk: 0,
                from: 1,
            },
            SendActivation {
                mb: 0,
                chunk: 0,
                to: 1,
            },
            Backward { mb: 0, chunk: 0 },
        ],
        vec![
            RecvActivation {
                mb: 0,
                chunk: 0,
                from: 0,
            },
            Forward { mb: 0, chunk: 0 },
            Backward { mb: 0, chunk: 0 },
            SendGrad {
                mb: 0,
                chunk: 0,
                to: 0,
            },
        ],
        1,
    );
    let err = check(&s).unwrap_err();
    assert_eq!(
        err.problems,
        vec![Problem::Deadlock {
            blocked: vec![
                (
                    0,
                    1,
                    RecvGrad {
                        mb: 0,
                        chunk: 0,
                        from: 1
                    }
                ),
                (
                    1,
                    0,
                    RecvActivation {
                        mb: 0,
                        chunk: 0,
                        from: 0
                    }
                ),
            ],
            cycle: vec![0, 1],
        }]
    );
    let text = err.to_string();
    assert!(text.contains("cycle: rank 0 -> rank 1 -> rank 0"), "{text}");
}

#[test]
fn rejects_backward_before_forward() {
    let mut s = ScheduleKind::OneFOneB.generate(4, 4);
    let list = &mut s.actions[3];
    let b0 = list
        .iter()
        .position(|a| *a == Backward { mb: 0, chunk: 0 })
        .unwrap();
    let moved = list.remove(b0);
    list.insert(0, moved);
    let err = check(&s).unwrap_err();
    assert!(
        err.problems.iter().any(|p| matches!(p,
            Problem::Order { rank: 3, index: 0, action: Backward { mb: 0, chunk: 0 }, why }
                if why.contains("before Forward(mb=0, chunk=0)"))),
        "{err}"
    );
}

#[test]
fn rejects_a_cycle_inside_a_four_rank_1f1b() {
    // Rank 0 asks for micro-batch 0's gradient before sending its activation: ranks 0 and 1
    // wait on each other, ranks 2 and 3 wait behind them.
    let mut s = ScheduleKind::OneFOneB.generate(4, 4);
    let list = &mut s.actions[0];
    let rg = list
        .iter()
        .position(|a| {
            *a == RecvGrad {
                mb: 0,
                chunk: 0,
                from: 1,
            }
        })
        .unwrap();
    let moved = list.remove(rg);
    list.insert(1, moved); // right after F0, before SendActivation(mb=0)
    let err = check(&s).unwrap_err();
    match &err.problems[..] {
        [Problem::Deadlock { blocked, cycle }] => {
            assert_eq!(cycle, &vec![0, 1], "{err}");
            assert_eq!(blocked.len(), 4, "{err}");
            assert_eq!(
                blocked[0],
                (
                    0,
                    1,
                    RecvGrad {
                        mb: 0,
                        chunk: 0,
                        from: 1
                    }
                ),
                "{err}"
            );
        }
        other => panic!("expected one deadlock, got {other:?}"),
    }
}

#[test]
fn rejects_wrong_peer_and_out_of_range() {
    let mut s = good();
    s.actions[0][1] = SendActivation {
        mb: 0,
        chunk: 0,
        to: 0,
    };
    s.actions[1][2] = Backward { mb: 5, chunk: 0 };
    let err = check(&s).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("rank 0 action #1 SendActivation(mb=0, chunk=0, to=0)"),
        "{text}"
    );
    assert!(
        text.contains("rank 1 action #2 Backward(mb=5, chunk=0): micro-batch out of range"),
        "{text}"
    );
}

#[test]
fn rejects_missing_weight_step() {
    let mut s = ScheduleKind::ZbH1.generate(2, 2);
    let w = s.actions[0]
        .iter()
        .position(|a| *a == BackwardWeight { mb: 1, chunk: 0 })
        .unwrap();
    s.actions[0].remove(w);
    let err = check(&s).unwrap_err();
    assert!(
        err.problems.contains(&Problem::Missing {
            rank: 0,
            what: "BackwardWeight(mb=1, chunk=0)".into()
        }),
        "{err}"
    );
}

struct Nothing;
impl StageCompute for Nothing {
    fn forward(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        Ok(Some(Activation::new(vec![1], vec![0.0])))
    }
    fn backward(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        Ok(Some(Activation::new(vec![1], vec![0.0])))
    }
    fn backward_input(
        &mut self,
        mb: usize,
        c: usize,
        g: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        self.backward(mb, c, g)
    }
    fn backward_weight(&mut self, _: usize, _: usize) -> Result<(), PipelineError> {
        Ok(())
    }
}

#[test]
fn runtime_refuses_a_bad_schedule_without_hanging() {
    let bad = {
        let mut s = good();
        s.actions[1].remove(0);
        s
    };
    let out = ThreadWorld::new(2)
        .timeout(Duration::from_secs(10))
        .launch(
            |pg| match run_schedule(&pp_mesh(&pg), "pp", &bad, &mut Nothing) {
                Err(PipelineError::Schedule(e)) => e.problems.len(),
                other => panic!("expected a schedule error, got {other:?}"),
            },
        )
        .unwrap();
    assert!(out.iter().all(|&n| n >= 2));
    // And the good one runs.
    ThreadWorld::new(2)
        .timeout(Duration::from_secs(10))
        .launch(|pg| {
            run_schedule(&pp_mesh(&pg), "pp", &good(), &mut Nothing)
                .unwrap()
                .spans
                .len()
        })
        .unwrap();
}

fn pp_mesh(pg: &bonfire_comm::ProcessGroup) -> bonfire_dtensor::DeviceMesh {
    bonfire_dtensor::DeviceMesh::one_d(pg, "pp").unwrap()
}
