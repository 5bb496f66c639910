//! The block timeline of one decode step (`FERRITE_DIAG_TL`, a timing diagnostic).
//!
//! The CUPTI trace (tools/h200/kernel_trace) gives each kernel's end; what it cannot show is
//! what a launch's blocks do inside the step: when the early blocks of a PDL launch start
//! (and so issue their weight copies) against the predecessor's end, how many are resident
//! before their wait returns, and at what rate the later waves start (a block starts where
//! another has ended). With the switch set, every kernel file is compiled with `FERRITE_TL`
//! (common.cuh `TL_STAMP`): each block's first thread stamps `%globaltimer` at its PDL wait's
//! entry and return, the tensor-core GEMVs at their output and the decode attention at its
//! marks (timeline.cuh `TL_MARK`), into the module's
//! `ferrite_tl` buffer. Before the chosen graph replay this zeroes every module's count; after
//! it, it waits for the step and writes one line a stamp (tools/timeline.py reads them).

use std::io::Write;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use cudarc::driver::{CudaGraph, CudaModule, CudaStream};

use super::switches;

/// The stamps a module holds at most (common.cuh `FERRITE_TL_CAP`).
const CAP: usize = 1 << 20;

static MODULES: Mutex<Vec<(String, Arc<CudaModule>)>> = Mutex::new(Vec::new());
static REPLAYS: AtomicI64 = AtomicI64::new(0);

/// Keeps a loaded module whose stamps the traced replay reads.
pub(super) fn register(name: &str, module: &Arc<CudaModule>) {
    if let Ok(mut m) = MODULES.lock() {
        m.push((name.to_string(), module.clone()));
    }
}

/// Replays `g`; the `FERRITE_DIAG_TL`-th replay is recorded and written out.
pub(super) fn replay(stream: &Arc<CudaStream>, g: &CudaGraph) -> Result<()> {
    let n = REPLAYS.fetch_add(1, Ordering::Relaxed) + 1;
    if n != switches::diag_tl() {
        g.launch()?;
        return Ok(());
    }
    let modules = MODULES
        .lock()
        .map_err(|_| anyhow::anyhow!("timeline: poisoned"))?
        .clone();
    for (name, m) in &modules {
        let mut count = m
            .get_global("ferrite_tl_n", stream)
            .with_context(|| format!("timeline: {name} has no ferrite_tl_n"))?;
        stream.memset_zeros(&mut count)?;
    }
    g.launch()?;
    stream.synchronize()?;
    let path =
        std::env::var("FERRITE_DIAG_TL_OUT").unwrap_or_else(|_| "ferrite-timeline.tsv".into());
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&path).with_context(|| format!("timeline: creating {path}"))?,
    );
    writeln!(out, "module\tkind\tt_ns\tsm\twarps\tgrid\tblock")?;
    let mut lines = 0usize;
    for (name, m) in &modules {
        let count = m.get_global("ferrite_tl_n", stream)?;
        let mut c = [0u8; 4];
        stream.memcpy_dtoh(&count, &mut c)?;
        let k = (u32::from_le_bytes(c) as usize).min(CAP);
        if k == 0 {
            continue;
        }
        let buf = m.get_global("ferrite_tl", stream)?;
        let mut raw = vec![0u8; 16 * k];
        stream.memcpy_dtoh(&buf.slice(..16 * k), &mut raw)?;
        for s in raw.chunks_exact(16) {
            let t = u64::from_le_bytes(s[..8].try_into()?);
            let w = u64::from_le_bytes(s[8..].try_into()?);
            writeln!(
                out,
                "{name}\t{}\t{t}\t{}\t{}\t{}\t{}",
                w >> 60,
                (w >> 46) & 0xFF,
                (w >> 54) & 0x3F,
                (w >> 23) & 0x7F_FFFF,
                w & 0x7F_FFFF
            )?;
        }
        lines += k;
    }
    out.flush()?;
    tracing::info!("timeline: {lines} stamps of replay {n} written to {path}");
    Ok(())
}
