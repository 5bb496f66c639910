/* kernel_trace.c — a CUPTI injection library that logs every kernel's start and end
 * (concurrent-kernel activity records, graph-launched kernels included) to $TRACE_OUT:
 * one line per kernel, "start_ns end_ns gridX gridY gridZ name".
 *
 * Why: with programmatic dependent launch a kernel's blocks start while its predecessor still
 * runs, so per-kernel durations overlap; the differences between consecutive kernels' END
 * times are what each kernel adds to a decode step (tools/h200/kernel_trace.py). ncu
 * serialises kernels and the machines have no nsys.
 *
 * Built and used on the GPU machine (KREC: the newest CUpti_ActivityKernel<N> of its header):
 *   nvcc -shared -Xcompiler -fPIC -DKREC=CUpti_ActivityKernel10 -I$CUDA/targets/x86_64-linux/include \
 *        tools/h200/kernel_trace.c -L$CUDA/targets/x86_64-linux/lib -lcupti -o /tmp/libktrace.so
 *   CUDA_INJECTION64_PATH=/tmp/libktrace.so TRACE_OUT=/tmp/trace.txt ferrite bench ...
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define TRACE_BUF (16u << 20)

static FILE *trace_out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = (uint8_t *)aligned_alloc(8, TRACE_BUF);
    *size = *buffer ? TRACE_BUF : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    CUpti_Activity *r = NULL;
    (void)ctx, (void)stream, (void)size;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const KREC *k = (const KREC *)r;
            fprintf(trace_out, "%llu %llu %d %d %d %s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->gridX, k->gridY, k->gridZ, k->name);
        }
    }
    free(buffer);
}

static void flush_at_exit(void) {
    cuptiActivityFlushAll(1);
    if (trace_out) fclose(trace_out);
}

int InitializeInjection(void) {
    const char *path = getenv("TRACE_OUT");
    trace_out = fopen(path ? path : "kernel_trace.txt", "w");
    if (!trace_out) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
    atexit(flush_at_exit);
    return 1;
}
