# issue 35: GPU speed before (8d98ff2, in .before/: git archive 8d98ff2 starshard launch | tar -x -C .before) and after (this tree), same card, same call, interleaved.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
mkdir -p /tmp/res; git log --oneline -1 | tee -a $OUT/device.txt
for round in 1 2; do
 for tree in before after; do
  root=$([ $tree = before ] && echo .before || echo .)
  timeout 150 python3 $root/launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 32768 \
     --repeats 5 --warmup 1 --decode-steps 0 --out /tmp/res/prefill32k_${tree}_$round.json > /dev/null 2>$OUT/err_${tree}.txt || tail -5 $OUT/err_${tree}.txt
  timeout 200 python3 $root/launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 131072 \
     --repeats 1 --warmup 0 --decode-steps 64 --out /tmp/res/decode128k_${tree}_$round.json > /dev/null 2>>$OUT/err_${tree}.txt || tail -5 $OUT/err_${tree}.txt
  timeout 120 python3 $root/launch/bench.py sparse --lengths 131072 --patterns "vs:1000,6096" --repeats 5 --warmup 2 \
     --out /tmp/res/sparse_${tree}_$round.json > /dev/null 2>>$OUT/err_${tree}.txt || tail -5 $OUT/err_${tree}.txt
 done
done
python3 -c "import json,glob,os; json.dump({os.path.basename(f): json.load(open(f)) for f in sorted(glob.glob('/tmp/res/*.json'))}, open(os.environ['OUT']+'/all.json','w'))"
ls -la $OUT
