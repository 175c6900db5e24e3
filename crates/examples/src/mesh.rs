//! `--mesh dp=N,tp=M,pp=K` and the other layout options of the parity harness, validated
//! against what this build supports (data and tensor parallelism, for now).

/// The parallel layout: sizes of the dp, tp and pp axes (omitted axes are 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
}

impl Mesh {
    /// Parses `dp=2,tp=2,pp=2` (any order, any subset).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut mesh = Mesh {
            dp: 1,
            tp: 1,
            pp: 1,
        };
        let mut seen = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (axis, size) = part
                .split_once('=')
                .ok_or_else(|| format!("--mesh: `{part}` is not AXIS=SIZE (e.g. dp=2)"))?;
            let size: usize = size
                .trim()
                .parse()
                .ok()
                .filter(|s| *s >= 1)
                .ok_or_else(|| format!("--mesh: size of `{axis}` must be a positive integer"))?;
            let axis = axis.trim();
            if seen.contains(&axis.to_string()) {
                return Err(format!("--mesh: axis `{axis}` given twice"));
            }
            seen.push(axis.to_string());
            match axis {
                "dp" => mesh.dp = size,
                "tp" => mesh.tp = size,
                "pp" => mesh.pp = size,
                other => {
                    return Err(format!(
                        "--mesh: unknown axis `{other}` (known: dp, tp, pp)"
                    ));
                }
            }
        }
        Ok(mesh)
    }

    /// Number of ranks (the product of the axes).
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.pp
    }
}

/// Every layout option of the harness command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub mesh: Mesh,
    pub zero: u8,
    pub schedule: Option<String>,
    pub microbatches: Option<usize>,
    /// Sequence parallelism on the tp axis (norms and the position table on sequence shards).
    pub sequence_parallel: bool,
    /// Vocab-parallel cross-entropy on the tp axis (the head's logits stay sharded).
    pub loss_parallel: bool,
}

impl Layout {
    /// Rejects, with a clear error, what this build does not implement yet: it never ignores
    /// an option.
    pub fn check_supported(&self) -> Result<(), String> {
        if self.mesh.pp > 1 {
            if self.sequence_parallel || self.loss_parallel {
                return Err(format!(
                    "--sequence-parallel / --loss-parallel with --mesh pp={}: not supported by this build yet (tensor parallelism inside pipeline stages gathers the logits)",
                    self.mesh.pp
                ));
            }
            if self.zero == 3 {
                return Err(format!(
                    "--zero 3 with --mesh pp={}: not supported by this build (stage 3's parameters exist only gathered inside its own forward, which the pipeline runtime does not run; --zero 1 and 2 work with pp, as ZeRO-1 does in DeepSpeed)",
                    self.mesh.pp
                ));
            }
            if self.schedule.is_none() {
                return Err(format!(
                    "--mesh pp={} needs --schedule gpipe|1f1b|interleaved|zb (and --microbatches M, default pp)",
                    self.mesh.pp
                ));
            }
        }
        if self.mesh.tp == 1 && (self.sequence_parallel || self.loss_parallel) {
            return Err(
                "--sequence-parallel and --loss-parallel need a tp axis (e.g. --mesh tp=2)".into(),
            );
        }
        if self.zero > 3 {
            return Err(format!("--zero {}: must be 0, 1, 2 or 3", self.zero));
        }
        if let Some(s) = self.schedule.as_ref().filter(|_| self.mesh.pp == 1) {
            return Err(format!(
                "--schedule {s}: pipeline schedules are not supported by this build yet (no pp axis)"
            ));
        }
        if let Some(m) = self.microbatches.filter(|_| self.mesh.pp == 1) {
            return Err(format!(
                "--microbatches {m}: microbatching is not supported by this build yet (no pp axis)"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(Mesh::parse("dp=2").unwrap().world_size(), 2);
        let m = Mesh::parse("pp=2, dp=2,tp=3").unwrap();
        assert_eq!((m.dp, m.tp, m.pp), (2, 3, 2));
        assert!(Mesh::parse("dp=0").is_err());
        assert!(Mesh::parse("xp=2").is_err());
        assert!(Mesh::parse("dp=2,dp=2").is_err());
        let layout = |mesh: &str, zero| Layout {
            mesh: Mesh::parse(mesh).unwrap(),
            zero,
            schedule: None,
            microbatches: None,
            sequence_parallel: false,
            loss_parallel: false,
        };
        assert!(layout("dp=4", 0).check_supported().is_ok());
        assert!(layout("dp=2,tp=2", 0).check_supported().is_ok());
        let mut tp_pp = layout("tp=2,pp=2", 0);
        tp_pp.schedule = Some("1f1b".into());
        assert!(tp_pp.check_supported().is_ok());
        tp_pp.loss_parallel = true;
        assert!(
            tp_pp
                .check_supported()
                .unwrap_err()
                .contains("not supported")
        );
        let mut sp = layout("dp=2", 0);
        sp.sequence_parallel = true;
        assert!(sp.check_supported().unwrap_err().contains("tp axis"));
        assert!(layout("dp=2", 3).check_supported().is_ok());
        assert!(layout("dp=2", 4).check_supported().is_err());
        assert!(layout("dp=2,tp=2", 3).check_supported().is_ok());
        let mut zero_pp = layout("dp=2,pp=2", 1);
        zero_pp.schedule = Some("gpipe".into());
        assert!(zero_pp.check_supported().is_ok());
        zero_pp.zero = 3;
        assert!(zero_pp.check_supported().unwrap_err().contains("--zero 3"));
    }
}
