//! PyTorch's side of `gemm`, `attention` and `bench-1b` (the kit's `bin/gpu_bench.py`, run by
//! `python3` when it imports torch), and the device's peak memory as `nvidia-smi` reads it.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The H200's dense bf16 rate by its datasheet (FLOP/s): MFU's denominator.
pub const H200_BF16_FLOPS: f64 = 989e12;

/// `gpu_bench.py` beside the kit's fixtures, else in the source tree.
fn script() -> std::path::PathBuf {
    let kit = std::env::var_os("BONFIRE_GPU_KIT_FIXTURES").map(std::path::PathBuf::from);
    match kit.map(|f| f.with_file_name("gpu_bench.py")) {
        Some(p) if p.exists() => p,
        _ => "examples/python/gpu_bench.py".into(),
    }
}

/// Runs `gpu_bench.py args`; its output, or why it gave none.
pub fn run(args: &[&str]) -> Result<String, String> {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            Err(format!("gpu_bench.py {}: {}", args[0], tail.join(" / ")))
        }
    }
}

/// The number `name=` on the line of `out` that starts with `key`.
pub fn field(out: &str, key: &str, name: &str) -> Result<f64, String> {
    let line = out
        .lines()
        .find(|l| l.starts_with(key))
        .ok_or(format!("PyTorch printed no `{key}` line"))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .ok_or(format!("PyTorch's `{key}` line has no {name}="))
}

/// The largest `memory.used` of GPU 0 that `nvidia-smi` reports while it runs (every
/// 100 ms), in bytes: the same meter for both engines (their allocators' pools included).
pub struct PeakMemory {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl PeakMemory {
    pub fn start() -> Self {
        let (stop, peak) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let out = Command::new("nvidia-smi")
                    .args(["-i", "0", "--query-gpu=memory.used"])
                    .arg("--format=csv,noheader,nounits")
                    .output();
                let mib = out.ok().and_then(|o| {
                    String::from_utf8_lossy(&o.stdout)
                        .trim()
                        .parse::<u64>()
                        .ok()
                });
                p.fetch_max(mib.unwrap_or(0) << 20, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        Self { stop, peak, thread }
    }

    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().ok();
        self.peak.load(Ordering::Relaxed)
    }
}
