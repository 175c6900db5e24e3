//! The planner: from a model and a cluster to the layouts that fit, fastest first, with
//! predicted bytes per rank and step time, and why the first won.
//!
//! ```sh
//! cargo run --example plan -- --model llama3-70b --nodes 8 --gpus-per-node 8 \
//!     --device h100 --device-memory 80GiB --intra nvlink --inter ib --global-batch 512
//! cargo run --example plan -- --model my_model.json --cluster my_cluster.json --global-batch 64
//! cargo run --example plan -- --model gpt-bench --device cpu --gpus-per-node 2 --global-batch 16
//! ```
//!
//! One line per feasible layout, `plan rank=K dp=… cp=… zero=… tp=… sp=… pp=… schedule=…
//! microbatches=… recompute=… precision=… reduce=… bytes_per_rank=… step_ms=…` (led by
//! `dp_replicate=R` for an HSDP layout: R replicas of ZeRO shards over dp × cp), then `why: …` lines
//! for the first. A request nothing fits exits with status 2 and `error: no layout fits: …`
//! (what does not fit where); a model or cluster file with a missing or impossible value
//! exits with status 2 and one line naming the field.
//!
//! `--model` takes a preset (`gpt-bench`, `gpt3-175b`, `llama3-8b`, `llama3-70b`,
//! `llama3-405b`) or a JSON file (`vocab_size`, `d_model`, `n_heads`, `n_layers`, `seq_len`,
//! `d_ff`; optional `arch` gpt|llama, `attention` materialized|flash, `n_kv_heads`, `name`).
//! `--cluster` takes a JSON file (`nodes`, `gpus_per_node`, `device` or `flops`,
//! `device_memory`, `intra`, `inter`, …) instead of the cluster flags. `--device cpu` plans
//! for this machine: its rates are measured first (a short matmul and all-reduce timing on
//! `nodes × gpus-per-node` rank threads), its memory per rank is `--device-memory` or the
//! available memory over the ranks. Sources of the presets: `docs/planner.md`.

use bonfire_examples::cli::fail;
use bonfire_layout::MixedPrecision;
use bonfire_plan::machine::{available_memory, calibrate, this_machine};
use bonfire_plan::{
    ClusterSpec, ModelSpec, PRESETS, PlanError, PlannedLayout, Request, format_bytes, plan,
};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    about = "Rank the dp (× dp_replicate) × ZeRO × cp × tp × pp layouts that fit a model on a cluster"
)]
struct Cli {
    /// A preset (gpt-bench, gpt3-175b, llama3-8b, llama3-70b, llama3-405b) or a JSON file.
    #[arg(long)]
    model: String,
    /// A cluster JSON file (instead of the flags below).
    #[arg(long)]
    cluster: Option<String>,
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// h100, a100, or cpu (this machine, measured).
    #[arg(long, default_value = "h100")]
    device: String,
    /// Memory per device (`80GiB`, `24GB`); default: the preset's (cpu: available / ranks).
    #[arg(long)]
    device_memory: Option<String>,
    /// Link inside a node: nvlink, nvlink3, pcie, shm.
    #[arg(long, default_value = "nvlink")]
    intra: String,
    /// Link between nodes: ib, ethernet.
    #[arg(long, default_value = "ib")]
    inter: String,
    /// The device's f32 (and bf16, unless --flops-bf16) matrix-product FLOP/s, overriding the
    /// preset's.
    #[arg(long)]
    flops: Option<f64>,
    #[arg(long)]
    flops_bf16: Option<f64>,
    /// Sequences per step over all replicas (default: one per rank).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    seq: Option<usize>,
    /// f32, bf16, f16, bf16/reduce=bf16 (gradients reduced in bf16), or any (f32 and bf16);
    /// default bf16 on GPUs, f32 on cpu.
    #[arg(long)]
    precision: Option<String>,
    /// The share of a device's memory a plan may fill (default 0.9; 1 on cpu).
    #[arg(long)]
    memory_fraction: Option<f64>,
    /// Layouts printed.
    #[arg(long, default_value_t = 10)]
    top: usize,
}

fn model(name: &str) -> Result<ModelSpec, PlanError> {
    if let Some(m) = ModelSpec::preset(name) {
        return Ok(m);
    }
    let what = format!("model {name}");
    if !name.ends_with(".json") && !std::path::Path::new(name).exists() {
        return Err(PlanError::File {
            what,
            reason: format!("neither a preset ({}) nor a file", PRESETS.join(", ")),
        });
    }
    let text = std::fs::read_to_string(name).map_err(|e| PlanError::File {
        what: what.clone(),
        reason: e.to_string(),
    })?;
    ModelSpec::from_json(&what, &text)
}

/// The cluster from `--cluster` or the flags (through the same checks as a file).
fn cluster(cli: &Cli, model: &ModelSpec) -> Result<ClusterSpec, PlanError> {
    if let Some(path) = &cli.cluster {
        let what = format!("cluster {path}");
        let text = std::fs::read_to_string(path).map_err(|e| PlanError::File {
            what: what.clone(),
            reason: e.to_string(),
        })?;
        return ClusterSpec::from_json(&what, &text);
    }
    let mut o = serde_json::json!({
        "nodes": cli.nodes,
        "gpus_per_node": cli.gpus_per_node,
        "intra": cli.intra,
        "inter": cli.inter,
    });
    let ranks = cli.nodes * cli.gpus_per_node;
    if cli.device == "cpu" {
        let memory = match &cli.device_memory {
            Some(m) => bonfire_plan::parse_bytes(m)
                .map_err(|e| PlanError::field("cluster (flags)", "device_memory", e))?,
            None => available_memory().unwrap_or(1 << 30) / ranks.max(1),
        };
        if ranks == 0 {
            return ClusterSpec::from_json("cluster (flags)", &o.to_string());
        }
        let c = calibrate(ranks, 1024, model.d_model.min(1024), model.d_ff.min(4096));
        eprintln!(
            "calibrated: {:.2} GFLOP/s per rank with {ranks} busy, all-reduce {:.2} GB/s, {:.1} µs, memory {:.1} GB/s",
            c.flops / 1e9,
            c.bandwidth / 1e9,
            c.latency * 1e6,
            c.mem_bw / 1e9
        );
        let mut machine = this_machine(ranks, memory, &c);
        machine.nodes = cli.nodes;
        machine.gpus_per_node = cli.gpus_per_node;
        return Ok(machine);
    }
    o["device"] = cli.device.clone().into();
    if let Some(m) = &cli.device_memory {
        o["device_memory"] = m.clone().into();
    }
    if let Some(f) = cli.flops {
        o["flops"] = f.into();
    }
    if let Some(f) = cli.flops_bf16 {
        o["flops_bf16"] = f.into();
    }
    ClusterSpec::from_json("cluster (flags)", &o.to_string())
}

fn request(cli: &Cli, model: &ModelSpec, cluster: &ClusterSpec) -> Result<Request, PlanError> {
    let bad = |field: &str, reason: String| PlanError::field("request", field, reason);
    let cpu = cluster.device.name == "cpu";
    let precisions = match cli
        .precision
        .as_deref()
        .unwrap_or(if cpu { "f32" } else { "bf16" })
    {
        "any" => vec![MixedPrecision::f32(), MixedPrecision::bf16()],
        name => {
            let p = MixedPrecision::parse(name).ok_or_else(|| {
                bad(
                    "precision",
                    format!("`{name}` is unknown (f32, bf16, f16, bf16/reduce=bf16, any)"),
                )
            })?;
            p.validate().map_err(|e| bad("precision", e))?;
            vec![p]
        }
    };
    let global_batch = cli.global_batch.unwrap_or(cluster.world());
    if global_batch == 0 {
        return Err(bad("global_batch", "must be at least 1, got 0".into()));
    }
    let seq = cli.seq.unwrap_or(model.seq_len);
    if seq == 0 || (model.arch == bonfire_plan::Arch::Gpt && seq > model.seq_len) {
        return Err(bad(
            "seq",
            format!(
                "{seq} tokens: must be between 1 and the model's seq_len {}",
                model.seq_len
            ),
        ));
    }
    let memory_fraction = cli.memory_fraction.unwrap_or(if cpu { 1.0 } else { 0.9 });
    if !(memory_fraction > 0.0 && memory_fraction <= 1.0) {
        return Err(bad(
            "memory_fraction",
            format!("{memory_fraction}: must be in (0, 1]"),
        ));
    }
    Ok(Request {
        global_batch,
        seq,
        precisions,
        memory_fraction,
    })
}

fn main() {
    let cli = Cli::parse();
    let model = model(&cli.model).unwrap_or_else(|e| fail(e));
    let cluster = cluster(&cli, &model).unwrap_or_else(|e| fail(e));
    let req = request(&cli, &model, &cluster).unwrap_or_else(|e| fail(e));
    println!(
        "plan model={} params={} world={} nodes={} gpus_per_node={} device={} device_memory={} \
         intra={} inter={} global_batch={} seq={}",
        model.name,
        model.num_params(),
        cluster.world(),
        cluster.nodes,
        cluster.gpus_per_node,
        cluster.device.name,
        cluster.device.memory,
        cluster.intra.name,
        cluster.inter.name,
        req.global_batch,
        req.seq
    );
    let plan = plan(&model, &cluster, &req).unwrap_or_else(|e| fail(e));
    for (k, e) in plan.ranked.iter().take(cli.top).enumerate() {
        println!(
            "plan rank={} {} bytes_per_rank={:.0} step_ms={:.3}",
            k + 1,
            e.layout.record(),
            e.bytes(),
            e.step_ms()
        );
    }
    println!(
        "plan feasible={} shown={} top_bytes={}",
        plan.ranked.len(),
        plan.ranked.len().min(cli.top),
        format_bytes(plan.ranked[0].bytes())
    );
    for line in &plan.why {
        println!("why: {line}");
    }
}
