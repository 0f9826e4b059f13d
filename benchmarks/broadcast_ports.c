/* The cost of the GEMM micro-kernel's broadcasts (mplower/numerics/gemm.py, `_codegen`).

   One k step of an 8-row x 2-vector float32 tile, written as AVX-512 assembly and repeated,
   in TSC cycles per step:
     bcast+mul+add  8 vbroadcastss from memory, 16 vmulps, 16 vaddps (the kernel before)
     embedded       16 vmulps with an embedded {1to16} broadcast, 16 vaddps (the kernel now)
     mul+add reg    16 vmulps, 16 vaddps, all operands in registers
     fma reg        16 vfmadd231ps in registers (the FP ports' limit)
   Build and run on an AVX-512 host:
     gcc -O2 -mavx512f benchmarks/broadcast_ports.c -o /tmp/broadcast_ports && /tmp/broadcast_ports
   Figures: round twelve of docs/benchmarks.md (git show 856f10d:docs/benchmarks.md). */
#include <stdint.h>
#include <stdio.h>
#include <x86intrin.h>

#define STEPS 20000000L
static float row[64] __attribute__((aligned(64)));

/* acc += x * b for the two vectors b (zmm30, zmm29) of one row, products in t0 and t1 */
#define PAIR(x0, x1, a0, a1, t0, t1)                                           \
    "vmulps " x0 ", %%zmm30, %%zmm" t0 "\n\tvaddps %%zmm" t0 ", %%zmm" a0 ", %%zmm" a0 "\n\t" \
    "vmulps " x1 ", %%zmm29, %%zmm" t1 "\n\tvaddps %%zmm" t1 ", %%zmm" a1 ", %%zmm" a1 "\n\t"
#define BCAST(off, a0, a1, t0, t1, b)                                          \
    "vbroadcastss " off "(%0), %%zmm" b "\n\t" PAIR("%%zmm" b, "%%zmm" b, a0, a1, t0, t1)
#define EMBED(off, a0, a1, t0, t1)                                             \
    PAIR(off "(%0)%{1to16%}", off "(%0)%{1to16%}", a0, a1, t0, t1)
#define REG(a0, a1, t0, t1) PAIR("%%zmm31", "%%zmm31", a0, a1, t0, t1)
#define FMA2(a0, a1)                                                           \
    "vfmadd231ps %%zmm31, %%zmm30, %%zmm" a0 "\n\tvfmadd231ps %%zmm31, %%zmm29, %%zmm" a1 "\n\t"

static double per_step(uint64_t t0) { return (double)(__rdtsc() - t0) / STEPS; }

int main(void) {
    uint64_t t0;
    for (int i = 0; i < 64; i++) row[i] = 1.0f;
    t0 = __rdtsc();
    for (long i = 0; i < STEPS; i++)
        __asm__ volatile(BCAST("0", "0", "1", "16", "17", "24") BCAST("4", "2", "3", "18", "19", "25")
                         BCAST("8", "4", "5", "20", "21", "26") BCAST("12", "6", "7", "22", "23", "27")
                         BCAST("16", "8", "9", "16", "17", "24") BCAST("20", "10", "11", "18", "19", "25")
                         BCAST("24", "12", "13", "20", "21", "26") BCAST("28", "14", "15", "22", "23", "27")
                         :: "r"(row) : "memory");
    printf("bcast+mul+add %6.2f TSC cycles per k step\n", per_step(t0));
    t0 = __rdtsc();
    for (long i = 0; i < STEPS; i++)
        __asm__ volatile(EMBED("0", "0", "1", "16", "17") EMBED("4", "2", "3", "18", "19")
                         EMBED("8", "4", "5", "20", "21") EMBED("12", "6", "7", "22", "23")
                         EMBED("16", "8", "9", "16", "17") EMBED("20", "10", "11", "18", "19")
                         EMBED("24", "12", "13", "20", "21") EMBED("28", "14", "15", "22", "23")
                         :: "r"(row) : "memory");
    printf("embedded      %6.2f\n", per_step(t0));
    t0 = __rdtsc();
    for (long i = 0; i < STEPS; i++)
        __asm__ volatile(REG("0", "1", "16", "17") REG("2", "3", "18", "19") REG("4", "5", "20", "21")
                         REG("6", "7", "22", "23") REG("8", "9", "16", "17") REG("10", "11", "18", "19")
                         REG("12", "13", "20", "21") REG("14", "15", "22", "23") ::: "memory");
    printf("mul+add reg   %6.2f\n", per_step(t0));
    t0 = __rdtsc();
    for (long i = 0; i < STEPS; i++)
        __asm__ volatile(FMA2("0", "1") FMA2("2", "3") FMA2("4", "5") FMA2("6", "7")
                         FMA2("8", "9") FMA2("10", "11") FMA2("12", "13") FMA2("14", "15") ::: "memory");
    printf("fma reg       %6.2f\n", per_step(t0));
    return 0;
}
