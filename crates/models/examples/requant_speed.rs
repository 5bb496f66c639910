//! How fast `--quantize` requantizes: values per second for each target type, one BF16
//! matrix of 4096 × 4096 (`cargo run --release -p ferrite-models --example requant_speed`).

use std::borrow::Cow;
use std::time::Instant;

use ferrite_backend::HostTensor;
use ferrite_formats::{quant, GgmlType};
use ferrite_models::mix::requantize;

fn main() {
    let (rows, cols) = (4096usize, 4096usize);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| (((i * 7919) % 2003) as f32 / 1001.0 - 1.0) * 0.02)
        .collect();
    let mut data = vec![0u8; GgmlType::BF16.bytes_for(x.len()).unwrap()];
    quant::quantize(GgmlType::BF16, &x, &mut data).unwrap();
    let t = HostTensor {
        dtype: GgmlType::BF16,
        shape: vec![rows, cols],
        data: Cow::Owned(data),
    };
    for to in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let t0 = Instant::now();
        let q = requantize(&t, to).unwrap();
        let s = t0.elapsed().as_secs_f64();
        println!(
            "{to}: {:.0} M values/s ({} threads), {} bytes",
            (rows * cols) as f64 / s / 1e6,
            rayon::current_num_threads(),
            q.data.len()
        );
    }
}
