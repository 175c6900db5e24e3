//! Stages 1, 2, 3 with and without offload, on 2 and 4 ranks, SGD and Adam: parameters after
//! 3 steps equal DDP's and single-device training's within 1e-5 relative (1e-6 absolute floor).

mod common;
use bonfire_zero::Stage;
use common::*;

fn check(opt: Opt) {
    let model = initial();
    let reference = single(&model, opt);
    for n in [2, 4] {
        let d = ddp(&model, opt, n);
        assert_close(&d, &reference, &format!("ddp n={n} {opt:?}"));
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for offload in [false, true] {
                let all = zero(&model, opt, n, stage, offload);
                for (r, got) in all.iter().enumerate() {
                    let what = format!("{stage:?} offload={offload} n={n} rank={r} {opt:?}");
                    assert_close(got, &reference, &what);
                    assert_close(got, &d, &format!("{what} vs ddp"));
                }
            }
        }
    }
}

#[test]
fn small_model_sgd() {
    check(Opt::Sgd);
}

#[test]
fn small_model_adam() {
    check(Opt::Adam);
}
