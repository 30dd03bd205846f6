"""Programmatic dependent launch (kernels/pdl.py): when it is used, and what the kernels compile to.
Its effect on a GPU (same greedy tokens off / on, decode step times) is measured in
docs/results.md, Decode; here: the launch policy, and that each PDL-aware kernel built for
sm_90a waits on the kernel ahead (griddepcontrol.wait) and lets the next one start
(griddepcontrol.launch_dependents) only with USE_PDL, and that the GEMV's first weight tile is loaded
before its wait."""
import torch

from tests.helpers.sm90_compile import assert_compiles_for_sm90
from starshard.kernels.pdl import pdl_enabled, pdl_launch


def test_off_on_cpu_and_outside_graph_capture():
    assert pdl_launch(torch.zeros(2)) == {"USE_PDL": False}
    assert not pdl_enabled(torch.device("cpu"))


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels import activation, argmax, decode, gemv, kv_write, moe_decode, norm, rope
kernels = [gemv._gemv_kernel, norm._rms_norm_kernel, rope._rope_qk_kernel, kv_write._write_kv_slot_kernel,
           decode._decode_merge_kernel, moe_decode._route_kernel, moe_decode._gate_up_kernel,
           moe_decode._down_kernel, argmax._argmax_chunks_kernel, argmax._argmax_reduce_kernel,
           activation._silu_mul_rows_kernel]
ptrs = {"_gemv_kernel": "X W S BIAS RES Y", "_rms_norm_kernel": "X W Y", "_rope_qk_kernel": "Q K QO KO QW KW COS SIN",
        "_write_kv_slot_kernel": "K V POS SLOT CK CV CPOS KS VS", "_decode_merge_kernel": None,
        "_route_kernel": "logit_ptr weight_ptr expert_ptr", "_gate_up_kernel": "x_ptr exp_ptr w_ptr s_ptr out_ptr",
        "_down_kernel": "a_ptr exp_ptr pw_ptr w_ptr s_ptr res_ptr out_ptr", "_argmax_chunks_kernel": "X VAL IDX",
        "_argmax_reduce_kernel": "VAL IDX OUT", "_silu_mul_rows_kernel": "G Y"}
ints = {"TOP_K": 2, "K_PAD": 2, "BLOCK_E": 16, "BLOCK_N": 4, "BLOCK_K": 64, "BLOCK_R": 2, "BLOCK_D": 64,
        "BLOCK_HQ": 2, "BLOCK_HK": 2, "BLOCK_HALF": 32, "BLOCK_REST": 0, "CHUNK": 256, "BLOCK": 256, "BLOCK_C": 16,
        "HEAD_DIM": 64, "BLOCK_S": 16}
for fn in kernels:
    names = fn.arg_names
    is_ptr = lambda n: (n[0].isupper() and len(n) <= 5 and n.isupper()) if ptrs[fn.__name__] is None else n in ptrs[fn.__name__].split()
    for use in (False, True):
        sig, const = {}, {}
        for n in names:
            p = fn.params[names.index(n)]
            if p.is_constexpr:
                sig[n] = "constexpr"
                const[n] = use if n == "USE_PDL" else ints.get(n, False)
            elif is_ptr(n):
                sig[n] = "*bf16"
            else:
                sig[n] = "fp32" if n == "eps" else "i32"
        ptx = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4}).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == use and ("griddepcontrol.launch_dependents" in ptx) == use, fn.__name__
        if use and fn.__name__ == "_gemv_kernel":  # the first weight tile is requested before the wait
            assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait"), "gemv: no load before the wait"
print("compiled")
"""


def test_pdl_kernels_compile_for_sm90(tmp_path):
    assert_compiles_for_sm90(_COMPILE, tmp_path)
