"""/proc/cpuinfo text of CPUs this project meets, for tests of feature detection and capping."""

from __future__ import annotations

_COMMON = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
    "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid pni pclmulqdq ssse3 fma cx16 pcid sse4_1 "
    "sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm abm fsgsbase bmi1 avx2 smep bmi2 erms invpcid"
)


def cpuinfo(flags: str) -> str:
    """Two processors' worth of /proc/cpuinfo with `flags` on each."""
    return "".join(f"processor\t: {n}\nvendor_id\t: x\nflags\t\t: {flags}\nbogomips\t: 4000\n\n" for n in (0, 1))


# Intel Xeon Sapphire Rapids: AMX, avx512_fp16, AVX-VNNI.
SAPPHIRE_RAPIDS = cpuinfo(
    _COMMON + " avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
    "xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke avx512_vbmi2 gfni "
    "vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid movdiri movdir64b fsrm serialize tsxldtrk "
    "amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities"
)
# AMD EPYC Genoa (Zen 4): AVX512-BF16 and VNNI, no AMX, no avx512_fp16, no AVX-VNNI.
ZEN4 = cpuinfo(
    _COMMON + " mmxext fxsr_opt cmp_legacy svm extapic sse4a misalignsse 3dnowprefetch topoext avx512f avx512dq "
    "rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves "
    "avx512_bf16 clzero wbnoinvd arat avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni "
    "avx512_bitalg avx512_vpopcntdq rdpid fsrm"
)
# Intel Ice Lake server: AVX-512 with VNNI, no bfloat16.
ICE_LAKE = cpuinfo(
    _COMMON + " avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
    "xsaveopt xsavec avx512vbmi umip pku avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq rdpid"
)
# Intel Haswell: AVX2 and FMA, nothing of AVX-512.
HASWELL = cpuinfo(_COMMON + " xsaveopt arat")
# A CPU before AVX (Westmere).
WESTMERE = cpuinfo(
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx rdtscp lm constant_tsc pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 popcnt aes"
)
