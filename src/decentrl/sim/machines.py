"""The consumer machines a simulated swarm is made of (`HARDWARE`), each figure with its source.

Peaks are dense (no structured sparsity) fp16/bf16 tensor matmuls with fp32 accumulation, which is
what PyTorch's bf16 matmuls run; GeForce cards do it at half their fp16-accumulate rate. NVIDIA
publishes it for some cards in its architecture whitepapers; for the others it is derived, and
said so: the SM count x boost clock x the architecture's per-SM rate, checked against the
"AI TOPS" NVIDIA lists (FP8 with sparsity on Ada, FP4 with sparsity on Blackwell: 8x and 16x the
figure here). Apple and CPU figures are derived from unit counts and clocks: marked estimated.
Memory is the card's VRAM; for a Mac, the share of unified memory macOS lets the GPU wire by
default (about two thirds up to 32 GB, three quarters above); for a PC, the RAM of a 64 GB
desktop less what the OS and the rest keep. Bandwidths are the vendors' (bus width x data rate)."""

from __future__ import annotations

from decentrl.sim.hardware import HardwareProfile

_AMPERE = ("https://www.nvidia.com/content/PDF/"
           "nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_BLACKWELL = ("https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/"
              "nvidia-rtx-blackwell-gpu-architecture.pdf")
_NV30 = "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/"
_NV40 = "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/"
_TPU = "https://www.techpowerup.com/gpu-specs/"
# Apple GPUs run fp16 FMAs at the fp32 rate (no packed doubling): Philip Turner's measurements.
_APPLE_FP16 = "https://github.com/philipturner/metal-benchmarks"
_APPLE_MEMORY = ("memory_gib estimated: the share of unified memory macOS wires for the GPU by "
                 "default (recommendedMaxWorkingSetSize)")
_ADA_DERIVED = ("peak derived: SMs x boost clock x 512 dense fp16 FLOPs/clock/SM at fp32 "
                "accumulate (the Ada whitepaper's RTX 4090 rate), = NVIDIA's AI TOPS / 8")


def _nvidia(name: str, memory_gib: float, peak_tflops: float, bandwidth_gbs: float,
            sources: tuple[str, ...], notes: str = "") -> HardwareProfile:
    return HardwareProfile(name=name, kind="nvidia", memory_gib=memory_gib,
                           peak_tflops=peak_tflops, bandwidth_gbs=bandwidth_gbs,
                           sources=sources, notes=notes)


HARDWARE: dict[str, HardwareProfile] = {
    # ---- NVIDIA Ampere (GA10x): 256 dense fp16 FLOPs/clock/SM at fp32 accumulate -------------
    "rtx-3060-12gb": _nvidia(
        "GeForce RTX 3060 12GB", 12, 12.7, 360,
        (_NV30 + "rtx-3060-3060ti/", _TPU + "geforce-rtx-3060-12-gb.c3682", _AMPERE),
        "peak derived: 28 SMs x 1.777 GHz x 256 FLOPs/clock/SM (the GA102 whitepaper's "
        "per-SM rate; the whitepaper does not list the 3060)"),
    "rtx-3070": _nvidia(
        "GeForce RTX 3070", 8, 20.3, 448,
        (_AMPERE, _NV30 + "rtx-3070-3070ti/", _TPU + "geforce-rtx-3070.c3674")),
    "rtx-3080-10gb": _nvidia(
        "GeForce RTX 3080 10GB", 10, 29.8, 760,
        (_AMPERE, _NV30 + "rtx-3080-3080ti/", _TPU + "geforce-rtx-3080.c3621")),
    "rtx-3090": _nvidia(
        "GeForce RTX 3090", 24, 35.6, 936,
        (_AMPERE, _NV30 + "rtx-3090-3090ti/", _TPU + "geforce-rtx-3090.c3622")),
    # ---- NVIDIA Ada (AD10x): 512 dense fp16 FLOPs/clock/SM at fp32 accumulate ----------------
    "rtx-4060": _nvidia(
        "GeForce RTX 4060", 8, 30.2, 272,
        (_NV40 + "rtx-4060-4060ti/", _TPU + "geforce-rtx-4060.c4107", _ADA),
        _ADA_DERIVED + ": 24 SMs x 2.46 GHz, 242 AI TOPS"),
    "rtx-4060-ti-16gb": _nvidia(
        "GeForce RTX 4060 Ti 16GB", 16, 44.1, 288,
        (_NV40 + "rtx-4060-4060ti/", _TPU + "geforce-rtx-4060-ti-16-gb.c4155", _ADA),
        _ADA_DERIVED + ": 34 SMs x 2.535 GHz, 353 AI TOPS"),
    "rtx-4070": _nvidia(
        "GeForce RTX 4070", 12, 58.3, 504,
        (_NV40 + "rtx-4070-family/", _TPU + "geforce-rtx-4070.c3924", _ADA),
        _ADA_DERIVED + ": 46 SMs x 2.475 GHz, 466 AI TOPS"),
    "rtx-4070-ti-super": _nvidia(
        "GeForce RTX 4070 Ti SUPER", 16, 88.2, 672,
        (_NV40 + "rtx-4070-family/", _TPU + "geforce-rtx-4070-ti-super.c4187", _ADA),
        _ADA_DERIVED + ": 66 SMs x 2.61 GHz, 706 AI TOPS"),
    "rtx-4080": _nvidia(
        "GeForce RTX 4080", 16, 97.5, 716.8,
        (_ADA, _NV40 + "rtx-4080-family/", _TPU + "geforce-rtx-4080.c3888")),
    "rtx-4090": _nvidia(
        "GeForce RTX 4090", 24, 165.2, 1008,
        (_ADA, _NV40 + "rtx-4090/", _TPU + "geforce-rtx-4090.c3889")),
    # ---- NVIDIA Blackwell ------------------------------------------------------------------
    "rtx-5090": _nvidia(
        "GeForce RTX 5090", 32, 209.5, 1792,
        (_BLACKWELL, "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/",
         _TPU + "geforce-rtx-5090.c4216"),
        "peak: the Blackwell whitepaper's fp16 at fp32 accumulate, dense (= 3352 AI TOPS / 16)"),
    # ---- AMD RDNA 3 -------------------------------------------------------------------------
    "rx-7900-xtx": HardwareProfile(
        name="Radeon RX 7900 XTX", kind="amd", memory_gib=24, peak_tflops=122.8,
        bandwidth_gbs=960,
        sources=("https://www.amd.com/en/products/graphics/desktops/radeon/7000-series/"
                 "amd-radeon-rx-7900xtx.html", _TPU + "radeon-rx-7900-xtx.c3941"),
        notes="peak: AMD's fp16 figure, which counts dual-issued WMMA (96 CUs x 2.5 GHz x 512 "
              "FLOPs/clock/CU); the amd matmul efficiency discounts it"),
    # ---- Apple silicon (GPU through MPS; bf16 weights) --------------------------------------
    "m1": HardwareProfile(
        name="Apple M1 (8-core GPU, 16 GB)", kind="apple", memory_gib=10.7, peak_tflops=2.6,
        bandwidth_gbs=68.25,
        sources=("https://www.apple.com/newsroom/2020/11/apple-unleashes-m1/",
                 "https://www.anandtech.com/show/16252/mac-mini-apple-m1-tested", _APPLE_FP16),
        notes="peak: Apple's 2.6 TFLOPS (fp32; fp16 runs at the same rate). bandwidth derived: "
              "128-bit LPDDR4X-4266 (Apple publishes none). " + _APPLE_MEMORY + ": 2/3 of 16 GB"
              ". The M1 has no bf16 ALUs: MPS emulates bf16, slower than this peak says"),
    "m2-pro": HardwareProfile(
        name="Apple M2 Pro (19-core GPU, 16 GB)", kind="apple", memory_gib=10.7,
        peak_tflops=6.8, bandwidth_gbs=200,
        sources=("https://www.apple.com/newsroom/2023/01/apple-unveils-m2-pro-and-m2-max-next-"
                 "generation-chips-for-next-level-workflows/", "https://en.wikipedia.org/wiki/"
                 "Apple_M2", _APPLE_FP16),
        notes="peak estimated: 2432 ALUs x 2 FLOPs x 1.398 GHz. " + _APPLE_MEMORY
              + ": 2/3 of 16 GB"),
    "m3-max": HardwareProfile(
        name="Apple M3 Max (40-core GPU, 64 GB)", kind="apple", memory_gib=48, peak_tflops=14.3,
        bandwidth_gbs=400,
        sources=("https://www.apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max-the"
                 "-most-advanced-chips-for-a-personal-computer/", "https://www.notebookcheck.net"
                 "/M3-Max-40-Core-GPU-vs-M1-Pro-14-Core-GPU-vs-M3-Max-30-Core-GPU_11636_10965_"
                 "12034.247598.0.html", _APPLE_FP16),
        notes="peak estimated: 5120 ALUs x 2 FLOPs x 1.398 GHz (reviews quote up to 16.4 at "
              "1.6 GHz). " + _APPLE_MEMORY + ": 3/4 of 64 GB"),
    "m4-pro": HardwareProfile(
        name="Apple M4 Pro (20-core GPU, 24 GB)", kind="apple", memory_gib=16, peak_tflops=7.5,
        bandwidth_gbs=273,
        sources=("https://www.apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/",
                 _APPLE_FP16),
        notes="peak estimated: 2560 ALUs x 2 FLOPs x 1.47 GHz (sources quote 7.5 to 9.2). "
              + _APPLE_MEMORY + ": 2/3 of 24 GB"),
    # ---- desktop CPUs (64 GB of DDR5, two channels) -----------------------------------------
    "ryzen-9-7950x": HardwareProfile(
        name="AMD Ryzen 9 7950X (64 GB DDR5-5200)", kind="cpu", memory_gib=48, peak_tflops=2.46,
        bandwidth_gbs=83.2,
        sources=("https://www.amd.com/en/products/processors/desktops/ryzen/7000-series/"
                 "amd-ryzen-9-7950x.html",),
        notes="peak estimated: 16 Zen 4 cores x 32 fp32 FLOPs/clock (two 256-bit FMA pipes) x "
              "4.8 GHz all-core; AVX512-BF16 dot products could reach up to twice that. "
              "bandwidth derived: 2 channels x 8 bytes x 5200 MT/s. memory_gib estimated: 48 of "
              "64 GB. decentrl computes in bf16 here (an AVX-512 CPU)"),
    "core-i7-14700k": HardwareProfile(
        name="Intel Core i7-14700K (64 GB DDR5-5600)", kind="cpu", memory_gib=48,
        peak_tflops=2.09, bandwidth_gbs=89.6, compute_bytes=4,
        sources=("https://www.intel.com/content/www/us/en/products/sku/236783/intel-core-i7-"
                 "processor-14700k-33m-cache-up-to-5-60-ghz/specifications.html",),
        notes="peak estimated: 8 P-cores x 32 fp32 FLOPs/clock x 5.0 GHz + 12 E-cores x 16 x "
              "4.2 GHz (AVX2 FMA). bandwidth derived: 2 channels x 8 bytes x 5600 MT/s. "
              "memory_gib estimated: 48 of 64 GB. No AVX-512: decentrl computes in fp32 here"),
}
