//! Weights streamed into L2 ahead of the GEMVs that read them (decode graphs only).
//!
//! Why: a decode step alternates GEMVs, which stream weights from DRAM, with small kernels
//! (QK-norm + RoPE, attention, RMSNorm) that move almost nothing; during those the memory
//! system idles — per Qwen3-8B layer ~10 µs, ~40 MB of copy time (DECODE_STEP.md). With
//! programmatic dependent launch a GEMV's blocks start their weight copies while the kernel
//! before them runs, but only the first wave's, and only under the one kernel just before.
//! Here the model names the weights it reads next ([`crate::Backend::prefetch_weights`]:
//! the o-projection and the FFN's gate and up, named after the QKV projection) and a
//! one-warp-per-SM kernel (`l2_prefetch`, elementwise.cu) issues bulk L2 prefetches of their
//! leading bytes on a second stream, forked from the main one at that point: it starts when
//! the GEMV before it completes and runs beside RoPE and attention, and the GEMVs then copy
//! those bytes from L2.
//!
//! Only while a decode step is captured into a graph (the graph's branch is joined back into
//! the main stream before the capture ends, and the graph lives no longer than the model's
//! weights); eager steps and prefill run as before. `FERRITE_L2_PREFETCH_MB` sets the bytes
//! per call (0: off); the default is what was measured best (DECODE_STEP.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, LaunchConfig};

use super::launch::{KernelArg, LaunchExt};
use super::{CudaBackend, CudaWeight};

/// Segments per `l2_prefetch` launch (`L2PF_SEGS` in elementwise.cu).
pub const L2PF_SEGS: usize = 4;

/// Default bytes per call, in MB: see the module comment and DECODE_STEP.md.
const DEFAULT_MB: i64 = 24;

/// The kernel's argument: `L2Segs` (segment addresses, then their byte counts).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct L2Segs {
    p: [u64; L2PF_SEGS],
    n: [u64; L2PF_SEGS],
}

// SAFETY: plain old data laid out as the C struct (4 pointers, 4 byte counts).
unsafe impl super::launch::ScalarArg for L2Segs {}

/// The side stream and the capture state.
pub struct L2Prefetch {
    side: Arc<CudaStream>,
    /// Bytes per call; 0 turns the prefetch off (also below sm_90: no bulk prefetch).
    budget: usize,
    /// A decode step is being captured on the main stream.
    capturing: AtomicBool,
    /// The side stream has work since the last join.
    pending: AtomicBool,
}

impl L2Prefetch {
    pub fn new(ctx: &Arc<CudaContext>, major: i32) -> Result<Self> {
        let mb = super::switches::int_or("FERRITE_L2_PREFETCH_MB", DEFAULT_MB);
        let l2 = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .unwrap_or(0)
            .max(0) as usize;
        // What is prefetched must still be there when the GEMVs read it: at most 80% of L2
        // (the rest holds the activations, the KV cache lines attention touches, and the
        // GEMV's own streaming copies).
        let budget = if major >= 9 {
            ((mb.max(0) as usize) << 20).min(l2 / 5 * 4)
        } else {
            0
        };
        Ok(L2Prefetch {
            side: ctx
                .new_stream()
                .context("creating the L2 prefetch stream")?,
            budget,
            capturing: AtomicBool::new(false),
            pending: AtomicBool::new(false),
        })
    }

    /// Bytes per call (0: off).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// A capture of the main stream begins.
    pub fn begin_capture(&self) {
        self.pending.store(false, Ordering::Relaxed);
        self.capturing.store(true, Ordering::Relaxed);
    }

    /// A capture of the main stream is about to end: the side stream's work is joined back
    /// (a capture with an unjoined fork does not end).
    pub fn end_capture(&self, main: &CudaStream) -> Result<()> {
        self.capturing.store(false, Ordering::Relaxed);
        if self.pending.swap(false, Ordering::Relaxed) {
            main.join(&self.side)?;
        }
        Ok(())
    }

    /// Issues the prefetch of the weights' leading bytes (groups in order, within the
    /// budget: [`shares`]) on the side stream, after the main stream's work so far. Nothing
    /// outside a capture or with a zero budget.
    pub fn prefetch(&self, be: &CudaBackend, groups: &[&[&CudaWeight]]) -> Result<()> {
        if self.budget == 0 || groups.is_empty() || !self.capturing.load(Ordering::Relaxed) {
            return Ok(());
        }
        let sizes: Vec<Vec<usize>> = groups
            .iter()
            .map(|g| g.iter().map(|w| w.data.len()).collect())
            .collect();
        let sizes: Vec<&[usize]> = sizes.iter().map(|g| g.as_slice()).collect();
        let bytes = shares(&sizes, self.budget);
        let mut segs = L2Segs::default();
        let mut k = 0;
        let ws = groups.iter().flat_map(|g| g.iter());
        for (w, n) in ws.zip(bytes.into_iter().flatten()) {
            let (p, _sync) = w.data.device_ptr(&be.stream);
            if n == 0 || p % 16 != 0 {
                continue;
            }
            anyhow::ensure!(
                k < L2PF_SEGS,
                "prefetch_weights: more than {L2PF_SEGS} weights"
            );
            segs.p[k] = p;
            segs.n[k] = n as u64;
            k += 1;
        }
        if k == 0 {
            return Ok(());
        }
        self.side.join(&be.stream)?;
        let cfg = LaunchConfig {
            grid_dim: (be.sm_count as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.side.kernel(&be.ops.l2_prefetch);
        launch.arg(&segs).hint();
        // SAFETY: every segment lies inside a live weight allocation (its leading n bytes,
        // n <= its length), read only; the kernel writes nothing.
        unsafe { launch.launch(cfg) }?;
        self.pending.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// Bytes of each weight to prefetch within `budget`: the groups in order, each whole while
/// the budget lasts, the group that does not fit split evenly between its weights (their
/// leading bytes: the SwiGLU GEMV reads gate row r with up row r), nothing after it.
/// Multiples of 16 bytes (the bulk prefetch's unit).
pub fn shares(groups: &[&[usize]], budget: usize) -> Vec<Vec<usize>> {
    let mut left = budget;
    groups
        .iter()
        .map(|g| {
            let whole: usize = g.iter().map(|&n| n & !15).sum();
            if whole <= left {
                left -= whole;
                g.iter().map(|&n| n & !15).collect()
            } else {
                let each = (left / g.len().max(1)) & !15;
                left = 0;
                g.iter().map(|&n| n.min(each) & !15).collect()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::shares;

    #[test]
    fn shares_take_groups_in_order_and_split_the_last_evenly() {
        const MB: usize = 1 << 20;
        // Qwen3-8B Q4_K_M: o 9 MB; gate and up 27 MB each; 24 MB: o whole, then equal parts.
        let (o, g) = (9 * MB, 27 * MB);
        let s = shares(&[&[o], &[g, g]], 24 * MB);
        assert_eq!(s, vec![vec![o], vec![15 * MB / 2, 15 * MB / 2]]);
        // Everything fits: every weight whole (rounded down to 16 bytes).
        assert_eq!(
            shares(&[&[100], &[4000]], 1 << 30),
            vec![vec![96], vec![4000]]
        );
        // The budget ends inside the first group: nothing for the later ones.
        assert_eq!(shares(&[&[64, 64], &[32]], 64), vec![vec![32, 32], vec![0]]);
        // No budget.
        assert_eq!(shares(&[&[4096, 4096]], 0), vec![vec![0, 0]]);
        assert!(shares(&[], 1000).is_empty());
        // Never more than a weight holds, never more than the budget.
        for budget in [0, 15, 16, 1000, 5 * MB, 100 * MB] {
            let s = shares(&[&[3 * MB + 7], &[17, MB], &[40 * MB]], budget);
            let all: Vec<usize> = s.into_iter().flatten().collect();
            assert!(all.iter().sum::<usize>() <= budget);
            let sz = [3 * MB + 7, 17, MB, 40 * MB];
            assert!(all.iter().zip(&sz).all(|(a, b)| a <= b && a % 16 == 0));
        }
    }
}
