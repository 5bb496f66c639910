//! Quantization mixes: which GGUF type each tensor of a model gets, following llama.cpp's
//! `llama_tensor_get_type` for the mixes ferrite writes (`ferrite synth`) or applies to float
//! weights as they load (`--quantize`), and that requantization itself.
//!
//! Quantizing at load lets a Hugging Face checkpoint (F32, F16, BF16, or FP8 / NVFP4 decoded
//! to BF16) run on the quantized kernels with no conversion step: a decode step reads each
//! weight once, so its bytes set the speed (Q8_0 is 8.5 bits a weight, the Q4_K_M mix ~4.9,
//! against BF16's 16). Each weight becomes exactly what llama.cpp's quantizer would make of
//! the same f32 values (the same block formats and rounding, `ferrite_formats::quant`).

use std::borrow::Cow;

use anyhow::{Context, Result};
use ferrite_backend::HostTensor;
use ferrite_formats::{quant, GgmlType};
use rayon::prelude::*;

/// A quantization mix.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// All matrices F16, norms F32.
    F16,
    /// All matrices BF16, norms F32.
    BF16,
    /// All matrices Q8_0, norms F32.
    Q8_0,
    /// llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output projection and for attn_v and
    /// ffn_down on the "use_more_bits" layers (and its MoE and Qwen3.5 exceptions).
    Q4_K_M,
    /// llama.cpp's MXFP4_MOE: the routed experts MXFP4 (set by the caller), the other
    /// matrices Q8_0.
    MXFP4_MOE,
}

impl Mix {
    /// llama.cpp's name of the mix (`general.file_type`'s).
    pub fn name(self) -> &'static str {
        match self {
            Mix::F16 => "F16",
            Mix::BF16 => "BF16",
            Mix::Q8_0 => "Q8_0",
            Mix::Q4_K_M => "Q4_K_M",
            Mix::MXFP4_MOE => "MXFP4_MOE",
        }
    }
}

/// What kind of tensor, for choosing its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Norm,
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOut,
    FfnGateUp,
    FfnDown,
    Router,
    /// Qwen3.5's fused linear-attention `attn_qkv` (Q5_K in the Q4_K_M mix).
    AttnQkv,
    /// Other matrices (linear-attention z/α/β/out): the mix's base type.
    Other,
    /// Small matrices llama.cpp never quantizes (`ssm_conv1d`, the shared-expert gate).
    KeepF32,
}

/// The model-wide facts the type rules look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixModel {
    /// Layers (`block_count`).
    pub n_layers: usize,
    /// Routed experts (0: dense).
    pub n_experts: usize,
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third one
/// in between get more bits in the Q4_K_M mix.
pub fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    let (i, n) = (i_layer as i64, n_layers as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The type of one tensor of `role` in layer `layer` (for Qwen3.5's attn_v: its index among
/// the attn_v tensors, as llama.cpp counts them) whose rows hold `row_len` values, under
/// `mix` (following `llama_tensor_get_type` for Q4_K_M), then the block-size fallback:
/// Q8_0 where the row is a whole number of its 32-blocks, else F16.
pub fn tensor_type(mix: Mix, role: Role, layer: usize, m: MixModel, row_len: usize) -> GgmlType {
    let t = match role {
        // 1-D tensors and the MoE router stay F32 in every mix (the converter forces
        // ffn_gate_inp to F32 and llama-quantize never quantizes it).
        Role::Norm | Role::Router | Role::KeepF32 => return GgmlType::F32,
        _ => match mix {
            Mix::F16 => GgmlType::F16,
            Mix::BF16 => GgmlType::BF16,
            // The experts are set to MXFP4 by the caller.
            Mix::Q8_0 | Mix::MXFP4_MOE => GgmlType::Q8_0,
            Mix::Q4_K_M => match role {
                Role::Output => GgmlType::Q6K,
                Role::AttnV if m.n_experts == 8 => GgmlType::Q8_0,
                Role::AttnV if use_more_bits(layer, m.n_layers) => GgmlType::Q6K,
                Role::AttnK if m.n_experts == 8 => GgmlType::Q8_0,
                Role::AttnOut if m.n_experts == 8 => GgmlType::Q5K,
                Role::FfnDown if use_more_bits(layer, m.n_layers) => GgmlType::Q6K,
                Role::AttnQkv => GgmlType::Q5K,
                _ => GgmlType::Q4K,
            },
        },
    };
    if row_len.is_multiple_of(t.block_size()) {
        t
    } else if row_len.is_multiple_of(GgmlType::Q8_0.block_size())
        && t != GgmlType::F16
        && t != GgmlType::BF16
    {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

/// Float weights as they load, quantized to a mix (`--quantize`). Tensors already quantized
/// (a GGUF's) keep their type, as do 1-D ones and those the mix keeps in float.
#[derive(Clone, Copy, Debug)]
pub struct LoadQuant {
    pub mix: Mix,
    pub model: MixModel,
}

impl LoadQuant {
    /// `t` (of `role` in `layer`) in the type the mix gives it: requantized when it is a
    /// float matrix the mix quantizes, otherwise as it is.
    pub fn apply<'a>(&self, t: HostTensor<'a>, role: Role, layer: usize) -> Result<HostTensor<'a>> {
        let float = matches!(t.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let Some(&row_len) = t.shape.last() else {
            return Ok(t);
        };
        if !float || t.shape.len() < 2 {
            return Ok(t);
        }
        let to = tensor_type(self.mix, role, layer, self.model, row_len);
        // Float stays float (the mix's F32 roles; a fallback to F16 keeps the stored type).
        if to == t.dtype || matches!(to, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Ok(t);
        }
        requantize(&t, to)
    }
}

/// `t` (float, rows of its last dimension) quantized to `to`: every row decoded to f32 and
/// quantized on its own, rows in parallel (no f32 copy of the whole tensor).
pub fn requantize(t: &HostTensor<'_>, to: GgmlType) -> Result<HostTensor<'static>> {
    let row_len = *t.shape.last().context("a 0-D tensor")?;
    let n = t.validate()?;
    let rows = n.checked_div(row_len).unwrap_or(0);
    let (src_row, dst_row) = (t.dtype.bytes_for(row_len)?, to.bytes_for(row_len)?);
    let mut out = vec![0u8; rows * dst_row];
    out.par_chunks_mut(dst_row.max(1))
        .zip(t.data.par_chunks(src_row.max(1)))
        .try_for_each(|(dst, src)| -> Result<()> {
            let mut x = vec![0f32; row_len];
            quant::dequantize(t.dtype, src, &mut x)?;
            quant::quantize(to, &x, dst)?;
            Ok(())
        })?;
    Ok(HostTensor {
        dtype: to,
        shape: t.shape.clone(),
        data: Cow::Owned(out),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp() {
        // 36 layers: n/8 = 4, 7n/8 = 31 -> 0..4, 31..36 and 4 + 3k + 2.
        let got: Vec<usize> = (0..36).filter(|&i| use_more_bits(i, 36)).collect();
        assert_eq!(
            got,
            vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
        );
        // 2 layers: n/8 = 0, 7n/8 = 1 -> layer 1, and layer 0 since (0 - 0) % 3 != 2.
        assert_eq!(
            (0..2).filter(|&i| use_more_bits(i, 2)).collect::<Vec<_>>(),
            vec![1]
        );
    }

    fn f32_tensor(shape: &[usize], f: impl Fn(usize) -> f32) -> HostTensor<'static> {
        let n: usize = shape.iter().product();
        HostTensor {
            dtype: GgmlType::F32,
            shape: shape.to_vec(),
            data: Cow::Owned((0..n).flat_map(|i| f(i).to_le_bytes()).collect()),
        }
    }

    /// Each row is what quantizing that row alone gives (the parallel rows land in order).
    #[test]
    fn requantize_is_rowwise_quantize() {
        let t = f32_tensor(&[3, 5, 256], |i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0);
        for to in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
            let q = requantize(&t, to).unwrap();
            assert_eq!((q.dtype, &q.shape[..]), (to, &[3, 5, 256][..]));
            let row = to.bytes_for(256).unwrap();
            for r in 0..15 {
                let x: Vec<f32> = t.data[r * 1024..(r + 1) * 1024]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let mut want = vec![0u8; row];
                quant::quantize(to, &x, &mut want).unwrap();
                assert_eq!(&q.data[r * row..(r + 1) * row], &want[..], "{to} row {r}");
            }
        }
    }

    #[test]
    fn load_quant_keeps_what_the_mix_keeps() {
        let lq = LoadQuant {
            mix: Mix::Q4_K_M,
            model: MixModel {
                n_layers: 36,
                n_experts: 0,
            },
        };
        let m = f32_tensor(&[4, 256], |i| i as f32 / 1024.0);
        let ty = |role, layer| lq.apply(m.clone(), role, layer).unwrap().dtype;
        assert_eq!(ty(Role::AttnQ, 5), GgmlType::Q4K);
        assert_eq!(ty(Role::Output, 0), GgmlType::Q6K);
        assert_eq!(ty(Role::FfnDown, 0), GgmlType::Q6K, "a use_more_bits layer");
        assert_eq!(ty(Role::FfnDown, 4), GgmlType::Q4K);
        assert_eq!(ty(Role::Router, 3), GgmlType::F32);
        assert_eq!(ty(Role::KeepF32, 3), GgmlType::F32);
        // Rows of 64: Q4_K's 256-blocks do not fit, Q8_0's do.
        let narrow = f32_tensor(&[4, 64], |i| i as f32);
        assert_eq!(
            lq.apply(narrow, Role::AttnQ, 5).unwrap().dtype,
            GgmlType::Q8_0
        );
        // Rows of 4 (a conv's taps): stays float. 1-D: stays.
        let taps = f32_tensor(&[8, 4], |i| i as f32);
        assert_eq!(lq.apply(taps, Role::Other, 0).unwrap().dtype, GgmlType::F32);
        let norm = f32_tensor(&[256], |_| 1.0);
        assert_eq!(lq.apply(norm, Role::Norm, 0).unwrap().dtype, GgmlType::F32);
        // Already quantized: kept as stored.
        let q = requantize(&m, GgmlType::Q8_0).unwrap();
        assert_eq!(lq.apply(q, Role::AttnQ, 5).unwrap().dtype, GgmlType::Q8_0);
    }
}
