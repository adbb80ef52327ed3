// The kernels for the avx512 target (compile flags in CMakeLists.txt).
#define DUET_ISA avx512
#define DUET_MAX_MB 8
#include "kernels_impl.inc"
#include "attention_impl.inc"
#include "attention_decode_impl.inc"
#include "swiglu_impl.inc"
