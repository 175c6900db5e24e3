//! Reduction operators and the kernels that apply them.
//!
//! Kernels work block by block: every source block is combined into a small accumulator that
//! stays in L1, and only then written to the destinations. That lets a destination alias a
//! source (in-place all-reduce) and lets one pass write the result to several buffers, which
//! is what the shared-memory backend does to halve its memory traffic.

use crate::dtype::{DType, Element};
use crate::memops::copy_bytes;
use half::{bf16, f16};
use std::fmt;

/// How values from different ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum (wrapping for integer types).
    Sum,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Element-wise product (wrapping for integer types).
    Product,
}

impl ReduceOp {
    /// Every operator, in a fixed order (used by conformance tests and the wire encoding).
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ];
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        };
        f.write_str(s)
    }
}

/// Elements per kernel block: 4 KiB of f32, comfortably inside L1 with its sources.
const BLOCK: usize = 1024;

/// The type in which an element is accumulated (f32 for the 16-bit floats, so that a
/// reduction over many ranks rounds once).
trait Accumulate: Element {
    type Acc: bytemuck::Pod + Default;
    /// True when `Acc` is `Self` and conversions are identities (the block can be written
    /// out without a conversion pass).
    const ACC_IS_SELF: bool;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(acc: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn mul(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! accumulate_float {
    ($t:ty) => {
        impl Accumulate for $t {
            type Acc = $t;
            const ACC_IS_SELF: bool = true;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a * b
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                if b > a { b } else { a }
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                if b < a { b } else { a }
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t {
                a / n as $t
            }
        }
    };
}
accumulate_float!(f32);
accumulate_float!(f64);

macro_rules! accumulate_int {
    ($t:ty) => {
        impl Accumulate for $t {
            type Acc = $t;
            const ACC_IS_SELF: bool = true;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t {
                a / n as $t
            }
        }
    };
}
accumulate_int!(i32);
accumulate_int!(i64);
accumulate_int!(u8);

macro_rules! accumulate_half {
    ($t:ty) => {
        impl Accumulate for $t {
            type Acc = f32;
            const ACC_IS_SELF: bool = false;
            #[inline(always)]
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from_acc(acc: f32) -> $t {
                <$t>::from_f32(acc)
            }
            #[inline(always)]
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            #[inline(always)]
            fn mul(a: f32, b: f32) -> f32 {
                a * b
            }
            #[inline(always)]
            fn max(a: f32, b: f32) -> f32 {
                if b > a { b } else { a }
            }
            #[inline(always)]
            fn min(a: f32, b: f32) -> f32 {
                if b < a { b } else { a }
            }
            #[inline(always)]
            fn div(a: f32, n: usize) -> f32 {
                a / n as f32
            }
        }
    };
}
accumulate_half!(f16);
accumulate_half!(bf16);

#[inline(always)]
fn combine_block<T: Accumulate>(
    acc: &mut [T::Acc],
    src: &[T],
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    for (a, s) in acc.iter_mut().zip(src) {
        *a = f(*a, s.to_acc());
    }
}

#[inline(always)]
fn combine_pair<T: Accumulate>(
    acc: &mut [T::Acc],
    x: &[T],
    y: &[T],
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    for ((a, x), y) in acc.iter_mut().zip(x).zip(y) {
        *a = f(x.to_acc(), y.to_acc());
    }
}

/// Where a reduction reads and writes: `n_src` sources and `n_dst` destinations of the
/// same length, given as functions of their index so that callers need not allocate.
pub struct Operands<'a> {
    /// Number of sources.
    pub n_src: usize,
    /// Start address of source `i`.
    pub src: &'a dyn Fn(usize) -> *const u8,
    /// Number of destinations.
    pub n_dst: usize,
    /// Start address of destination `i`.
    pub dst: &'a dyn Fn(usize) -> *mut u8,
    /// Write destinations with streaming stores (large buffers); call
    /// `memops::fence` afterwards.
    pub stream: bool,
}

/// Reduces `len` elements from every source into every destination.
///
/// # Safety
/// Every source must be valid for reading and every destination for writing `len` elements
/// of `T`; no other thread may write the sources or touch the destinations meanwhile. A
/// destination may alias a source.
unsafe fn reduce_typed<T: Accumulate>(
    op: ReduceOp,
    avg_divisor: usize,
    len: usize,
    io: &Operands<'_>,
) {
    assert!(io.n_src >= 1);
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let (acc, out) = scratch.split_at_mut(BLOCK);
        // SAFETY: forwarded from the caller.
        unsafe { reduce_blocks::<T>(op, avg_divisor, len, io, cast_block(acc), cast_block(out)) }
    })
}

/// Views a block of the per-thread scratch as `BLOCK` elements of `E` (at most 8 bytes each,
/// aligned to 8 bytes).
fn cast_block<E: bytemuck::Pod>(words: &mut [u64]) -> &mut [E] {
    &mut bytemuck::cast_slice_mut::<u64, E>(words)[..BLOCK]
}

thread_local! {
    /// Two blocks of scratch per thread (accumulator and converted output), so a reduction
    /// neither allocates nor zeroes 8 KiB of stack per call — that memset used to dominate
    /// small all-reduces.
    static SCRATCH: std::cell::RefCell<Vec<u64>> = std::cell::RefCell::new(vec![0; 2 * BLOCK]);
}

/// The block loop of [`reduce_typed`], on caller-provided scratch blocks.
///
/// # Safety
/// As [`reduce_typed`].
unsafe fn reduce_blocks<T: Accumulate>(
    op: ReduceOp,
    avg_divisor: usize,
    len: usize,
    io: &Operands<'_>,
    acc: &mut [T::Acc],
    out: &mut [T],
) {
    let mut start = 0;
    while start < len {
        let m = BLOCK.min(len - start);
        let acc = &mut acc[..m];
        // SAFETY: the caller guarantees each source is readable for `len` elements.
        let block = |k: usize| unsafe {
            std::slice::from_raw_parts(((io.src)(k) as *const T).add(start), m)
        };
        if io.n_src == 1 {
            for (a, s) in acc.iter_mut().zip(block(0)) {
                *a = s.to_acc();
            }
        } else {
            let (x, y) = (block(0), block(1));
            match op {
                ReduceOp::Sum | ReduceOp::Avg => combine_pair::<T>(acc, x, y, T::add),
                ReduceOp::Product => combine_pair::<T>(acc, x, y, T::mul),
                ReduceOp::Max => combine_pair::<T>(acc, x, y, T::max),
                ReduceOp::Min => combine_pair::<T>(acc, x, y, T::min),
            }
        }
        for k in 2..io.n_src {
            let s = block(k);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => combine_block::<T>(acc, s, T::add),
                ReduceOp::Product => combine_block::<T>(acc, s, T::mul),
                ReduceOp::Max => combine_block::<T>(acc, s, T::max),
                ReduceOp::Min => combine_block::<T>(acc, s, T::min),
            }
        }
        let bytes: &[u8] = if T::ACC_IS_SELF && op != ReduceOp::Avg {
            bytemuck::cast_slice(acc)
        } else {
            let out = &mut out[..m];
            if op == ReduceOp::Avg {
                for (o, a) in out.iter_mut().zip(acc.iter()) {
                    *o = T::from_acc(T::div(*a, avg_divisor));
                }
            } else {
                for (o, a) in out.iter_mut().zip(acc.iter()) {
                    *o = T::from_acc(*a);
                }
            }
            bytemuck::cast_slice(out)
        };
        let offset = start * std::mem::size_of::<T>();
        for k in 0..io.n_dst {
            // SAFETY: the caller guarantees each destination is writable for `len` elements;
            // `bytes` is a local buffer, so the ranges cannot overlap.
            unsafe {
                copy_bytes(
                    (io.dst)(k).add(offset),
                    bytes.as_ptr(),
                    bytes.len(),
                    io.stream,
                )
            };
        }
        start += m;
    }
}

/// Type-erased reduction: combines `len` elements of `dtype` from every source with `op` and
/// writes the result to every destination. `Avg` divides by `avg_divisor`.
///
/// # Safety
/// See [`Operands`]: sources readable, destinations writable for `len` elements, no
/// concurrent writers; a destination may alias a source.
pub unsafe fn reduce_raw(
    dtype: DType,
    op: ReduceOp,
    avg_divisor: usize,
    len: usize,
    io: &Operands<'_>,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match dtype {
            DType::F32 => reduce_typed::<f32>(op, avg_divisor, len, io),
            DType::F64 => reduce_typed::<f64>(op, avg_divisor, len, io),
            DType::F16 => reduce_typed::<f16>(op, avg_divisor, len, io),
            DType::BF16 => reduce_typed::<bf16>(op, avg_divisor, len, io),
            DType::I32 => reduce_typed::<i32>(op, avg_divisor, len, io),
            DType::I64 => reduce_typed::<i64>(op, avg_divisor, len, io),
            DType::U8 => reduce_typed::<u8>(op, avg_divisor, len, io),
        }
    }
}

/// Safe helper: `acc = op(acc, other)` elementwise on typed-erased buffers of equal dtype and
/// length. Backends that receive peers' data into a scratch buffer (MPI, tree algorithms)
/// use this; `Avg` is treated as `Sum` here (divide once at the end with [`finish_avg`]).
pub fn reduce_into(op: ReduceOp, acc: &mut crate::BufMut<'_>, other: crate::BufRef<'_>) {
    assert_eq!(acc.dtype(), other.dtype(), "dtype mismatch in reduce_into");
    assert_eq!(acc.len(), other.len(), "length mismatch in reduce_into");
    let op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let len = acc.len();
    let dtype = acc.dtype();
    let a = acc.bytes_mut().as_mut_ptr();
    let b = other.bytes().as_ptr();
    let io = Operands {
        n_src: 2,
        src: &|k| if k == 0 { a as *const u8 } else { b },
        n_dst: 1,
        dst: &|_| a,
        stream: false,
    };
    // SAFETY: both buffers hold `len` elements; `acc` is exclusively borrowed.
    unsafe { reduce_raw(dtype, op, 1, len, &io) }
}

/// Divides every element by `n` (the last step of an `Avg` built from `Sum`s).
pub fn finish_avg(buf: &mut crate::BufMut<'_>, n: usize) {
    let len = buf.len();
    let dtype = buf.dtype();
    let a = buf.bytes_mut().as_mut_ptr();
    let io = Operands {
        n_src: 1,
        src: &|_| a as *const u8,
        n_dst: 1,
        dst: &|_| a,
        stream: false,
    };
    // SAFETY: one source that is also the destination, `len` elements, exclusively borrowed.
    unsafe { reduce_raw(dtype, ReduceOp::Avg, n, len, &io) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BufMut, BufRef};

    #[test]
    fn reduce_into_sums_and_takes_max() {
        let mut a = vec![1.0f32, 5.0, -2.0];
        let b = vec![2.0f32, 1.0, 7.0];
        reduce_into(ReduceOp::Sum, &mut BufMut::new(&mut a), BufRef::new(&b));
        assert_eq!(a, vec![3.0, 6.0, 5.0]);
        reduce_into(ReduceOp::Max, &mut BufMut::new(&mut a), BufRef::new(&b));
        assert_eq!(a, vec![3.0, 6.0, 7.0]);
        finish_avg(&mut BufMut::new(&mut a), 2);
        assert_eq!(a, vec![1.5, 3.0, 3.5]);
    }

    #[test]
    fn half_types_accumulate_in_f32_and_ints_wrap() {
        let mut a: Vec<bf16> = [256.0f32, 1.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let b: Vec<bf16> = [1.0f32, 2.0].iter().map(|&v| bf16::from_f32(v)).collect();
        reduce_into(ReduceOp::Sum, &mut BufMut::new(&mut a), BufRef::new(&b));
        // 257 is not representable in bf16: rounds to 256 (ties to even).
        assert_eq!(a[0].to_f32(), 256.0);
        assert_eq!(a[1].to_f32(), 3.0);
        let mut c = vec![250u8, 3];
        reduce_into(
            ReduceOp::Sum,
            &mut BufMut::new(&mut c),
            BufRef::new(&[10u8, 4]),
        );
        assert_eq!(c, vec![4, 7]);
    }

    #[test]
    fn reduction_spans_several_blocks() {
        let n = BLOCK * 3 + 17;
        let mut a: Vec<i64> = (0..n as i64).collect();
        let b: Vec<i64> = (0..n as i64).map(|v| v * 10).collect();
        reduce_into(ReduceOp::Sum, &mut BufMut::new(&mut a), BufRef::new(&b));
        assert!(a.iter().enumerate().all(|(i, &v)| v == 11 * i as i64));
    }
}
