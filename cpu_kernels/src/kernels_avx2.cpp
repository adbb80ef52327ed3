// The kernels for the avx2 target (compile flags in CMakeLists.txt).
#define DUET_ISA avx2
#define DUET_MAX_MB 4
#include "kernels_impl.inc"
#include "attention_impl.inc"
#include "swiglu_impl.inc"
