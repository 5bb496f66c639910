// What a dependent phase costs on the H200: a kernel boundary in a CUDA graph (with and
// without programmatic dependent launch) against a grid-wide barrier inside one persistent
// kernel. The question behind it (DECODE_STEP.md, "A persistent attention half"): the decode
// step's small kernels each add ~2 µs in the graph; would the same phases as one kernel with
// grid barriers between them cost less per phase?
//
// Every phase does the same token work: each block reads one float written by another block
// in the previous phase (a real dependency through L2) and writes its own.
//
//   nvcc -O3 -arch=sm_90a tools/h200/barrier_bench.cu -o /tmp/barrier_bench && /tmp/barrier_bench
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                  \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// One phase as its own kernel.
__global__ void phase_kernel(float* buf, int i, int pdl) {
    if (pdl) pdl_launch();
    if (pdl) pdl_wait();
    __shared__ float s;
    int nb = gridDim.x;
    if (threadIdx.x == 0) s = buf[(i & 1) * nb + (blockIdx.x + 1) % nb];
    __syncthreads();
    if (threadIdx.x == 0) buf[((i + 1) & 1) * nb + blockIdx.x] = s + 1.0f;
}

__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

// All phases in one kernel, a grid barrier between them.
__global__ void persistent_kernel(float* buf, unsigned* count, int n) {
    __shared__ float s;
    int nb = gridDim.x;
    for (int i = 0; i < n; i++) {
        if (threadIdx.x == 0) s = buf[(i & 1) * nb + (blockIdx.x + 1) % nb];
        __syncthreads();
        if (threadIdx.x == 0) buf[((i + 1) & 1) * nb + blockIdx.x] = s + 1.0f;
        grid_barrier(count, (unsigned)(i + 1) * nb);
    }
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int N = 200, REPS = 20, THREADS = 256;
    float* buf;
    unsigned* count;
    CK(cudaMalloc(&buf, 2 * sms * sizeof(float)));
    CK(cudaMalloc(&count, sizeof(unsigned)));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int blocks : {1, 8, sms}) {
        for (int pdl = 0; pdl < 2; pdl++) {
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < N; i++) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(blocks);
                cfg.blockDim = dim3(THREADS);
                cfg.stream = st;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                at[0].val.programmaticStreamSerializationAllowed = 1;
                cfg.attrs = at;
                cfg.numAttrs = pdl;
                CK(cudaLaunchKernelEx(&cfg, phase_kernel, buf, i, pdl));
            }
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, st));
            CK(cudaStreamSynchronize(st));
            CK(cudaEventRecord(e0, st));
            for (int r = 0; r < REPS; r++) CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            printf("kernel boundary, %3d blocks, pdl %d: %.2f us per phase\n", blocks, pdl,
                   ms * 1000.0f / (N * REPS));
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        }
    }
    for (int blocks : {8, sms}) {
        float best = 1e9f;
        for (int r = 0; r < REPS; r++) {
            CK(cudaMemsetAsync(count, 0, sizeof(unsigned), st));
            CK(cudaEventRecord(e0, st));
            persistent_kernel<<<blocks, THREADS, 0, st>>>(buf, count, N);
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (ms < best) best = ms;
        }
        printf("grid barrier,    %3d blocks:        %.2f us per phase (best of %d)\n", blocks,
               best * 1000.0f / N, REPS);
    }
    return 0;
}
