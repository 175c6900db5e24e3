//! [`ScheduleKind`]: the pipeline schedules, by name.

/// A pipeline schedule kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward (PipeDream-flush).
    OneFOneB,
    /// Interleaved 1F1B with `chunks` model chunks per rank.
    Interleaved {
        /// Model chunks per rank (at least 1).
        chunks: usize,
    },
    /// Zero-bubble ZB-H1 (1F1B memory, B/W split).
    ZbH1,
    /// Zero-bubble ZB-V (V-shaped stage map, two chunks per rank, B/W split).
    ZbV,
}

impl ScheduleKind {
    /// The names [`parse`](Self::parse) reads, for help and error messages.
    pub const NAMES: &'static str = "gpipe, 1f1b, interleaved[:V], zb-h1 (zb), zb-v";

    /// Parses `gpipe`, `1f1b`, `interleaved` (2 chunks), `interleaved:V`, `zb` / `zb-h1`,
    /// `zb-v` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.to_ascii_lowercase();
        Some(match s.as_str() {
            "gpipe" => Self::GPipe,
            "1f1b" => Self::OneFOneB,
            "interleaved" => Self::Interleaved { chunks: 2 },
            "zb" | "zb-h1" | "zbh1" => Self::ZbH1,
            "zb-v" | "zbv" => Self::ZbV,
            other => {
                let v = other.strip_prefix("interleaved:")?.parse().ok()?;
                if v == 0 {
                    return None;
                }
                Self::Interleaved { chunks: v }
            }
        })
    }

    /// The canonical name (what [`parse`](Self::parse) reads back).
    pub fn name(&self) -> String {
        match *self {
            Self::GPipe => "gpipe".into(),
            Self::OneFOneB => "1f1b".into(),
            Self::Interleaved { chunks } => format!("interleaved:{chunks}"),
            Self::ZbH1 => "zb-h1".into(),
            Self::ZbV => "zb-v".into(),
        }
    }

    /// Model chunks per rank.
    pub fn chunks(&self) -> usize {
        match *self {
            Self::GPipe | Self::OneFOneB | Self::ZbH1 => 1,
            Self::Interleaved { chunks } => chunks,
            Self::ZbV => 2,
        }
    }

    /// The global stage that `rank`'s local `chunk` runs on `ranks` ranks: round robin
    /// (stage `chunk · ranks + rank`), or V-shaped for ZB-V (`rank`, then `2·ranks − 1 − rank`).
    pub fn stage(&self, ranks: usize, rank: usize, chunk: usize) -> usize {
        match (*self, chunk) {
            (Self::ZbV, 1) => 2 * ranks - 1 - rank,
            _ => chunk * ranks + rank,
        }
    }

    /// The bubble fraction theory predicts when F, B (input part) and W take equal time
    /// (full backward = 2 F): `(p−1)/(m+p−1)` for GPipe and 1F1B, `(p−1)/(v·m+p−1)` for
    /// interleaving, `(p−1)/(3m+p−1)` for ZB-H1 (its bubble is a third of 1F1B's), and `None`
    /// for ZB-V (no closed form).
    pub fn theory_bubble(&self, ranks: usize, microbatches: usize) -> Option<f64> {
        let (p, m) = (ranks as f64, microbatches as f64);
        match *self {
            Self::GPipe | Self::OneFOneB => Some((p - 1.0) / (m + p - 1.0)),
            Self::Interleaved { chunks } => Some((p - 1.0) / (chunks as f64 * m + p - 1.0)),
            Self::ZbH1 => Some((p - 1.0) / (3.0 * m + p - 1.0)),
            Self::ZbV => None,
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_and_bad_ones_do_not() {
        let kinds = [
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved { chunks: 3 },
            ScheduleKind::ZbH1,
            ScheduleKind::ZbV,
        ];
        for k in kinds {
            assert_eq!(ScheduleKind::parse(&k.name()), Some(k));
        }
        assert_eq!(
            ScheduleKind::parse("interleaved"),
            Some(ScheduleKind::Interleaved { chunks: 2 })
        );
        assert_eq!(ScheduleKind::parse("ZB"), Some(ScheduleKind::ZbH1));
        for bad in ["interleaved:0", "interleaved:x", "zb-x", ""] {
            assert_eq!(ScheduleKind::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn zb_v_places_chunks_in_a_v() {
        let v = ScheduleKind::ZbV;
        assert_eq!((v.stage(4, 0, 0), v.stage(4, 0, 1)), (0, 7));
        assert_eq!((v.stage(4, 3, 0), v.stage(4, 3, 1)), (3, 4));
        let i = ScheduleKind::Interleaved { chunks: 2 };
        assert_eq!(i.stage(4, 1, 1), 5);
    }
}
