//! A recomputed region's forward runs twice — once in forward, again in backward — and the
//! statistics it records for a model's state (`bonfire_module::state`: a router's loads) are
//! recorded once: a raw count would double otherwise (DeepSeek's sign rule hides a uniform
//! doubling, so the bias suites cannot see it).

use bonfire_module::state;
use bonfire_recompute::{recomputations, recompute};
use burn::module::{Module, Param, ParamId};
use burn::tensor::{Device, Tensor};

#[derive(Module, Debug)]
struct Scale {
    w: Param<Tensor<1>>,
}

#[test]
fn a_recomputed_region_records_its_statistics_once() {
    let device = Device::flex().autodiff();
    let m = Scale {
        w: Param::from_tensor(Tensor::ones([3], &device).require_grad()),
    };
    let id = ParamId::new();
    let x = Tensor::<2>::ones([2, 3], &device).require_grad();
    state::clear();
    let before = recomputations();
    let y = recompute(&m, x, move |m, x| {
        state::record(id, [1.0, 2.0]);
        x * m.w.val().unsqueeze::<2>()
    });
    let grads = y.sum().backward();
    assert!(m.w.val().grad(&grads).is_some());
    assert_eq!(
        recomputations(),
        before + 1,
        "the region ran again in backward"
    );
    assert_eq!(state::take()[&id], [1.0, 2.0]);
}
