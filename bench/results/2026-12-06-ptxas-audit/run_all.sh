# Compile-only register audit of the Triton kernels (no GPU): every launch the entry points make on CPU tensors
# compiles for sm_90a as the real launch specializes it (a stub driver, harness.py), and ptxas -v reports registers,
# spills and shared memory per variant. Triton 3.6 is the device image's:
#   pip install --no-deps --target /tmp/t36 triton==3.6.0; T36=/tmp/t36 bash bench/results/2026-12-06-ptxas-audit/run_all.sh
# Sequential (one compile process at a time), ~7 minutes on 2 cores; logs and the PTX of flagged variants in $OUT.
H=$(cd "$(dirname "$0")" && pwd); R=$(cd "$H/../../.." && pwd)
export OUT=${OUT:-$(mktemp -d)} PYTHONPATH=${T36:?the Triton 3.6 folder}:$R
for s in flash_audit flash_fp8_audit decode_audit small_audit anchor_audit minference_audit flash_fp8_configs \
         decode_fp8_configs anchor_sparse_launch; do
  TRITON_CACHE_DIR=$(mktemp -d) python3 $H/$s.py > $OUT/$s.log 2>&1
done
grep -h "SPILL\|<-- 255" $OUT/*.log | sort | uniq
echo "logs: $OUT"
