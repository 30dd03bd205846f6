"""Compile-only harness (no GPU): every Triton launch compiles for sm_90a as the real launch would specialize it,
then ptxas -v reports registers / spills. Import this module FIRST (before starshard), with
PYTHONPATH=<Triton 3.6, pip install --target>:<this repository>.

    import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
    ... call entry points with CPU tensors ...
    section("label")   # header for following lines
"""
import os, subprocess, tempfile, sys, traceback
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="tcache"))
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")


class Stub:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def __getattr__(self, name):
        raise AttributeError(f"stub driver: {name}")


driver.set_active(Stub())
compiled = []
_seen = set()
_label = [""]
ROWS = []
SHOW_SPEC = os.environ.get("SHOW_SPEC", "0") == "1"
_run = JITFunction.run


def ptxas(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([PTXAS, "-v", "-arch=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    os.unlink(f.name)
    regs = spill_st = spill_ld = stack = None
    for l in r.stderr.splitlines():
        if "registers" in l:
            regs = int(l.split("Used")[1].split("registers")[0])
        if "spill stores" in l:
            p = l.split(",")
            stack = int(p[0].split()[0]); spill_st = int(p[1].split()[0]); spill_ld = int(p[2].split()[0])
    if regs is None:
        print(r.stderr)
    return regs, spill_st, spill_ld, stack


def describe(k):
    src = k.src
    names = src.fn.arg_names
    cx = {}
    for key, v in src.constants.items():
        n = names[key[0]] if len(key) == 1 else str(key)
        if hasattr(v, "value"): v = v.value
        cx[n] = v
    # pointer / int args that did NOT get divisibility 16
    div = {names[key[0]] for key, a in src.attrs.items() if len(key) == 1 and any("divisibility" in str(x) for x in a)}
    sig = src.signature
    nodiv_ptr = [n for n in names if isinstance(sig.get(n), str) and sig[n].startswith("*") and n not in div]
    return cx, nodiv_ptr, div


def run(self, *args, grid, warmup, **kwargs):
    k = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if k is None:
        return k
    if k.hash in _seen:
        print(f"{_label[0]:28s} {self.fn.__name__:32s} (same variant as compiled before)", flush=True)
        return k
    _seen.add(k.hash)
    compiled.append((self.fn.__name__, k))
    regs, st, ld, stack = ptxas(k.asm["ptx"])
    cx, nodiv, div = describe(k)
    m = k.metadata
    flag = "  <-- SPILL" if (st or ld) else ("  <-- 255" if regs and regs >= 255 else "")
    cxs = ",".join(f"{a}={b}" for a, b in cx.items() if not (isinstance(b, (str,)) and len(b) > 20))
    line = (f"{_label[0]:28s} {self.fn.__name__:32s} w{m.num_warps} s{m.num_stages} regs {regs:3d} "
            f"spill st/ld {st}/{ld} stack {stack} smem {m.shared:6d}{flag}\n    constexpr: {cxs}\n"
            f"    ptr args w/o div16: {nodiv}")
    if SHOW_SPEC:
        line += f"\n    div16 args: {sorted(div)}"
    if flag or os.environ.get("SAVE_ALL") == "1":
        PTX = os.path.join(os.environ.get("OUT", tempfile.gettempdir()), "ptx"); os.makedirs(PTX, exist_ok=True)
        fn_ = PTX + "/" + "".join(c if c.isalnum() else "_" for c in _label[0] + "_" + self.fn.__name__)[:120] + ".ptx"
        open(fn_, "w").write(k.asm["ptx"])
        open(fn_[:-4] + ".ttgir", "w").write(k.asm.get("ttgir", ""))
        line += f"\n    saved {fn_}"
    print(line, flush=True)
    ROWS.append(dict(label=_label[0], kernel=self.fn.__name__, warps=m.num_warps, stages=m.num_stages, regs=regs,
                     spill_st=st, spill_ld=ld, smem=m.shared, constexpr=cxs, nodiv=nodiv))
    return k


JITFunction.run = run


def section(label):
    _label[0] = label


def attempt(label, fn, *a, **kw):
    section(label)
    try:
        return fn(*a, **kw)
    except Exception as e:
        print(f"[{label}] stopped: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if os.environ.get("TB") == "1":
            traceback.print_exc()
