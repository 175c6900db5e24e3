//! [`Mask`]: which keys each query of an attention call sees — all, a causal prefix, a sliding
//! window (Mistral's), each at an offset between the queries' and the keys' positions (what
//! ring attention's blocks need).

use burn::tensor::{Device, Int, Tensor, TensorData};
use std::ops::Range;

/// Added to a masked (query, key) pair's score where a mask is materialized: `exp` of it is 0
/// against any real score, and it stays finite in f32 and bf16 (in f16 it rounds to −∞, whose
/// `exp` is 0 as well), so a query that sees no key of a call gets a finite log-sum-exp
/// (≈ −1e30) that weighs nothing when calls are merged, not a NaN.
pub const MASKED: f32 = -1e30;

/// Which keys each query sees. Query `a` (of `Tq`) stands at position `p = a + offset` on the
/// keys' axis (`offset` `None`: `Tk − Tq`, the queries are the last `Tq` of the keys); it sees
/// key `c` when `c ≤ p` (if `causal`) and `c > p − W` (if `window` is `W`): Mistral's
/// `i − W < j ≤ i`. `Mask::from(bool)` is the plain causal (or full) mask.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mask {
    /// No key after the query's position.
    pub causal: bool,
    /// Only the `W` positions up to the query's (`W ≥ 1`).
    pub window: Option<usize>,
    /// The first query's position on the keys' axis (`None`: `Tk − Tq`).
    pub offset: Option<usize>,
}

impl From<bool> for Mask {
    fn from(causal: bool) -> Self {
        Self {
            causal,
            ..Self::default()
        }
    }
}

impl Mask {
    /// Every key to every query.
    pub const FULL: Mask = Mask {
        causal: false,
        window: None,
        offset: None,
    };
    /// The causal mask (queries the last `Tq` of the keys).
    pub const CAUSAL: Mask = Mask {
        causal: true,
        window: None,
        offset: None,
    };

    /// This mask limited to a window of `window` positions (`None`: unlimited).
    pub fn with_window(self, window: Option<usize>) -> Self {
        assert!(window != Some(0), "an attention window of 0 keys");
        Self { window, ..self }
    }

    /// This mask with the first query at position `offset` of the keys' axis.
    pub fn at(self, offset: usize) -> Self {
        Self {
            offset: Some(offset),
            ..self
        }
    }

    /// Whether it masks nothing.
    pub fn is_full(&self) -> bool {
        !self.causal && self.window.is_none()
    }

    /// The keys query `a` of `tq` sees among `tk`: `lo .. hi` (empty when it sees none).
    pub fn keys(&self, a: usize, tq: usize, tk: usize) -> Range<usize> {
        let p = a + self.offset.unwrap_or(tk.saturating_sub(tq));
        let hi = match self.causal {
            true => (p + 1).min(tk),
            false => tk,
        };
        let lo = self.window.map_or(0, |w| (p + 1).saturating_sub(w)).min(hi);
        lo..hi
    }

    /// [`Mask::values`] built on `device` (no host data): the queries at `offset ..`
    /// (default `Tk − Tq`), the keys at `0 .. Tk` ([`Mask::bias_at`]).
    pub fn bias(&self, tq: usize, tk: usize, device: &Device) -> Tensor<2> {
        let offset = self.offset.unwrap_or(tk.saturating_sub(tq)) as i64;
        let q = Tensor::<1, Int>::arange(offset..offset + tq as i64, device);
        self.bias_at(q, Tensor::<1, Int>::arange(0..tk as i64, device))
    }

    /// `[Tq, Tk]` on the positions' device: 0 where the query at position `q_pos[i]` sees
    /// the key at `k_pos[j]` (causal: `k ≤ q`; window W: `q − k < W`), [`MASKED`] elsewhere —
    /// any positions (ring attention's chunks), the offset not applied.
    pub fn bias_at(&self, q_pos: Tensor<1, Int>, k_pos: Tensor<1, Int>) -> Tensor<2> {
        let (tq, tk) = (q_pos.dims()[0], k_pos.dims()[0]);
        let q = q_pos.unsqueeze_dim::<2>(1).expand([tq, tk]);
        let k = k_pos.unsqueeze_dim::<2>(0).expand([tq, tk]);
        let mut bias = Tensor::<2>::zeros([tq, tk], &q.device());
        if self.causal {
            bias = bias.mask_fill(k.clone().greater(q.clone()), MASKED);
        }
        if let Some(w) = self.window {
            bias = bias.mask_fill((q - k).greater_equal_elem(w as i64), MASKED);
        }
        bias
    }

    /// `[Tq, Tk]` f32: 0 where query `a` sees key `c`, [`MASKED`] elsewhere.
    pub fn values(&self, tq: usize, tk: usize) -> TensorData {
        let mut values = vec![MASKED; tq * tk];
        for (a, row) in values.chunks_exact_mut(tk.max(1)).enumerate().take(tq) {
            row[self.keys(a, tq, tk)].fill(0.0);
        }
        TensorData::new(values, [tq, tk])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_causality_windows_and_offsets() {
        // Causal, queries the last 2 of 4 keys: query 0 at position 2.
        assert_eq!(Mask::CAUSAL.keys(0, 2, 4), 0..3);
        assert_eq!(Mask::CAUSAL.keys(1, 2, 4), 0..4);
        // Mistral's window W = 2: i − 2 < j ≤ i.
        let w = Mask::CAUSAL.with_window(Some(2));
        assert_eq!((w.keys(0, 4, 4), w.keys(3, 4, 4)), (0..1, 2..4));
        // Queries at positions 8.. over keys 0..4 with W = 6: query 0 sees 3, query 1 none.
        let ring = w.with_window(Some(6)).at(8);
        assert_eq!((ring.keys(0, 4, 4), ring.keys(1, 4, 4)), (3..4, 4..4));
        assert_eq!(Mask::FULL.keys(1, 2, 4), 0..4);
        // Built on a device, the same values.
        let device = Device::flex();
        for (mask, tq, tk) in [
            (Mask::CAUSAL, 3, 5),
            (Mask::FULL, 2, 4),
            (Mask::CAUSAL.with_window(Some(2)), 6, 6),
            (Mask::CAUSAL.with_window(Some(6)).at(8), 4, 4),
        ] {
            let built = mask.bias(tq, tk, &device).into_data();
            assert_eq!(built, mask.values(tq, tk), "{mask:?}");
        }
        let v = Mask::CAUSAL
            .with_window(Some(2))
            .values(3, 3)
            .try_to_vec::<f32>()
            .unwrap();
        let m = MASKED;
        assert_eq!(v, [0.0, m, m, 0.0, 0.0, m, m, 0.0, 0.0]);
    }
}
