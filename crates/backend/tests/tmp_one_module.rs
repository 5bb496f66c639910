use ferrite_backend::cuda;
#[test]
fn one() {
    let want = std::env::var("ONE_MODULE").unwrap_or_default();
    std::thread::scope(|sc| {
        for (n, src) in cuda::sources() {
            if !want.split(',').any(|w| w == n) {
                continue;
            }
            sc.spawn(move || {
                cuda::nvrtc::compile_cubin(n, &cuda::full_source(n, src), "compute_90a", false)
                    .unwrap();
            });
        }
    });
}
