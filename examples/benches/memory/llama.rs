//! `bench memory --model llama`: the GPT table's layouts on a Llama of the same size, each
//! with the planner's bytes for the Llama's shape beside its measured steady peak and held
//! state — rows the planner was never fitted on, printed, not asserted.

use super::{MemoryParts, ROWS, Request, SEQ, Tally, cases};
use crate::common::measure::measure_layout;
use bonfire_examples::default_device;
use bonfire_models::llama::{Llama, LlamaConfig};

/// The Llama of `--model llama`: the GPT's sizes in Llama form (vocab 8192, hidden 1024, 16
/// heads, 8 kv heads, 4 layers, intermediate 2816, positions 64).
fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 8192,
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: 4,
        num_attention_heads: 16,
        num_key_value_heads: 8,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_position_embeddings: 64,
        variant: bonfire_models::llama::LlamaVariant::default(),
    }
}

/// `--model llama`: every layout of the table on the Llama, each rank's held state and the
/// fullest rank's steady peak next to the planner's bytes for the Llama's shape
/// ([`LlamaConfig::spec`]) — rows the planner was never fitted on, printed, not asserted.
pub fn rows(steps: usize, only: &[String]) {
    let cfg = config();
    let model = Llama::new(&cfg, &default_device());
    println!(
        "bench memory model=llama vocab={} hidden={} heads={} kv_heads={} layers={} \
         intermediate={} params={} rows={ROWS} tokens_per_row={SEQ} optimizer=adamw \
         steps={steps} backend=flex machine=cpu-threads",
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.num_hidden_layers,
        cfg.intermediate_size,
        cfg.num_params()
    );
    let spec = cfg.spec();
    let mut tally = Tally::new("none");
    let mut first = 0;
    for case in cases() {
        if !only.is_empty() && !only.iter().any(|o| case.name.contains(o.as_str())) {
            continue;
        }
        let dims = &case.dims;
        let precision = dims.precision;
        let runs = measure_layout(cfg.vocab_size, dims, &model, (ROWS, SEQ, steps), first);
        first += dims.world_size();
        let head = format!(
            "bench memory model=llama layout={} ranks={} precision={precision} ac={}",
            case.name,
            dims.world_size(),
            if dims.recompute.is_on() { "on" } else { "off" },
        );
        let steady = runs.iter().map(|r| r.steady_peak()).max().unwrap_or(0);
        let req = Request {
            global_batch: ROWS,
            seq: SEQ,
            precisions: vec![precision],
            memory_fraction: 1.0,
        };
        match bonfire_plan::predict_ranks(&spec, &req, dims) {
            Err(why) => println!("{head} modelled=false steady_peak_bytes={steady} why=\"{why}\""),
            Ok(parts) => {
                let predicted = parts.iter().map(MemoryParts::total).fold(0.0, f64::max);
                let ratio = steady as f64 / predicted;
                let states: Vec<f64> = runs
                    .iter()
                    .zip(&parts)
                    .map(|(r, p)| r.held as f64 / p.state.total())
                    .collect();
                let lo = states.iter().copied().fold(f64::MAX, f64::min);
                let hi = states.iter().copied().fold(f64::MIN, f64::max);
                println!(
                    "{head} modelled=true planner_bytes={predicted:.0} steady_peak_bytes={steady} \
                     peak_ratio={ratio:.4} state_ratio_min={lo:.4} state_ratio_max={hi:.4} \
                     step_ms={:.0}",
                    runs[0].step_ms
                );
                tally.add(&case.name, ratio);
            }
        }
    }
    println!(
        "bench memory model=llama planner_summary rows={} within_10pct={} worst_layout={} \
         worst_peak_ratio={:.4} set=heldout",
        tally.rows, tally.within, tally.worst.0, tally.worst.1
    );
}
