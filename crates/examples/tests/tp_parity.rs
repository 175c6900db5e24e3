//! Tensor parallelism on the GPT: TP=2 and 4, with and without sequence parallelism and
//! loss_parallel, and dp=2 × tp=2, against single-device training — the loss at every step,
//! every step-0 gradient and every parameter after 3 SGD steps within 1e-5 relative
//! (absolute floor 1e-7, for values that are zero up to rounding) — plus the collectives each
//! layer issues, and the harness end to end with `--mesh tp=N` / `dp=N,tp=M`.

mod common;

use bonfire_comm::ThreadWorld;
use bonfire_dtensor::parallel::clear_parallel_states;
use bonfire_dtensor::{CommCounter, CommOp, DeviceMesh};
use bonfire_examples::data::Batches;
use bonfire_examples::harness::{self, HarnessArgs, HarnessResult, TpOptions, train_parallel};
use bonfire_examples::mesh::{Layout, Mesh};
use bonfire_examples::tp::parallelize_gpt;
use bonfire_examples::{Gpt, GptConfig, checkpoint, default_device};
use burn::module::Module;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

const REL: f32 = 1e-5;
const ABS: f32 = 1e-7;
const STEPS: usize = 3;
const LR: f64 = 0.5;

/// vocab 32, d 16, 4 heads, 2 layers, seq 8, d_ff 32.
fn cfg() -> GptConfig {
    GptConfig {
        n_heads: 4,
        ..GptConfig::tiny()
    }
}

struct Fixture {
    model: Gpt,
    batches: Batches,
    reference: HarnessResult,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let model = Gpt::new(&cfg(), &default_device());
        let batches = common::random_batches(&cfg(), STEPS, 4, 7);
        let reference =
            train_parallel(&model, &batches, 1, TpOptions::none(), 0, STEPS, LR).unwrap();
        Fixture {
            model,
            batches,
            reference,
        }
    })
}

fn compare(what: &str, got: &HarnessResult, want: &HarnessResult) {
    common::assert_close(&format!("{what} loss"), &got.losses, &want.losses, REL, ABS);
    assert_eq!(got.params.len(), want.params.len());
    for (name, (shape, w)) in &want.params {
        let (gshape, g) = &got.params[name];
        assert_eq!(gshape, shape, "{what} {name} shape");
        common::assert_close(&format!("{what} {name}"), g, w, REL, ABS);
        common::assert_close(
            &format!("{what} grad0.{name}"),
            &got.grad0[name],
            &want.grad0[name],
            REL,
            ABS,
        );
    }
}

fn parity(dp: usize, tp: usize, sp: bool, lp: bool) {
    let f = fixture();
    let opts = TpOptions {
        tp,
        sequence_parallel: sp,
        loss_parallel: lp,
    };
    let got = train_parallel(&f.model, &f.batches, dp, opts, 0, STEPS, LR).unwrap();
    compare(
        &format!("dp={dp},tp={tp} sp={sp} lp={lp}:"),
        &got,
        &f.reference,
    );
}

#[test]
fn tp2() {
    parity(1, 2, false, false);
}
#[test]
fn tp2_sequence_parallel() {
    parity(1, 2, true, false);
}
#[test]
fn tp2_loss_parallel() {
    parity(1, 2, false, true);
}
#[test]
fn tp2_sequence_and_loss_parallel() {
    parity(1, 2, true, true);
}
#[test]
fn tp4() {
    parity(1, 4, false, false);
}
#[test]
fn tp4_sequence_parallel() {
    parity(1, 4, true, false);
}
#[test]
fn tp4_loss_parallel() {
    parity(1, 4, false, true);
}
#[test]
fn tp4_sequence_and_loss_parallel() {
    parity(1, 4, true, true);
}
#[test]
fn dp2_tp2() {
    parity(2, 2, false, false);
}
#[test]
fn dp2_tp2_sequence_and_loss_parallel() {
    parity(2, 2, true, true);
}

/// The collectives of one forward and backward of the parallelized GPT, per layer kind.
#[test]
fn collective_counts() {
    let f = fixture();
    let layers = cfg().n_layers;
    for (sp, lp) in [(false, false), (true, true), (false, true), (true, false)] {
        let counts = ThreadWorld::new(2)
            .timeout(Duration::from_secs(60))
            .launch(|pg| {
                let device = default_device();
                let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
                let model =
                    parallelize_gpt(f.model.clone().fork(&device), &mesh, "tp", sp, lp).unwrap();
                let (ids, targets) = f.batches.rows(0, 0, 4, &device);
                let counter = CommCounter::start();
                let loss = model.loss(ids, targets);
                let fwd = counter.counts();
                counter.reset();
                loss.backward();
                let bwd = counter.counts();
                clear_parallel_states();
                (fwd, bwd)
            })
            .unwrap();
        let (fwd, bwd) = &counts[0];
        let n =
            |m: &std::collections::BTreeMap<CommOp, usize>, op| m.get(&op).copied().unwrap_or(0);
        let what = format!("sp={sp} lp={lp}: forward {fwd:?}, backward {bwd:?}");
        if !sp {
            // Forward: one all-reduce per row-wise output (tok_emb, o, fc2 per block); the
            // head's logits gathered, or three all-reduces in loss_parallel.
            assert_eq!(
                n(fwd, CommOp::AllReduce),
                1 + 2 * layers + if lp { 3 } else { 0 },
                "{what}"
            );
            assert_eq!(n(fwd, CommOp::AllGather), if lp { 0 } else { 1 }, "{what}");
            assert_eq!(n(fwd, CommOp::ReduceScatter), 0, "{what}");
            // Backward: one all-reduce per column-wise input (q, k, v, fc1, head).
            assert_eq!(n(bwd, CommOp::AllReduce), 4 * layers + 1, "{what}");
            assert_eq!(bwd.len(), 1, "{what}");
        } else {
            // Forward: a reduce-scatter per row-wise output, an all-gather of the sequence
            // per column-wise input, plus the head's vocabulary gather without lp.
            assert_eq!(n(fwd, CommOp::ReduceScatter), 1 + 2 * layers, "{what}");
            assert_eq!(
                n(fwd, CommOp::AllGather),
                4 * layers + 1 + if lp { 0 } else { 1 },
                "{what}"
            );
            assert_eq!(n(fwd, CommOp::AllReduce), if lp { 3 } else { 0 }, "{what}");
            // Backward: the duals, and one all-reduce per replicated parameter used on
            // sequence shards (2 per LayerNorm, the row-wise biases, pos_emb).
            assert_eq!(n(bwd, CommOp::AllGather), 1 + 2 * layers, "{what}");
            assert_eq!(n(bwd, CommOp::ReduceScatter), 4 * layers + 1, "{what}");
            assert_eq!(
                n(bwd, CommOp::AllReduce),
                2 * (2 * layers + 1) + 2 * layers + 1,
                "{what}"
            );
        }
    }
}

fn write_inputs(dir: &PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let f = fixture();
    std::fs::write(dir.join("cfg.json"), serde_json::to_string(&cfg()).unwrap()).unwrap();
    checkpoint::save(&f.model, dir.join("init.safetensors")).unwrap();
    let (s, b, t) = (STEPS, 4usize, cfg().max_seq_len);
    let bytes = |v: &[i64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let ids = bytes(&f.batches.input_ids);
    let tg = bytes(&f.batches.targets);
    let view = |d: &'static [u8]| {
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![s, b, t], d).unwrap()
    };
    let ids: &'static [u8] = Box::leak(ids.into_boxed_slice());
    let tg: &'static [u8] = Box::leak(tg.into_boxed_slice());
    safetensors::serialize_to_file(
        vec![("input_ids", view(ids)), ("targets", view(tg))],
        None,
        &dir.join("batch.safetensors"),
    )
    .unwrap();
}

/// The harness end to end: `--mesh tp=2 --sequence-parallel --loss-parallel` and
/// `--mesh dp=2,tp=2` write the single-device results; bad layouts are clear errors.
#[test]
fn harness_tp_meshes() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tp-harness-{}", std::process::id()));
    write_inputs(&dir);
    let args = |mesh: &str, sp: bool, lp: bool| HarnessArgs {
        config: dir.join("cfg.json"),
        weights: dir.join("init.safetensors"),
        data: dir.join("batch.safetensors"),
        layout: Layout {
            mesh: Mesh::parse(mesh).unwrap(),
            zero: 0,
            schedule: None,
            microbatches: None,
            sequence_parallel: sp,
            loss_parallel: lp,
        },
        steps: STEPS,
        lr: LR,
        out: dir.join(format!("result-{mesh}-{sp}-{lp}.safetensors")),
    };
    let single = harness::read_result(
        harness::run(&args("dp=1", false, false))
            .map(|_| ())
            .map(|_| args("dp=1", false, false).out)
            .unwrap(),
    )
    .unwrap();
    for (mesh, sp, lp) in [("tp=2", true, true), ("dp=2,tp=2", false, false)] {
        let a = args(mesh, sp, lp);
        harness::run(&a).unwrap();
        let got = harness::read_result(&a.out).unwrap();
        assert_eq!(got.len(), single.len(), "{mesh}: same tensors");
        for (name, v) in &single {
            common::assert_close(&format!("{mesh} {name}"), &got[name], v, REL, ABS);
        }
    }
    // tp=3 does not divide 4 heads; sequence parallelism over 3 does not divide 8 positions.
    let err = harness::run(&args("tp=3", false, false)).unwrap_err();
    assert!(
        err.contains("n_heads 4 is not divisible by the tensor-parallel size 3"),
        "{err}"
    );
    let err = harness::run(&args("dp=2", true, false)).unwrap_err();
    assert!(err.contains("tp axis"), "{err}");
}
