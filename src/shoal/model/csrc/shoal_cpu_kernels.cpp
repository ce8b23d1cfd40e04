// The library's kernels but paged attention, as one translation unit: each file below stays a kernel
// of its own, and torch's headers (about 6 s of a build) are parsed once for all of them. Paged
// attention's templates take about as long to compile as the rest together, so it is a unit of its
// own, compiled at the same time as this one (native_kernels.TRANSLATION_UNITS).
#include "linear_cpu.cpp"
#include "linear_packing_cpu.cpp"
#include "decoder_layer_cpu.cpp"
#include "moe_cpu.cpp"
#include "argmax_cpu.cpp"
#include "categorical_cpu.cpp"
#include "lora_cpu.cpp"
