# Issue 49's load run with every tier (CPU, SmolLM2-135M float32): a device budget of ~2 documents, a host tier
# of ~1, the rest to disk; 48 requests, 4 at a time, over 8 documents of 1-2K tokens, 80 % follow-ups.
D=${D:-/tmp/kvload}; rm -rf $D; mkdir -p $D; chmod 700 $D
python -m starshard bench serve --scenario load --device cpu --dtype float32 --cache-gib 0.2 --host-cache-gib 0.1 \
  --disk-cache-dir $D --disk-cache-gib 1 --num-prompts 48 --max-concurrency 4 --num-docs 8 --doc-len-dist list:1024,2048 \
  --follow-up-ratio 0.8 --question-len 32 --output-len 16 --request-timeout 600 --seed 7 --out load_tiers.json
