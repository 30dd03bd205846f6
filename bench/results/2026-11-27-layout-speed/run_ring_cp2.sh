# issue 35: ring cp=2 before (8d98ff2, in .before/ as in run_one_gpu.sh) and after (this tree), same machine, interleaved.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
mkdir -p /tmp/res
for round in 1 2; do
 for tree in before after; do
  root=$([ $tree = before ] && echo .before || echo .)
  timeout 200 torchrun --standalone --nproc-per-node 2 $root/launch/bench.py prefill --cp 2 --cp-strategy ring \
     --random-weights llama-3.1-8b --lengths 65536 --repeats 5 --warmup 1 --decode-steps 32 \
     --out /tmp/res/ring_${tree}_$round.json > /dev/null 2>>$OUT/err.txt || tail -5 $OUT/err.txt
 done
done
python3 -c "import json,glob,os; json.dump({os.path.basename(f): json.load(open(f)) for f in sorted(glob.glob('/tmp/res/*.json'))}, open(os.environ['OUT']+'/ring.json','w'))"
