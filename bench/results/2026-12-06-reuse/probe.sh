# read_paths.py on this tree and on the commit before the read fixes (.head: `git archive 9c2e9e3 starshard`)
. bench/results/2026-12-06-step-loop/prelude.sh
D=/var/tmp/probe; rm -rf $D; mkdir -p $D
timeout 250 $NEW bench/results/2026-12-06-reuse/read_paths.py $D $OUT/probe_new.json
RAW=0 CODE=9c2e9e3 timeout 150 env PYTHONPATH=/tmp/site:$PWD/.head python3 bench/results/2026-12-06-reuse/read_paths.py $D $OUT/probe_old.json
rm -rf $D
