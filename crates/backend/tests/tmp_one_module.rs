#[test]
fn one_module() {
    let n = std::env::var("ONE_MODULE").unwrap();
    let src = std::fs::read_to_string(format!("src/cuda/kernels/{n}.cu")).unwrap();
    let full = ferrite_backend::cuda::full_source(&n, &src);
    let bin = ferrite_backend::cuda::nvrtc::compile_cubin(&n, &full, "compute_90a", false).unwrap();
    println!("{n}: {} bytes", bin.len());
}
