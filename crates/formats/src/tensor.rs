//! A format-independent view of stored tensors.

use crate::quant::GgmlType;

/// One tensor as stored in a model file: its element type, its shape and its raw bytes
/// (borrowed from the memory map; nothing is copied or converted).
///
/// `shape` is in row-major order as PyTorch writes it: the last dimension is contiguous.
/// For a 2-D weight `[n_out, n_in]` each of the `n_out` rows holds `n_in` elements, stored as
/// `n_in / block_size` quant blocks. (GGUF stores dims innermost-first; the GGUF reader
/// reverses them so both formats agree here.)
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub dtype: GgmlType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorView<'_> {
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
    /// Number of rows when seen as a matrix whose rows are the last dimension.
    pub fn n_rows(&self) -> usize {
        let last = self.shape.last().copied().unwrap_or(1);
        self.n_elements().checked_div(last).unwrap_or(0)
    }
    /// Length of one row (the contiguous last dimension).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    /// Dequantize the whole tensor to f32.
    pub fn to_f32(&self) -> crate::Result<Vec<f32>> {
        let mut out = vec![0f32; self.n_elements()];
        crate::quant::dequantize(self.dtype, self.data, &mut out)?;
        Ok(out)
    }
}

/// A tensor made at load from a stored form ferrite does not compute with (a safetensors FP8
/// weight and its block scales, as BF16): owned, in the same terms as [`TensorView`].
#[derive(Clone, Debug)]
pub struct OwnedTensor {
    pub dtype: GgmlType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Anything that holds named tensors: a GGUF file or a safetensors checkpoint.
pub trait TensorSource: Send + Sync {
    /// The tensor with this name, or `None`.
    fn tensor(&self, name: &str) -> Option<TensorView<'_>>;
    /// All tensor names, in file order.
    fn tensor_names(&self) -> Vec<String>;
    /// The tensor with this name, or an error saying why there is none: missing, or (in a
    /// safetensors checkpoint) stored in a dtype ferrite does not compute with.
    fn require_tensor(&self, name: &str) -> crate::Result<TensorView<'_>> {
        self.tensor(name)
            .ok_or_else(|| crate::FormatError::MissingTensor(name.to_owned()))
    }
    /// Tensor `name` converted at load, where it is stored in a form ferrite converts (a
    /// safetensors FP8 weight with its `_scale_inv` block scales, to BF16); `None` where
    /// it is not one (a plain view, absent, or stored in a type without a conversion).
    fn converted(&self, _name: &str) -> Option<crate::Result<OwnedTensor>> {
        None
    }
    /// Whether the source stores a tensor of this name, in any type (an optional weight
    /// stored in a type that needs converting is present, not absent).
    fn has(&self, name: &str) -> bool {
        self.tensor(name).is_some()
    }
}
