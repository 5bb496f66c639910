//! `ferrite check` cases of batched attention over a paged KV cache (the serving step):
//! several sequences at different positions, their pages drawn from a shuffled pool, first
//! filled by batched prefill steps (several sequences' chunks per step), then one checked
//! step whose rows are decode rows and prefill chunks of all of them. The backend under test
//! and the CPU reference get the same data and the same page assignment.

use anyhow::Result;
use ferrite_backend::{AttnArgs, AttnShape, Backend, PagedKv, SeqRows, StepInput};

use super::{
    kv_elem_bytes, FillStep, HostData, Rng, ATTN_DECODE_MAX_ROWS, ATTN_F16_DECODE_NMSE,
    ATTN_F16_TC_NMSE, ATTN_F32_NMSE, ATTN_Q8_NMSE, FILL_CHUNK,
};

/// One paged case: `seqs` are the (first position, rows) of each sequence's part of the
/// checked step, in row order.
#[derive(Clone, Debug)]
pub(super) struct PagedCase {
    pub shape: AttnShape,
    pub page_size: usize,
    pub seqs: Vec<(usize, usize)>,
    /// A q8_0 cache on backends that have one (the CPU reference keeps f32).
    pub q8: bool,
}

/// The host side of a paged case beyond the checked step's q, k, v.
#[derive(Default)]
pub(super) struct PagedData {
    /// Per sequence: its block table.
    pages: Vec<Vec<u32>>,
    /// Per sequence: the fill chunks before the checked step.
    fills: Vec<Vec<FillStep>>,
    n_pages: usize,
    max_pages: usize,
}

impl PagedCase {
    pub fn name(&self) -> String {
        let s = self.shape;
        let seqs: Vec<String> = self.seqs.iter().map(|(p, r)| format!("{r}@{p}")).collect();
        format!(
            "attention paged hd={} heads={}/kv{} p{} {} seqs={}",
            s.head_dim,
            s.n_heads,
            s.n_kv_heads,
            self.page_size,
            if self.q8 { "q8_0" } else { "f16" },
            seqs.join(",")
        )
    }

    fn rows(&self) -> usize {
        self.seqs.iter().map(|s| s.1).sum()
    }

    /// Random q, k, v for the checked step and every fill chunk; the pages of each sequence
    /// drawn from a shuffled pool with a few pages to spare.
    pub fn gen(&self, rng: &mut Rng, h: &mut HostData) {
        let (qd, kvd) = (
            self.shape.n_heads * self.shape.head_dim,
            self.shape.n_kv_heads * self.shape.head_dim,
        );
        let need: Vec<usize> = self
            .seqs
            .iter()
            .map(|(p, r)| (p + r).div_ceil(self.page_size))
            .collect();
        let n_pages = need.iter().sum::<usize>() + 3;
        let mut pool: Vec<u32> = (0..n_pages as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.below(i + 1));
        }
        let mut d = PagedData {
            n_pages,
            max_pages: need.iter().copied().max().unwrap_or(1) + 1,
            ..PagedData::default()
        };
        for (&(pos0, _), &n) in self.seqs.iter().zip(&need) {
            d.pages.push(pool.split_off(pool.len() - n));
            let mut fills = Vec::new();
            let mut p = 0;
            while p < pos0 {
                let n = FILL_CHUNK.min(pos0 - p);
                fills.push((
                    rng.normals(n * qd, 1.0),
                    rng.normals(n * kvd, 1.0),
                    rng.normals(n * kvd, 1.0),
                    p,
                    n,
                ));
                p += n;
            }
            d.fills.push(fills);
        }
        let rows = self.rows();
        h.acts.push((rng.normals(rows * qd, 1.0), rows, qd));
        h.acts.push((rng.normals(rows * kvd, 1.0), rows, kvd));
        h.acts.push((rng.normals(rows * kvd, 1.0), rows, kvd));
        h.out = (rows, qd);
        h.paged = Some(d);
    }

    /// The filled paged cache and the checked step's input.
    pub fn prepare<B: Backend>(&self, be: &B, h: &HostData) -> Result<(B::Kv, StepInput<B::IBuf>)> {
        let d = h
            .paged
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("paged case without its data"))?;
        let shape = self.shape;
        let (qd, kvd) = (
            shape.n_heads * shape.head_dim,
            shape.n_kv_heads * shape.head_dim,
        );
        let n = self.seqs.len();
        let mut kv = be.kv_new_paged(
            2,
            shape,
            PagedKv {
                n_pages: d.n_pages,
                page_size: self.page_size,
                max_pages: d.max_pages,
                max_rows: n,
                q8_0: self.q8,
            },
        )?;
        // Fill round r: the r-th chunk of every sequence that has one, in one batched step.
        let rounds = d.fills.iter().map(Vec::len).max().unwrap_or(0);
        let mut fstep = be.batch_step_input(n * FILL_CHUNK, n, d.max_pages, self.page_size)?;
        for r in 0..rounds {
            let part: Vec<usize> = (0..n).filter(|&i| r < d.fills[i].len()).collect();
            let zeros = vec![0u32; FILL_CHUNK];
            let rows: Vec<SeqRows> = part
                .iter()
                .map(|&i| {
                    let f = &d.fills[i][r];
                    SeqRows {
                        tokens: &zeros[..f.4],
                        pos0: f.3,
                        pages: &d.pages[i],
                        logits: 1,
                        state: i,
                    }
                })
                .collect();
            be.set_batch(&mut fstep, &rows)?;
            let cat = |j: usize| -> Vec<f32> {
                part.iter()
                    .flat_map(|&i| {
                        let f = &d.fills[i][r];
                        match j {
                            0 => f.0.clone(),
                            1 => f.1.clone(),
                            _ => f.2.clone(),
                        }
                    })
                    .collect()
            };
            let t = fstep.rows;
            let (q, k, v) = (
                be.from_host(&cat(0), t, qd)?,
                be.from_host(&cat(1), t, kvd)?,
                be.from_host(&cat(2), t, kvd)?,
            );
            let mut o = be.zeros(t, qd)?;
            be.attention(
                &mut kv,
                &fstep,
                AttnArgs {
                    layer: 1,
                    q: &q,
                    k: &k,
                    v: &v,
                    shape,
                },
                &mut o,
            )?;
        }
        let mut step = be.batch_step_input(self.rows(), n, d.max_pages, self.page_size)?;
        let tokens = vec![0u32; self.rows()];
        let rows: Vec<SeqRows> = self
            .seqs
            .iter()
            .zip(&d.pages)
            .enumerate()
            .map(|(i, (&(pos0, r), pages))| SeqRows {
                tokens: &tokens[..r],
                pos0,
                pages,
                logits: 1,
                state: i,
            })
            .collect();
        be.set_batch(&mut step, &rows)?;
        Ok((kv, step))
    }

    /// As single-sequence attention: the cache type decides, and prefill-sized segments
    /// (> ATTN_DECODE_MAX_ROWS rows: the prefill kernel) get the prefill threshold.
    pub fn threshold<B: Backend>(&self, be: &B) -> f64 {
        if be.kv_bytes_per_element() >= 4.0 {
            ATTN_F32_NMSE
        } else if self.q8 {
            ATTN_Q8_NMSE
        } else if self.seqs.iter().any(|s| s.1 > ATTN_DECODE_MAX_ROWS) {
            ATTN_F16_TC_NMSE
        } else {
            ATTN_F16_DECODE_NMSE
        }
    }

    /// K/V bytes the step must read (each sequence's prefix once) plus q, k, v and out.
    pub fn bytes<B: Backend>(&self, be: &B, h: &HostData) -> f64 {
        let kvd = self.shape.n_kv_heads * self.shape.head_dim;
        let kv_per_el = kv_elem_bytes(be, self.q8);
        let keys: usize = self.seqs.iter().map(|(p, r)| p + r).sum();
        let acts: usize = h.acts.iter().map(|(x, _, _)| x.len() * 4).sum();
        (keys * kvd * 2) as f64 * kv_per_el + (acts + h.out.0 * h.out.1 * 4) as f64
    }
}

/// The paged cases: decode batches (page boundaries, deep positions, more rows than one
/// decode launch of the contiguous path), mixed decode + prefill steps, every tuned head
/// dim, the fallback head dim, page sizes 1..64, f16 and q8_0 caches.
pub(super) fn cases(quick: bool) -> Vec<PagedCase> {
    let shape = |n_heads, n_kv_heads, head_dim| AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    let q8b = shape(32, 8, 128);
    let mut v = Vec::new();
    let mut add = |shape, page_size, seqs: &[(usize, usize)], both: bool| {
        for q8 in [false, true] {
            if q8 && !both {
                continue;
            }
            v.push(PagedCase {
                shape,
                page_size,
                seqs: seqs.to_vec(),
                q8,
            });
        }
    };
    // Decode rows of six sequences, around page boundaries.
    add(
        q8b,
        16,
        &[(0, 1), (17, 1), (100, 1), (63, 1), (64, 1), (15, 1)],
        true,
    );
    // Decode and prefill chunks in one step: a long chunk (prefill kernel), a short one
    // (decode kernel), decode rows between them.
    add(
        q8b,
        16,
        &[(5, 1), (0, 37), (300, 1), (64, 9), (200, 100), (1, 1)],
        true,
    );
    add(shape(8, 4, 64), 16, &[(3, 1), (0, 20), (50, 1)], true);
    add(shape(4, 4, 32), 16, &[(9, 1), (31, 2), (0, 17)], false);
    add(shape(8, 2, 256), 32, &[(10, 1), (0, 33), (70, 2)], true);
    // Head dim 80: the fallback kernel (f16 only: q8_0 needs 32 | head_dim).
    add(shape(4, 2, 80), 16, &[(5, 1), (0, 18), (40, 3)], false);
    // One-position pages.
    add(shape(4, 1, 128), 1, &[(7, 1), (0, 20)], true);
    if quick {
        return v;
    }
    // Twenty decode rows: more than one contiguous-cache decode launch holds.
    let twenty: Vec<(usize, usize)> = (0..20).map(|i| ((i * 37) % 700, 1)).collect();
    add(q8b, 16, &twenty, true);
    // Deep positions (fill chunks over several rounds) and big pages.
    add(
        shape(8, 2, 128),
        64,
        &[(0, 64), (128, 70), (1500, 1), (700, 1)],
        true,
    );
    add(
        shape(8, 2, 128),
        16,
        &[(1000, 1), (2000, 1), (3000, 1)],
        true,
    );
    v
}
