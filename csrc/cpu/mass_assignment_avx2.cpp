// The CPU mass-assignment kernels built a second time, for x86-64 cores with
// AVX2 (kernel_variant.h says how one of the two builds is chosen).
#include "kernel_variant.h"

#ifdef TORCHPM_CPU_AVX2_KERNELS
#define TORCHPM_MASS_ASSIGNMENT_AVX2 1
#include "mass_assignment.cpp"
#endif
