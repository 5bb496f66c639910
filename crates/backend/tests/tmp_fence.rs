use ferrite_backend::cuda;
#[test]
fn fence() {
    let src = r#"
extern "C" __global__ void __cluster_dims__(2,1,1) k1(float* p, float v) {
    __shared__ float s[32];
    s[threadIdx.x] = v;
    p[threadIdx.x] = v;
    asm volatile("fence.acq_rel.cluster;\n" ::: "memory");
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    p[threadIdx.x + 32] = s[(threadIdx.x + 1) & 31];
}
extern "C" __global__ void __cluster_dims__(2,1,1) k2(float* p, float v) {
    __shared__ float s[32];
    s[threadIdx.x] = v;
    p[threadIdx.x] = v;
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    p[threadIdx.x + 32] = s[(threadIdx.x + 1) & 31];
}
"#;
    let bin = cuda::nvrtc::compile_cubin("fence", src, "compute_90a", false).unwrap();
    std::fs::write("/tmp/fence.cubin", bin).unwrap();
}
