//! Element types that collectives move, and type-erased views of their buffers.
//!
//! Backends work on [`BufRef`] / [`BufMut`] (bytes plus a [`DType`]) so that the
//! [`Backend`](crate::Backend) trait stays object-safe; the typed API on
//! [`ProcessGroup`](crate::ProcessGroup) builds those views from `&[T]` without copying.

use half::{bf16, f16};
use std::fmt;

/// The element type of a communication buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float (`f32`).
    F32,
    /// 64-bit IEEE float (`f64`).
    F64,
    /// 16-bit IEEE half float ([`half::f16`]).
    F16,
    /// 16-bit brain float: `f32`'s exponent range, 8-bit mantissa ([`half::bf16`]).
    BF16,
    /// 32-bit signed integer (`i32`).
    I32,
    /// 64-bit signed integer (`i64`).
    I64,
    /// Unsigned byte (`u8`); also the type of a barrier, which moves nothing.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Every supported dtype, in a fixed order (used by conformance tests).
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        };
        f.write_str(name)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain-old-data element that can be communicated and reduced.
///
/// Sealed: the reduction kernels are specialised per type, so the set is closed.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + PartialOrd + fmt::Debug + sealed::Sealed + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Converts from `f64` (rounding / truncating like `as`); used by tests and averaging.
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64` (exact for every supported type except large `i64`).
    fn to_f64(self) -> f64;
}

macro_rules! impl_element_prim {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
impl_element_prim!(f32, DType::F32);
impl_element_prim!(f64, DType::F64);
impl_element_prim!(i32, DType::I32);
impl_element_prim!(i64, DType::I64);
impl_element_prim!(u8, DType::U8);

macro_rules! impl_element_half {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
        }
    };
}
impl_element_half!(f16, DType::F16);
impl_element_half!(bf16, DType::BF16);

/// A read-only, type-erased view of a communication buffer.
#[derive(Clone, Copy)]
pub struct BufRef<'a> {
    dtype: DType,
    bytes: &'a [u8],
}

/// A mutable, type-erased view of a communication buffer.
pub struct BufMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

impl<'a> BufRef<'a> {
    /// Views a typed slice as bytes (no copy).
    pub fn new<T: Element>(data: &'a [T]) -> Self {
        Self {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice(data),
        }
    }
    /// Builds a view from raw bytes; `bytes.len()` must be a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8]) -> Self {
        assert_eq!(
            bytes.len() % dtype.size(),
            0,
            "byte length not a multiple of {dtype}"
        );
        Self { dtype, bytes }
    }
    /// Element type of the buffer.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }
    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// The buffer's raw bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

impl<'a> BufMut<'a> {
    /// Views a typed slice as bytes (no copy).
    pub fn new<T: Element>(data: &'a mut [T]) -> Self {
        Self {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice_mut(data),
        }
    }
    /// Builds a view from raw bytes; `bytes.len()` must be a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &'a mut [u8]) -> Self {
        assert_eq!(
            bytes.len() % dtype.size(),
            0,
            "byte length not a multiple of {dtype}"
        );
        Self { dtype, bytes }
    }
    /// Element type of the buffer.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }
    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// The buffer's raw bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }
    /// The buffer's raw bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
    /// Reborrows as a read-only view.
    pub fn as_ref(&self) -> BufRef<'_> {
        BufRef {
            dtype: self.dtype,
            bytes: self.bytes,
        }
    }
    /// Reborrows mutably for a shorter lifetime.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        BufMut {
            dtype: self.dtype,
            bytes: self.bytes,
        }
    }
}

impl fmt::Debug for BufRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufRef({} x {})", self.len(), self.dtype)
    }
}
impl fmt::Debug for BufMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufMut({} x {})", self.len(), self.dtype)
    }
}
