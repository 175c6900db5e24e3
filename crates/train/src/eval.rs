//! Evaluation while training: [`Evaluation`], hooks that compute the mean loss of fixed
//! held-out batches every few steps — forward only, in any layout ([`Engine::evaluate`]) —
//! and print it on rank 0 (and write it to TensorBoard, [`Evaluation::with_tensorboard`]).

use crate::engine::Engine;
use crate::error::TrainError;
use crate::fit::{Hooks, StepReport};
use crate::tensorboard::TensorBoard;
use bonfire_parallel::{DataSource, Rows};

/// The mean loss of the first `batches` global batches of a held-out [`DataSource`], every
/// `every` steps (after step `s` the model has trained `s + 1` steps: that is the step an
/// evaluation is reported at) and whenever [`run`](Self::run) is called.
pub struct Evaluation<'a, B> {
    data: &'a dyn DataSource<B>,
    batches: usize,
    every: usize,
    /// `(steps trained, mean loss)` of every evaluation so far.
    pub losses: Vec<(usize, f32)>,
    board: Option<TensorBoard>,
}

impl<'a, B: Rows> Evaluation<'a, B> {
    /// Evaluates on batches `0..batches` of `data` every `every` steps (0: only when
    /// [`run`](Self::run) is called).
    pub fn new(data: &'a dyn DataSource<B>, batches: usize, every: usize) -> Self {
        assert!(batches > 0, "an evaluation of 0 batches");
        Self {
            data,
            batches,
            every,
            losses: Vec::new(),
            board: None,
        }
    }

    /// Also writes each evaluation's loss to `board` as `eval/loss` (rank 0's board; `None`
    /// elsewhere).
    pub fn with_tensorboard(mut self, board: Option<TensorBoard>) -> Self {
        self.board = board;
        self
    }

    /// The mean loss of the evaluation batches under the model as it is after `steps` steps,
    /// printed on rank 0 as `eval step {steps}  loss {loss}` and recorded. A collective.
    pub fn run(&mut self, steps: usize, engine: &mut dyn Engine<B>) -> Result<f32, TrainError> {
        let replica = engine.replica();
        let mut sum = 0.0;
        for k in 0..self.batches {
            let batch = self.data.replica_batch(k, replica, engine.device());
            sum += f64::from(engine.evaluate(&batch)?);
        }
        let loss = (sum / self.batches as f64) as f32;
        if engine.world().rank() == 0 {
            println!("eval step {steps}  loss {loss:.6}");
        }
        if let Some(board) = &self.board {
            board.scalars(steps, &[("eval/loss", f64::from(loss))])?;
        }
        self.losses.push((steps, loss));
        Ok(loss)
    }

    /// The last evaluation's `(steps, loss)`, if any.
    pub fn last(&self) -> Option<(usize, f32)> {
        self.losses.last().copied()
    }
}

impl<B: Rows> Hooks<B> for Evaluation<'_, B> {
    fn after_step(
        &mut self,
        report: &StepReport,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        let trained = report.step + 1;
        if self.every > 0 && trained.is_multiple_of(self.every) {
            self.run(trained, engine)?;
        }
        Ok(())
    }
}
