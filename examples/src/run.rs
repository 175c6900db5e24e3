//! What a training program's checkpoint records of its run (`RunRecord`, in the index's
//! `extra`), and the check that a resumed command line continues the same run.

use bonfire_train::checkpoint::Checkpoint;

/// What a checkpoint records of the run, to continue the same run: the model's configuration
/// as JSON, the seed, the sequence length, the global batch, the optimizer, and the data the
/// batches come from. The data stream's position is the step's: batch `s` is positions
/// `s · global_rows ..` of the data's seeded stream of epochs, so a resumed run at step `s`
/// reads exactly what it would have.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunRecord {
    /// The model's configuration (its `config.json`, or the GPT's).
    pub model: serde_json::Value,
    /// Seed of the initial model and of the data's order.
    pub seed: u64,
    /// Tokens per sequence.
    pub seq: usize,
    /// Sequences per step, over all replicas.
    pub global_rows: usize,
    /// The optimizer's name.
    pub optim: String,
    /// The learning rate (the peak of the schedule).
    pub lr: f64,
    /// The learning rate's schedule (a checkpoint from before schedules: constant).
    #[serde(default)]
    pub schedule: bonfire_train::LrSchedule,
    /// The training data: `generated`, or the file and its token count.
    #[serde(default = "generated")]
    pub data: String,
}

fn generated() -> String {
    "generated".into()
}

impl RunRecord {
    /// The run a resumed checkpoint `ckpt` continues: checks this command line's record
    /// (`self`) agrees with it, that its global batch splits over `dp`, and that `steps` (the
    /// run's total) is past its step, unless `export_only` (no step to train: the checkpoint
    /// is only read).
    pub fn resumed(
        &self,
        ckpt: &Checkpoint,
        dp: usize,
        steps: usize,
        export_only: bool,
    ) -> Result<RunRecord, String> {
        let run: RunRecord =
            serde_json::from_value(ckpt.index.extra["run"].clone()).map_err(|e| {
                format!(
                    "{}: not a checkpoint of a training program ({e})",
                    ckpt.dir.display()
                )
            })?;
        let differs = |what: &str, there: String, here: String| {
            Err(format!(
                "--resume {}: the run has {what} {there}, this command line {here} (a resumed \
                 run continues the same run)",
                ckpt.dir.display()
            ))
        };
        if run.model != self.model {
            return differs("model", run.model.to_string(), self.model.to_string());
        }
        if (run.seed, run.seq) != (self.seed, self.seq) {
            return differs(
                "--seed/--seq",
                format!("{}/{}", run.seed, run.seq),
                format!("{}/{}", self.seed, self.seq),
            );
        }
        if (&run.optim, run.lr) != (&self.optim, self.lr) {
            return differs(
                "--optim/--lr",
                format!("{}/{}", run.optim, run.lr),
                format!("{}/{}", self.optim, self.lr),
            );
        }
        if run.schedule != self.schedule {
            let flags = |s: &bonfire_train::LrSchedule| {
                format!("{}/{:?}/{}", s.warmup, s.decay, s.min_lr).to_lowercase()
            };
            return differs(
                "--lr-warmup/--lr-decay/--lr-min",
                flags(&run.schedule),
                flags(&self.schedule),
            );
        }
        if run.data != self.data {
            return differs("data", run.data.clone(), self.data.clone());
        }
        if !run.global_rows.is_multiple_of(dp) {
            return Err(format!(
                "--resume: the run's global batch of {} rows does not split over dp={dp}",
                run.global_rows
            ));
        }
        if ckpt.step() >= steps && !export_only {
            return Err(format!(
                "--resume: the checkpoint is at step {}, --steps {steps} (the run's total) leaves nothing to train",
                ckpt.step()
            ));
        }
        Ok(run)
    }
}
