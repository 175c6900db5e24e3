//! What the example programs' command lines share: the layout options of every trainer
//! front end (`train_gpt`, the parity harness), and how a program starts and fails.

use bonfire_pipeline::ScheduleKind;
use bonfire_train::{ActivationCheckpointing, MixedPrecision, ParallelDims};
use bonfire_zero::Stage;

/// The layout options of a command line, as given (checked further when the run is built).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LayoutArgs {
    /// Axes and sizes, e.g. `dp=2`, `tp=4`, `dp=2,tp=2,pp=2` (omitted axes are 1).
    #[arg(long)]
    pub mesh: Option<String>,
    /// ZeRO stage on the dp axis: 0 is DDP; 1, 2, 3 shard the optimizer state, the
    /// gradients, the parameters.
    #[arg(long, default_value_t = 0)]
    pub zero: usize,
    /// Pipeline schedule with a pp axis: gpipe, 1f1b, interleaved[:V], zb, zb-v.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Pipeline micro-batches (default: pp).
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Sequence parallelism on the tp axis.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Vocab-parallel cross-entropy on the tp axis.
    #[arg(long)]
    pub loss_parallel: bool,
    /// Keep ZeRO's optimizer state on the host between steps (needs --zero 1..3).
    #[arg(long)]
    pub offload: bool,
    /// Compute/parameter dtype: f32, bf16 or f16 (fp32 master weights and optimizer state,
    /// gradients reduced in fp32; f16 adds dynamic loss scaling).
    #[arg(long, value_name = "f32|bf16|f16")]
    pub precision: Option<String>,
    /// Reduce gradients in the compute dtype instead of fp32 (with --precision bf16|f16).
    #[arg(long)]
    pub reduce_in_half: bool,
    /// Recompute activations in backward: alone, every layer; `K`, every K-th layer.
    #[arg(long, num_args = 0..=1, default_missing_value = "1", value_name = "K")]
    pub activation_checkpointing: Option<usize>,
}

impl LayoutArgs {
    /// `mesh` and no option.
    pub fn mesh(mesh: &str) -> Self {
        Self {
            mesh: Some(mesh.into()),
            ..Self::default()
        }
    }

    /// The layout they describe, `default_mesh` when no `--mesh` was given.
    pub fn dims(&self, default_mesh: &str) -> Result<ParallelDims, String> {
        let mesh = self.mesh.as_deref().unwrap_or(default_mesh);
        let mut dims = ParallelDims::parse_mesh(mesh).map_err(|e| e.to_string())?;
        dims.zero = Stage::from_index(self.zero)
            .ok_or_else(|| format!("--zero {}: must be 0, 1, 2 or 3", self.zero))?;
        if let Some(name) = &self.schedule {
            let kind = ScheduleKind::parse(name).ok_or_else(|| {
                format!(
                    "--schedule {name}: unknown (known: gpipe, 1f1b, interleaved[:V], zb, zb-v)"
                )
            })?;
            dims = dims.with_schedule(kind);
        }
        dims.pp.microbatches = self.microbatches;
        let name = self.precision.as_deref().unwrap_or("f32");
        let mut precision = MixedPrecision::parse(name)
            .ok_or_else(|| format!("--precision {name}: unknown (known: f32, bf16, f16)"))?;
        if self.reduce_in_half {
            if !precision.is_mixed() {
                return Err("--reduce-in-half needs --precision bf16 or f16".into());
            }
            precision = precision.with_reduce_dtype(precision.param_dtype);
        }
        let ac = match self.activation_checkpointing {
            None => ActivationCheckpointing::Off,
            Some(0) => return Err("--activation-checkpointing K: K must be at least 1".into()),
            Some(k) => ActivationCheckpointing::Every(k),
        };
        Ok(dims
            .with_precision(precision)
            .with_activation_checkpointing(ac)
            .with_sequence_parallel(self.sequence_parallel)
            .with_loss_parallel(self.loss_parallel)
            .with_offload(self.offload))
    }
}

/// Logs (Bonfire's notices) to stderr, without timestamps.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_target(false)
        .without_time()
        .with_writer(std::io::stderr)
        .init();
}

/// Prints `error: {message}` and exits with status 2.
pub fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("error: {message}");
    std::process::exit(2)
}
