"""Print the figures of a call's JSON files (argument: the folder)."""
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1])
for p in sorted(out.glob("*.json")):
    d = json.loads(p.read_text())
    print("==", p.name, d.get("device"), "warmup_s", d.get("warmup_s"))
    for r in d.get("results", []):
        if "prefill_seconds" in r:
            dec = r.get("decode") or {}
            print(" prefill", r["length"], round(r["prefill_seconds"], 3), "decode", dec.get("step_seconds"),
                  {k: dec.get(k) for k in ("bytes_bound_s", "step_over_bound", "copy_read_bytes_per_s", "step_over_copy_bound")},
                  dec.get("back_to_back"))
        if "ttft_uncached_s" in r:
            print(" serve", r["length"], "ttft", round(r["ttft_uncached_s"], 3), "cached", round(r["ttft_cached_s"], 3),
                  "steps", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in (r.get("prefill_steps") or {}).items()})
            for c in r["concurrency"]:
                print("   q", c["questions"], "tok/s", round(c["decode_tokens_per_second"], 1),
                      "over_bound", c.get("tokens_per_second_over_device_bound"),
                      {k: (round(v, 5) if isinstance(v, float) else v) for k, v in (c.get("decode_steps") or {}).items()})
                if "timeline" in c:
                    print("     steady", round(c["steady_s"], 4), "s; idle while decoding", c.get("idle_while_decoding_s"), "s; steps [kind, n, busy ms, idle ms before]:", c["timeline"])
