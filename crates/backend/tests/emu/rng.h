// The emulation harnesses' random numbers (gemv_tc_emu, gemv_tc2_emu): xorshift64*, its state
// `rng` saved and restored by the harnesses to replay a configuration's draws.
#pragma once
#include <cstdint>

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32);
}
static float unif(float a, float b) { return a + (b - a) * (rnd() >> 8) / 16777216.0f; }
// A positive normal f16 in about [2^-12, 2^-4].
static uint16_t rnd_f16() { return (uint16_t)(((3 + rnd() % 8) << 10) | (rnd() & 1023)); }
