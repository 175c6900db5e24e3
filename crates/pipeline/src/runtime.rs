//! The runtime: executes a checked [`Schedule`] on one rank.
//!
//! The runtime owns the control flow — walking the rank's action list, moving activations
//! and gradients between stages (over `bonfire-comm` send/recv, or locally when two
//! consecutive stages share a rank) and timing every action — and delegates the arithmetic to
//! a [`StageCompute`]: [`crate::BurnStage`] for Burn modules, or anything else (the benchmark's
//! sleeping stages). Each message is a fixed-size shape header then the data, tagged by
//! (micro-batch, destination stage, activation or gradient), so any schedule that passed
//! [`check`] pairs them correctly.

use crate::check::check;
pub use crate::error::PipelineError;
use crate::schedule::{Action, Schedule, StageMap};
use crate::timeline::RankTimeline;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::DeviceMesh;
use std::collections::HashMap;
use std::time::Instant;

/// Largest tensor rank a message header carries.
pub const MAX_DIMS: usize = 7;

/// An activation or gradient crossing a stage boundary, as host data.
#[derive(Clone, Debug, PartialEq)]
pub struct Activation {
    /// Tensor shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Activation {
    /// A new activation; `data.len()` must be the product of `shape`.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }
}

/// The per-stage arithmetic the runtime drives.
///
/// For every call, `chunk` is the rank-local chunk and the runtime guarantees the order the
/// schedule was checked for (a backward after its forward, a weight step after its input
/// step). `input` is `None` exactly on the first stage (which reads its own data), `forward`
/// returns `None` exactly on the last stage (which computes the loss), `grad_output` is `None`
/// exactly on the last stage, and the backward steps return `None` exactly on the first stage.
pub trait StageCompute {
    /// Forward of micro-batch `mb` through `chunk`.
    fn forward(
        &mut self,
        mb: usize,
        chunk: usize,
        input: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError>;

    /// Full backward: accumulates the weight gradients, returns the input gradient.
    fn backward(
        &mut self,
        mb: usize,
        chunk: usize,
        grad_output: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError>;

    /// Zero-bubble "B": returns the input gradient; the weight part waits for
    /// [`StageCompute::backward_weight`].
    fn backward_input(
        &mut self,
        mb: usize,
        chunk: usize,
        grad_output: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError>;

    /// Zero-bubble "W": accumulates the weight gradients of (`mb`, `chunk`).
    fn backward_weight(&mut self, mb: usize, chunk: usize) -> Result<(), PipelineError>;
}

fn tag(mb: usize, dst_stage: usize, stages: usize, grad: bool, part: u64) -> u64 {
    (((mb * stages + dst_stage) as u64 * 2 + grad as u64) * 2) + part
}

fn send(pg: &ProcessGroup, a: &Activation, to: usize, base: u64) -> Result<(), PipelineError> {
    if a.shape.len() > MAX_DIMS {
        return Err(PipelineError::Invalid(format!(
            "activations of rank {} exceed the {MAX_DIMS} dimensions a message carries",
            a.shape.len()
        )));
    }
    let mut header = [0i64; MAX_DIMS + 1];
    header[0] = a.shape.len() as i64;
    for (h, &d) in header[1..].iter_mut().zip(&a.shape) {
        *h = d as i64;
    }
    pg.send(&header, to, base)?;
    pg.send(&a.data, to, base + 1)?;
    Ok(())
}

fn recv(pg: &ProcessGroup, from: usize, base: u64) -> Result<Activation, PipelineError> {
    let mut header = [0i64; MAX_DIMS + 1];
    pg.recv(&mut header, from, base)?;
    let ndim = usize::try_from(header[0])
        .ok()
        .filter(|&n| n <= MAX_DIMS)
        .ok_or_else(|| {
            PipelineError::Invalid(format!("bad message header from rank {from}: {header:?}"))
        })?;
    let shape: Vec<usize> = header[1..=ndim].iter().map(|&d| d as usize).collect();
    let mut data = vec![0f32; shape.iter().product()];
    pg.recv(&mut data, from, base + 1)?;
    Ok(Activation { shape, data })
}

/// Checks `schedule`, then runs this rank's part of it along the mesh axis `axis` (whose size
/// must be the schedule's rank count; this rank's coordinate on it is its pipeline rank),
/// returning the rank's timeline. The checker's verdict is the guarantee that the run cannot
/// deadlock. A plain pipeline over a whole group: `DeviceMesh::one_d(&pg, "pp")`.
pub fn run_schedule<C: StageCompute + ?Sized>(
    mesh: &DeviceMesh,
    axis: &str,
    schedule: &Schedule,
    compute: &mut C,
) -> Result<RankTimeline, PipelineError> {
    let pg = mesh.group(axis)?;
    check(schedule)?;
    run_unchecked(pg, schedule, compute)
}

/// [`run_schedule`] on the group `pg` (its ranks are the pipeline ranks), without the static
/// check (for a schedule already checked).
pub fn run_unchecked<C: StageCompute + ?Sized>(
    pg: &ProcessGroup,
    schedule: &Schedule,
    compute: &mut C,
) -> Result<RankTimeline, PipelineError> {
    if pg.size() != schedule.ranks() {
        return Err(PipelineError::Invalid(format!(
            "schedule `{}` is for {} ranks, the pipeline group has {}",
            schedule.name,
            schedule.ranks(),
            pg.size()
        )));
    }
    let mut run = RankRun::new(pg, schedule.stage_map);
    let mut timeline = RankTimeline::start(run.rank);
    for action in &schedule.actions[run.rank] {
        let start = Instant::now();
        run.action(compute, action)?;
        timeline.record(*action, start, Instant::now());
    }
    Ok(timeline)
}

/// Activations or gradients by (micro-batch, local chunk).
type Held = HashMap<(usize, usize), Activation>;

/// One rank running its actions: the data that waits between them.
struct RankRun<'a> {
    pg: &'a ProcessGroup,
    stage_map: StageMap,
    rank: usize,
    /// Activations waiting for the forward of (mb, chunk).
    inputs: Held,
    /// Outputs of the forward of (mb, chunk) waiting to be sent.
    outputs: Held,
    /// Output gradients waiting for the backward of (mb, chunk).
    grad_outputs: Held,
    /// Input gradients of the backward of (mb, chunk) waiting to be sent.
    grad_inputs: Held,
}

impl<'a> RankRun<'a> {
    /// This rank of `pg`, with nothing held yet.
    fn new(pg: &'a ProcessGroup, stage_map: StageMap) -> Self {
        Self {
            pg,
            stage_map,
            rank: pg.rank(),
            inputs: HashMap::new(),
            outputs: HashMap::new(),
            grad_outputs: HashMap::new(),
            grad_inputs: HashMap::new(),
        }
    }

    /// The error of `action` finding no `what` to work on.
    fn missing(&self, what: &str, action: &Action) -> PipelineError {
        PipelineError::Invalid(format!("rank {}: {action} found no {what}", self.rank))
    }

    /// The global stage of `action`'s chunk on this rank.
    fn stage(&self, action: &Action) -> usize {
        self.stage_map.stage(self.rank, action.chunk())
    }

    /// The message tag base of micro-batch `mb` going to stage `dst_stage`.
    fn tag(&self, mb: usize, dst_stage: usize, grad: bool) -> u64 {
        tag(mb, dst_stage, self.stage_map.stages(), grad, 0)
    }

    /// Runs one action.
    fn action<C: StageCompute + ?Sized>(
        &mut self,
        compute: &mut C,
        action: &Action,
    ) -> Result<(), PipelineError> {
        match *action {
            Action::Forward { .. } => self.forward(compute, action),
            Action::Backward { .. } | Action::BackwardInput { .. } => {
                self.backward(compute, action)
            }
            Action::BackwardWeight { mb, chunk } => compute.backward_weight(mb, chunk),
            Action::SendActivation { to, .. } => self.send_activation(action, to),
            Action::RecvActivation { from, .. } => self.recv_activation(action, from),
            Action::SendGrad { to, .. } => self.send_grad(action, to),
            Action::RecvGrad { from, .. } => self.recv_grad(action, from),
        }
    }

    /// Forward: takes the input (none on the first stage), keeps the output for the next
    /// stage (here, or to send; none on the last stage).
    fn forward<C: StageCompute + ?Sized>(
        &mut self,
        compute: &mut C,
        action: &Action,
    ) -> Result<(), PipelineError> {
        let (mb, chunk, s) = (action.mb(), action.chunk(), self.stage(action));
        let input = if s == 0 {
            None
        } else {
            Some(
                self.inputs
                    .remove(&(mb, chunk))
                    .ok_or_else(|| self.missing("input", action))?,
            )
        };
        let out = compute.forward(mb, chunk, input)?;
        if s + 1 < self.stage_map.stages() {
            let out = out.ok_or_else(|| self.missing("output from the stage", action))?;
            let (next_rank, next_chunk) = self.stage_map.locate(s + 1);
            if next_rank == self.rank {
                self.inputs.insert((mb, next_chunk), out);
            } else {
                self.outputs.insert((mb, chunk), out);
            }
        }
        Ok(())
    }

    /// Full or input backward: takes the output gradient (none on the last stage), keeps the
    /// input gradient for the previous stage (here, or to send; none on the first stage).
    fn backward<C: StageCompute + ?Sized>(
        &mut self,
        compute: &mut C,
        action: &Action,
    ) -> Result<(), PipelineError> {
        let (mb, chunk, s) = (action.mb(), action.chunk(), self.stage(action));
        let grad = if s + 1 == self.stage_map.stages() {
            None
        } else {
            Some(
                self.grad_outputs
                    .remove(&(mb, chunk))
                    .ok_or_else(|| self.missing("output gradient", action))?,
            )
        };
        let gin = if matches!(action, Action::Backward { .. }) {
            compute.backward(mb, chunk, grad)?
        } else {
            compute.backward_input(mb, chunk, grad)?
        };
        if s > 0 {
            let gin = gin.ok_or_else(|| self.missing("input gradient from the stage", action))?;
            let (prev_rank, prev_chunk) = self.stage_map.locate(s - 1);
            if prev_rank == self.rank {
                self.grad_outputs.insert((mb, prev_chunk), gin);
            } else {
                self.grad_inputs.insert((mb, chunk), gin);
            }
        }
        Ok(())
    }

    /// Sends the forward output of `action`'s (mb, chunk) to rank `to`.
    fn send_activation(&mut self, action: &Action, to: usize) -> Result<(), PipelineError> {
        let (mb, chunk, s) = (action.mb(), action.chunk(), self.stage(action));
        let out = self
            .outputs
            .remove(&(mb, chunk))
            .ok_or_else(|| self.missing("activation to send", action))?;
        send(self.pg, &out, to, self.tag(mb, s + 1, false))
    }

    /// Receives the input of `action`'s (mb, chunk) from rank `from`.
    fn recv_activation(&mut self, action: &Action, from: usize) -> Result<(), PipelineError> {
        let (mb, chunk, s) = (action.mb(), action.chunk(), self.stage(action));
        let a = recv(self.pg, from, self.tag(mb, s, false))?;
        self.inputs.insert((mb, chunk), a);
        Ok(())
    }

    /// Sends the input gradient of `action`'s (mb, chunk) to rank `to`.
    fn send_grad(&mut self, action: &Action, to: usize) -> Result<(), PipelineError> {
        let (mb, chunk, s) = (action.mb(), action.chunk(), self.stage(action));
        let g = self
            .grad_inputs
            .remove(&(mb, chunk))
            .ok_or_else(|| self.missing("gradient to send", action))?;
        send(self.pg, &g, to, self.tag(mb, s - 1, true))
    }

    /// Receives the output gradient of `action`'s (mb, chunk) from rank `from`.
    fn recv_grad(&mut self, action: &Action, from: usize) -> Result<(), PipelineError> {
        let (mb, chunk, s) = (action.mb(), action.chunk(), self.stage(action));
        let g = recv(self.pg, from, self.tag(mb, s, true))?;
        self.grad_outputs.insert((mb, chunk), g);
        Ok(())
    }
}
