//! The main job: train the reference GPT on a generated text corpus, data parallel over
//! in-process CPU ranks, with a progress bar (step, loss, tokens/s), then save a checkpoint
//! and print a sample.
//!
//! ```sh
//! cargo run --release --example train_gpt                  # 2 ranks, 300 steps
//! cargo run --release --example train_gpt -- --ranks 4 --steps 100 --batch 4
//! cargo run --release --example train_gpt -- --zero 3     # ZeRO stage 3 instead of DDP
//! # one rank per MPI process:
//! cargo build --release -p bonfire-examples --features mpi --example train_gpt
//! mpirun -np 2 target/release/examples/train_gpt --launcher env
//! ```

use bonfire_comm::{ProcessGroup, ReduceOp, ThreadWorld, World};
use bonfire_ddp::{DdpConfig, params};
use bonfire_examples::corpus::{self, CharTokenizer, Rng};
use bonfire_examples::dp_axis::DpAxis;
use bonfire_examples::{Gpt, GptConfig, checkpoint, default_device};
use bonfire_zero::{Stage, ZeroConfig};
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a small GPT data-parallel on CPU rank threads")]
struct Cli {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 512)]
    d_ff: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// DDP bucket size in MiB.
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 25)]
    log_every: usize,
    /// Where to save the trained parameters (safetensors, PyTorch layout).
    #[arg(long, default_value = "target/train_gpt/gpt.safetensors")]
    checkpoint: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// ZeRO stage on the data-parallel ranks: 0 is DDP (the default); 1, 2, 3 shard the
    /// optimizer state, the gradients, the parameters (stage 3 trains with Balanced
    /// checkpointing: each layer's parameters are gathered for its forward and re-gathered in
    /// backward).
    #[arg(long, default_value_t = 0)]
    zero: usize,
    /// Other parallel axes arrive with later releases; only dp is supported.
    #[arg(long, default_value = "dp")]
    parallel: String,
    /// `threads`: `--ranks` rank threads in this process; `env`: this process is one rank of
    /// a job started by a launcher (`mpirun`; build with `--features mpi`).
    #[arg(long, default_value = "threads")]
    launcher: String,
}

/// The device of a run: stage 3 recomputes (re-gathers) instead of keeping.
fn device_for(zero: usize) -> Device {
    match zero {
        3 => default_device().gradient_checkpointing(),
        _ => default_device(),
    }
}

/// One rank's training loop; returns the trained model on rank 0.
fn train_rank(pg: ProcessGroup, cli: &Cli, model: &Gpt, tokens: &[i64]) -> Option<Gpt> {
    let device = device_for(cli.zero);
    let rank = pg.rank();
    let replica = model.clone().fork(&device);
    let mut dp = match Stage::from_index(cli.zero).filter(|s| *s != Stage::Zero0) {
        None => {
            let config = DdpConfig::new().with_bucket_mb(cli.bucket_mb);
            DpAxis::ddp(replica, pg.clone(), AdamConfig::new().init(), config)
        }
        Some(stage) => DpAxis::zero(
            replica,
            pg.clone(),
            AdamConfig::new().build(),
            ZeroConfig::new(stage).with_bucket_bytes((cli.bucket_mb * 1048576.0) as usize),
        ),
    }
    .expect("data-parallel setup");
    let bar = (rank == 0).then(|| {
        let bar = ProgressBar::new(cli.steps as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos:>5}/{len} [{bar:30}] {msg} ({elapsed}<{eta})",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        bar
    });
    let mut rng = Rng::new(cli.seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9));
    let tokens_per_step = (cli.ranks * cli.batch * cli.seq) as f64;
    let start = Instant::now();
    for step in 0..cli.steps {
        let t0 = Instant::now();
        let batch = corpus::sample_batch(tokens, cli.batch, cli.seq, &mut rng);
        let (ids, targets) = batch.rows(0, 0, cli.batch, &device);
        let local = dp
            .train_step(cli.lr, |m| m.loss(ids, targets))
            .expect("training step");
        let mut loss = [local];
        pg.all_reduce(&mut loss, ReduceOp::Avg).expect("loss");
        if let Some(bar) = &bar {
            let tps = tokens_per_step / t0.elapsed().as_secs_f64();
            bar.set_message(format!("loss {:.4}  {tps:>7.0} tok/s", loss[0]));
            bar.inc(1);
            if step % cli.log_every == 0 || step + 1 == cli.steps {
                let avg = tokens_per_step * (step + 1) as f64 / start.elapsed().as_secs_f64();
                let line = format!("step {step:>5}  loss {:.4}  {avg:.0} tok/s", loss[0]);
                // Without a terminal the bar is hidden (and so are its lines): print plainly.
                if bar.is_hidden() {
                    println!("{line}");
                } else {
                    bar.println(line);
                }
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    let model = dp.into_model().expect("gathering the trained model");
    (rank == 0).then_some(model)
}

fn main() {
    let cli = Cli::parse();
    if cli.zero > 3 {
        eprintln!("error: --zero {}: must be 0, 1, 2 or 3", cli.zero);
        std::process::exit(2);
    }
    if cli.parallel != "dp" {
        eprintln!(
            "error: --parallel {}: only dp is supported by this build",
            cli.parallel
        );
        std::process::exit(2);
    }
    let tok = CharTokenizer;
    let cfg = GptConfig {
        vocab_size: tok.vocab_size(),
        d_model: cli.d_model,
        n_heads: cli.heads,
        n_layers: cli.layers,
        max_seq_len: cli.seq,
        d_ff: cli.d_ff,
    };
    if let Err(e) = cfg.validate() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let text = corpus::generate(400_000, cli.seed);
    let tokens = tok.encode(&text);
    let device = device_for(cli.zero);
    device.seed(cli.seed);
    let model = Gpt::new(&cfg, &device);
    println!(
        "train_gpt: {} parameters, {} ranks ({}) x {} sequences x {} tokens, {} steps, corpus {} chars",
        cfg.num_params(),
        cli.ranks,
        match cli.zero {
            0 => "DDP".to_string(),
            n => format!("ZeRO-{n}"),
        },
        cli.batch,
        cli.seq,
        cli.steps,
        text.len()
    );

    let trained = match cli.launcher.as_str() {
        "threads" => ThreadWorld::new(cli.ranks)
            .name("train_gpt")
            .launch(|pg| train_rank(pg, &cli, &model, &tokens))
            .expect("training failed")
            .into_iter()
            .flatten()
            .next(),
        "env" => {
            let world = World::from_env().unwrap_or_else(|e| {
                eprintln!("error: {e}");
                std::process::exit(2)
            });
            let cli = Cli {
                ranks: world.size(),
                ..cli.clone()
            };
            train_rank(world.group().clone(), &cli, &model, &tokens)
        }
        other => {
            eprintln!("error: --launcher {other}: expected `threads` or `env`");
            std::process::exit(2)
        }
    };
    // Only rank 0 returns the model (and saves it).
    let Some(trained) = trained else {
        return;
    };
    match checkpoint::save(&trained, &cli.checkpoint) {
        Ok(()) => {
            let cfg_path = cli.checkpoint.with_extension("json");
            let _ = std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap());
            println!(
                "saved checkpoint to {} (config {})",
                cli.checkpoint.display(),
                cfg_path.display()
            );
        }
        Err(e) => eprintln!("error: {e}"),
    }
    println!(
        "sample: {:?}",
        sample(&trained.valid(), &tok, "the ", 120, cli.seq)
    );
}

/// Greedy continuation of `prompt`.
fn sample(model: &Gpt, tok: &CharTokenizer, prompt: &str, n: usize, seq: usize) -> String {
    let device = model.tok_emb.weight.val().device();
    let mut ids = tok.encode(prompt);
    for _ in 0..n {
        let window = &ids[ids.len().saturating_sub(seq)..];
        let t = window.len();
        let input = Tensor::<2, Int>::from_data(TensorData::new(window.to_vec(), [1, t]), &device);
        let logits = params::to_host(model.forward(input).narrow(1, t - 1, 1));
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as i64)
            .unwrap_or(0);
        ids.push(next);
    }
    tok.decode(&ids)
}
