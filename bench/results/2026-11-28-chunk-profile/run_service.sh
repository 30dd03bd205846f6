# One GPU: the same tapered 128K prefill through the service's scheduler (its step thread, in process) against
# runner.prefill in chunks and the service's whole prefill: run.sh found the runner's chunked prefill as fast as
# its whole one (10.92 vs 11.03 s, 32 layers), while the service measured 1.16-1.22x.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for L in ${LAYERS:-4 32}; do
  P="python3 bench/profile_prefill.py --layers $L --prompt-len 131072 --repeats 2 --gaps 8 --host 14"
  $P --service --out $OUT/svc_whole_$L.json 2>&1 | grep -v Warn | head -12
  $P --service --prefill-chunk 4096 --prefill-knee 26624 --out $OUT/svc_taper4096_$L.json 2>&1 | grep -v Warn | head -60
  $P --prefill-chunk 4096 --prefill-knee 26624 --out $OUT/taper4096_$L.json 2>&1 | grep -v Warn | head -3
done
