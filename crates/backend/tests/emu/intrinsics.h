// Host versions of the CUDA types and intrinsics the kernel emulation harnesses share
// (gemv_tc_emu, attn_decode_tc_emu): the vector types, the cached loads (plain loads here),
// the device qualifiers, byte permute, f16 bits -> f32, and the float warp shuffles on top of
// fibers.h's warp_exchange. Included after fibers.h.
#pragma once
#include <algorithm>
#include <cmath>

#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict

struct int4 {
    int x, y, z, w;
};
struct uint2 {
    uint32_t x, y;
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
template <class T>
static inline T __ldg(const T* p) {
    return *p;
}
template <class T>
static inline T __ldcg(const T* p) {
    return *p;
}
using std::max;
using std::min;

static inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t sh) {
    return (uint32_t)((((uint64_t)hi << 32) | lo) >> (sh & 31));
}
static inline uint32_t __funnelshift_l(uint32_t lo, uint32_t hi, uint32_t sh) {
    return (uint32_t)(((((uint64_t)hi << 32) | lo) << (sh & 31)) >> 32);
}

static inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t v = (uint64_t)y << 32 | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}

// An f16's bits as the f32 of the same value (infinities and NaN included).
static float h2f(uint16_t h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
    const float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m | 1024), e - 25);
    return s ? -v : v;
}

static float __shfl_xor_sync(unsigned, float v, int off) {
    Deposit m{};
    m.kind = 1;
    m.w[0] = f2u(v);
    const Deposit* all = warp_exchange(m);
    return __uint_as_float(all[(cur % 32) ^ off].w[0]);
}

static float __shfl_sync(unsigned, float v, int src) {
    Deposit m{};
    m.kind = 3;
    m.w[0] = f2u(v);
    const Deposit* all = warp_exchange(m);
    return __uint_as_float(all[src & 31].w[0]);
}

static uint32_t __shfl_sync(unsigned, uint32_t v, int src) {
    Deposit m{};
    m.kind = 5;
    m.w[0] = v;
    const Deposit* all = warp_exchange(m);
    return all[src & 31].w[0];
}

static int __shfl_xor_sync(unsigned, int v, int off) {
    Deposit m{};
    m.kind = 4;
    m.w[0] = (uint32_t)v;
    const Deposit* all = warp_exchange(m);
    return (int)all[(cur % 32) ^ off].w[0];
}

// The device's rsqrtf is within 2 ulp of this (harnesses compare with tolerances, not bits).
static inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
