//! The one element-wise comparison of every parity test: `|got − want| ≤ rel·max(|got|,
//! |want|) + abs`, failing with the first offending element named, and reporting how close it
//! came ([`Closeness`], for closing notes and docs).

/// A tolerance: relative, with an absolute floor below which values count as equal (f32
/// summation-order noise around zero).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Allowed difference as a fraction of the larger magnitude of the two values.
    pub rel: f32,
    /// Allowed difference added on top, whatever the magnitude.
    pub abs: f32,
}

impl Tolerance {
    /// `rel` relative with an `abs` absolute floor.
    pub const fn new(rel: f32, abs: f32) -> Self {
        Self { rel, abs }
    }

    /// Whether `got` and `want` agree.
    pub fn holds(&self, got: f32, want: f32) -> bool {
        (got - want).abs() <= self.rel * got.abs().max(want.abs()) + self.abs
    }
}

/// How close two runs came.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Closeness {
    /// The largest `|got − want|` over the tolerance allowed for that element (≤ 1 passes).
    pub used: f32,
    /// The largest `|got − want|`.
    pub max_abs: f32,
}

impl Closeness {
    /// The worse of two.
    pub fn max(self, other: Closeness) -> Closeness {
        Closeness {
            used: self.used.max(other.used),
            max_abs: self.max_abs.max(other.max_abs),
        }
    }
}

impl std::fmt::Display for Closeness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} of the tolerance, largest |diff| {:.1e}",
            self.used, self.max_abs
        )
    }
}

/// Asserts `got` and `want` agree element-wise within `tol`; says how close they came.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tolerance) -> Closeness {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut out = Closeness::default();
    for (i, (&x, &y)) in got.iter().zip(want).enumerate() {
        let diff = (x - y).abs();
        let allowed = tol.rel * x.abs().max(y.abs()) + tol.abs;
        assert!(
            tol.holds(x, y),
            "{what}[{i}]: {x} vs {y} (|diff| {diff:e} > {allowed:e})"
        );
        out.max_abs = out.max_abs.max(diff);
        if allowed > 0.0 {
            out.used = out.used.max(diff / allowed);
        }
    }
    out
}

/// Whether every element agrees within `tol`.
pub fn is_close(got: &[f32], want: &[f32], tol: Tolerance) -> bool {
    got.len() == want.len() && got.iter().zip(want).all(|(&x, &y)| tol.holds(x, y))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_with_a_floor() {
        let tol = Tolerance::new(1e-3, 1e-6);
        assert!(tol.holds(1000.0, 1000.9));
        assert!(!tol.holds(1000.0, 1002.0));
        assert!(tol.holds(0.0, 5e-7));
        assert!(is_close(&[1.0, 2.0], &[1.0005, 2.0], tol));
        let c = assert_close("x", &[1.0, 2.0], &[1.0005, 2.0], tol);
        assert!((c.max_abs - 0.0005).abs() < 1e-6);
        assert!(c.used > 0.49 && c.used < 0.5, "{c}");
    }
}
