export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
S=$(date +%s)
timeout 200 torchrun --nproc-per-node 4 bench/results/2026-11-28-service-cp4/admit.py --strategy star --block 32768 --length 1048448 --conc 1,8 --out $OUT/star4_1m.json > $OUT/log3.txt 2>&1; echo rc=$? t=$(( $(date +%s)-S ))
timeout 100 python3 bench/results/2026-11-28-service-cp4/admit.py --strategy dense --length 131072 --conc 1,1,8 --out $OUT/dense1_128k.json > $OUT/log1.txt 2>&1; echo rc=$? t=$(( $(date +%s)-S ))
tail -n 3 $OUT/log3.txt
