//! Host emulation of the chunked gated-delta prefill kernel (`gated_delta_chunked` in
//! `kernels/gated_delta.cu`, the section between its GDC_EMU markers) against the CPU
//! recurrence (`gated_delta::heads`, the CPU reference's input preparation and recurrence).
//!
//! The kernel body is compiled unchanged with g++ (`gated_delta_emu/harness.cpp` on
//! `emu/fibers.h`: every CUDA thread a fiber, barriers and warp collectives scheduled,
//! mma.sync m16n8k8 tf32 and cvt.rna.tf32 emulated from the PTX ISA fragment layout), run on
//! random inputs of the real and odd shapes, two calls each (the second continues the first one's state), and its
//! outputs and final state are compared with the recurrence. Needs only g++; skipped with a
//! note where it is missing. What it cannot see: the tensor core's own accumulation order,
//! cp.async timing, and anything NVRTC/ptxas does (GATED_DELTA.md, "Chunked prefill").

use std::path::PathBuf;
use std::process::Command;

use ferrite_backend::gated_delta;
use ferrite_backend::DeltaShape;

const SRC: &str = include_str!("../src/cuda/kernels/gated_delta.cu");
const HARNESS: &str = include_str!("gated_delta_emu/harness.cpp");

#[path = "emu/mod.rs"]
mod emu;

/// xorshift64*: deterministic uniforms in [0, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.next()).sum();
        (s - 2.0) * 3f32.sqrt()
    }
}

fn nmse(a: &[f32], r: &[f32]) -> f64 {
    let e: f64 = a.iter().zip(r).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    e / r
        .iter()
        .map(|y| (*y as f64).powi(2))
        .sum::<f64>()
        .max(1e-30)
}

#[derive(Clone, Copy)]
struct Shape {
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    tiled: bool,
}

/// One call's inputs, as `ferrite check` draws them.
struct Call {
    rows: usize,
    qkv: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
}

/// The CPU reference's gated_delta_rule for one call (`gated_delta::heads`: its per-head
/// preparation, then the recurrence or the CPU's chunked form); state `[nv][dk][dv]`.
fn cpu_call(
    s: Shape,
    ssm_a: &[f32],
    dt_bias: &[f32],
    st: &mut [f32],
    c: &Call,
    chunked: bool,
) -> Vec<f32> {
    let ds = DeltaShape {
        n_k_heads: s.nk,
        n_v_heads: s.nv,
        k_head_dim: s.dk,
        v_head_dim: s.dv,
        conv_kernel: 4, // unused by the delta rule
        tiled_v_heads: s.tiled,
    };
    let mut out = vec![0f32; c.rows * s.nv * s.dv];
    gated_delta::heads(
        &ds, c.rows, &c.qkv, &c.a, &c.b, ssm_a, dt_bias, chunked, st, &mut out, false,
    );
    out
}

fn le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn chunked_kernel_emulated_matches_recurrence() {
    let Some(exe) = emu::build(
        "gdc-emu",
        &[
            (
                "section.cuh",
                emu::section(SRC, "// GDC_EMU_BEGIN", "// GDC_EMU_END"),
            ),
            ("harness.cpp", HARNESS),
        ],
    ) else {
        return;
    };
    let dir: PathBuf = exe.parent().expect("the harness directory").to_path_buf();

    let sh = |nk, nv, dk, dv, tiled| Shape {
        nk,
        nv,
        dk,
        dv,
        tiled,
    };
    // (shape, fill rows, checked rows): Qwen3.5-9B's linear dims (tiled and grouped heads,
    // chunk boundaries 64/128/192 crossed, partial last chunks), and the odd check shapes
    // (dk padded, partial column blocks, scalar loads).
    let cases = [
        (sh(16, 32, 128, 128, true), 37, 200),
        (sh(16, 32, 128, 128, false), 100, 64),
        (sh(2, 4, 32, 32, false), 37, 200),
        (sh(3, 6, 24, 40, true), 100, 64),
        (sh(1, 2, 64, 20, false), 37, 200),
        (sh(2, 2, 100, 128, true), 100, 64),
        (sh(1, 3, 6, 7, true), 37, 200),
    ];
    let mut worst = 0f64;
    for (ci, &(s, fill, rows)) in cases.iter().enumerate() {
        let mut r = Rng((ci as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (nv, dk, dv) = (s.nv, s.dk, s.dv);
        let conv = 2 * s.nk * dk + nv * dv;
        // As `ferrite check`: ssm_a = −exp(U[−3, 3]), dt_bias ~ −1 + 0.5 N, qkv ~ N(0, 1),
        // a ~ N(0, 1), b ~ N(0, 2); a non-zero starting state.
        let ssm_a: Vec<f32> = (0..nv).map(|_| -((r.next() * 6.0 - 3.0).exp())).collect();
        let dt_bias: Vec<f32> = (0..nv).map(|_| -1.0 + 0.5 * r.normal()).collect();
        let s_cuda0: Vec<f32> = (0..nv * dv * dk).map(|_| 0.3 * r.normal()).collect();
        let calls: Vec<Call> = [fill, rows]
            .iter()
            .map(|&n| Call {
                rows: n,
                qkv: (0..n * conv).map(|_| r.normal()).collect(),
                a: (0..n * nv).map(|_| r.normal()).collect(),
                b: (0..n * nv).map(|_| 2.0 * r.normal()).collect(),
            })
            .collect();
        let mut inp = vec![];
        for x in [s.nk, nv, dk, dv, s.tiled as usize, calls.len()] {
            inp.extend((x as i32).to_le_bytes());
        }
        inp.extend(le(&ssm_a));
        inp.extend(le(&dt_bias));
        inp.extend(le(&s_cuda0));
        for c in &calls {
            inp.extend((c.rows as i32).to_le_bytes());
            inp.extend(le(&c.qkv));
            inp.extend(le(&c.a));
            inp.extend(le(&c.b));
        }
        let (fin, fout) = (dir.join("in.bin"), dir.join("out.bin"));
        std::fs::write(&fin, inp).unwrap();
        let t0 = std::time::Instant::now();
        let st = Command::new(&exe).arg(&fin).arg(&fout).status().unwrap();
        assert!(st.success(), "emulated kernel failed (case {ci})");
        let secs = t0.elapsed().as_secs_f64();
        let raw: Vec<f32> = std::fs::read(&fout)
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();

        // CUDA state [h][dv][dk] → CPU [h][dk][dv].
        let to_cpu = |sc: &[f32]| {
            let mut o = vec![0f32; sc.len()];
            for h in 0..nv {
                for j in 0..dv {
                    for i in 0..dk {
                        o[(h * dk + i) * dv + j] = sc[(h * dv + j) * dk + i];
                    }
                }
            }
            o
        };
        let (mut s_rec, mut s_chk) = (to_cpu(&s_cuda0), to_cpu(&s_cuda0));
        let mut off = 0;
        let mut line = format!(
            "nk={} nv={nv} dk={dk} dv={dv} tiled={} fill={fill} rows={rows}:",
            s.nk, s.tiled
        );
        for (k, c) in calls.iter().enumerate() {
            let o_rec = cpu_call(s, &ssm_a, &dt_bias, &mut s_rec, c, false);
            let o_chk = cpu_call(s, &ssm_a, &dt_bias, &mut s_chk, c, true);
            let o_emu = &raw[off..off + o_rec.len()];
            off += o_rec.len();
            let e = nmse(o_emu, &o_rec);
            worst = worst.max(e);
            line += &format!(" out{k} {e:.2e} (CPU chunked {:.2e})", nmse(&o_chk, &o_rec));
            assert!(
                e < 1e-9,
                "case {ci} call {k}: emulated kernel vs recurrence NMSE {e:e}"
            );
        }
        let s_emu = to_cpu(&raw[off..]);
        let es = nmse(&s_emu, &s_rec);
        worst = worst.max(es);
        println!(
            "{line} state {es:.2e} (CPU chunked {:.2e}); {secs:.1} s",
            nmse(&s_chk, &s_rec)
        );
        assert!(
            es < 1e-9,
            "case {ci}: emulated state vs recurrence NMSE {es:e}"
        );
    }
    println!("worst NMSE vs the recurrence: {worst:.2e}");
    let _ = std::fs::remove_dir_all(&dir);
}
