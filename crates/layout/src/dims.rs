//! [`ParallelDims`]: the one owner of a training layout — the degree of every [`Axis`], the
//! options of each (ZeRO stage and offload on dp, sequence and loss parallelism on tp,
//! schedule, micro-batches and split points on pp), precision and activation checkpointing,
//! and the checks that need no model. The trainer (`bonfire-train`) builds the mesh and
//! checks the layout against a model and a batch; the planner (`bonfire-plan`) searches
//! layouts and predicts their cost.

use crate::{
    Axis, LayoutError, MixedPrecision, PpOptions, Recompute, ScheduleKind, TpOptions, ZeroStage,
};
use std::fmt;

/// A training layout: degrees per axis and their options. Build one with the `with_*`
/// methods or [`ParallelDims::parse_mesh`]; the trainer validates it against the world, the
/// model and the batch before building anything.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParallelDims {
    degrees: [usize; Axis::COUNT],
    /// ZeRO stage on the dp axis (stage 0 is DDP).
    pub zero: ZeroStage,
    /// ZeRO-Offload: the optimizer state, its master values and the update live on a CPU
    /// device while the model trains on its own (stage ≥ 1).
    pub offload: bool,
    /// Options of the tp axis (its degree is [`ParallelDims::tp`]).
    pub tp_options: TpOptions,
    /// Options of the pp axis (its degree is [`ParallelDims::pp`]).
    pub pp_options: PpOptions,
    /// Mixed precision on every axis: compute/param dtype, gradient-reduction dtype (an
    /// fp32 master copy and fp32 optimizer state under a half type).
    pub precision: MixedPrecision,
    /// Activation checkpointing of the model's checkpointable layers.
    pub recompute: Recompute,
}

impl Default for ParallelDims {
    fn default() -> Self {
        Self::new()
    }
}

impl ParallelDims {
    /// One rank: every degree 1, DDP.
    pub fn new() -> Self {
        Self {
            degrees: [1; Axis::COUNT],
            zero: ZeroStage::Zero0,
            offload: false,
            tp_options: TpOptions::default(),
            pp_options: PpOptions::default(),
            precision: MixedPrecision::f32(),
            recompute: Recompute::Off,
        }
    }

    /// Parses `dp=2,tp=2,pp=2` (any order, any subset; omitted axes are 1).
    pub fn parse_mesh(spec: &str) -> Result<Self, LayoutError> {
        let bad = |reason: String| LayoutError::Parse {
            spec: spec.to_string(),
            reason,
        };
        let mut dims = Self::new();
        let mut seen = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, size) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("`{part}` is not AXIS=SIZE (e.g. dp=2)")))?;
            let axis = Axis::parse(name.trim()).ok_or_else(|| {
                let known: Vec<&str> = Axis::ALL
                    .iter()
                    .chain(&Axis::BORROWED)
                    .map(|a| a.name())
                    .collect();
                bad(format!(
                    "unknown axis `{}` (known: {})",
                    name.trim(),
                    known.join(", ")
                ))
            })?;
            let size: usize = size
                .trim()
                .parse()
                .ok()
                .filter(|s| *s >= 1)
                .ok_or_else(|| bad(format!("the size of `{axis}` must be a positive integer")))?;
            if seen.contains(&axis) {
                return Err(bad(format!("axis `{axis}` given twice")));
            }
            seen.push(axis);
            dims.degrees[axis.index()] = size;
        }
        Ok(dims)
    }

    /// The degree of `axis`.
    pub fn degree(&self, axis: Axis) -> usize {
        self.degrees[axis.index()]
    }
    /// The dp degree (replicas, or ZeRO shards).
    pub fn dp(&self) -> usize {
        self.degree(Axis::Dp)
    }
    /// The dp_replicate degree (HSDP's replicas of every ZeRO shard; 1 without HSDP).
    pub fn dp_replicate(&self) -> usize {
        self.degree(Axis::DpReplicate)
    }
    /// The data-parallel replicas that train on distinct rows of a batch: dp_replicate × dp
    /// (cp ranks share their replica's rows and split its sequences).
    pub fn data_replicas(&self) -> usize {
        self.dp_replicate() * self.dp()
    }
    /// Whether the layout is HSDP: replicas (dp_replicate > 1) of ZeRO shards (stage ≥ 1).
    /// Without ZeRO dp_replicate is plain DDP over dp_replicate × dp × cp.
    pub fn is_hsdp(&self) -> bool {
        self.dp_replicate() > 1 && self.zero != ZeroStage::Zero0
    }
    /// The cp degree (ranks a sequence is split over).
    pub fn cp(&self) -> usize {
        self.degree(Axis::Cp)
    }
    /// The tp degree (ranks a layer is split over).
    pub fn tp(&self) -> usize {
        self.degree(Axis::Tp)
    }
    /// The pp degree (pipeline ranks).
    pub fn pp(&self) -> usize {
        self.degree(Axis::Pp)
    }
    /// The ep degree: how many ranks of a dp × cp group split a mixture of experts' experts
    /// (1: every rank holds them all). It borrows its ranks: it adds none to the world.
    pub fn ep(&self) -> usize {
        self.degree(Axis::Ep)
    }
    /// The ranks that hold the same experts and reduce their gradients together under ep:
    /// dp × cp / ep (dp × cp without ep).
    pub fn expert_replicas(&self) -> usize {
        self.dp() * self.cp() / self.ep()
    }
    /// Number of ranks the layout needs (the mesh axes' degrees; ep borrows from dp × cp).
    pub fn world_size(&self) -> usize {
        Axis::ALL.iter().map(|&a| self.degree(a)).product()
    }
    /// Where world rank `rank` sits on `axis` of the mesh (axes in [`Axis::ALL`] order, the
    /// last innermost). On ep: its place in its group of ep consecutive ranks of the dp × cp
    /// group.
    pub fn coordinate(&self, rank: usize, axis: Axis) -> usize {
        if axis == Axis::Ep {
            let flat =
                self.coordinate(rank, Axis::Dp) * self.cp() + self.coordinate(rank, Axis::Cp);
            return flat % self.ep();
        }
        let inner: usize = Axis::ALL[axis.index() + 1..]
            .iter()
            .map(|&a| self.degree(a))
            .product();
        rank / inner % self.degree(axis)
    }
    /// Micro-batches per step (the pp degree unless set).
    pub fn microbatches(&self) -> usize {
        self.pp_options.microbatches.unwrap_or(self.pp())
    }

    /// The layout with `axis` of degree `degree`.
    pub fn with_degree(mut self, axis: Axis, degree: usize) -> Self {
        self.degrees[axis.index()] = degree;
        self
    }
    /// The layout with ZeRO stage `stage` on dp (stage 0: DDP).
    pub fn with_zero(mut self, stage: ZeroStage) -> Self {
        self.zero = stage;
        self
    }
    /// The layout with ZeRO-Offload on or off.
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }
    /// The layout with sequence parallelism on tp on or off.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.tp_options.sequence_parallel = on;
        self
    }
    /// The layout with loss parallelism on tp on or off.
    pub fn with_loss_parallel(mut self, on: bool) -> Self {
        self.tp_options.loss_parallel = on;
        self
    }
    /// The layout with pipeline schedule `schedule`.
    pub fn with_schedule(mut self, schedule: ScheduleKind) -> Self {
        self.pp_options.schedule = Some(schedule);
        self
    }
    /// The layout with `m` micro-batches per step.
    pub fn with_microbatches(mut self, m: usize) -> Self {
        self.pp_options.microbatches = Some(m);
        self
    }
    /// The layout with precision policy `precision`.
    pub fn with_precision(mut self, precision: MixedPrecision) -> Self {
        self.precision = precision;
        self
    }
    /// The layout with activation checkpointing `ac`.
    pub fn with_recompute(mut self, ac: Recompute) -> Self {
        self.recompute = ac;
        self
    }
    /// The layout with pipeline stages beginning at the module paths `points`.
    pub fn with_split_points(mut self, points: Vec<String>) -> Self {
        self.pp_options.split_points = Some(points);
        self
    }

    /// The layout with pipeline stages cut by each piece's cost (see
    /// [`PpOptions::piece_costs`]) where no split points name the cut.
    pub fn with_piece_costs(mut self, costs: Vec<u64>) -> Self {
        self.pp_options.piece_costs = Some(costs);
        self
    }

    /// Checks the layout on its own and against a world of `world` ranks: every option
    /// belongs to an axis that exists, the degrees multiply to the world size. (The model
    /// and the batch are checked by the trainer, `bonfire_train::Trainer::build`.)
    pub fn validate(&self, world: usize) -> Result<(), LayoutError> {
        for axis in Axis::ALL.into_iter().chain(Axis::BORROWED) {
            if self.degree(axis) == 0 {
                return Err(LayoutError::axis(axis, 0, "a degree must be at least 1"));
            }
        }
        if self.world_size() != world {
            return Err(LayoutError::WorldSize {
                layout: self.to_string(),
                product: self.world_size(),
                world,
            });
        }
        if self.is_hsdp() && self.dp() * self.cp() == 1 {
            return Err(LayoutError::axis(
                Axis::DpReplicate,
                self.dp_replicate(),
                format!(
                    "HSDP replicates ZeRO stage {}'s shards, but there is no dp (or cp) axis to \
                     shard over: add one (e.g. dp_replicate={},dp=2), or use dp={} for ZeRO \
                     over every rank",
                    self.zero.index(),
                    self.dp_replicate(),
                    self.dp_replicate()
                ),
            ));
        }
        self.validate_ep()?;
        if let Err(reason) = self.precision.validate() {
            return Err(LayoutError::axis(Axis::Dp, self.dp(), reason));
        }
        let (tp, pp) = (self.tp(), self.pp());
        if tp == 1 && self.tp_options.sequence_parallel {
            return Err(LayoutError::axis(
                Axis::Tp,
                1,
                "sequence parallelism needs a tp axis (e.g. tp=2)",
            ));
        }
        if tp == 1 && self.tp_options.loss_parallel {
            return Err(LayoutError::axis(
                Axis::Tp,
                1,
                "loss parallelism needs a tp axis (e.g. tp=2)",
            ));
        }
        if self.offload && self.zero == ZeroStage::Zero0 {
            return Err(LayoutError::axis(
                Axis::Dp,
                self.dp(),
                "offload moves ZeRO's optimizer state: it needs ZeRO stage 1, 2 or 3",
            ));
        }
        match (&self.pp_options.schedule, pp) {
            (None, p) if p > 1 => Err(LayoutError::axis(
                Axis::Pp,
                p,
                format!("a pipeline needs a schedule ({})", ScheduleKind::NAMES),
            )),
            (Some(kind), 1) => Err(LayoutError::axis(
                Axis::Pp,
                1,
                format!("schedule {} needs a pp axis (e.g. pp=2)", kind.name()),
            )),
            _ if pp == 1 && self.pp_options.microbatches.is_some() => Err(LayoutError::axis(
                Axis::Pp,
                1,
                "micro-batches are a pipeline option: they need a pp axis",
            )),
            _ if self.microbatches() == 0 => Err(LayoutError::axis(
                Axis::Pp,
                pp,
                "the number of micro-batches must be at least 1",
            )),
            _ => Ok(()),
        }
    }
}

impl ParallelDims {
    /// ep borrows its ranks from dp × cp (not from dp_replicate: an ep group stays inside a
    /// replica): it must divide them.
    fn validate_ep(&self) -> Result<(), LayoutError> {
        let ep = self.ep();
        if ep == 1 {
            return Ok(());
        }
        let ranks = self.dp() * self.cp();
        if !ranks.is_multiple_of(ep) {
            return Err(LayoutError::axis(
                Axis::Ep,
                ep,
                format!(
                    "ep borrows its ranks from dp × cp = {ranks} (dp={}, cp={}), which it must \
                     divide: give dp (× cp) a multiple of {ep}",
                    self.dp(),
                    self.cp()
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for ParallelDims {
    /// `pp=2,dp=2,tp=2` plus the options in use, e.g. `dp=2,tp=2 zero=3 sp`; `cp`,
    /// `dp_replicate` and `ep` appear when they are used (`pp=1,dp_replicate=2,dp=2,cp=2,tp=1`,
    /// `pp=1,dp=4,tp=1,ep=2`), so layouts without them read as they always did.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let degrees: Vec<String> = Axis::ALL
            .iter()
            .filter(|&&a| {
                (a != Axis::Cp || self.cp() > 1)
                    && (a != Axis::DpReplicate || self.dp_replicate() > 1)
            })
            .map(|&a| format!("{a}={}", self.degree(a)))
            .collect();
        write!(f, "{}", degrees.join(","))?;
        if self.ep() > 1 {
            write!(f, ",ep={}", self.ep())?;
        }
        if self.zero != ZeroStage::Zero0 {
            write!(f, " zero={}", self.zero.index())?;
        }
        if self.offload {
            write!(f, " offload")?;
        }
        if self.tp_options.sequence_parallel {
            write!(f, " sp")?;
        }
        if self.tp_options.loss_parallel {
            write!(f, " loss-parallel")?;
        }
        if let Some(kind) = &self.pp_options.schedule {
            write!(f, " schedule={} m={}", kind.name(), self.microbatches())?;
        }
        if self.precision.is_mixed() {
            write!(f, " precision={}", self.precision)?;
        }
        if self.recompute.is_on() {
            write!(f, " ac={}", self.recompute)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        let d = ParallelDims::parse_mesh("pp=2, dp=2,tp=3").unwrap();
        assert_eq!((d.pp(), d.dp(), d.tp(), d.world_size()), (2, 2, 3, 12));
        let at = |r| Axis::ALL.map(|a| d.coordinate(r, a));
        assert_eq!(
            (at(0), at(4), at(7), at(11)),
            (
                [0, 0, 0, 0, 0],
                [0, 0, 1, 0, 1],
                [1, 0, 0, 0, 1],
                [1, 0, 1, 0, 2]
            )
        );
        let c = ParallelDims::parse_mesh("dp=2,cp=2,tp=2").unwrap();
        assert_eq!(c.to_string(), "pp=1,dp=2,cp=2,tp=2");
        assert_eq!(Axis::ALL.map(|a| c.coordinate(5, a)), [0, 0, 1, 0, 1]);
        assert_eq!(d.to_string(), "pp=2,dp=2,tp=3", "cp=1 is not printed");
        assert!(ParallelDims::parse_mesh("dp=0").is_err());
        assert!(
            ParallelDims::parse_mesh("xp=2")
                .unwrap_err()
                .to_string()
                .contains("unknown axis")
        );
        assert!(ParallelDims::parse_mesh("dp=2,dp=2").is_err());
        let e = ParallelDims::parse_mesh("dp=2,tp=2")
            .unwrap()
            .validate(8)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "the layout pp=1,dp=2,tp=2 needs 4 ranks, but the world has 8"
        );
        let e = d.clone().validate(12).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("pp=2: a pipeline needs a schedule"),
            "{e}"
        );
        let sp = ParallelDims::new().with_sequence_parallel(true);
        assert!(sp.validate(1).unwrap_err().to_string().contains("tp=1"));
        let off = ParallelDims::new().with_offload(true);
        assert!(
            off.validate(1)
                .unwrap_err()
                .to_string()
                .contains("ZeRO stage")
        );
        let ok = d.with_schedule(ScheduleKind::OneFOneB).with_microbatches(4);
        ok.validate(12).unwrap();
        assert_eq!(ok.to_string(), "pp=2,dp=2,tp=3 schedule=1f1b m=4");
    }

    #[test]
    fn hsdp_parses_prints_and_is_checked() {
        let h = ParallelDims::parse_mesh("dp_replicate=2,dp=2,tp=2")
            .unwrap()
            .with_zero(ZeroStage::Zero3);
        assert_eq!(h.to_string(), "pp=1,dp_replicate=2,dp=2,tp=2 zero=3");
        assert_eq!(
            (h.dp_replicate(), h.data_replicas(), h.world_size()),
            (2, 4, 8)
        );
        assert!(h.is_hsdp());
        h.validate(8).unwrap();
        // dp_replicate is outside dp: ranks 0–3 are replica 0, 4–7 replica 1.
        assert_eq!(Axis::ALL.map(|a| h.coordinate(6, a)), [0, 1, 1, 0, 0]);
        let back = ParallelDims::parse_mesh(h.to_string().split(' ').next().unwrap()).unwrap();
        assert_eq!(back.with_zero(ZeroStage::Zero3), h);
        let ddp = ParallelDims::parse_mesh("dp_replicate=2").unwrap();
        assert!(!ddp.is_hsdp(), "without ZeRO it is DDP");
        ddp.validate(2).unwrap();
        let e = ddp.with_zero(ZeroStage::Zero2).validate(2).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("dp_replicate=2: HSDP replicates ZeRO stage 2's shards"),
            "{e}"
        );
    }

    #[test]
    fn ep_borrows_from_dp_and_cp() {
        let e = ParallelDims::parse_mesh("dp=4,ep=2").unwrap();
        assert_eq!((e.world_size(), e.ep(), e.expert_replicas()), (4, 2, 2));
        assert_eq!(e.to_string(), "pp=1,dp=4,tp=1,ep=2");
        assert_eq!(ParallelDims::parse_mesh("pp=1,dp=4,tp=1,ep=2").unwrap(), e);
        e.validate(4).unwrap();
        // ep groups are consecutive ranks of dp × cp: 0,1 | 2,3.
        assert_eq!(
            (0..4)
                .map(|r| e.coordinate(r, Axis::Ep))
                .collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
        let c = ParallelDims::parse_mesh("dp=2,cp=2,tp=2,ep=4").unwrap();
        c.validate(8).unwrap();
        assert_eq!((c.world_size(), c.expert_replicas()), (8, 1));
        // tp is innermost: ranks 2k and 2k+1 share a dp × cp place.
        assert_eq!(
            (0..8)
                .map(|r| c.coordinate(r, Axis::Ep))
                .collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2, 3, 3]
        );
        let bad = ParallelDims::parse_mesh("dp=3,ep=2")
            .unwrap()
            .validate(3)
            .unwrap_err();
        assert!(
            bad.to_string()
                .starts_with("ep=2: ep borrows its ranks from dp × cp = 3"),
            "{bad}"
        );
        let h = ParallelDims::parse_mesh("dp_replicate=2,dp=2,ep=2").unwrap();
        h.validate(4).unwrap();
        // Inside each replica: ranks 0,1 | 2,3.
        assert_eq!(
            (0..4)
                .map(|r| h.coordinate(r, Axis::Ep))
                .collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
    }
}
