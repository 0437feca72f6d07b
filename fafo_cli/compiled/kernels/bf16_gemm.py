"""A bf16 GEMM micro-kernel for inductor's CPU GEMM templates, on CPUs with AVX512-BF16 (and no AMX).

Inductor ships bf16 micro-kernels for AMX only; elsewhere it widens bf16 to fp32 and multiplies with fp32
FMAs. One `vdpbf16ps` does the work of two FMAs (a pair of bf16 products summed into fp32), and a step
carrying many rows (FAFO's verify and fumble rows) is compute-bound on a CPU, so it pays there (one row is
bound by memory either way; docs/compiled-steps.md). Weights are packed in pairs
along K (inductor's VNNI2 layout, done once when the graph is frozen; a product of two activations packs each
block of B as it goes, as inductor asks: `pack_vnni_B_locally`). Registering it changes inductor's
choices for this whole process, which only ever gains a faster candidate.

Results differ from the fp32-FMA kernel only in rounding (products are exact, each pair is summed once
more); float32 models never use this kernel.
"""

from __future__ import annotations

import importlib

import torch

_REGISTERED = False
# (rows, columns, depth) per register block: 12 rows x 32 columns keeps 24 accumulators, 2 weight vectors and
# one activation pair in the 32 vector registers; inductor ranks blocks that divide the row count first, so a
# 4-, 8- or 12-row step gets a block of its own height, and other heights up to 12 the 12-row block, whose
# remainder kernel covers all their rows in one pass over the weights
BLOCKINGS = ((12, 32, 2), (8, 32, 2), (4, 32, 2))

_KERNEL = r"""
template <int64_t M, int64_t N, bool accum>
inline void {{kernel_name}}_kernel(
    const {{input_t}}* {{restrict_keyword}} A,
    const {{input2_t}}* {{restrict_keyword}} B,
    {{output_t}}* {{restrict_keyword}} C,
    int64_t K,
    int64_t lda,
    int64_t ldb,
    int64_t ldc
) {
    constexpr const int COLS = N / 16;
    __m512i va;
    __m512i vb[COLS];
    __m512 vc[M * COLS];
    c10::ForcedUnroll<M * COLS>{}([&](auto i) { vc[i] = _mm512_setzero_ps(); });

    // B is packed in pairs along K: row pair k/2 holds [N, 2] bf16, i.e. 16 columns x 2 per vector
    auto compute = [&](auto i, int64_t k) {
        constexpr const int row = i / COLS;
        constexpr const int col = i % COLS;
        if constexpr (col == 0) {
            va = _mm512_set1_epi32(*(const int32_t*)(A + row * lda + k));
        }
        if constexpr (row == 0) {
            vb[col] = _mm512_loadu_si512((const __m512i*)(B + k * ldb + col * 32));
        }
        vc[i] = _mm512_dpbf16_ps(vc[i], (__m512bh)va, (__m512bh)vb[col]);
    };
    for (int64_t k = 0; k < K; k += 2) {
        c10::ForcedUnroll<M * COLS>{}(compute, k);
    }

    auto store = [&](auto i) {
        constexpr const int row = i / COLS;
        constexpr const int col = i % COLS;
        {{output_t}}* out = C + row * ldc + col * 16;
        if constexpr (accum) {
            vc[i] = _mm512_add_ps(vc[i], _mm512_loadu_ps(out));
        }
        _mm512_storeu_ps(out, vc[i]);
    };
    c10::ForcedUnroll<M * COLS>{}(store);
}
"""

_ENTRY = r"""
{{declare_kernel}} {
    {{kernel.assert_function}}(N % {{block_n}} == 0, "N dimension must be multiple of {{block_n}}");
    {{kernel.assert_function}}(K % 2 == 0, "K dimension must be even");
    const int64_t M_MAIN = M - M % {{block_m}};
{%- if pack_vnni_B_locally %}
    // B is not packed (a product of two activations, which freezing does not see): each block of columns is
    // packed in pairs here, as torch's AMX kernel does
    {{template.codegen_allocate_weight_buffer("packed_B", input2_t, "K", block_n)}}
    const int64_t ldb_packed = {{block_n}};
{%- else %}
    const int64_t ldb_packed = ldb;
{%- endif %}
    for (int64_t n = 0; n < N; n += {{block_n}}) {
{%- if pack_vnni_B_locally %}
        at::vec::pack_vnni2(B + n, packed_B, ldb, K, {{block_n}});
        const {{input2_t}}* b = packed_B;
{%- else %}
        const {{input2_t}}* b = B + n * 2;
{%- endif %}
        for (int64_t m = 0; m < M_MAIN; m += {{block_m}}) {
            {{kernel_name}}_kernel<{{block_m}}, {{block_n}}, accum>(
                A + m * lda, b, C + m * ldc + n, K, lda, ldb_packed, ldc);
        }
        switch (M - M_MAIN) {
{%- for tail in range(block_m - 1, 0, -1) %}
            case {{tail}}:
                {{kernel_name}}_kernel<{{tail}}, {{block_n}}, accum>(
                    A + M_MAIN * lda, b, C + M_MAIN * ldc + n, K, lda, ldb_packed, ldc);
                break;
{%- endfor %}
            default:
                break;
        }
    }
}
"""


def register() -> bool:
    """Offer the kernel to inductor's GEMM template (idempotent). False where this torch lacks the hooks."""
    global _REGISTERED
    if _REGISTERED:
        return True
    try:
        importlib.import_module("torch._inductor.lowering")  # imports the codegen modules in their working order
        from torch._inductor.codegen import cpp_micro_gemm as micro
        from torch._inductor.cpu_vec_isa import VecAVX512VNNI
        from torch._inductor.select_algorithm import KernelTemplate
    except ImportError:  # private modules: another torch may lack them, and then builds use its own kernels
        return False

    def usable(config, m, n, k, alpha, num_threads, **kwargs) -> bool:
        isa = kwargs.get("vec_isa")
        return (isa is not None and isa.is_avx512_bf16_supported() and k % 2 == 0 and alpha == 1
                and n % config.register_blocking.block_n == 0)

    class CppMicroGemmBF16Dot(micro.CppMicroGemm):
        def codegen_define(self, kernel) -> str:
            options = {"declare_kernel": self.get_kernel_declaration(), "kernel": kernel,
                       "block_m": self.register_blocking.block_m, "block_n": self.register_blocking.block_n,
                       **self.get_common_options()}
            render = KernelTemplate._template_from_string
            return render(_KERNEL).render(options) + render(_ENTRY).render(options)

        def get_b_layout(self):
            return micro.LayoutType.VNNI2

    # VecAVX512VNNI ranks above the fp32 kernels' VecAVX512, so inductor prefers this one where it applies
    micro.register_micro_gemm(*micro.generate_gemm_config(
        VecAVX512VNNI, BLOCKINGS, input_dtype=torch.bfloat16, output_dtype=torch.float,
        compute_dtype=torch.float, extra_check=usable))(CppMicroGemmBF16Dot)
    _REGISTERED = True
    return True
