"""First fast decode with an empty Triton cache, with and without hashing Triton's own key
ahead of the warm-up (``kernels.backend.start_compiler_key``). One case per process.
usage: first.py TREE CASE on|off"""
import os, sys, tempfile, time, statistics
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fvd-first-")
tree, case_name, mode = sys.argv[1:4]
import torch
from fast_vae_decode.bench.comfyui import comfyui_path, setup_comfyui
from fast_vae_decode.bench.cases import select_cases
from fast_vae_decode.bench.subjects import build_subject
from fast_vae_decode.bench.timing import timed_call
if mode == "off":
    import fast_vae_decode.fastpath.fused as fused, fast_vae_decode.fastpath.prewarm as prewarm
    fused.start_compiler_key = prewarm.start_compiler_key = prewarm.wait_compiler_key = lambda: None
nodes = setup_comfyui(comfyui_path(tree), [])
case = select_cases(case_name)[0]
with torch.inference_mode():
    s = build_subject(case, nodes=nodes, device=None, dtype=None, seed=0)
    for _ in range(3):
        s.stock()
    torch.cuda.synchronize()
    first, _ = timed_call(lambda: s.decode("high"), s.device)
    rest = [timed_call(lambda: s.decode("high"), s.device)[0] for _ in range(5)]
med = statistics.median(rest)
print(f"RESULT {os.path.basename(tree)} {case_name} prime={mode} first {first:.0f} ms, steady {med:.1f} ms, overhead {first - med:.0f} ms", flush=True)
