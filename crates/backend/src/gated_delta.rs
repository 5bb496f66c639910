//! The gated delta rule (Gated DeltaNet, Yang et al. 2024) for one value head, on the host in
//! f32, in its two forms:
//!
//! - [`recurrent`]: token by token, the definition. It is the CPU backend's implementation
//!   and the oracle everything else is checked against (transformers'
//!   `torch_recurrent_gated_delta_rule`).
//! - [`chunked`]: the same map evaluated in chunks of [`CHUNK`] tokens with the WY / UT
//!   transform (transformers' `torch_chunk_gated_delta_rule`, fla's `chunk_gated_delta_rule`):
//!   within a chunk everything is a small matrix product, and the state is read and written
//!   once per chunk. This is the form prefill kernels on tensor cores take; the tests below
//!   hold it equal to the recurrence.
//!
//! Per token `t` (`q`, `k` already L2-normalised, `q` scaled by `dk^-1/2`):
//! ```text
//! S ← e^{g_t} S                         decay          S: [dk, dv]
//! S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ      delta-rule write
//! o_t = Sᵀ q_t                          read
//! ```

use rayon::prelude::*;

use crate::DeltaShape;

/// Chunk length of the chunked form (transformers' and fla's default).
pub const CHUNK: usize = 64;

/// PyTorch's `F.softplus` (beta 1, threshold 20): `ln(1 + e^x)`, or `x` above 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(Σx² + 1e-6)`: the L2 normalisation of q and k in Gated DeltaNet (fla's and
/// transformers' `l2norm`, eps inside the root).
fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One call of Qwen3.5's gated delta rule over `rows` tokens, every value head (in parallel),
/// as the CPU reference computes it: per head, q and k gathered from `qkv` (`[rows,
/// conv_dim]`: `[q | k | v]`) and L2-normalised (q also scaled by `dk^-1/2`), the decay
/// `g = ssm_a · softplus(a + dt_bias)` and `β = σ(b)` (`a`, `b`: `[rows, n_v_heads]`), then
/// [`recurrent`] — or, with `chunked` and more than one row, [`chunked`] — on that head's
/// state. `states` is `[n_v_heads][dk][dv]`, carried in and out; `out` is `[rows,
/// value_dim]`. With `track`, the recurrence runs token by token and each head's state after
/// every token is returned (per head `[rows][dk][dv]`; empty without `track`): a speculative
/// verify's rollback takes the state after its last accepted row from there.
#[allow(clippy::too_many_arguments)]
pub fn heads(
    ds: &DeltaShape,
    rows: usize,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    ssm_a: &[f32],
    dt_bias: &[f32],
    chunked_form: bool,
    states: &mut [f32],
    out: &mut [f32],
    track: bool,
) -> Vec<Vec<f32>> {
    let (nv, dk, dv) = (ds.n_v_heads, ds.k_head_dim, ds.v_head_dim);
    let (key_dim, c) = (ds.key_dim(), ds.conv_dim());
    let scale = 1.0 / (dk as f32).sqrt();
    // One task per value head: gather its inputs, run the delta rule on its state.
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = states
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, state)| {
            let kh = ds.k_head_of(h);
            let mut q = Vec::with_capacity(rows * dk);
            let mut k = Vec::with_capacity(rows * dk);
            let mut v = Vec::with_capacity(rows * dv);
            let (mut g, mut beta) = (vec![0f32; rows], vec![0f32; rows]);
            for t in 0..rows {
                let row = &qkv[t * c..][..c];
                let qs = q.len();
                q.extend_from_slice(&row[kh * dk..][..dk]);
                l2_normalize(&mut q[qs..]);
                q[qs..].iter_mut().for_each(|x| *x *= scale);
                let ks = k.len();
                k.extend_from_slice(&row[key_dim + kh * dk..][..dk]);
                l2_normalize(&mut k[ks..]);
                v.extend_from_slice(&row[2 * key_dim + h * dv..][..dv]);
                g[t] = ssm_a[h] * softplus(a[t * nv + h] + dt_bias[h]);
                beta[t] = crate::cpu::sigmoid(b[t * nv + h]);
            }
            let mut o = vec![0f32; rows * dv];
            let mut after = Vec::new();
            let x = HeadInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
                dk,
                dv,
            };
            if track {
                // Token by token (the recurrence over one-token slices is the recurrence),
                // the state kept after each.
                after.reserve(rows * dk * dv);
                for t in 0..rows {
                    recurrent(&x.tokens(t, t + 1), state, &mut o[t * dv..][..dv]);
                    after.extend_from_slice(state);
                }
            } else if chunked_form && rows > 1 {
                chunked(&x, CHUNK, state, &mut o);
            } else {
                recurrent(&x, state, &mut o);
            }
            (o, after)
        })
        .collect();
    for (h, (o, _)) in per_head.iter().enumerate() {
        for t in 0..rows {
            out[t * nv * dv + h * dv..][..dv].copy_from_slice(&o[t * dv..][..dv]);
        }
    }
    per_head.into_iter().map(|(_, after)| after).collect()
}

/// One value head's inputs over `T` tokens.
#[derive(Clone, Copy)]
pub struct HeadInputs<'a> {
    /// `[T, dk]`, L2-normalised and scaled by `dk^-1/2`.
    pub q: &'a [f32],
    /// `[T, dk]`, L2-normalised.
    pub k: &'a [f32],
    /// `[T, dv]`.
    pub v: &'a [f32],
    /// `[T]`: log of the decay (≤ 0).
    pub g: &'a [f32],
    /// `[T]`: write strength in (0, 1).
    pub beta: &'a [f32],
    pub dk: usize,
    pub dv: usize,
}

impl<'a> HeadInputs<'a> {
    /// Tokens `a..b` of these inputs.
    pub fn tokens(&self, a: usize, b: usize) -> HeadInputs<'a> {
        let (dk, dv) = (self.dk, self.dv);
        HeadInputs {
            q: &self.q[a * dk..b * dk],
            k: &self.k[a * dk..b * dk],
            v: &self.v[a * dv..b * dv],
            g: &self.g[a..b],
            beta: &self.beta[a..b],
            dk,
            dv,
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `acc += s · x`.
fn axpy(acc: &mut [f32], s: f32, x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += s * b;
    }
}

/// Token-by-token recurrence. `state` is `[dk, dv]` (row `i` = key dimension `i`), carried
/// in and out; `out` is `[T, dv]`.
pub fn recurrent(x: &HeadInputs<'_>, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (x.dk, x.dv);
    let mut delta = vec![0f32; dv];
    for t in 0..x.g.len() {
        let q = &x.q[t * dk..][..dk];
        let k = &x.k[t * dk..][..dk];
        let v = &x.v[t * dv..][..dv];
        // S ← e^g S
        let decay = x.g[t].exp();
        state.iter_mut().for_each(|s| *s *= decay);
        // delta = β (v − Sᵀk)
        delta.fill(0.0);
        for (i, &ki) in k.iter().enumerate() {
            axpy(&mut delta, ki, &state[i * dv..][..dv]);
        }
        for (d, &vj) in delta.iter_mut().zip(v) {
            *d = (vj - *d) * x.beta[t];
        }
        // S ← S + k deltaᵀ
        for (i, &ki) in k.iter().enumerate() {
            axpy(&mut state[i * dv..][..dv], ki, &delta);
        }
        // o = Sᵀq
        let o = &mut out[t * dv..][..dv];
        o.fill(0.0);
        for (i, &qi) in q.iter().enumerate() {
            axpy(o, qi, &state[i * dv..][..dv]);
        }
    }
}

/// The chunked form: chunks of `chunk` tokens (the last may be shorter; transformers pads
/// it with `g = 0, k = v = 0` tokens, which change nothing). Same contract as
/// [`recurrent`]. Within a chunk, with `c_i = Σ_{j≤i} g_j` (cumulative log-decay):
/// ```text
/// L_ij = β_i (k_i·k_j) e^{c_i − c_j}                 j < i   (strictly lower)
/// U = (I + L)⁻¹ (β v)      W = (I + L)⁻¹ (β e^{c} k)          (forward substitution)
/// V' = U − W S                                        the part of v the state misses
/// o_i = e^{c_i} q_i S + Σ_{j≤i} (q_i·k_j) e^{c_i − c_j} V'_j
/// S ← e^{c_n} S + Σ_j e^{c_n − c_j} k_j V'_jᵀ          (c_n: the chunk's last c)
/// ```
/// Every exponent is ≤ 0, so nothing overflows however long the chunk.
pub fn chunked(x: &HeadInputs<'_>, chunk: usize, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (x.dk, x.dv);
    let t_len = x.g.len();
    let mut c0 = 0;
    while c0 < t_len {
        let n = chunk.min(t_len - c0);
        let q = |i: usize| &x.q[(c0 + i) * dk..][..dk];
        let k = |i: usize| &x.k[(c0 + i) * dk..][..dk];
        let v = |i: usize| &x.v[(c0 + i) * dv..][..dv];
        let beta = |i: usize| x.beta[c0 + i];
        let mut cum = vec![0f32; n];
        let mut acc = 0f32;
        for (i, c) in cum.iter_mut().enumerate() {
            acc += x.g[c0 + i];
            *c = acc;
        }

        // U and W by forward substitution through the unit lower-triangular I + L.
        let mut u = vec![0f32; n * dv];
        let mut w = vec![0f32; n * dk];
        for i in 0..n {
            let (u_prev, u_i) = u.split_at_mut(i * dv);
            let u_i = &mut u_i[..dv];
            let (w_prev, w_i) = w.split_at_mut(i * dk);
            let w_i = &mut w_i[..dk];
            for (a, &b) in u_i.iter_mut().zip(v(i)) {
                *a = beta(i) * b;
            }
            let s = beta(i) * cum[i].exp();
            for (a, &b) in w_i.iter_mut().zip(k(i)) {
                *a = s * b;
            }
            for j in 0..i {
                let l = beta(i) * dot(k(i), k(j)) * (cum[i] - cum[j]).exp();
                axpy(u_i, -l, &u_prev[j * dv..][..dv]);
                axpy(w_i, -l, &w_prev[j * dk..][..dk]);
            }
        }

        // V' = U − W S
        let mut vn = u;
        for i in 0..n {
            let row = &mut vn[i * dv..][..dv];
            for (a, &wa) in w[i * dk..][..dk].iter().enumerate() {
                axpy(row, -wa, &state[a * dv..][..dv]);
            }
        }

        // Outputs: the old state's read plus the intra-chunk attention over V'.
        for i in 0..n {
            let o = &mut out[(c0 + i) * dv..][..dv];
            o.fill(0.0);
            let e = cum[i].exp();
            for (a, &qa) in q(i).iter().enumerate() {
                axpy(o, e * qa, &state[a * dv..][..dv]);
            }
            for j in 0..=i {
                let s = dot(q(i), k(j)) * (cum[i] - cum[j]).exp();
                axpy(o, s, &vn[j * dv..][..dv]);
            }
        }

        // State update.
        let last = cum[n - 1];
        let decay = last.exp();
        state.iter_mut().for_each(|s| *s *= decay);
        for j in 0..n {
            let e = (last - cum[j]).exp();
            for (a, &ka) in k(j).iter().enumerate() {
                axpy(&mut state[a * dv..][..dv], e * ka, &vn[j * dv..][..dv]);
            }
        }
        c0 += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: a deterministic stream of uniforms in [0, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
        }
        fn normal(&mut self) -> f32 {
            // Sum of 4 uniforms, centred and scaled to unit variance: plenty for test data.
            let s: f32 = (0..4).map(|_| self.next()).sum();
            (s - 2.0) * 3f32.sqrt()
        }
    }

    fn l2(x: &mut [f32], scale: f32) {
        let n = (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        x.iter_mut().for_each(|v| *v = *v / n * scale);
    }

    fn nmse(a: &[f32], r: &[f32]) -> f64 {
        let e: f64 = a.iter().zip(r).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        e / r.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()
    }

    /// Chunked (3 chunks, the last partial) equals the recurrence, from a non-zero state,
    /// for slow and fast decays. Both run in f32 and differ only in association order, so
    /// they agree to f32 rounding accumulated over a few hundred terms: NMSE ~1e-13; 1e-10
    /// leaves room and still catches any wrong term (a missing decay gives NMSE ≥ 1e-3).
    #[test]
    fn chunked_equals_recurrent() {
        for (seed, t_len, dk, dv, g_scale) in [
            (1u64, 150usize, 32usize, 32usize, 0.05f32),
            (2, 129, 16, 24, 1.0),
            (3, 64, 32, 16, 0.3),
            (4, 7, 8, 8, 0.5),
        ] {
            let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut q: Vec<f32> = (0..t_len * dk).map(|_| r.normal()).collect();
            let mut k: Vec<f32> = (0..t_len * dk).map(|_| r.normal()).collect();
            for t in 0..t_len {
                l2(&mut q[t * dk..][..dk], 1.0 / (dk as f32).sqrt());
                l2(&mut k[t * dk..][..dk], 1.0);
            }
            let v: Vec<f32> = (0..t_len * dv).map(|_| r.normal()).collect();
            let g: Vec<f32> = (0..t_len).map(|_| -g_scale * r.next()).collect();
            let beta: Vec<f32> = (0..t_len).map(|_| r.next()).collect();
            let s0: Vec<f32> = (0..dk * dv).map(|_| 0.3 * r.normal()).collect();
            let x = HeadInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
                dk,
                dv,
            };
            let (mut s_rec, mut s_chk) = (s0.clone(), s0.clone());
            let (mut o_rec, mut o_chk) = (vec![0f32; t_len * dv], vec![0f32; t_len * dv]);
            recurrent(&x, &mut s_rec, &mut o_rec);
            chunked(&x, CHUNK, &mut s_chk, &mut o_chk);
            let (eo, es) = (nmse(&o_chk, &o_rec), nmse(&s_chk, &s_rec));
            println!("T={t_len} dk={dk} dv={dv}: NMSE out {eo:.2e}, state {es:.2e}");
            assert!(
                eo < 1e-10 && es < 1e-10,
                "chunked != recurrent: {eo:e} {es:e}"
            );
        }
    }

    /// Splitting a sequence anywhere (prefill then decode) gives the same result as one
    /// pass: the state carries everything.
    #[test]
    fn state_carries_across_calls() {
        let (t_len, dk, dv) = (20, 4, 3);
        let mut r = Rng(7);
        let q: Vec<f32> = (0..t_len * dk).map(|_| r.normal() * 0.3).collect();
        let k: Vec<f32> = (0..t_len * dk).map(|_| r.normal() * 0.3).collect();
        let v: Vec<f32> = (0..t_len * dv).map(|_| r.normal()).collect();
        let g: Vec<f32> = (0..t_len).map(|_| -r.next()).collect();
        let beta: Vec<f32> = (0..t_len).map(|_| r.next()).collect();
        let slice = |a: usize, b: usize| HeadInputs {
            q: &q[a * dk..b * dk],
            k: &k[a * dk..b * dk],
            v: &v[a * dv..b * dv],
            g: &g[a..b],
            beta: &beta[a..b],
            dk,
            dv,
        };
        let mut s1 = vec![0f32; dk * dv];
        let mut o1 = vec![0f32; t_len * dv];
        recurrent(&slice(0, t_len), &mut s1, &mut o1);
        let mut s2 = vec![0f32; dk * dv];
        let mut o2 = vec![0f32; t_len * dv];
        chunked(&slice(0, 13), CHUNK, &mut s2, &mut o2[..13 * dv]);
        for t in 13..t_len {
            recurrent(&slice(t, t + 1), &mut s2, &mut o2[t * dv..(t + 1) * dv]);
        }
        assert!(nmse(&o2, &o1) < 1e-10 && nmse(&s2, &s1) < 1e-10);
    }
}
