// The int8 kernel for the base target (compile flags in CMakeLists.txt), in a translation unit of its
// own so that adding it changes nothing in how the float kernels (kernels_base.cpp) are compiled:
// kernels_impl.inc contributes only its helpers here.
#define DUET_ISA base
#define DUET_MAX_MB 4
#define DUET_HELPERS_ONLY
#include "kernels_impl.inc"
#include "int8_impl.inc"
