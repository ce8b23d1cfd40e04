// The library as one translation unit: torch's headers take most of a build's time, and are parsed
// once here instead of once per kernel file. Each file below stays a kernel of its own.
#include "paged_attention_cpu.cpp"
#include "linear_cpu.cpp"
#include "linear_packing_cpu.cpp"
#include "decoder_layer_cpu.cpp"
#include "moe_cpu.cpp"
#include "argmax_cpu.cpp"
#include "categorical_cpu.cpp"
#include "lora_cpu.cpp"
