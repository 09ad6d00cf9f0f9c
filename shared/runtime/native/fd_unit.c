// The native kernels' translation unit. It is compiled once per instruction set, with that set's
// compiler flags and -DFD_ISA_<SET> (omnidraft/shared/native_kernels.py: compile_flags), by
// `pip install` (setup.py) or, where no installed build fits, at first use.
#include "fd_common.h"
#if defined(FD_ISA_AMX)
#include "fd_avx512.h"
#include "fd_amx.h"
#elif defined(FD_ISA_AVX512)
#include "fd_avx512.h"
#elif defined(FD_ISA_AVX2)
#include "fd_avx2.h"
#elif defined(FD_ISA_NEON_DOTPROD) || defined(FD_ISA_NEON)
#include "fd_neon.h"
#else
#error "define one of FD_ISA_AMX, FD_ISA_AVX512, FD_ISA_AVX2, FD_ISA_NEON_DOTPROD, FD_ISA_NEON"
#endif
#include "fd_driver.c"

#ifndef FD_SOURCE_KEY
#define FD_SOURCE_KEY "unknown"
#endif
// Which sources and flags this library was built from: the loader rebuilds a stale one.
const char* fd_source_key(void) { return FD_SOURCE_KEY; }
