// Two builds of the CPU mass-assignment kernels (mass_assignment.cpp) on x86-64
// with GCC: one for the baseline instruction set (SSE2), the other for cores
// with AVX2 (mass_assignment_avx2.cpp compiles the same file again under
// `#pragma GCC target`). The op library registers the one the CPU supports.
//
// Both execute the same IEEE operations in the same order: the AVX2 target
// adds no FMA (nothing is contracted) and nothing is reassociated, so they give
// the same bits; the AVX2 build is faster because the stencils' floors,
// conversions and loads use wider and three-operand instructions.
//
// The environment variable TORCHPM_CPU_KERNELS picks one when the library is
// loaded: unset, "" or "auto" (AVX2 where the CPU has it), "avx2" or
// "baseline". A value that is not one of these, or "avx2" on a CPU without
// AVX2, registers the baseline and makes cpu_kernel_variant() raise, which
// `import torchpm` calls; a LibTorch program can call it after loading.
#pragma once

#include <torch/library.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCHPM_CPU_AVX2_KERNELS 1
#endif

namespace torchpm {

#ifdef TORCHPM_CPU_AVX2_KERNELS
namespace cpu_avx2 {
// Registers the AVX2 build's kernels (defined by mass_assignment_avx2.cpp).
void register_mass_assignment_kernels(torch::Library& m);
}  // namespace cpu_avx2
#endif

// "avx2" or "baseline": the kernels registered in this process. Raises (a
// c10::Error naming TORCHPM_CPU_KERNELS) when that variable asked for what
// could not be given.
std::string cpu_kernel_variant();

}  // namespace torchpm
