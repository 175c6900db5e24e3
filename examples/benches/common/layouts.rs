//! The benches' named layouts (`cargo xtask bench train`, `bench profile --layouts`): one
//! rank, DDP, ZeRO 1–3, tp ± SP ± loss parallelism (`-lp`: the head's logits kept sharded by
//! vocabulary, as torchtitan's tp does by default) and the pipelines over every rank, and
//! expert parallelism's `…-epK`.

use bonfire_layout::{Axis, ParallelDims, ScheduleKind, ZeroStage};

/// Every dense layout, in the benches' order.
pub const LAYOUTS: &[&str] = &[
    "single", "ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "tp-lp", "tp-sp-lp", "pp-1f1b",
    "pp-zb-h1", "pp-zb-v",
];

/// Layout `name`'s mesh and options on `n` ranks (pipelines over `microbatches`), and its
/// rank count.
pub fn layout(name: &str, n: usize, microbatches: usize) -> Result<(ParallelDims, usize), String> {
    let dp = || ParallelDims::new().with_degree(Axis::Dp, n);
    let tp = || ParallelDims::new().with_degree(Axis::Tp, n);
    let pp = |schedule: &str| {
        let kind = ScheduleKind::parse(schedule).expect("a known schedule");
        ParallelDims::new()
            .with_degree(Axis::Pp, n)
            .with_schedule(kind)
            .with_microbatches(microbatches)
    };
    Ok(match name {
        "single" => (ParallelDims::new(), 1),
        "ddp" => (dp(), n),
        "zero1" => (dp().with_zero(ZeroStage::Zero1), n),
        "zero2" => (dp().with_zero(ZeroStage::Zero2), n),
        "zero3" => (dp().with_zero(ZeroStage::Zero3), n),
        "tp" => (tp(), n),
        "tp-sp" => (tp().with_sequence_parallel(true), n),
        "tp-lp" => (tp().with_loss_parallel(true), n),
        "tp-sp-lp" => (
            tp().with_sequence_parallel(true).with_loss_parallel(true),
            n,
        ),
        "pp-1f1b" => (pp("1f1b"), n),
        "pp-zb-h1" => (pp("zb-h1"), n),
        "pp-zb-v" => (pp("zb-v"), n),
        other => match other.rsplit_once("-ep") {
            Some((base @ ("ddp" | "zero1" | "zero2" | "zero3"), k)) => match k.parse() {
                Ok(ep) if ep > 1 && n.is_multiple_of(ep) => {
                    let (dims, ranks) = layout(base, n, microbatches)?;
                    (dims.with_degree(Axis::Ep, ep), ranks)
                }
                _ => return Err(format!("{other}: ep must be above 1 and divide {n} ranks")),
            },
            _ => {
                return Err(format!(
                    "unknown layout `{other}`; known: {}, and for the Mixtral \
                     ddp-epK, zero1-epK, zero2-epK, zero3-epK",
                    LAYOUTS.join(", ")
                ));
            }
        },
    })
}
