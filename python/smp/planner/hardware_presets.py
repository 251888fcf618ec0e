"""The hardware presets: one GPU and the node it sits in, each figure with its public source.

Figures are the vendors' specifications (peak dense matmul TFLOP/s without sparsity, memory,
memory bandwidth, NVLink bandwidth per GPU in one direction, the node's network per GPU in one
direction), plus the fractions of them that real kernels sustain, each from a public measurement
or from smp's own runs. Sources (numbered as in the `sources` of each preset):

[1] NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
    312 TFLOP/s bf16/fp16 dense, 19.5 TFLOP/s fp32; 40GB HBM2 at 1,555 GB/s, 80GB HBM2e at
    2,039 GB/s (SXM); NVLink 600 GB/s per GPU (both directions: 300 GB/s each way).
[2] NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 989 TFLOP/s bf16/fp16 dense (1,979 with
    sparsity), 67 TFLOP/s fp32; 80GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (450 GB/s each way).
[3] NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the H100's compute, 141GB HBM3e
    at 4.8 TB/s, NVLink 900 GB/s.
[4] NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs (A100), and the Hopper
    whitepaper: 132 SMs (H100 SXM5); the number of tiles a GEMM runs at once.
[5] S. Bekman, "Machine Learning Engineering" (github.com/stas00/ml-engineering,
    compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"): best bf16
    matmul measured 271.2 of 312 TFLOP/s on A100 SXM (86.9%), 794.5 of 989 on H100 SXM (80.3%,
    "H200 is the same"). smp's own H200 runs measured an 8192^3 bf16 matmul at 792-798 TFLOP/s
    (docs/benchmarks.md, "GPU: smp against plain PyTorch"): 80-81%.
[6] The same book, network/README.md: nccl-tests all_reduce on an A100 node reaches 235 GB/s of
    NVLink's 300 GB/s one-way ("80% of the theoretical spec ... holds on newer hardware too"); its
    inter-node table: AWS EFA v1 (p4d) 4 x 100 Gbps = 50 GB/s per node, DGX H100 NDR
    8 x 400 Gbps = 400 GB/s per node. NCCL's own model caps A100 NVLink bus bandwidth at
    235 GB/s (src/graph/tuning.cc, `busBw = std::min(busBw, 235.0f)` for compute capability 8.0).
[7] NCCL src/graph/tuning.cc, ring algorithm, Simple protocol (the one large messages use):
    8.4 us base latency, 3.4 us per ring step over NVLink, 9.6 us per step over the network.
[8] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (SC'21), section 5: DGX A100 80GB nodes (Selene), 8 GPUs over NVLink/NVSwitch,
    eight 200 Gbps HDR InfiniBand adapters per node (25 GB/s per GPU).
[9] AWS, Amazon EC2 P4d instances: ml.p4d.24xlarge / p4d.24xlarge, 8 x A100 40GB, 400 Gbps EFA
    per instance; P5: 8 x H100, 3,200 Gbps EFA per instance (50 GB/s per GPU).
[10] Achieved HBM bandwidth of optimized streaming kernels: about 1,800 of the A100 80GB's
    2,039 GB/s, 88% ("GPU memory bandwidth optimization", fridayswithfaraday.com, 2020); taken
    for every GPU here.
[11] NVIDIA Matrix Multiplication Background User's Guide (docs.nvidia.com/deeplearning/
    performance): cuBLAS computes a GEMM in output tiles (256x128, 128x256, 128x128 among the
    largest), one tile per SM at a time: tile and wave quantization.
[12] smp's own measured step (docs/benchmarks.md, "GPU: smp against plain PyTorch", one H200,
    2026-11-27, second call): GPT-2-medium, bf16, torch.compile'd, batch 8 x 1024 tokens,
    150,306 tokens/s = 54.50 ms a step, where this model with every fraction above and none for
    the step predicts 49.78 ms: a whole step sustains 0.913 of its kernels' rates (gaps between
    kernels, clocks under sustained load). Taken for every GPU here; the one calibration from a
    measured step (tests/python/test_planner_time.py re-derives it).
"""

from __future__ import annotations

# Shared by every NVIDIA preset (sources 5, 6, 7, 10, 11).
_NVIDIA = {
    "memory_efficiency": 0.88,  # [10]
    "link_efficiency": 0.78,  # [6]: 235 / 300 GB/s
    "collective_latency_us": 8.4,  # [7]
    "intra_node_step_latency_us": 3.4,  # [7]
    "inter_node_step_latency_us": 9.6,  # [7]
    "matmul_tiles": [[256, 128], [128, 256], [128, 128]],  # [11]
    "kernel_overhead_us": 0.0,  # kernels queue asynchronously behind the large ones modelled here
    "sustained_fraction": 0.913,  # [12]
    "overlap": True,  # NCCL runs on its own streams: bucketed gradient averaging overlaps compute
}

_A100 = {
    **_NVIDIA,
    "peak_tflops": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},  # [1]
    "matmul_efficiency": 0.869,  # [5]: 271.2 / 312
    "compute_units": 108,  # [4]
    "intra_node_gbps": 300.0,  # [1]: NVLink 600 GB/s both ways
    "gpus_per_node": 8,
}

_HOPPER = {
    **_NVIDIA,
    "peak_tflops": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # [2]
    "matmul_efficiency": 0.803,  # [5]: 794.5 / 989 (smp measured 792-798 on H200)
    "compute_units": 132,  # [4]
    "intra_node_gbps": 450.0,  # [2]: NVLink 900 GB/s both ways
    "gpus_per_node": 8,
}

PRESETS: dict[str, dict] = {
    "a100-40gb": {
        **_A100,
        "description": "NVIDIA A100 SXM 40GB, 8 per node (ml.p4d.24xlarge: 400 Gbps EFA per node)",
        "memory": "40GiB",  # [1] (40960 MiB)
        "memory_bandwidth_gbps": 1555.0,  # [1]
        "inter_node_gbps": 50.0 / 8,  # [6], [9]: 50 GB/s per node over 8 GPUs
        "sources": "[1] [4] [5] [6] [7] [9] [10] [11] in smp/planner/hardware_presets.py",
    },
    "a100-80gb": {
        **_A100,
        "description": "NVIDIA A100 SXM 80GB, 8 per node (DGX A100: 8 x 200 Gbps InfiniBand HDR)",
        "memory": "80GiB",  # [1] (81920 MiB)
        "memory_bandwidth_gbps": 2039.0,  # [1]
        "inter_node_gbps": 25.0,  # [8]: one 200 Gbps adapter per GPU
        "sources": "[1] [4] [5] [6] [7] [8] [10] [11] in smp/planner/hardware_presets.py",
    },
    "h100-sxm": {
        **_HOPPER,
        "description": "NVIDIA H100 SXM 80GB, 8 per node (DGX H100 / p5: 400 Gbps per GPU)",
        "memory": "80GB",  # [2]
        "memory_bandwidth_gbps": 3350.0,  # [2]
        "inter_node_gbps": 50.0,  # [6], [9]: 8 x 400 Gbps per node
        "sources": "[2] [4] [5] [6] [7] [9] [10] [11] in smp/planner/hardware_presets.py",
    },
    "h200": {
        **_HOPPER,
        "description": "NVIDIA H200 SXM 141GB, 8 per node (DGX H200: 400 Gbps per GPU)",
        "memory": "141GB",  # [3]
        "memory_bandwidth_gbps": 4800.0,  # [3]
        "inter_node_gbps": 50.0,  # [6]: DGX H200 as DGX H100, 8 x 400 Gbps per node
        "sources": "[3] [4] [5] [6] [7] [10] [11] in smp/planner/hardware_presets.py",
    },
}
DEFAULT = "a100-40gb"  # the Best Practices seed's reference table ran on ml.p4d.24xlarge
