//! GGUF metadata values and their on-disk type tags.

use std::fmt;

/// The type tag stored before every metadata value (`gguf_type` in ggml).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    /// The id stored in the file.
    pub fn id(self) -> u32 {
        match self {
            GgufValueType::U8 => 0,
            GgufValueType::I8 => 1,
            GgufValueType::U16 => 2,
            GgufValueType::I16 => 3,
            GgufValueType::U32 => 4,
            GgufValueType::I32 => 5,
            GgufValueType::F32 => 6,
            GgufValueType::Bool => 7,
            GgufValueType::String => 8,
            GgufValueType::Array => 9,
            GgufValueType::U64 => 10,
            GgufValueType::I64 => 11,
            GgufValueType::F64 => 12,
        }
    }

    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgufValueType::U8,
            1 => GgufValueType::I8,
            2 => GgufValueType::U16,
            3 => GgufValueType::I16,
            4 => GgufValueType::U32,
            5 => GgufValueType::I32,
            6 => GgufValueType::F32,
            7 => GgufValueType::Bool,
            8 => GgufValueType::String,
            9 => GgufValueType::Array,
            10 => GgufValueType::U64,
            11 => GgufValueType::I64,
            12 => GgufValueType::F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type can occupy in a file. The reader uses it to
    /// reject an array count that could not possibly fit in the bytes left, before it
    /// allocates anything.
    pub(crate) fn min_encoded_size(self) -> usize {
        match self {
            GgufValueType::U8 | GgufValueType::I8 | GgufValueType::Bool => 1,
            GgufValueType::U16 | GgufValueType::I16 => 2,
            GgufValueType::U32 | GgufValueType::I32 | GgufValueType::F32 => 4,
            GgufValueType::U64 | GgufValueType::I64 | GgufValueType::F64 => 8,
            // u64 length, possibly zero bytes of text
            GgufValueType::String => 8,
            // u32 element type + u64 count
            GgufValueType::Array => 12,
        }
    }
}

/// One metadata value. Arrays hold values of one type (arrays of arrays are allowed).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::F64(_) => GgufValueType::F64,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
        }
    }

    /// Any integer type, if the value is representable as i128 (all of them are).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer type whose value fits in u64. Writers disagree on the integer type of a
    /// key (llama.cpp writes u32, some converters i32 or u64), so readers accept all.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }
    /// Any integer type whose value fits in u32.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }
    /// Any integer type whose value fits in usize.
    pub fn as_usize(&self) -> Option<usize> {
        self.as_i128().and_then(|v| usize::try_from(v).ok())
    }
    /// Any integer type whose value fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }
    /// Any integer type whose value fits in i32.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }
    /// f32 or f64 (narrowed). Integers are not floats: a key that should be a float but is
    /// stored as an integer is more likely a wrong key than a convenience.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }
    /// f32 (widened) or f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
    /// An array whose elements are all strings.
    pub fn as_str_array(&self) -> Option<Vec<&str>> {
        self.as_array()?.iter().map(GgufValue::as_str).collect()
    }
    /// An array whose elements are all integers that fit in u32.
    pub fn as_u32_array(&self) -> Option<Vec<u32>> {
        self.as_array()?.iter().map(GgufValue::as_u32).collect()
    }
    /// An array whose elements are all integers that fit in i32.
    pub fn as_i32_array(&self) -> Option<Vec<i32>> {
        self.as_array()?.iter().map(GgufValue::as_i32).collect()
    }
    /// An array whose elements are all f32 or f64.
    pub fn as_f32_array(&self) -> Option<Vec<f32>> {
        self.as_array()?.iter().map(GgufValue::as_f32).collect()
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for GgufValue {
            fn from(v: $t) -> Self {
                GgufValue::$v(v)
            }
        })*
    };
}
from_scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32,
    u64 => U64, i64 => I64, f32 => F32, f64 => F64, bool => Bool, String => String);

impl From<&str> for GgufValue {
    fn from(v: &str) -> Self {
        GgufValue::String(v.to_owned())
    }
}

impl<T: Into<GgufValue>> From<Vec<T>> for GgufValue {
    fn from(v: Vec<T>) -> Self {
        GgufValue::Array(v.into_iter().map(Into::into).collect())
    }
}

/// A short rendering for listings (`ferrite info`): long arrays are summarised, long
/// strings cut, so printing a 150k-entry vocab does not flood the terminal.
impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MAX_ITEMS: usize = 8;
        const MAX_CHARS: usize = 80;
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(s) => {
                if s.chars().count() > MAX_CHARS {
                    let cut: String = s.chars().take(MAX_CHARS).collect();
                    write!(f, "{cut:?}… ({} bytes)", s.len())
                } else {
                    write!(f, "{s:?}")
                }
            }
            GgufValue::Array(a) => {
                write!(f, "[")?;
                for (i, v) in a.iter().take(MAX_ITEMS).enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.len() > MAX_ITEMS {
                    write!(f, ", … {} items]", a.len())
                } else {
                    write!(f, "]")
                }
            }
        }
    }
}
