// tools/kernel_name.hpp: the names tools/kernel_trace.cpp gives kernels (demangled, parameter list cut), on
// the CPU.
#include <doctest/doctest.h>

#include <string>

#include "kernel_name.hpp"

using smcgraph::tools::kernel_short_name;

TEST_CASE("a mangled kernel name is demangled and loses its parameter list, not its anonymous namespace") {
  // nvcc's anonymous namespace (_GLOBAL__N__...) in a template kernel, as the library's Llama GEMM has it.
  CHECK(
      kernel_short_name("_ZN8smcgraph5llama46_GLOBAL__N__73428246_13_llama_gemm_cu_204369f415LlamaGemmKernelI"
                        "Li3ELi4ELi4ELi1ELi4EEEvNS0_8GemmArgsEb") ==
      "void smcgraph::llama::(anonymous namespace)::LlamaGemmKernel<3, 4, 4, 1, 4>");
  // A plain function in the global anonymous namespace.
  CHECK(kernel_short_name("_ZN12_GLOBAL__N_16kernelEi") == "(anonymous namespace)::kernel");
}

TEST_CASE("an already demangled name: only the trailing balanced parameter list is cut") {
  CHECK(kernel_short_name("void smcgraph::llama::(anonymous namespace)::LlamaGemmKernel<0, 1, 1, 1, 8>("
                          "smcgraph::llama::GemmArgs, bool)") ==
        "void smcgraph::llama::(anonymous namespace)::LlamaGemmKernel<0, 1, 1, 1, 8>");
  // Parentheses inside template arguments and inside the parameter list.
  CHECK(kernel_short_name("void smcgraph::detail::LogitsPassKernel<(smcgraph::DType)1, 4>(smcgraph::detail::"
                          "PassArgs)") == "void smcgraph::detail::LogitsPassKernel<(smcgraph::DType)1, 4>");
  CHECK(kernel_short_name("void f(void (*)(int), int)") == "void f");
  // Another spelling of the anonymous namespace, or none: the scope stays whole.
  CHECK(kernel_short_name("void smcgraph::llama::(anonymous_namespace)::K(int)") ==
        "void smcgraph::llama::(anonymous_namespace)::K");
}

TEST_CASE("names without a parameter list stay whole") {
  CHECK(kernel_short_name("smcgraph::llama::(anonymous namespace)::LlamaEmbedKernel") ==
        "smcgraph::llama::(anonymous namespace)::LlamaEmbedKernel");
  CHECK(kernel_short_name("nvjet_sm90_tst_384x64_64x3_2x1_v_bz_coopB_TNN") ==
        "nvjet_sm90_tst_384x64_64x3_2x1_v_bz_coopB_TNN");
  CHECK(kernel_short_name("") == "");
  CHECK(kernel_short_name("(weird)") == "(weird)"); // nothing would be left: kept whole
  CHECK(kernel_short_name("a(b(c)") == "a(b");      // unbalanced: the last balanced group is cut
}
