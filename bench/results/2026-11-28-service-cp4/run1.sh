export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
git log --oneline | head -1
S=$(date +%s)
timeout 150 python3 bench/results/2026-11-28-service-cp4/admit.py --strategy dense --length 131072 --conc 1,8 --out $OUT/dense1_128k.json > $OUT/log1.txt 2>&1; echo rc=$? t=$(( $(date +%s)-S ))
timeout 150 torchrun --nproc-per-node 4 bench/results/2026-11-28-service-cp4/admit.py --strategy star --length 131072 --conc 1,8 --out $OUT/star4_128k.json > $OUT/log2.txt 2>&1; echo rc=$? t=$(( $(date +%s)-S ))
timeout 170 torchrun --nproc-per-node 4 bench/results/2026-11-28-service-cp4/admit.py --strategy star --block 32768 --length 1048576 --conc 1 --out $OUT/star4_1m.json > $OUT/log3.txt 2>&1; echo rc=$? t=$(( $(date +%s)-S ))
timeout 120 torchrun --nproc-per-node 4 bench/results/2026-11-28-service-cp4/admit.py --strategy ring --length 524288 --conc 1 --out $OUT/ring4_512k.json > $OUT/log4.txt 2>&1; echo rc=$? t=$(( $(date +%s)-S ))
tail -3 $OUT/log*.txt
