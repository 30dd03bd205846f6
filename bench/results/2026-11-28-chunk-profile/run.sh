# One GPU: where a tapered chunked 128K prefill's extra time goes (issue 36: 1.16-1.22x the whole prefill, ~35 ms
# per step): the Llama-3.1-8B shape cut to 4 layers, whole vs serve's 4096-token tapered chunks vs 8192, kernels,
# idle gaps and host ops of one prefill under torch.profiler.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P="python3 bench/profile_prefill.py --layers 4 --prompt-len 131072 --repeats 2 --gaps 8 --host 12"
$P --out $OUT/whole.json 2>&1 | head -24
$P --prefill-chunk 4096 --prefill-knee 26624 --out $OUT/taper4096.json 2>&1 | head -40
$P --prefill-chunk 8192 --prefill-knee 26624 --out $OUT/taper8192.json 2>&1 | head -8
# The whole model (32 layers): the service's ratio outside the service (runner.prefill in chunks)
P32="python3 bench/profile_prefill.py --layers 32 --prompt-len 131072 --repeats 2 --gaps 8 --host 12"
$P32 --out $OUT/whole32.json 2>&1 | head -16
$P32 --prefill-chunk 4096 --prefill-knee 26624 --out $OUT/taper4096_32.json 2>&1 | head -40
