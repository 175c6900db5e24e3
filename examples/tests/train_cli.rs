//! The training front door, `train`, as a user runs it:
//!
//! - **Hugging Face directories round-trip bit for bit**: the transformers fixture exported
//!   with `--steps 0` holds exactly its tensors; a trained model exported at the end of a run
//!   (sharded, with an index), the run's checkpoint exported under another layout with
//!   `--resume … --steps 0`, and that export loaded and exported again are the same bits.
//! - **Your own text, evaluated, resumed exactly**: a Llama on text tokenized by a Hugging
//!   Face `tokenizer.json`, an eval loss every 2 steps; 4 steps on one device equal 2 steps
//!   under dp=2 × tp=2 then 2 resumed under pp=2 (the data stream goes on where the
//!   checkpoint left it) — every step's loss and both eval losses.
//! - **Bad input** gets one clear error (exit 2) before anything trains.

mod common;

use bonfire_comm::testing::assert_close;
use bonfire_models::tensor_file;
use std::path::{Path, PathBuf};
use std::process::Command;

const TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../crates/data/tests/fixtures/tokenizer.json"
);

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/llama")
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-train-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `train` with `args` (and `--log-every 0`); returns (exit code, stdout, stderr).
fn train(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(common::example("train"))
        .args(args)
        .args(["--log-every", "0"])
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// Runs `train` and panics with its output unless it succeeds; returns stdout.
fn ok(args: &[&str]) -> String {
    let (code, stdout, stderr) = train(args);
    assert_eq!(code, Some(0), "train {args:?}\n{stdout}\n{stderr}");
    stdout
}

/// Every tensor of a Hugging Face directory, as f32 bits, by name.
fn bits(dir: &Path) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    let files = bonfire_models::pretrained::weight_files(dir).unwrap();
    let mut all: Vec<_> = files
        .iter()
        .flat_map(|f| tensor_file::read_floats(f).unwrap())
        .map(|(name, (shape, v))| (name, shape, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!all.is_empty(), "{}: no tensor", dir.display());
    all
}

#[test]
fn hugging_face_directories_round_trip_bit_for_bit() {
    let dir = scratch("export");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let model = fixture();
    let model = model.to_str().unwrap();
    let common_args = ["--seq", "8", "--batch", "2"];
    ok(&[
        &["--model", model, "--steps", "0", "--export", &p("init")][..],
        &common_args,
    ]
    .concat());
    assert_eq!(bits(&dir.join("init")), bits(&fixture()));
    // Each rank reads only its slices: tp shards, ZeRO-3 pieces, pipeline stages.
    for mesh in ["dp=2,tp=2", "pp=2,dp=2"] {
        let out = p(&format!("sliced-{mesh}"));
        let args = [
            "--model", model, "--steps", "0", "--mesh", mesh, "--zero", "3", "--export", &out,
        ];
        let stdout = ok(&[&args[..], &common_args].concat());
        let read: Vec<(usize, usize)> = stdout
            .lines()
            .filter(|l| l.starts_with("weights rank="))
            .map(|l| {
                (
                    common::number_after(l, "read="),
                    common::number_after(l, "total="),
                )
            })
            .collect();
        assert_eq!(read.len(), 4, "{stdout}");
        for (got, total) in &read {
            assert!(
                *got > 0 && 2 * got < *total,
                "{mesh}: a rank read {got} of {total}: {stdout}"
            );
        }
        assert_eq!(bits(Path::new(&out)), bits(&fixture()), "{mesh}");
        println!("{mesh} zero 3: values read per rank {read:?}");
    }
    // Trained, exported at the end in shards of at most 8 KB, and checkpointed.
    let stdout = ok(&[
        &[
            "--model",
            model,
            "--steps",
            "3",
            "--mesh",
            "dp=2,pp=2",
            "--zero",
            "1",
            "--checkpoint-dir",
            &p("ckpt"),
            "--export",
            &p("trained"),
            "--max-shard-size",
            "8KB",
        ][..],
        &common_args,
    ]
    .concat());
    assert!(stdout.contains("weight files)"), "{stdout}");
    assert!(dir.join("trained/model.safetensors.index.json").exists());
    let trained = bits(&dir.join("trained"));
    assert_ne!(trained, bits(&fixture()), "3 steps moved nothing");
    // The checkpoint exported under another layout, with no step trained.
    ok(&[
        &[
            "--model",
            model,
            "--resume",
            &p("ckpt"),
            "--steps",
            "0",
            "--mesh",
            "tp=2",
        ][..],
        &["--export", &p("resumed")],
        &common_args,
    ]
    .concat());
    assert_eq!(bits(&dir.join("resumed")), trained);
    // The export is a model directory the front door loads again.
    ok(&[
        &[
            "--model",
            &p("trained"),
            "--steps",
            "0",
            "--export",
            &p("again"),
        ][..],
        &common_args,
    ]
    .concat());
    assert_eq!(bits(&dir.join("again")), trained);
    std::fs::remove_dir_all(&dir).ok();
}

/// A training text and a held-out one (`train.txt`, `valid.txt`) in `dir`; the flags that
/// train the tiny Llama on them with the fixture tokenizer.
fn write_text(dir: &Path) -> [String; 8] {
    let text = bonfire_data::generated::generate;
    std::fs::write(dir.join("train.txt"), text(20_000, 1)).unwrap();
    std::fs::write(dir.join("valid.txt"), text(4_000, 2)).unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    [
        "--model".into(),
        "llama-tiny".into(),
        "--tokenizer".into(),
        TOKENIZER.into(),
        "--data".into(),
        path("train.txt"),
        "--eval-data".into(),
        path("valid.txt"),
    ]
}

/// Every step's loss of a `--metrics` file.
fn losses(path: &Path) -> Vec<f32> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap() as f32
        })
        .collect()
}

/// The eval losses a run printed (`eval step S  loss L`), by step.
fn evals(stdout: &str) -> Vec<(usize, f32)> {
    stdout
        .lines()
        .filter(|l| l.starts_with("eval step "))
        .map(|l| {
            (
                common::number_after(l, "eval step "),
                common::number_after(l, "loss "),
            )
        })
        .collect()
}

#[test]
fn own_text_evaluated_and_resumed_in_other_layouts_equals_one_device() {
    let dir = scratch("text");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let text = write_text(&dir);
    let text: Vec<&str> = text.iter().map(String::as_str).collect();
    let data = [
        &text[..],
        &[
            "--eval-every",
            "2",
            "--eval-batches",
            "2",
            "--seq",
            "8",
            "--optim",
            "sgd",
            "--lr",
            "0.5",
            "--lr-warmup",
            "1",
            "--lr-decay",
            "linear",
            "--lr-min",
            "0.05",
            "--seed",
            "4",
        ],
    ]
    .concat();
    let one = ok(&[
        &data[..],
        &["--mesh", "dp=1", "--batch", "4", "--steps", "4"],
        &["--metrics", &p("one.jsonl")],
    ]
    .concat());
    let first = ok(&[
        &data[..],
        &["--mesh", "dp=2,tp=2", "--batch", "2", "--steps", "2"],
        &[
            "--checkpoint-dir",
            &p("ckpt"),
            "--metrics",
            &p("split.jsonl"),
        ],
    ]
    .concat());
    let second = ok(&[
        &data[..],
        &["--mesh", "pp=2", "--batch", "4", "--steps", "4"],
        &["--resume", &p("ckpt"), "--metrics", &p("split.jsonl")],
    ]
    .concat());
    assert!(
        second.contains("step 2 starts at epoch 0, position 8"),
        "{second}"
    );
    // The schedule is the run's: a resume under another decay is refused before any step.
    let other: Vec<&str> = data
        .iter()
        .map(|a| if *a == "linear" { "cosine" } else { a })
        .chain(["--steps", "4", "--batch", "4"])
        .collect();
    let (code, stdout, stderr) = train(&[&other[..], &["--resume", &p("ckpt")]].concat());
    assert_ne!(code, Some(0), "{stdout}");
    assert!(
        stderr.contains("--lr-warmup/--lr-decay/--lr-min"),
        "{stdout}{stderr}"
    );
    // The metrics carry each step's rate: warmup 1, then linear from 0.5 to 0.05 over 3 steps.
    let rates: Vec<f64> = std::fs::read_to_string(dir.join("one.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let want_rates = [0.5, 0.5, 0.5 - 0.45 / 3.0, 0.5 - 0.9 / 3.0];
    assert_eq!(rates.len(), want_rates.len(), "{rates:?}");
    for (got, want) in rates.iter().zip(want_rates) {
        assert!((got - want).abs() < 1e-12, "{rates:?} vs {want_rates:?}");
    }
    let want = losses(&dir.join("one.jsonl"));
    assert_eq!(want.len(), 4);
    let c = assert_close(
        "losses",
        &losses(&dir.join("split.jsonl")),
        &want,
        common::SGD,
    );
    println!("losses {want:?}: {c}");
    let (want, got) = (evals(&one), [evals(&first), evals(&second)].concat());
    assert_eq!(
        want.iter().map(|e| e.0).collect::<Vec<_>>(),
        [2, 4],
        "{one}"
    );
    assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4]);
    let values = |e: &[(usize, f32)]| e.iter().map(|x| x.1).collect::<Vec<_>>();
    // Printed with 6 decimals: 1e-6 absolute on top of the parity tolerance.
    let tol = bonfire_comm::testing::Tolerance::new(1e-5, 1e-6);
    let c = assert_close("eval losses", &values(&got), &values(&want), tol);
    println!("eval losses {want:?}: {c}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_gets_one_clear_error() {
    let dir = scratch("bad");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // A token file with an id outside llama-tiny's 32 tokens.
    let ids: Vec<u32> = (0..100)
        .map(|i| if i == 57 { 40 } else { i % 32 })
        .collect();
    bonfire_data::write_tokens(
        p("bad.bin"),
        &ids,
        bonfire_data::TokenWidth::U16,
        bonfire_data::TokenFormat::Raw,
    )
    .unwrap();
    std::fs::write(dir.join("text.txt"), "some text").unwrap();
    let model = fixture();
    let model = model.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--model", "llama-tiny", "--data", &p("bad.bin")],
            "token 40 at position 57",
        ),
        (
            &["--model", "llama-tiny", "--data", &p("text.txt")],
            "needs --tokenizer",
        ),
        (
            &[
                "--model",
                "llama-tiny",
                "--data",
                &p("missing.txt"),
                "--tokenizer",
                TOKENIZER,
            ],
            "missing.txt",
        ),
        (
            &["--model", model, "--seq", "16"],
            "max_position_embeddings is 8",
        ),
        (
            &["--model", &p("nowhere")],
            "not gpt, llama-tiny, llama-bench",
        ),
    ];
    for (args, want) in cases {
        let (code, stdout, stderr) = train(&[args, &["--steps", "1"]].concat());
        assert_eq!(code, Some(2), "{args:?}: {stdout}{stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line\n{stderr}");
        assert!(!stdout.contains("step"), "{args:?} trained: {stdout}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The GPT exports too (its `model.safetensors` and `cfg.json`), and the export is the trained
/// model: after 2 steps it loads into a plain `Gpt` of that config with other values than the
/// same command's export after 0 steps (the initial model).
#[test]
fn the_gpt_exports_its_trained_weights() {
    let dir = scratch("gpt-export");
    let export = |steps: &str| {
        let out = dir.join(format!("out-{steps}"));
        let args = [
            "--model", "gpt", "--steps", steps, "--sample", "0", "--seq", "16",
        ];
        let (code, stdout, stderr) =
            train(&[&args[..], &["--export", out.to_str().unwrap()]].concat());
        assert_eq!(code, Some(0), "{stdout}{stderr}");
        assert!(stdout.contains("exported"), "{stdout}");
        let cfg = bonfire_models::GptConfig::load(out.join("cfg.json")).unwrap();
        let device = bonfire_examples::default_device();
        let model = bonfire_models::weights::load(
            bonfire_models::Gpt::new(&cfg, &device),
            out.join("model.safetensors"),
        )
        .unwrap();
        bonfire_module::params::flatten_values(&model, &bonfire_module::params::inventory(&model))
    };
    let (initial, trained) = (export("0"), export("2"));
    assert_eq!(initial.len(), trained.len());
    assert_ne!(initial, trained, "the export holds the trained values");
    std::fs::remove_dir_all(&dir).ok();
}

/// One JSON value of every line of a `--metrics` file.
fn metric(path: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[key].as_f64())
        .map(|v| v.unwrap_or_else(|| panic!("{}: a line without {key}", path.display())))
        .collect()
}

/// The training recipe from the command line (issue 46): AdamW's flags, `--grad-accum 2`
/// under ZeRO-2, and a `--clip-grad-norm` between the run's unclipped norms — which clips
/// some steps and not others, so the clipped run's later norms and losses differ while its
/// first step's do not; `grad_norm`, `lr` and `peak_rss_bytes` in every metrics line, an
/// eval loss, and the TensorBoard event file. With `BONFIRE_KEEP_TENSORBOARD=DIR` the event
/// folder and the metrics are left in DIR for `examples/python/check_tensorboard.py`
/// (TensorBoard's own reader: the `clients` step).
#[test]
fn a_recipe_run_reports_to_tensorboard() {
    let dir = match std::env::var_os("BONFIRE_KEEP_TENSORBOARD") {
        Some(keep) => PathBuf::from(keep),
        None => scratch("tensorboard"),
    };
    std::fs::create_dir_all(&dir).unwrap();
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let text = write_text(&dir);
    let text: Vec<&str> = text.iter().map(String::as_str).collect();
    let args = [
        &text[..],
        &[
            "--eval-every",
            "3",
            "--eval-batches",
            "1",
            "--seq",
            "8",
            "--batch",
            "4",
            "--steps",
            "6",
            "--mesh",
            "dp=2",
            "--zero",
            "2",
            "--optim",
            "adamw",
            "--lr",
            "0.01",
            "--adamw-betas",
            "0.8,0.99",
            "--adamw-eps",
            "1e-8",
            "--weight-decay",
            "0.05",
            "--no-decay-1d",
            "--grad-accum",
            "2",
            "--lr-warmup",
            "2",
            "--lr-decay",
            "cosine",
            "--seed",
            "4",
        ],
    ]
    .concat();
    ok(&[&args[..], &["--metrics", &p("free.jsonl")]].concat());
    let free = metric(&dir.join("free.jsonl"), "grad_norm");
    let (lo, hi) = free
        .iter()
        .fold((f64::MAX, 0.0f64), |(a, b), &n| (a.min(n), b.max(n)));
    let clip = format!("{}", (lo + hi) / 2.0);
    let board = dir.join("tensorboard");
    std::fs::remove_dir_all(&board).ok();
    let out = ok(&[
        &args[..],
        &["--clip-grad-norm", &clip, "--metrics", &p("metrics.jsonl")],
        &["--tensorboard", board.to_str().unwrap()],
    ]
    .concat());
    let metrics = dir.join("metrics.jsonl");
    let norms = metric(&metrics, "grad_norm");
    let clipped = norms.iter().filter(|&&n| n > (lo + hi) / 2.0).count();
    assert!(
        clipped > 0 && clipped < norms.len(),
        "clip {clip}: {norms:?}"
    );
    assert_eq!(
        norms[0], free[0],
        "the first step's norm is before any clip"
    );
    assert_ne!(losses(&metrics)[5], losses(&dir.join("free.jsonl"))[5]);
    assert!(metric(&metrics, "peak_rss_bytes").iter().all(|&b| b > 0.0));
    assert_eq!(evals(&out).len(), 2, "{out}");
    let files: Vec<_> = std::fs::read_dir(&board).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one event file");
    let name = files[0].file_name().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let bytes = std::fs::read(files[0].path()).unwrap();
    // The first record: its length, the format's name inside it.
    let first = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert!(bytes.len() > 16 + first, "more than the first record");
    let text = String::from_utf8_lossy(&bytes[12..12 + first]);
    assert!(text.contains("brain.Event:2"), "{text}");
    if std::env::var_os("BONFIRE_KEEP_TENSORBOARD").is_none() {
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// `--fused-loss` (the head and its loss by blocks of 5 positions, which divide neither 32
/// nor a rank's 16) trains the tiny Llama on text as the unfused head does, under ZeRO-3 on 2
/// ranks and on one device (4 sequences a step either way: `--batch` is a replica's): every
/// step's loss within 1e-5 relative; the flag reaches the model (on one device the runs are
/// not the same bits: the loss and the weight's gradient sum blocks).
#[test]
fn the_fused_loss_trains_as_the_unfused_head() {
    let dir = scratch("fused");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let text = write_text(&dir);
    let text: Vec<&str> = text.iter().map(String::as_str).collect();
    let args = [&text[..], &["--seq", "8", "--steps", "3", "--seed", "4"]].concat();
    let run = |(mesh, batch): (&str, &str), fused: &[&str], name: &str| {
        let layout = ["--mesh", mesh, "--batch", batch, "--zero", "3"];
        ok(&[&args[..], &layout, &["--metrics", &p(name)], fused].concat());
        losses(&dir.join(name))
    };
    let unfused = run(("dp=1", "4"), &[], "unfused.jsonl");
    assert_eq!(unfused.len(), 3, "{unfused:?}");
    let mut differ = false;
    for (mesh, batch) in [("dp=1", "4"), ("dp=2", "2")] {
        let name = format!("fused-{mesh}.jsonl");
        let fused = run((mesh, batch), &["--fused-loss", "5"], &name);
        assert_eq!(fused.len(), unfused.len(), "{mesh}");
        for (step, (a, b)) in fused.iter().zip(&unfused).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{mesh} step {step}: {a} against {b}"
            );
            differ |= mesh == "dp=1" && a.to_bits() != b.to_bits();
        }
    }
    assert!(
        differ,
        "the fused runs' losses are the unfused bits: was the flag applied?"
    );
    std::fs::remove_dir_all(&dir).ok();
}
