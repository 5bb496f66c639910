use ferrite_backend::cuda;
#[test]
fn compile_modules() {
    let only = std::env::var("ONE_MODULE").ok();
    let srcs: Vec<_> = cuda::sources()
        .into_iter()
        .filter(|(n, _)| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|x| x == *n))
        })
        .collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = srcs
            .iter()
            .map(|(n, src)| {
                s.spawn(move || {
                    let t = std::time::Instant::now();
                    cuda::nvrtc::compile_cubin(n, &cuda::full_source(n, src), "compute_90a", false)
                        .unwrap();
                    eprintln!("{n}: {:?}", t.elapsed());
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}
