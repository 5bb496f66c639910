//! The CPU backend's fused ops are bitwise the ops they replace: `add_rms_norm` ==
//! `add_assign` then `rms_norm`; `qk_norm_rope` == `head_rms_norm` (q, k) then `rope` (q, k).
//! The CPU backend is the oracle, so the model files may use either form.

use std::borrow::Cow;

use ferrite_backend::cpu::{CpuBackend, CpuWeight};
use ferrite_backend::{Act, Backend, HostTensor, Rope, RopeStyle};
use ferrite_formats::GgmlType;
use rand::{Rng, SeedableRng};

fn normals(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| scale * (rng.random::<f32>() * 2.0 - 1.0))
        .collect()
}

fn weight(be: &CpuBackend, v: &[f32]) -> CpuWeight {
    be.upload(&HostTensor {
        dtype: GgmlType::F32,
        shape: vec![v.len()],
        data: Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    })
    .unwrap()
}

fn bits(be: &CpuBackend, x: &Act<Vec<f32>>) -> Vec<u32> {
    be.to_host(x).unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn add_rms_norm_is_add_then_norm() {
    let be = CpuBackend::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for (rows, cols) in [(1, 4096), (7, 576), (33, 1000), (3, 33)] {
        let x0 = normals(&mut rng, rows * cols, 3.0);
        let y0 = normals(&mut rng, rows * cols, 1.0);
        let w = weight(&be, &normals(&mut rng, cols, 1.0));
        let y = be.from_host(&y0, rows, cols).unwrap();

        let mut xa = be.from_host(&x0, rows, cols).unwrap();
        let mut ha = be.zeros(rows, cols).unwrap();
        be.add_assign(&mut xa, &y).unwrap();
        be.rms_norm(&xa, &w, 1e-6, &mut ha).unwrap();

        let mut xb = be.from_host(&x0, rows, cols).unwrap();
        let mut hb = be.zeros(rows, cols).unwrap();
        be.add_rms_norm(&mut xb, &y, &w, 1e-6, &mut hb).unwrap();

        assert_eq!(bits(&be, &xa), bits(&be, &xb), "x {rows}x{cols}");
        assert_eq!(bits(&be, &ha), bits(&be, &hb), "h {rows}x{cols}");
    }
}

#[test]
fn qk_norm_rope_is_norms_then_ropes() {
    let be = CpuBackend::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    // (q heads, k heads, head_dim, rot_dim, style, theta)
    let shapes = [
        (32, 8, 128, 128, RopeStyle::Neox, 1e6f32),
        (32, 8, 128, 128, RopeStyle::Adjacent, 5e5),
        (16, 2, 256, 64, RopeStyle::Neox, 1e7),
        (5, 5, 96, 72, RopeStyle::Adjacent, 1e4),
        (3, 1, 72, 72, RopeStyle::Neox, 1e4),
    ];
    for (hq, hk, hd, rot, style, theta) in shapes {
        let rope = Rope {
            style,
            theta,
            rot_dim: rot,
            inv_freq: None,
        };
        for norm in [true, false] {
            for (rows, pos0) in [(1, 0), (1, 1000), (9, 17)] {
                let q0 = normals(&mut rng, rows * hq * hd, 1.0);
                let k0 = normals(&mut rng, rows * hk * hd, 2.0);
                let qw = weight(&be, &normals(&mut rng, hd, 1.5));
                let kw = weight(&be, &normals(&mut rng, hd, 1.5));
                let mut step = be.step_input(rows).unwrap();
                be.set_step(&mut step, &vec![0; rows], pos0).unwrap();

                let mut qa = be.from_host(&q0, rows, hq * hd).unwrap();
                let mut ka = be.from_host(&k0, rows, hk * hd).unwrap();
                if norm {
                    be.head_rms_norm(&mut qa, &qw, hd, 1e-6).unwrap();
                    be.head_rms_norm(&mut ka, &kw, hd, 1e-6).unwrap();
                }
                be.rope(&mut qa, hd, &step, &rope).unwrap();
                be.rope(&mut ka, hd, &step, &rope).unwrap();

                let mut qb = be.from_host(&q0, rows, hq * hd).unwrap();
                let mut kb = be.from_host(&k0, rows, hk * hd).unwrap();
                let (qn, kn) = if norm {
                    (Some(&qw), Some(&kw))
                } else {
                    (None, None)
                };
                be.qk_norm_rope(&mut qb, &mut kb, qn, kn, hd, 1e-6, &step, &rope)
                    .unwrap();

                let what = format!("{hq}/{hk}x{hd} rot {rot} {style:?} norm {norm} rows {rows}");
                assert_eq!(bits(&be, &qa), bits(&be, &qb), "q {what}");
                assert_eq!(bits(&be, &ka), bits(&be, &kb), "k {what}");
            }
        }
    }
}

#[test]
fn fused_ops_check_shapes() {
    let be = CpuBackend::new();
    let w = weight(&be, &[1.0; 8]);
    let y = be.zeros(2, 8).unwrap();
    let mut x = be.zeros(2, 8).unwrap();
    let mut h = be.zeros(2, 4).unwrap();
    assert!(be.add_rms_norm(&mut x, &y, &w, 1e-6, &mut h).is_err());
    let w4 = weight(&be, &[1.0; 4]);
    let mut h = be.zeros(2, 8).unwrap();
    assert!(be.add_rms_norm(&mut x, &y, &w4, 1e-6, &mut h).is_err());

    let rope = Rope {
        style: RopeStyle::Neox,
        theta: 1e4,
        rot_dim: 8,
        inv_freq: None,
    };
    let mut step = be.step_input(2).unwrap();
    be.set_step(&mut step, &[0, 0], 0).unwrap();
    let mut q = be.zeros(2, 16).unwrap();
    let mut k = be.zeros(2, 8).unwrap();
    // A norm weight of the wrong length, a k that is not whole heads, a row mismatch.
    assert!(be
        .qk_norm_rope(&mut q, &mut k, Some(&w4), None, 8, 1e-6, &step, &rope)
        .is_err());
    let mut k_bad = be.zeros(2, 12).unwrap();
    assert!(be
        .qk_norm_rope(&mut q, &mut k_bad, None, None, 8, 1e-6, &step, &rope)
        .is_err());
    let mut k_rows = be.zeros(1, 8).unwrap();
    assert!(be
        .qk_norm_rope(&mut q, &mut k_rows, None, None, 8, 1e-6, &step, &rope)
        .is_err());
    assert!(be
        .qk_norm_rope(&mut q, &mut k, Some(&w), Some(&w), 8, 1e-6, &step, &rope)
        .is_ok());
}
