// The kernels for the base target (compile flags in CMakeLists.txt).
#define DUET_ISA base
#define DUET_MAX_MB 4
#include "kernels_impl.inc"
#include "attention_impl.inc"
#include "swiglu_impl.inc"
