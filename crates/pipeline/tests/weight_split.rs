//! The zero-bubble B/W split is real and exact: a backward of a forward run under
//! `weight_grad::deferring` ("B") gives no linear weight any gradient, and "W" then adds
//! exactly (bitwise) the weight gradients of the undivided backward; a pipeline stage under
//! ZB-H1 and ZB-V hands its holder bitwise the gradients of the same schedule without the
//! split and of 1F1B; and a last stage that makes the loss with its last block
//! (`with_block_loss`, as a head fused with its loss does) hands over the same gradients and
//! loss as one that takes the block's output (`with_loss`).

use bonfire_comm::ThreadWorld;
use bonfire_dtensor::DeviceMesh;
use bonfire_module::weight_grad::{self, deferring};
use bonfire_pipeline::Generate;
use bonfire_pipeline::{
    Block, BurnStage, LocalChunks, Schedule, ScheduleKind, chunks_for_rank, microbatch_weights,
    run_schedule, split_balanced, split_batch,
};
use bonfire_tp::{ParallelLayerNorm, ParallelLinear};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Distribution, Tensor};
use std::collections::BTreeMap;
use std::time::Duration;

/// A pre-norm MLP on `[batch, seq, d]`: LN → fc1 (+bias) → GELU → fc2 (no bias), residual.
#[derive(Module, Debug)]
struct Net {
    ln: ParallelLayerNorm,
    fc1: ParallelLinear,
    fc2: ParallelLinear,
}

impl Net {
    fn new(d: usize, device: &Device) -> Self {
        Self {
            ln: ParallelLayerNorm::new(d, device),
            fc1: ParallelLinear::new(d, 4 * d, true, device),
            fc2: ParallelLinear::new(4 * d, d, false, device),
        }
    }
}

impl Block<3> for Net {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = self
            .fc2
            .forward(gelu(self.fc1.forward(self.ln.forward(x.clone()))));
        x + h
    }
}

/// Every float parameter's gradient in `grads`, by id (`None`: no gradient).
fn grads_of<M: Module>(module: &M, grads: &GradientsParams) -> BTreeMap<ParamId, Option<Vec<f32>>> {
    struct Get<'a>(&'a GradientsParams, BTreeMap<ParamId, Option<Vec<f32>>>);
    impl ModuleVisitor for Get<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let g = self.0.get::<D>(param.id);
            let g = g.map(|g| g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap());
            self.1.insert(param.id, g);
        }
    }
    let mut get = Get(grads, BTreeMap::new());
    module.visit(&mut get);
    get.1
}

fn dev() -> Device {
    Device::flex().autodiff()
}

#[test]
fn b_leaves_linear_weights_to_w_and_b_plus_w_is_the_full_backward() {
    let device = dev();
    let model = Net::new(16, &device);
    let x = Tensor::<3>::random([3, 5, 16], Distribution::Default, &device);
    let root = |y: Tensor<3>| (y.clone() * y).sum();

    // The undivided backward.
    let full_model = model.clone().fork(&device);
    let input = x.clone().require_grad();
    let mut full = root(full_model.forward(input.clone())).backward();
    let full_dx = input.grad_remove(&mut full).unwrap().into_data();
    let full = grads_of(&full_model, &GradientsParams::from_grads(full, &full_model));

    // B: the forward defers, the backward leaves the linear weights without a gradient.
    let split_model = model.fork(&device);
    let input = x.require_grad();
    let (y, deferred) = deferring(|| split_model.forward(input.clone()));
    assert_eq!(deferred.len(), 2, "both linear layers defer");
    let mut grads = root(y).backward();
    let dx = input.grad_remove(&mut grads).unwrap().into_data();
    for (name, w) in [
        ("fc1", &split_model.fc1.weight),
        ("fc2", &split_model.fc2.weight),
    ] {
        assert!(
            w.val().grad(&grads).is_none(),
            "B computed {name}.weight's gradient"
        );
    }
    let bias = split_model.fc1.bias.as_ref().unwrap().val();
    assert!(bias.grad(&grads).is_some(), "B computes the bias gradient");
    assert!(split_model.ln.weight.val().grad(&grads).is_some());
    assert_eq!(
        dx, full_dx,
        "B's input gradient is the full backward's, bitwise"
    );

    // W: exactly the missing gradients, bitwise those of the undivided backward.
    let before = weight_grad::applied();
    assert_eq!(deferred.apply(&mut grads), 2);
    // Counted on this thread only: exactly this call's two.
    assert_eq!(weight_grad::applied(), before + 2);
    let split = grads_of(
        &split_model,
        &GradientsParams::from_grads(grads, &split_model),
    );
    assert_eq!(split.len(), full.len());
    for (id, g) in &full {
        assert!(
            g.is_some(),
            "the full backward gives every parameter a gradient"
        );
        assert_eq!(
            &split[id], g,
            "parameter {id}: B + W differs from the full backward"
        );
    }
}

#[test]
fn outside_deferring_and_for_untracked_weights_nothing_is_deferred() {
    let device = dev();
    let model = Net::new(8, &device);
    let x = Tensor::<3>::random([2, 3, 8], Distribution::Default, &device).require_grad();
    // A frozen copy: weights are constants, nothing to defer.
    let frozen = model.clone().no_grad();
    let (_, deferred) = deferring(|| frozen.forward(x.clone()));
    assert!(deferred.is_empty());
    // Outside `deferring` the weights get their gradients in the one backward.
    let grads = (model.forward(x).sum()).backward();
    assert!(model.fc2.weight.val().grad(&grads).is_some());
}

/// The gradients one rank's holder received after one batch under `schedule`, by id.
type RankGrads = BTreeMap<ParamId, Option<Vec<f32>>>;

/// Four blocks, shared by every rank and run (each forks its own leaves).
fn blocks() -> Vec<Net> {
    (0..4).map(|_| Net::new(8, &dev())).collect()
}

/// Each rank's gradients, and how many weight gradients the ranks deferred to "W" steps
/// (counted on each rank's thread around its own work, summed).
fn stage_grads(blocks: &[Net], schedule: &Schedule, split: bool) -> (Vec<RankGrads>, u64) {
    let (grads, applied, _) = stage_run(blocks, schedule, split, false);
    (grads, applied)
}

/// [`stage_grads`], and the batch loss, with the loss made from the last block's output or
/// (`block_loss`) with the last block itself.
fn stage_run(
    blocks: &[Net],
    schedule: &Schedule,
    split: bool,
    block_loss: bool,
) -> (Vec<RankGrads>, u64, f64) {
    let (rows, m) = (4, schedule.microbatches);
    let ranks = ThreadWorld::new(schedule.ranks())
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let before = weight_grad::applied();
            let device = dev();
            // Each rank its own leaves holding the shared values.
            let model: Vec<Net> = blocks.iter().map(|b| b.clone().fork(&device)).collect();
            let stages = split_balanced(model, schedule.stages()).unwrap();
            let chunks = chunks_for_rank(&stages, schedule, pg.rank()).unwrap();
            let x = Tensor::<3>::ones([rows, 3, 8], &device) * 0.3;
            let mesh = DeviceMesh::one_d(&pg, "pp").unwrap();
            let stage = BurnStage::new(
                LocalChunks::new(chunks),
                schedule,
                pg.rank(),
                device.clone(),
                microbatch_weights(rows, m),
            )
            .with_weight_grad_split(split)
            .with_inputs(split_batch(x, m));
            let loss = |y: Tensor<3>| y.tanh().powi_scalar(2).mean();
            let mut stage = match block_loss {
                true => stage.with_block_loss(move |_, b: &Net, x| loss(b.forward(x))),
                false => stage.with_loss(move |_, y| loss(y)),
            };
            run_schedule(&mesh, "pp", schedule, &mut stage).unwrap();
            let (held, batch_loss) = stage.finish();
            let (chunks, grads) = held.into_parts();
            let applied = weight_grad::applied() - before;
            (grads_of(&chunks, &grads), applied, batch_loss)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let applied = ranks.iter().map(|(_, n, _)| n).sum();
    let loss = ranks.iter().find_map(|(_, _, l)| *l).expect("a last stage");
    (
        ranks.into_iter().map(|(g, _, _)| g).collect(),
        applied,
        loss,
    )
}

#[test]
fn a_loss_made_with_the_last_block_hands_over_what_the_output_loss_does() {
    let blocks = blocks();
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
    ] {
        let schedule = kind.generate(2, 4);
        let split = kind != ScheduleKind::OneFOneB;
        let (output, _, output_loss) = stage_run(&blocks, &schedule, split, false);
        let (block, deferred, block_loss) = stage_run(&blocks, &schedule, split, true);
        assert_eq!(block, output, "{}: gradients", kind.name());
        assert_eq!(block_loss, output_loss, "{}: loss", kind.name());
        // The last block's forward ran inside the loss: its linear weights still deferred.
        assert_eq!(
            deferred > 0,
            split,
            "{}: deferred weight gradients",
            kind.name()
        );
    }
}

#[test]
fn zero_bubble_stages_hand_over_the_gradients_of_the_undivided_backward() {
    let blocks = blocks();
    let (one_f_one_b, none) = stage_grads(&blocks, &ScheduleKind::OneFOneB.generate(2, 4), false);
    assert_eq!(none, 0, "1F1B deferred a weight gradient");
    for kind in [ScheduleKind::ZbH1, ScheduleKind::ZbV] {
        let schedule = kind.generate(2, 4);
        let (split, deferred) = stage_grads(&blocks, &schedule, true);
        assert!(
            deferred > 0,
            "{}: no weight gradient was deferred",
            kind.name()
        );
        let (unsplit, _) = stage_grads(&blocks, &schedule, false);
        assert_eq!(split, unsplit, "{}: split vs unsplit", kind.name());
        if kind == ScheduleKind::ZbH1 {
            // The stage placement of 1F1B: the very same gradients.
            assert_eq!(split, one_f_one_b, "ZB-H1 vs 1F1B");
        }
        for rank in &split {
            assert!(
                rank.values().all(Option::is_some),
                "{}: a parameter got no gradient",
                kind.name()
            );
        }
    }
}
